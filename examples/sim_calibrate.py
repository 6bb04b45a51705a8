"""Calibration: does the simulator predict minicomm's own measured times?

    python examples/sim_calibrate.py --out /tmp/calib --run --json docs/sim-calibration.json
    python examples/sim_calibrate.py --raw docs/sim-calibration.json    # re-predict, no benchmark
    python examples/sim_calibrate.py --out /tmp/calib --run --rounds 8 \
        --collectives reduce_scatter --json docs/sim-calibration-reduce-scatter.json

``--run`` measures, for every transport (shm, tcp) and world size (2, 3, 4), ``--rounds`` times,
interleaved so that each prediction uses links measured minutes (not an hour) before its run:
  1. this machine's memory (``minicomm.tuning.links.measure_memory``: memcpy δ and in-place add γ
     per working set 64 KiB .. 64 MiB, and the slowdown of two copiers at once), and the load
     average;
  2. a two-rank link sweep through the benchmark tool (``minicomm bench broadcast,allgather
     --algorithms tree,rhd``, 8 B .. 16 MiB, in a fresh link cache so its world start also probes
     the wake-up cost): o, latency and (tcp) β are fitted to it by least squares through the
     engine (``minicomm.tuning.calibration.fit_links``, once per transport over all its sweeps;
     shm's β is its two copies by the model);
  3. the measured run: ``minicomm bench allreduce,allgather,broadcast`` (``--collectives``)
     at that world size, ring / tree / rhd, sizes 64 KiB .. 64 MiB; the load average again.
Every row is then predicted by ``minicomm.cost.schedule_time`` — the real schedules on the
simulator engine's host machine (``run_host``: copy-in / copy-out per message, 1 MiB streaming,
doorbell wake-ups, the node's cores shared by the ranks, memory bandwidth shared by copiers) — as
the benchmark runs it (back-to-back calls), and compared with the row's fastest batch (the same
estimator as the fitted probes; module doc of ``minicomm.tuning.calibration``). The raw runs go
to ``--json`` (what tests/test_sim.py recomputes through the current engine).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from minicomm import cost
from minicomm.tuning import calibration as cal
from minicomm.tuning.links import measure_memory

COLLS = "allreduce,allgather,broadcast"
PROBE_SIZES = "8,4K,64K,512K,4M,16M"


BATCH_TIME = 0.005     # short batches: more of them fit between other jobs' bursts
# warm-up calls per row: the benchmark sizes its batches from the median of all but the first,
# so one preempted call cannot shrink a batch to a single call
WARMUP = 6


def run_bench(path, transport, n, sizes, algos, colls, env, batches):
    cmd = [sys.executable, "-m", "minicomm.cli", "bench", colls, "--sizes", sizes, "-n", str(n),
           "--transport", transport, "--algorithms", algos, "--batches", str(batches),
           "--batch-time", str(BATCH_TIME), "--warmup", str(WARMUP), "--json", path]
    print("#", " ".join(cmd[2:]), flush=True)
    for attempt in range(3):      # a failed world start (seen under load) is retried, and said
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=1800)
        if done.returncode == 0:
            break
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        cause = next((ln for ln in lines if "root cause" in ln), lines[-1])
        print(f"#   failed (attempt {attempt + 1}): {cause}", flush=True)
    else:
        raise RuntimeError(f"benchmark failed 3 times: {' '.join(cmd)}")
    with open(path) as f:
        return json.load(f)["rows"]


ROW_FIELDS = ("collective", "library", "algo", "nranks", "transport", "size", "count", "iters",
              "time_us", "batches_us", "wrong")


def slim(rows):
    """The benchmark rows with the fields the calibration reads (the raw file stays small)."""
    return [{k: r[k] for k in ROW_FIELDS if k in r} for r in rows]


def single_copy_threshold(transport, env):
    """The single-copy size a world of this transport agrees on here (shm: what its pairs' setup
    probes chose, cma.choose_min; 0: none), read from a two-rank world's link model."""
    code = ("import minicomm as mc\n"
            f"print(mc.spawn(lambda c: c.link_model.single_copy, 2, transport={transport!r})[0])")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return int(done.stdout.split()[-1])


def record_run(out, transport, n, rnd, sizes, algos, colls, batches):
    cache = tempfile.mkdtemp(prefix=f"cache-{transport}-n{n}-r{rnd}-", dir=out)
    env = dict(os.environ, MINICOMM_CACHE_DIR=cache)
    load_before = os.getloadavg()
    memory = measure_memory()
    probe = run_bench(os.path.join(out, f"probe-{transport}-n{n}-r{rnd}.json"), transport, 2,
                      PROBE_SIZES, "tree,rhd", "broadcast,allgather", env, batches)
    with open(os.path.join(cache, os.listdir(cache)[0])) as f:
        world_start = json.load(f)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = run_bench(os.path.join(out, f"{transport}-n{n}-r{rnd}.json"), transport, n, sizes,
                     algos, colls, env, batches)
    return {"transport": transport, "ranks": n, "round": rnd, "cores": int(cores or 0),
            # the single-copy threshold this run had (shm: probed per pair at world start)
            "single_copy": single_copy_threshold(transport, env),
            # the small-message path's message limit of this code (minicomm.smallpath)
            "small_bytes": cost.SMALL_BYTES.get(transport, 0),
            "batches": batches, "batch_time": BATCH_TIME,
            "load_before": load_before, "load_after": os.getloadavg(), "memory": memory,
            "wake": world_start.get("wake", 0.0), "world_start_links": world_start,
            "probe": slim(probe), "rows": slim(rows)}


def recorded_collectives(raw):
    """The collectives of the measured runs, in the order they were recorded."""
    seen = {}
    for run in raw["runs"]:
        for r in run["rows"]:
            seen.setdefault(r["collective"], None)
    return list(seen)


def print_table(raw):
    runs = raw["runs"]
    colls = recorded_collectives(raw)
    print(f"# examples/sim_calibrate.py: {len(runs)} recorded runs ("
          f"{len({r['round'] for r in runs})} rounds x transports x world sizes), each: memory "
          f"probe, 2-rank link sweep (minicomm bench broadcast,allgather --algorithms tree,rhd "
          f"--sizes {PROBE_SIZES}), then minicomm bench {','.join(colls)} (ring, tree, rhd; "
          f"64K,1M,16M,64M), {runs[0].get('batches', 11)} batches of "
          f"{runs[0].get('batch_time', BATCH_TIME) * 1e3:g} ms per row and run")
    print("# estimator: the fastest batch over all rounds, for the link sweep and the measured "
          "rows alike (each batch is the slowest rank's time per call); predicted: "
          "minicomm.cost.schedule_time (engine host machine, back-to-back calls as the batch "
          "runs them); error = predicted / fastest - 1; summary = exp(mean |ln(pred/meas)|) - 1")
    print(f"# load average (1 min) over the runs: "
          f"{min(r['load_before'][0] for r in runs):.1f} .. "
          f"{max(max(r['load_before'][0], r['load_after'][0]) for r in runs):.1f} on "
          f"{runs[0].get('cores')} cores (this box is shared with other jobs)")
    cells = cal.merge_rounds(raw)
    rows = cal.calibration_rows(raw, cells)
    print("# per transport and world size: the link (one per transport, fitted to all its probe "
          "sweeps, the fastest batch of each row over all rounds), memory (δ by working set; "
          "shm's β is δ(working set) + δ(ring), tcp's the fitted β plus the kernel's copies), "
          "wake (world start's probe), load average per round:")
    for c in cells:
        ln, mem = c["links"], c["memory"]
        beta = ("δ(ws) + δ(ring)" if c["transport"] in cost.COPY_TRANSPORTS
                else f"{1e-9 / ln['beta']:.2f} GB/s")
        print(f"#   {c['transport']} n={c['ranks']}: o {ln['overhead'] * 1e6:.1f} us, latency "
              f"{ln['latency'] * 1e6:.1f} us, executor +{ln['exec_overhead'] * 1e6:.1f} us per "
              f"message op, β {beta}; wake "
              f"{c['wake'] * 1e6:.0f} us; δ {1e-9 / mem[0][1]:.0f}..{1e-9 / mem[-1][1]:.1f} GB/s "
              f"(64K..64M); load average "
              + ", ".join(f"{a:.2f}->{b:.2f}" for a, b in c["load"]))
    print(f"{'transport':>9} {'n':>2} {'collective':>10} {'algo':>5} {'size':>7} "
          f"{'fastest':>10} {'median':>10} {'predicted':>10} {'error':>7}")
    for r in rows:
        print(f"{r['transport']:>9} {r['ranks']:>2} {r['collective']:>10} "
              f"{r['algorithm']:>5} {r['bytes'] >> 10:>6}K {r['timed_s'] * 1e6:>8.0f}us "
              f"{r['median_s'] * 1e6:>8.0f}us {r['predicted_s'] * 1e6:>8.0f}us "
              f"{100 * r['error']:>6.1f}%")
    groups = [("all", rows)]
    for t in sorted({r["transport"] for r in rows}):
        groups.append((t, [r for r in rows if r["transport"] == t]))
        for n in sorted({r["ranks"] for r in rows}):
            groups.append((f"{t} n={n}", [r for r in rows if r["transport"] == t
                                          and r["ranks"] == n]))
    for c in colls:
        groups.append((c, [r for r in rows if r["collective"] == c]))
    for fam in ("ring", "tree", "rhd"):
        groups.append((fam, [r for r in rows if r["algorithm"] == fam]))
    for lo, hi, name in ((0, 1 << 20, "< 1 MiB"), (1 << 20, 1 << 40, ">= 1 MiB")):
        groups.append((name, [r for r in rows if lo <= r["bytes"] < hi]))
    for name, sub in groups:
        if sub:
            print(f"# {name:>10}: {len(sub):3d} rows, geometric-mean error "
                  f"{100 * cal.geomean_error(sub):.1f}% (exp mean |ln(pred/meas)| - 1; vs the "
                  f"fastest batch)")
    print_picks(cal.pick_rows(cells))


def print_picks(picks):
    """auto's picks on the same runs: what the cost model chooses against what ran fastest."""
    print("# auto's pick (cost.model_choice on each cell's fitted link, no tuned table) against "
          "the fastest family, by the median over rounds of each round's median batch; regret "
          "= pick's time / best time")
    print(f"{'transport':>9} {'n':>2} {'collective':>10} {'size':>7} {'pick':>5} {'best':>5} "
          f"{'regret':>7}")
    for p in picks:
        print(f"{p['transport']:>9} {p['ranks']:>2} {p['collective']:>10} "
              f"{p['bytes'] >> 10:>6}K {p['pick']:>5} {p['best']:>5} {p['regret']:>7.2f}")
    worst = max(picks, key=lambda p: p["regret"])
    print(f"# picks: {len(picks)}; the fastest family picked in "
          f"{sum(p['pick'] == p['best'] for p in picks)}; regret above 1.10 in "
          f"{sum(p['regret'] > 1.10 for p in picks)}; geometric-mean regret "
          f"{cal.geomean_regret(picks):.3f}; worst {worst['regret']:.2f} ({worst['transport']} "
          f"n={worst['ranks']} {worst['collective']} {worst['bytes'] >> 10}K: {worst['pick']} "
          f"picked, {worst['best']} fastest)")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="working directory for --run")
    ap.add_argument("--run", action="store_true", help="run the benchmarks")
    ap.add_argument("--raw", help="recorded runs (JSON) to predict instead of running")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--sizes", default="64K,1M,16M,64M")
    ap.add_argument("--algorithms", default="ring,tree,rhd")
    ap.add_argument("--collectives", default=COLLS, help="the measured runs' collectives")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batches", type=int, default=11)
    ap.add_argument("--json", help="write the raw runs here (with --run)")
    a = ap.parse_args()
    if a.run:
        if not a.out:
            ap.error("--run needs --out")
        os.makedirs(a.out, exist_ok=True)
        runs = []
        for rnd in range(a.rounds):
            for t in a.transports.split(","):
                for n in (int(x) for x in a.worlds.split(",")):
                    runs.append(record_run(a.out, t, n, rnd, a.sizes, a.algorithms,
                                           a.collectives, a.batches))
                    raw = {"format": "minicomm-calibration/1", "runs": runs}
                    with open(a.json or os.path.join(a.out, "raw.json"), "w") as f:
                        json.dump(raw, f, indent=0)
    elif a.raw:
        with open(a.raw) as f:
            raw = json.load(f)
    else:
        ap.error("give --run (with --out) or --raw")
    print_table(raw)


if __name__ == "__main__":
    main()
