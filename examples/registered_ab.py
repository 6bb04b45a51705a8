"""Registered against plain buffers, A/B inside one job: every collective at one size, with its
buffers from ``comm.empty`` (registered) and from the page-aligned heap (plain, as the bench's),
interleaved round by round in the same processes, so drift on a shared machine hits both alike.
Prints rank 0's median time per call of each and plain / registered (above 1: registered is
faster).

    minicomm run -n 2 examples/registered_ab.py                   # 1 MiB, ROUNDS=5
    NBYTES=4M CALLS=50 minicomm run -n 4 examples/registered_ab.py

Over shm, a message from registered memory larger than a ring chunk travels as a descriptor the
receiver copies from (one copy); up to a chunk it takes the ring like a plain one (shm.py,
"Registered memory"), so at 1 MiB and below the two columns should agree.
"""
import os
import statistics
import time

import numpy as np

import minicomm as mc
from minicomm.tools.benchspec import parse_size
from minicomm.transports.bytecopy import page_aligned


def main():
    comm = mc.init()
    p, r = comm.size, comm.rank
    nbytes, calls = parse_size(os.environ.get("NBYTES", "1M")), int(os.environ.get("CALLS", "200"))
    n = nbytes // 4

    def plain(shape):
        a = page_aligned(int(np.prod(shape)) * 4).view(np.float32).reshape(shape)
        a[...] = 1
        return a

    def registered(shape):
        a = comm.empty(shape, np.float32)
        a[...] = 1
        return a

    kinds = {"plain": plain, "registered": registered}
    cases = {}
    for kind, make in kinds.items():
        block, blocks, vec, out_vec = make((n // p,)), make((p, n // p)), make((n,)), make((n,))
        mine, out_blocks = make((n // p,)), make((p, n // p))
        cases[kind] = {
            "broadcast": lambda: comm.broadcast(vec, root=0, out=out_vec),
            "reduce": lambda: comm.reduce(vec, root=0, out=out_vec if r == 0 else None),
            "allreduce": lambda: comm.allreduce(vec, out=out_vec),
            "allgather": lambda: comm.allgather(block, out=out_blocks),
            "reduce_scatter": lambda: comm.reduce_scatter(blocks, out=mine),
            "gather": lambda: comm.gather(block, root=0, out=out_blocks if r == 0 else None),
            "scatter": lambda: comm.scatter(blocks if r == 0 else None, root=0, out=mine),
            "alltoall": lambda: comm.alltoall(blocks, out=out_blocks),
        }
    times = {}
    for _ in range(int(os.environ.get("ROUNDS", "5"))):
        for kind in kinds:
            for coll, call in cases[kind].items():
                for _ in range(10):
                    call()
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                comm.barrier()
                times.setdefault((coll, kind), []).append((time.perf_counter() - t0) / calls)
    if r == 0:
        for coll in cases["plain"]:
            a, b = (statistics.median(times[(coll, kind)]) * 1e6 for kind in kinds)
            print(f"n={p} {nbytes >> 10} KiB {coll:15s} plain {a:8.1f} us   registered {b:8.1f} us"
                  f"   plain/registered {a / b:.2f}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
