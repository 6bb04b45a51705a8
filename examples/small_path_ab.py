"""The small path's message limit, A/B inside one job: every rooted and unrooted collective at
1 MiB, run with shm's small path limited to 16 KiB (EAGER: what it was) and to a ring chunk
(1 MiB: what it is), interleaved round by round in the same processes, so drift on a shared
machine hits both alike. Prints rank 0's median time per call of each.

    minicomm run -n 2 examples/small_path_ab.py            # ROUNDS=5 by default
    ROUNDS=3 minicomm run -n 4 examples/small_path_ab.py

The limit is the transport's ``small_bytes``; the communicator compiles a call's plan for the
small path when every message fits it, once per call signature, so each phase clears that cache.
"""
import os
import statistics
import time

import numpy as np

import minicomm as mc
from minicomm.transports import shm
from minicomm.transports.bytecopy import page_aligned

NBYTES = 1 << 20
CALLS = 200


def aligned(shape):
    """Page-aligned float32 ones: the bench's buffers (benchspec.page_aligned_empty)."""
    a = page_aligned(int(np.prod(shape)) * 4).view(np.float32).reshape(shape)
    a[...] = 1
    return a


def main():
    comm = mc.init()
    p, r, t = comm.size, comm.rank, comm.transport
    if not isinstance(t, shm.ShmTransport):
        raise SystemExit("run it with every rank on one node (shm)")
    block, blocks = aligned((NBYTES // 4 // p,)), aligned((p, NBYTES // 4 // p))
    vec, out_vec = aligned((NBYTES // 4,)), aligned((NBYTES // 4,))
    mine, out_blocks = aligned((NBYTES // 4 // p,)), aligned((p, NBYTES // 4 // p))
    cases = {
        "broadcast": lambda: comm.broadcast(vec, root=0, out=out_vec),
        "reduce": lambda: comm.reduce(vec, root=0, out=out_vec if r == 0 else None),
        "allreduce": lambda: comm.allreduce(vec, out=out_vec),
        "allgather": lambda: comm.allgather(block, out=out_blocks),
        "reduce_scatter": lambda: comm.reduce_scatter(blocks, out=mine),
        "gather": lambda: comm.gather(block, root=0, out=out_blocks if r == 0 else None),
        "scatter": lambda: comm.scatter(blocks if r == 0 else None, root=0, out=mine),
        "alltoall": lambda: comm.alltoall(blocks, out=out_blocks),
    }
    limits = {"16 KiB": shm.EAGER, "1 MiB": t.small_bytes}
    times = {}
    for _ in range(int(os.environ.get("ROUNDS", "5"))):
        for name, limit in limits.items():
            t.small_bytes = limit
            comm._forget_calls()          # plans are chosen per call signature: choose again
            for coll, call in cases.items():
                for _ in range(20):
                    call()
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    call()
                comm.barrier()
                times.setdefault((coll, name), []).append((time.perf_counter() - t0) / CALLS)
    if r == 0:
        for coll in cases:
            a, b = (statistics.median(times[(coll, name)]) * 1e6 for name in limits)
            print(f"n={p} {coll:15s} 16 KiB limit {a:7.1f} us   1 MiB limit {b:7.1f} us   "
                  f"ratio {a / b:.2f}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
