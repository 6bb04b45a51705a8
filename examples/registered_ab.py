"""Registered against plain buffers, A/B inside one job: every collective at one size, with its
buffers from ``comm.empty`` (registered) and from the page-aligned heap (plain, as the bench's),
interleaved round by round in the same processes (interleave.py). Prints rank 0's median time
per call of each and plain / registered (above 1: registered is faster).

    minicomm run -n 2 examples/registered_ab.py                   # 1 MiB, ROUNDS=5
    NBYTES=4M CALLS=50 minicomm run -n 4 examples/registered_ab.py

Over shm, a message from registered memory larger than a ring chunk travels as a descriptor the
receiver copies from (one copy); up to a chunk it takes the ring like a plain one
(docs/decisions/registered-buffers.md), so at 1 MiB and below the two columns should agree.
"""
import os

import numpy as np
from interleave import aligned, calls_on, interleaved, report

import minicomm as mc
from minicomm.tools.benchspec import parse_size


def main():
    comm = mc.init()
    nbytes = parse_size(os.environ.get("NBYTES", "1M"))

    def registered(shape):
        a = comm.empty(shape, np.float32)
        a[...] = 1
        return a

    modes = {"plain": calls_on(comm, aligned, nbytes // 4),
             "registered": calls_on(comm, registered, nbytes // 4)}
    medians = interleaved(comm, {m: (lambda c=c: c) for m, c in modes.items()}, {},
                          int(os.environ.get("ROUNDS", "5")), int(os.environ.get("CALLS", "200")))
    report(comm, f"{nbytes >> 10} KiB", medians, modes)
    comm.close()


if __name__ == "__main__":
    main()
