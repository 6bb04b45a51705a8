"""How much communication async allreduce hides behind compute (the DDP pattern).

Each rank runs a "step" of 8 slices of numpy compute; after each slice it submits that slice's
gradient bucket with ``allreduce(async_op=True)`` and goes on computing, then waits for all 8.
The same step is also timed with compute alone and with the 8 allreduces alone (serially), so

    overlap = (compute + comm - step) / min(compute, comm)

is the fraction of the shorter phase that was hidden (1.0: perfect overlap, 0.0: none). It also
reports how long one submit takes: it must not wait for the earlier buckets.

    python examples/async_overlap.py [--ranks 2] [--bucket-mib 4] [--steps 5] [--transport shm]

Compute is a float64 matmul (numpy releases the GIL inside it, so the communicator's worker
thread moves bytes meanwhile); on a machine with as many cores as ranks, compute and the copies
of communication still compete for the same core, which bounds the overlap.
"""
import argparse
import json
import statistics
import time

import numpy as np

import minicomm as mc


def rank_main(comm, bucket_mib: float, steps: int, compute_n: int):
    buckets = [np.full(int(bucket_mib * (1 << 20)) // 4, comm.rank + 1.0, dtype=np.float32)
               for _ in range(8)]
    a = np.random.default_rng(comm.rank).standard_normal((compute_n, compute_n))

    def compute_slice():
        return a @ a

    def step(mode: str):
        submit_s = []
        works = []
        t0 = time.perf_counter()
        for b in buckets:
            if mode != "comm":
                compute_slice()
            if mode == "overlap":
                t = time.perf_counter()
                works.append(comm.allreduce(b, op="avg", async_op=True))
                submit_s.append(time.perf_counter() - t)
            elif mode == "comm":
                comm.allreduce(b, op="avg")
        for w in works:
            w.wait()
        return time.perf_counter() - t0, submit_s

    for mode in ("compute", "comm", "overlap"):      # warm-up
        step(mode)
    times = {"compute": [], "comm": [], "overlap": []}
    submits = []
    for _ in range(steps):
        for mode in times:
            comm.barrier()
            dt, sub = step(mode)
            times[mode].append(dt)
            submits.extend(sub)
    med = {k: statistics.median(v) for k, v in times.items()}
    slowest = comm.allreduce(np.array([med["compute"], med["comm"], med["overlap"]]), op="max")
    return {"compute_s": slowest[0], "comm_s": slowest[1], "step_s": slowest[2],
            "submit_us_median": 1e6 * statistics.median(submits),
            "submit_us_max": 1e6 * max(submits)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--bucket-mib", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compute-n", type=int, default=320, help="matmul size of one slice")
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = mc.spawn(rank_main, args.ranks, args=(args.bucket_mib, args.steps, args.compute_n),
                   transport=args.transport, timeout=300)[0]
    c, m, s = res["compute_s"], res["comm_s"], res["step_s"]
    res["serial_s"] = c + m
    res["overlap"] = (c + m - s) / min(c, m) if min(c, m) > 0 else 0.0
    if args.json:
        print(json.dumps(res))
        return
    print(f"{args.ranks} ranks over {args.transport}, 8 buckets of {args.bucket_mib:g} MiB, "
          f"median of {args.steps} steps (slowest rank)")
    print(f"  compute alone      {1e3 * c:8.1f} ms")
    print(f"  allreduces alone   {1e3 * m:8.1f} ms")
    print(f"  serial sum         {1e3 * (c + m):8.1f} ms")
    print(f"  overlapped step    {1e3 * s:8.1f} ms   (x{(c + m) / s:.2f} faster than serial)")
    print(f"  overlap achieved   {res['overlap']:8.2f}   of the shorter phase hidden")
    print(f"  one async submit   {res['submit_us_median']:8.1f} us median, "
          f"{res['submit_us_max']:.1f} us max")


if __name__ == "__main__":
    main()
