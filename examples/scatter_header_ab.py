"""Scatter's header exchange, A/B inside one job: ``comm.scatter`` (one exchange of header rows
that is also the call's argument check, then the data) against the protocol it replaced (a
rooted shape/dtype broadcast, itself fingerprint-checked, then the data), interleaved round by
round in the same processes, so drift on a shared machine hits both alike. Prints rank 0's
median time per call (slowest rank) of each and their ratio, with and without out= at the
non-roots.

    minicomm run -n 2 examples/scatter_header_ab.py          # ROUNDS=7 by default
    minicomm run -n 4 examples/scatter_header_ab.py

The old protocol is rebuilt here from the communicator's parts (its broadcast runs under
broadcast's own call code instead of "scatter:meta"; the messages and their sizes are the same).
"""
import os
import statistics
import time

import numpy as np

import minicomm as mc
from minicomm.communicator import _META_WORDS, _decode_meta, _encode_meta


def broadcast_then_scatter(comm, x, root, out):
    """The replaced protocol: a tree broadcast of the root's shape and dtype, then the data."""
    if comm.rank == root:
        arr, inflat = comm._flat_in(x)
        meta = _encode_meta(arr.dtype, arr.shape[1:])
    else:
        meta = np.zeros(_META_WORDS, dtype=np.int64)
    m = np.empty(_META_WORDS, dtype=np.int64)
    comm._execute("broadcast", meta, m, _META_WORDS, "none", root, "tree", (_META_WORDS,))
    dtype, block = _decode_meta(m)
    res, outflat = comm._make_out(out, block, dtype, "scatter")
    src = comm._separate(inflat, outflat, out) if comm.rank == root else np.empty(0, dtype)
    comm._execute("scatter", src, outflat, outflat.size, "none", root, "auto",
                  (comm.size,) + tuple(block), fingerprint=False)
    return res


def main():
    comm = mc.init()
    p, r = comm.size, comm.rank
    for nbytes in (16 * p, 64 << 10, 1 << 20):
        count = nbytes // 4 // p
        x = np.ones((p, count), np.float32) if r == 0 else None
        for with_out in (True, False):
            out = np.empty(count, np.float32) if with_out else None
            cases = {"broadcast, then data": lambda: broadcast_then_scatter(comm, x, 0, out),
                     "header exchange": lambda: comm.scatter(x, root=0, out=out)}
            calls = 200 if nbytes >= 1 << 20 else 1000
            times = {name: [] for name in cases}
            for _ in range(int(os.environ.get("ROUNDS", "7"))):
                for name, call in cases.items():
                    for _ in range(5):
                        call()
                    comm.barrier()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        call()
                    mine = np.array([(time.perf_counter() - t0) / calls * 1e6])
                    times[name].append(float(comm.allreduce(mine, op="max")[0]))
            if r == 0:
                old, new = (statistics.median(v) for v in times.values())
                print(f"n={p} scatter {nbytes:>8} B, out={'yes' if with_out else 'no '}: "
                      f"broadcast then data {old:7.1f} us, header exchange {new:7.1f} us, "
                      f"x{old / new:.2f}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
