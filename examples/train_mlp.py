"""Train the demo's numpy MLP on every rank of a launched job: data-parallel allreduce, or a
parameter server with ``--servers K``.

    minicomm run -n 4 examples/train_mlp.py                        # 4 workers, allreduce auto
    minicomm run -n 4 examples/train_mlp.py --mode ring --steps 300
    minicomm run -n 4 examples/train_mlp.py --servers 2            # 2 servers + 2 workers, sync
    minicomm run -n 4 --servers 2 examples/train_mlp.py            # the same, roles from the launcher
    minicomm run -n 3 examples/train_mlp.py --servers 1 --mode ps-async
    minicomm run -n 4 examples/train_mlp.py --servers 2 --mode ps-ssp --staleness 3
    python examples/train_mlp.py --workers 2 --servers 2           # no launcher: spawns locally
    minicomm run --on-failure continue -n 4 examples/train_mlp.py --elastic --kill-worker 45
    minicomm run --on-failure continue -n 4 examples/train_mlp.py --servers 1 --kill-worker 45

Options are ``minicomm demo``'s (``--steps --workers --servers --transport --json --out``, plus
``--batch --lr --hidden --seed --dataset --staleness --chunk-bytes``) and ``--mode`` for the one run this
script makes: an allreduce algorithm (ring, tree, rhd, hier, auto; the default without
``--servers``) or ps-sync (the default with ``--servers``), ps-async, ps-ssp. Under a launcher the
world size is ``-n``; ``--workers``, if given, must equal it minus ``--servers``. Rank 0 prints
one table row (or, with ``--json``, the demo's JSON document with this single run) and writes
the loss plots to ``--out`` when matplotlib is there.

``--elastic`` trains data-parallel with ``train_elastic``: when a worker dies, the survivors
shrink the communicator, roll back to the last commit (every ``--commit-every`` steps, 10) and
train on to ``--steps`` with the global batch re-sharded over them. ``--kill-worker STEP`` makes
the last rank die (``os._exit``) before step STEP, to watch that happen; it needs ``--elastic``
or ``--servers`` (the PS then drops the dead worker, ``on_worker_failure="drop"``) and, under
``minicomm run``, ``--on-failure continue`` so the launcher lets the others finish. With
``--elastic`` or a kill, the rank that holds the final parameters reports, from its own log
(its shard's losses), and says what the recovery cost.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import minicomm as mc
from minicomm.tools import demo
from minicomm.training import (
    load_dataset,
    ps_available,
    train_data_parallel,
    train_elastic,
    train_ps,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p, modes=False)
    # `minicomm run -n 6 --servers 2 script.py` hands the PS roles over in MINICOMM_NUM_SERVERS
    p.set_defaults(workers=None, servers=int(os.environ.get("MINICOMM_NUM_SERVERS") or 0))
    p.add_argument("--mode", choices=demo.ALLREDUCE_ALGORITHMS + demo.PS_MODES, default=None,
                   help="allreduce algorithm, or PS mode with --servers")
    p.add_argument("--elastic", action="store_true", help="data-parallel training that "
                   "survives dead workers (shrink, roll back to the last commit, go on)")
    p.add_argument("--commit-every", type=int, default=10,
                   help="--elastic: steps between commits (10)")
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
    if a.batch % workers and not a.elastic:       # elastic shards by shard_bounds
        raise ValueError(f"--batch {a.batch} must be a multiple of the {workers} workers "
                         f"(every worker takes an equal shard)")
    if a.servers and not ps_available():
        raise ValueError("--servers needs minicomm.ps, which is not importable here")
    if a.elastic and a.servers:
        raise ValueError("--elastic is for allreduce training; drop --servers (the parameter "
                         "server drops a dead worker with --kill-worker)")
    if a.kill_worker is not None:
        if not (a.elastic or a.servers):
            raise ValueError("--kill-worker needs --elastic or --servers: plain allreduce "
                             "training ends when a worker dies")
        demo.check_kill_step(a.kill_worker, a.steps, workers)
    return demo.plan_runs([mode], workers, a.servers, a.staleness)[0]


def train_rank(comm, a, spec, dataset, config, bar):
    """This rank's training (the last rank dies before step ``--kill-worker``)."""
    victim = a.kill_worker is not None and comm.rank == comm.size - 1
    before_step = demo.DieAt(a.kill_worker) if victim else None
    if spec.servers:
        failure = "drop" if a.kill_worker is not None else "fail"
        return train_ps(comm, dataset, config, num_servers=spec.servers,
                        staleness=spec.staleness, chunk_bytes=a.chunk_bytes, on_step=bar,
                        on_worker_failure=failure, before_step=before_step)
    if a.elastic:
        return train_elastic(comm, dataset, config, spec.algorithm,
                             commit_every=a.commit_every, on_step=bar, before_step=before_step)
    return train_data_parallel(comm, dataset, config, spec.algorithm, on_step=bar)


def train(comm, a):
    """Every rank: train, then rank 0 gathers the training ranks' logs and reports."""
    config = demo.config_from_args(a)
    spec = spec_for(a, comm.size)
    dataset = load_dataset(a.dataset, seed=config.seed)
    show = (not a.json) and comm.rank == a.servers
    bar = demo.Progress(spec.label, config.steps, show)
    try:
        log = train_rank(comm, a, spec, dataset, config, bar)
    finally:
        bar.close()
    if a.elastic or a.kill_worker is not None:
        # the world may have lost a rank: the holder of the final parameters reports alone
        if log is None or log.params is None:
            return None
        logs = [log]
        for r in () if a.json else log.info.get("recoveries", ()):
            print(f"recovered: failure at step {r['failed_at']}, resumed from the commit at "
                  f"step {r['resumed_at']} ({r['steps_lost']} steps lost) on "
                  f"{r['world'][1]} of {r['world'][0]} workers in {r['recover_s']:.3f} s",
                  flush=True)
    else:
        logs = comm.gather_object(log, root=0)     # servers contribute None
        if comm.rank != 0:
            return None
    record = demo.summarize(spec, [g for g in logs if g is not None], dataset, config)
    if a.elastic:
        record["recoveries"] = log.info["recoveries"]
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
    if a.kill_worker is None:
        mc.spawn(train, workers + a.servers, args=(a,), transport=a.transport)
        return 0
    try:        # a kill needs processes: threads (inproc) would all end with the victim
        mc.spawn(train, workers + a.servers, args=(a,),
                 transport=demo.drill_transport(a.transport), on_failure="continue")
    except mc.SpawnError as e:
        if all(result is None for result in e.results):
            raise
        print(f"rank(s) {[rank for rank, _ in e.failures]} died; the others finished",
              flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"train_mlp.py: {e}", file=sys.stderr)
        sys.exit(2)
