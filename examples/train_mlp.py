"""Train the demo's numpy MLP on every rank of a launched job: data-parallel allreduce, or a
parameter server with ``--servers K``.

    minicomm run -n 4 examples/train_mlp.py                        # 4 workers, allreduce auto
    minicomm run -n 4 examples/train_mlp.py --mode ring --steps 300
    minicomm run -n 4 examples/train_mlp.py --servers 2            # 2 servers + 2 workers, sync
    minicomm run -n 4 --servers 2 examples/train_mlp.py            # the same, roles from the launcher
    minicomm run -n 3 examples/train_mlp.py --servers 1 --mode ps-async
    minicomm run -n 4 examples/train_mlp.py --servers 2 --mode ps-ssp --staleness 3
    python examples/train_mlp.py --workers 2 --servers 2           # no launcher: spawns locally

Options are ``minicomm demo``'s (``--steps --workers --servers --transport --json --out``, plus
``--batch --lr --hidden --seed --dataset --staleness --chunk-bytes``) and ``--mode`` for the one run this
script makes: an allreduce algorithm (ring, tree, rhd, hier, auto; the default without
``--servers``) or ps-sync (the default with ``--servers``), ps-async, ps-ssp. Under a launcher the
world size is ``-n``; ``--workers``, if given, must equal it minus ``--servers``. Rank 0 prints
one table row (or, with ``--json``, the demo's JSON document with this single run) and writes
the loss plots to ``--out`` when matplotlib is there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import minicomm as mc
from minicomm.tools import demo
from minicomm.training import load_dataset, ps_available, train_data_parallel, train_ps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p, modes=False)
    # `minicomm run -n 6 --servers 2 script.py` hands the PS roles over in MINICOMM_NUM_SERVERS
    p.set_defaults(workers=None, servers=int(os.environ.get("MINICOMM_NUM_SERVERS") or 0))
    p.add_argument("--mode", choices=demo.ALLREDUCE_ALGORITHMS + demo.PS_MODES, default=None,
                   help="allreduce algorithm, or PS mode with --servers")
    return p.parse_args(argv)


def spec_for(a, world_size: int) -> demo.RunSpec:
    workers = world_size - a.servers
    if a.servers < 0 or workers < 1:
        raise ValueError(f"--servers {a.servers} leaves no worker among {world_size} ranks")
    if a.workers is not None and a.workers != workers:
        raise ValueError(f"--workers {a.workers} does not match {world_size} ranks minus "
                         f"{a.servers} servers")
    mode = a.mode or ("ps-sync" if a.servers else "auto")
    if (mode in demo.PS_MODES) != bool(a.servers):
        raise ValueError(f"--mode {mode} " + ("needs --servers K" if a.servers == 0 else
                                             "is an allreduce mode; drop --servers"))
    if a.batch % workers:
        raise ValueError(f"--batch {a.batch} must be a multiple of the {workers} workers "
                         f"(every worker takes an equal shard)")
    if a.servers and not ps_available():
        raise ValueError("--servers needs minicomm.ps, which is not importable here")
    return demo.plan_runs([mode], workers, a.servers, a.staleness)[0]


def train(comm, a):
    """Every rank: train, then rank 0 gathers the training ranks' logs and reports."""
    config = demo.config_from_args(a)
    spec = spec_for(a, comm.size)
    dataset = load_dataset(a.dataset, seed=config.seed)
    show = (not a.json) and comm.rank == a.servers
    bar = demo.Progress(spec.label, config.steps, show)
    try:
        if spec.servers:
            log = train_ps(comm, dataset, config, num_servers=spec.servers,
                           staleness=spec.staleness, chunk_bytes=a.chunk_bytes, on_step=bar)
        else:
            log = train_data_parallel(comm, dataset, config, spec.algorithm, on_step=bar)
    finally:
        bar.close()
    logs = comm.gather_object(log, root=0)     # servers contribute None
    if comm.rank != 0:
        return None
    record = demo.summarize(spec, [g for g in logs if g is not None], dataset, config)
    doc = {"dataset": dataset.name, "steps": config.steps, "runs": [record], "skipped": []}
    if a.json:
        print(json.dumps(demo.public_json(doc), allow_nan=False), flush=True)
    else:
        print(demo.format_table([record]), flush=True)
        if not a.no_plots:
            paths = demo.write_plots([record], a.out)
            if paths:
                print(f"plots: {', '.join(paths)}", flush=True)
    return record


def main(argv=None) -> int:
    a = parse_args(argv)
    if any(os.environ.get(v) for v in ("MINICOMM_RANK", "RANK", "OMPI_COMM_WORLD_RANK",
                                        "PMI_RANK", "SLURM_PROCID")):
        comm = mc.init(transport=None if a.transport == "auto" else a.transport)
        try:
            train(comm, a)
        finally:
            comm.close()
        return 0
    # Not launched: start the ranks here (--workers, default 2, plus --servers).
    workers = 2 if a.workers is None else a.workers
    mc.spawn(train, workers + a.servers, args=(a,), transport=a.transport)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"train_mlp.py: {e}", file=sys.stderr)
        sys.exit(2)
