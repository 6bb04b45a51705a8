"""Calibration: does the simulator predict minicomm's own measured times?

    python examples/sim_calibrate.py --out /tmp/calib --run      # measure, then predict
    python examples/sim_calibrate.py --out /tmp/calib            # predict from earlier runs

With ``--run`` it runs ``minicomm bench`` for allreduce / allgather / broadcast at world sizes 2-4,
sizes 64 KiB-64 MiB, over shm and tcp, with ``MINICOMM_CACHE_DIR=<out>/cache``: the benchmark's
world start measures this machine's links (α, β, o per transport; γ, δ, wake, contention) into
that cache, once. Then every measured row (out-of-place time, the median batch of the slowest
rank) is predicted by ``minicomm.cost.schedule_time`` — the real schedules on the simulator
engine's host machine, with the measured parameters and this machine's cores — and compared.

The links are measured ``--probe-runs`` times per transport (each in an empty cache: the
benchmark's world start probes them) and each field's median is kept.

Error of a row: predicted / measured - 1 (measured: the benchmark's median batch; also shown
against its fastest batch, the least disturbed by other work on a shared machine). Summary: the geometric mean of |predicted/measured|
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


def run_bench(out, transport, n, sizes, algos, env, colls=COLLS, batches=3, name=None):
    path = os.path.join(out, name or f"{transport}-n{n}.json")
    cmd = [sys.executable, "-m", "minicomm.cli", "bench", colls, "--sizes", sizes, "-n", str(n),
           "--transport", transport, "--algorithms", algos, "--batches", str(batches),
           "--warmup", "2", "--json", path]
    print("#", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return path


def probe_links(out, transports, runs):
    """The benchmark's world start measures the links into an empty cache; ``runs`` times per
    transport, each field's median kept (one probe on a shared 2-core box can land in someone
    else's burst). Writes <out>/cache/links-<host>.json, which the benchmark runs then use."""
    import socket
    import statistics
    fields = {}
    for t in transports:
        for i in range(runs):
            d = os.path.join(out, f"probe-{t}-{i}")
            env = dict(os.environ, MINICOMM_CACHE_DIR=d)
            run_bench(out, t, 2, "64K", "ring", env, colls="allreduce", batches=1,
                      name=f"probe-{t}-{i}.json")
            with open(os.path.join(d, f"links-{socket.gethostname()}.json")) as f:
                c = json.load(f)
            for k, v in c["links"].items():
                for f_, x in v.items():
                    fields.setdefault(("links", k, f_), []).append(x)
            for f_ in ("gamma", "delta", "wake", "contention"):
                if f_ in c:
                    fields.setdefault((f_,), []).append(c[f_])
    cache = {"format": "minicomm-links/3", "host": socket.gethostname(), "links": {},
             "probe_runs": runs}
    for key, xs in fields.items():
        if key[0] == "links":
            cache["links"].setdefault(key[1], {})[key[2]] = statistics.median(xs)
        else:
            cache[key[0]] = statistics.median(xs)
    os.makedirs(os.path.join(out, "cache"), exist_ok=True)
    with open(os.path.join(out, "cache", f"links-{socket.gethostname()}.json"), "w") as f:
        json.dump(cache, f, indent=1)


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
    ap.add_argument("--probe-runs", type=int, default=3,
                    help="link measurements per transport (median kept)")
    ap.add_argument("--per-run-links", action="store_true",
                    help="every benchmark run measures its own links at its start (an empty "
                         "cache of its own) and its rows are predicted with them")
    ap.add_argument("--json", help="write the table as JSON")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, MINICOMM_CACHE_DIR=os.path.join(a.out, "cache"))
    transports = a.transports.split(",")
    worlds = [int(x) for x in a.worlds.split(",")]
    def cache_dir(t, n):
        return os.path.join(a.out, f"cache-{t}-n{n}" if a.per_run_links else "cache")

    if a.run:
        if not a.per_run_links:
            probe_links(a.out, transports, a.probe_runs)
        for t in transports:
            for n in worlds:
                run_bench(a.out, t, n, a.sizes, a.algorithms,
                          dict(env, MINICOMM_CACHE_DIR=cache_dir(t, n)))

    def load_cache(t, n):
        d = cache_dir(t, n)
        name = [f for f in os.listdir(d) if f.startswith("links-")][0]
        with open(os.path.join(d, name)) as f:
            return json.load(f)
    rows = []
    caches = {}
    for t in transports:
        for n in worlds:
            cache = caches[(t, n)] = load_cache(t, n)
            m = link_model(cache, t)
            path = os.path.join(a.out, f"{t}-n{n}.json")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                data = json.load(f)
            for r in data["rows"]:
                if r.get("library") != "minicomm" or r["algo"] not in cost.FAMILIES:
                    continue
                meas = r["time_us"] * 1e-6
                fastest = min(r["batches_us"]) * 1e-6
                pred = cost.schedule_time(r["collective"], r["algo"], n, r["count"], (0,) * n, m)
                rows.append({"transport": t, "ranks": n, "collective": r["collective"],
                             "algorithm": r["algo"], "bytes": r["size"], "measured_s": meas,
                             "fastest_s": fastest, "predicted_s": pred,
                             "error": pred / meas - 1, "error_fastest": pred / fastest - 1})
    print("# links measured by the benchmark's world start"
          + (" (each run its own)" if a.per_run_links else "") + ":")
    shown = set()
    for (t, n), cache in caches.items():
        key = json.dumps(cache, sort_keys=True)
        if key in shown:
            continue
        shown.add(key)
        where = f"{t} n={n}: " if a.per_run_links else ""
        print(f"#   {where}" + "; ".join(
            f"{k} α {v['alpha'] * 1e6:.1f} us, {1e-9 / v['beta']:.2f} GB/s, o "
            f"{v['overhead'] * 1e6:.1f} us" for k, v in cache["links"].items())
            + f"; γ {1e-9 / cache['gamma']:.2f} GB/s, δ {1e-9 / cache['delta']:.2f} GB/s, "
              f"wake {cache.get('wake', 0) * 1e6:.0f} us, contention "
              f"{cache.get('contention', 0):.3f}")
    print(f"{'transport':>9} {'n':>2} {'collective':>10} {'algo':>5} {'size':>7} "
          f"{'median':>10} {'fastest':>10} {'predicted':>10} {'error':>7} {'vs fast':>7}")
    for r in rows:
        print(f"{r['transport']:>9} {r['ranks']:>2} {r['collective']:>10} {r['algorithm']:>5} "
              f"{r['bytes'] >> 10:>6}K {r['measured_s'] * 1e6:>8.0f}us {r['fastest_s'] * 1e6:>8.0f}us "
              f"{r['predicted_s'] * 1e6:>8.0f}us {100 * r['error']:>6.1f}% "
              f"{100 * r['error_fastest']:>6.1f}%")

    def summary(sub, key="error"):
        logs = [abs(math.log(1 + r[key])) for r in sub]
        abs_e = [max(abs(r[key]), 1e-9) for r in sub]
        return (math.exp(sum(logs) / len(logs)) - 1,
                math.exp(sum(math.log(e) for e in abs_e) / len(abs_e)))
    groups = [("all", rows)] + [(t, [r for r in rows if r["transport"] == t]) for t in transports] \
        + [(c, [r for r in rows if r["collective"] == c]) for c in COLLS.split(",")]
    for name, sub in groups:
        if sub:
            g, ga = summary(sub)
            gf, _ = summary(sub, "error_fastest")
            print(f"# {name:>10}: {len(sub):3d} rows, geometric-mean error {100 * g:.1f}% "
                  f"(log-ratio; {100 * ga:.1f}% as geomean of |error|); against the fastest "
                  f"batch {100 * gf:.1f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"links": {f"{t}-n{n}": c for (t, n), c in caches.items()}, "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
