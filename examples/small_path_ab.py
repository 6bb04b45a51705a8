"""The small path's message limit, A/B inside one job: every rooted and unrooted collective at
1 MiB, run with shm's small path limited to 16 KiB (EAGER: what it was) and to a ring chunk
(1 MiB: what it is), interleaved round by round in the same processes (interleave.py), so drift
on a shared machine hits both alike. Prints rank 0's median time per call of each.

    minicomm run -n 2 examples/small_path_ab.py            # ROUNDS=5 by default
    ROUNDS=3 minicomm run -n 4 examples/small_path_ab.py

The limit is the eager channel's ``small_bytes`` (``comm.caps.eager``); the communicator
compiles a call's plan for the small path when every message fits it, once per call signature,
so each phase clears that cache.
"""
import os

from interleave import aligned, calls_on, interleaved, report

import minicomm as mc
from minicomm.transports import shm

NBYTES = 1 << 20


def main():
    comm = mc.init()
    eager = comm.caps.eager
    if eager is None:
        raise SystemExit("run it with every rank on one node (shm: the eager channel)")

    def limit(nbytes):
        def switch():
            eager.small_bytes = nbytes
            comm._forget_calls()          # plans are chosen per call signature: choose again
        return switch

    modes = {"16 KiB limit": limit(shm.EAGER), "1 MiB limit": limit(eager.small_bytes)}
    medians = interleaved(comm, modes, calls_on(comm, aligned, NBYTES // 4),
                          int(os.environ.get("ROUNDS", "5")), 200, warmup=20)
    report(comm, "1 MiB", medians, modes)
    comm.close()


if __name__ == "__main__":
    main()
