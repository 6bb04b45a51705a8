"""Scatter's header exchange, A/B inside one job: ``comm.scatter`` (one exchange of header rows
that is also the call's argument check, then the data) against the protocol it replaced (a
rooted shape/dtype broadcast, itself fingerprint-checked, then the data), interleaved round by
round in the same processes (interleave.py). Prints rank 0's median time per call of each and
their ratio (old / new), with and without out= at the non-roots.

    minicomm run -n 2 examples/scatter_header_ab.py          # ROUNDS=7 by default
    minicomm run -n 4 examples/scatter_header_ab.py

The old protocol is rebuilt here from the communicator's parts (its broadcast runs under
broadcast's own call code instead of "scatter:meta"; the messages and their sizes are the same).
"""
import os

import numpy as np
from interleave import interleaved, report

import minicomm as mc
from minicomm.communicator.scatter import META_WORDS, decode_meta, encode_meta


def broadcast_then_scatter(comm, x, root, out):
    """The replaced protocol: a tree broadcast of the root's shape and dtype, then the data."""
    if comm.rank == root:
        arr, inflat = comm._flat_in(x)
        meta = encode_meta(arr.dtype, arr.shape[1:])
    else:
        meta = np.zeros(META_WORDS, dtype=np.int64)
    m = np.empty(META_WORDS, dtype=np.int64)
    comm._execute("broadcast", meta, m, META_WORDS, "none", root, "tree", (META_WORDS,))
    dtype, block = decode_meta(m)
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
            modes = {"broadcast-then-data": lambda: {
                         "scatter": lambda: broadcast_then_scatter(comm, x, 0, out)},
                     "header-exchange": lambda: {
                         "scatter": lambda: comm.scatter(x, root=0, out=out)}}
            medians = interleaved(comm, modes, {}, int(os.environ.get("ROUNDS", "7")),
                                  200 if nbytes >= 1 << 20 else 1000, warmup=5)
            report(comm, f"{nbytes} B out={'yes' if with_out else 'no'}", medians, modes)
    comm.close()


if __name__ == "__main__":
    main()
