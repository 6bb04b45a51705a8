"""DDP step time: stock ``DistributedDataParallel`` over the "minicomm" backend vs over gloo.

    python examples/ddp_bench.py                 # 2 and 4 ranks, the table the README shows
    python examples/ddp_bench.py --ranks 2 --rounds 3 --json

Model: 4 x (Linear(1024, 1024) + ReLU), 4.2 M float32 parameters (16.8 MB of gradients); batch 32
per rank; SGD with momentum; one torch thread per rank; DDP's default buckets (25 MB, the first
1 MB). Every rank builds both process groups in one run — the default "minicomm" group and a
gloo group (``dist.new_group(backend="gloo")``) — and two DDP copies of one model. Rounds
alternate which backend goes first, so both see the same machine; each timed block is
``--steps`` steps after ``--warmup`` untimed ones; every step is timed on every rank and taken
as the slowest rank's. A third row trains the same model with no communication at all (what a
step costs here without DDP). Reported: the median step over all rounds (robust to the bursts
of other work a shared machine has), and ratio = gloo ms / minicomm ms (>= 1.0: minicomm's step
is at least as fast).

Not a test: the numbers depend on the machine and on what else runs on it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import minicomm.torch  # noqa: F401  (registers the "minicomm" backend)

WIDTH, LAYERS, BATCH = 1024, 4, 32


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _time_block(model, opt, x, y, steps: int, group) -> list:
    """Milliseconds of each of ``steps`` training steps, the slowest rank's per step (a MAX
    allreduce of every rank's step times on ``group``, after the block)."""
    dist.barrier(group=group)
    times = torch.zeros(steps, dtype=torch.float64)
    for i in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return (times * 1e3).tolist()


def _rank_main(rank: int, size: int, store_path: str, args, out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, size)
    dist.init_process_group("minicomm", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    mc = dist.group.WORLD
    models = {
        "minicomm": DDP(make_model(), process_group=mc),
        "gloo": DDP(make_model(), process_group=gloo),
        "local": make_model(),                       # no communication: the compute floor
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for k, m in models.items()}
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, WIDTH, generator=g)
    times = {k: [] for k in models}
    order = ["minicomm", "gloo", "local"]
    for rnd in range(args.rounds):
        for name in (order if rnd % 2 == 0 else order[1::-1] + order[2:]):
            group = gloo if name != "minicomm" else mc
            _time_block(models[name], opts[name], x, y, args.warmup, group)
            times[name].append(_time_block(models[name], opts[name], x, y, args.steps, group))
    # the two DDP copies trained identically on every rank (same data, same steps)
    a = torch.cat([p.detach().reshape(-1) for p in models["minicomm"].parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in models["gloo"].parameters()])
    same = torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": size, "ms_per_step": times, "models_agree": bool(same)}, f)
    dist.destroy_process_group()


def run(size: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="minicomm-ddp-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_rank_main, args=(size, os.path.join(tmp, "store"), args, out),
                           nprocs=size, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each block")
    p.add_argument("--rounds", type=int, default=10, help="blocks per backend (interleaved)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    params = sum(q.numel() for q in make_model().parameters())
    rows = []
    for size in (int(s) for s in args.ranks.split(",")):
        res = run(size, args)
        med = {k: statistics.median(t for block in v for t in block)
               for k, v in res["ms_per_step"].items()}
        rows.append({"ranks": size, "minicomm_ms": med["minicomm"], "gloo_ms": med["gloo"],
                     "local_ms": med["local"], "ratio": med["gloo"] / med["minicomm"],
                     "rounds": res["ms_per_step"], "models_agree": res["models_agree"]})
    if args.json:
        print(json.dumps({"model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}) + ReLU",
                          "parameters": params, "batch_per_rank": BATCH,
                          "torch_threads_per_rank": 1, "steps": args.steps,
                          "rounds": args.rounds, "rows": rows}, indent=1))
        return 0
    print(f"DDP step time, {LAYERS} x Linear({WIDTH},{WIDTH})+ReLU ({params / 1e6:.1f} M params), "
          f"batch {BATCH}/rank, 1 torch thread/rank, median step of {args.rounds} interleaved "
          f"rounds x {args.steps} steps")
    print(f"{'ranks':>5} {'minicomm ms':>12} {'gloo ms':>9} {'ratio':>6} {'no-comm ms':>11}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['minicomm_ms']:>12.1f} {r['gloo_ms']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['local_ms']:>11.1f}")
        if not r["models_agree"]:
            print(f"  warning: at {r['ranks']} ranks the minicomm and gloo models diverged",
                  file=sys.stderr)
    print("ratio = gloo ms / minicomm ms (>= 1.0: minicomm at least as fast)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
