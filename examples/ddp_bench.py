"""DDP step time: stock ``DistributedDataParallel`` over the "minicomm" backend vs over gloo.

    python examples/ddp_bench.py                 # 2 and 4 ranks, the table the README shows
    python examples/ddp_bench.py --ranks 2 --steps 50 --json

Model: 4 x (Linear(1024, 1024) + ReLU), 4.2 M float32 parameters (16.8 MB of gradients); batch 32
per rank; SGD with momentum; one torch thread per rank; DDP's default buckets (25 MB, the first
1 MB). Every rank builds both process groups in one run — the default "minicomm" group and a
gloo group (``dist.new_group(backend="gloo")``) — and two DDP copies of one model, plus a third
copy trained with no communication at all (what a step costs here without DDP). The three are
interleaved step by step, the order rotating, after ``--warmup`` untimed steps each; ranks start
every step together (an untimed barrier) and each step counts as its slowest rank's. Reported:
the median step of each over ``--steps`` steps, and ratio = the median over steps of gloo's step
/ minicomm's step run back to back (>= 1.0: minicomm's step is at least as fast). Pairing
neighbouring steps cancels the load changes of a shared machine, which move faster than a block
of steps lasts.

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


def _timed_step(model, opt, x, y, group) -> float:
    """One training step on this rank, in seconds (ranks start it together: a barrier first)."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


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
    groups = {"minicomm": mc, "gloo": gloo, "local": gloo}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for k, m in models.items()}
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, WIDTH, generator=g)
    names = list(models)
    for _ in range(args.warmup):
        for name in names:
            _timed_step(models[name], opts[name], x, y, groups[name])
    # Interleaved step by step, the order rotating, so every backend sees the same machine
    # (a shared box's load changes faster than a block of steps lasts).
    times = {name: torch.zeros(args.steps, dtype=torch.float64) for name in names}
    for i in range(args.steps):
        for name in names[i % 3:] + names[:i % 3]:
            times[name][i] = _timed_step(models[name], opts[name], x, y, groups[name])
    for t in times.values():                         # each step's slowest rank
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    # the two DDP copies trained identically on every rank (same data, same steps)
    a = torch.cat([p.detach().reshape(-1) for p in models["minicomm"].parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in models["gloo"].parameters()])
    same = torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": size, "ms_per_step": {k: (v * 1e3).tolist()
                                                      for k, v in times.items()},
                       "models_agree": bool(same)}, f)
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
    p.add_argument("--steps", type=int, default=100, help="timed steps per backend")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per backend first")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    params = sum(q.numel() for q in make_model().parameters())
    rows = []
    for size in (int(s) for s in args.ranks.split(",")):
        res = run(size, args)
        ms = res["ms_per_step"]
        med = {k: statistics.median(v) for k, v in ms.items()}
        paired = statistics.median(g / m for g, m in zip(ms["gloo"], ms["minicomm"]))
        rows.append({"ranks": size, "minicomm_ms": med["minicomm"], "gloo_ms": med["gloo"],
                     "local_ms": med["local"], "ratio": paired,
                     "ratio_of_medians": med["gloo"] / med["minicomm"],
                     "ms_per_step": ms, "models_agree": res["models_agree"]})
    if args.json:
        print(json.dumps({"model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}) + ReLU",
                          "parameters": params, "batch_per_rank": BATCH,
                          "torch_threads_per_rank": 1, "steps": args.steps,
                          "rows": rows}, indent=1))
        return 0
    print(f"DDP step time, {LAYERS} x Linear({WIDTH},{WIDTH})+ReLU ({params / 1e6:.1f} M params), "
          f"batch {BATCH}/rank, 1 torch thread/rank; median of {args.steps} steps "
          f"interleaved step by step (slowest rank)")
    print(f"{'ranks':>5} {'minicomm ms':>12} {'gloo ms':>9} {'ratio':>6} {'no-comm ms':>11}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['minicomm_ms']:>12.1f} {r['gloo_ms']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['local_ms']:>11.1f}")
        if not r["models_agree"]:
            print(f"  warning: at {r['ranks']} ranks the minicomm and gloo models diverged",
                  file=sys.stderr)
    print("ratio = median over steps of gloo ms / minicomm ms, each pair run back to back "
          "(>= 1.0: minicomm at least as fast)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
