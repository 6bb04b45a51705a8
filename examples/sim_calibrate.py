"""Calibration: does the simulator predict minicomm's own measured times?

    python examples/sim_calibrate.py --out /tmp/calib --run      # measure, then predict
    python examples/sim_calibrate.py --out /tmp/calib            # predict from earlier runs

With ``--run`` it runs ``minicomm bench`` for allreduce / allgather / broadcast at world sizes 2-4,
sizes 64 KiB-64 MiB, over shm and tcp, with ``MINICOMM_CACHE_DIR=<out>/cache``: the benchmark's
world start measures this machine's links (α, β, o per transport; γ, δ, wake, contention) into
that cache, once. Then every measured row (out-of-place time, the median batch of the slowest
rank) is predicted by ``minicomm.cost.schedule_time`` — the real schedules on the simulator
engine's host machine, with the measured parameters and this machine's cores — and compared.

Error of a row: predicted / measured - 1. Summary: the geometric mean of |predicted/measured|
in log space, exp(mean |ln(pred / meas)|) - 1 (a 2x over- and a 2x under-prediction both count
as 100%), and, for comparison with simulator papers, the geometric mean of |error|.
"""
import argparse
import json
import math
import os
import subprocess
import sys

from minicomm import cost

COLLS = "allreduce,allgather,broadcast"


def run_bench(out, transport, n, sizes, algos, env):
    path = os.path.join(out, f"{transport}-n{n}.json")
    cmd = [sys.executable, "-m", "minicomm.cli", "bench", COLLS, "--sizes", sizes, "-n", str(n),
           "--transport", transport, "--algorithms", algos, "--batches", "3", "--warmup", "2",
           "--json", path]
    print("#", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return path


def link_model(cache, transport):
    """The LinkModel a world of this transport agrees on (as minicomm.tuning.links does)."""
    intra, inter = ("tcp", "tcp") if transport == "tcp" else ("shm", "tcp")
    default = cost.LinkModel.for_transports(intra, inter)
    kw = {}
    for side, kind in (("intra", intra), ("inter", inter)):
        got = cache["links"].get(kind)
        if got:
            kw[f"alpha_{side}"], kw[f"beta_{side}"] = got["alpha"], got["beta"]
            kw[f"overhead_{side}"] = got["overhead"]
    for f in ("gamma", "delta", "wake", "contention"):
        if f in cache:
            kw[f] = cache[f]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cost.LinkModel(**{**{f: getattr(default, f) for f in (
        "alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma", "delta",
        "overhead_intra", "overhead_inter", "wake", "contention")}, **kw},
        cores=int(cores or 0), intra=intra, inter=inter)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--run", action="store_true", help="run the benchmarks first")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    ap.add_argument("--algorithms", default="ring,tree,rhd")
    ap.add_argument("--json", help="write the table as JSON")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, MINICOMM_CACHE_DIR=os.path.join(a.out, "cache"))
    transports = a.transports.split(",")
    worlds = [int(x) for x in a.worlds.split(",")]
    if a.run:
        for t in transports:
            for n in worlds:
                run_bench(a.out, t, n, a.sizes, a.algorithms, env)
    caches = [f for f in os.listdir(os.path.join(a.out, "cache")) if f.startswith("links-")]
    with open(os.path.join(a.out, "cache", caches[0])) as f:
        cache = json.load(f)
    rows = []
    for t in transports:
        m = link_model(cache, t)
        for n in worlds:
            path = os.path.join(a.out, f"{t}-n{n}.json")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                data = json.load(f)
            for r in data["rows"]:
                if r.get("library") != "minicomm" or r["algo"] not in cost.FAMILIES:
                    continue
                meas = r["time_us"] * 1e-6
                pred = cost.schedule_time(r["collective"], r["algo"], n, r["count"], (0,) * n, m)
                rows.append({"transport": t, "ranks": n, "collective": r["collective"],
                             "algorithm": r["algo"], "bytes": r["size"], "measured_s": meas,
                             "predicted_s": pred, "error": pred / meas - 1})
    print(f"# links measured by the benchmark ({caches[0]}):")
    for k, v in cache["links"].items():
        print(f"#   {k}: α {v['alpha'] * 1e6:.1f} us, {1e-9 / v['beta']:.2f} GB/s, "
              f"o {v['overhead'] * 1e6:.1f} us")
    print(f"#   γ {1e-9 / cache['gamma']:.2f} GB/s, δ {1e-9 / cache['delta']:.2f} GB/s, "
          f"wake {cache.get('wake', 0) * 1e6:.0f} us, contention {cache.get('contention', 0):.3f}")
    print(f"{'transport':>9} {'n':>2} {'collective':>10} {'algo':>5} {'size':>7} "
          f"{'measured':>11} {'predicted':>11} {'error':>7}")
    for r in rows:
        print(f"{r['transport']:>9} {r['ranks']:>2} {r['collective']:>10} {r['algorithm']:>5} "
              f"{r['bytes'] >> 10:>6}K {r['measured_s'] * 1e6:>9.0f}us "
              f"{r['predicted_s'] * 1e6:>9.0f}us {100 * r['error']:>6.1f}%")

    def summary(sub):
        logs = [abs(math.log(1 + r["error"])) for r in sub]
        abs_e = [max(abs(r["error"]), 1e-9) for r in sub]
        return (math.exp(sum(logs) / len(logs)) - 1,
                math.exp(sum(math.log(e) for e in abs_e) / len(abs_e)))
    groups = [("all", rows)] + [(t, [r for r in rows if r["transport"] == t]) for t in transports] \
        + [(c, [r for r in rows if r["collective"] == c]) for c in COLLS.split(",")]
    for name, sub in groups:
        if sub:
            g, ga = summary(sub)
            print(f"# {name:>10}: {len(sub):3d} rows, geometric-mean error {100 * g:.1f}% "
                  f"(log-ratio), {100 * ga:.1f}% (geomean of |error|)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"links": cache, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
