"""The collectives' hot case (``Communicator._fast``: a repeated call signature skips the
argument handling) against the general path, A/B inside one job: every collective at one size,
interleaved round by round in the same processes (interleave.py). Prints rank 0's median time per
call of each and general / hot (above 1: the hot case is faster). allreduce and barrier keep
theirs in both modes (not switched here: the timing loop's barriers stay the same).

    minicomm run -n 2 examples/hot_case_ab.py                 # 8 B, ROUNDS=5
    NBYTES=1M CALLS=200 ROUNDS=7 minicomm run -n 2 examples/hot_case_ab.py
"""
import os

from interleave import aligned, calls_on, interleaved, report

import minicomm as mc
from minicomm.communicator.buffers import MISS
from minicomm.tools.benchspec import parse_size

UNSWITCHED = ("allreduce", "barrier")


def main():
    comm = mc.init()
    nbytes = parse_size(os.environ.get("NBYTES", "8"))
    cases = calls_on(comm, aligned, max(nbytes // 4, comm.size))
    del cases["allreduce"]
    fast = comm._fast

    def general():
        comm._fast = lambda name, *args: fast(name, *args) if name in UNSWITCHED else MISS

    def hot_case():
        comm._fast = fast

    modes = {"general": general, "hot": hot_case}
    medians = interleaved(comm, modes, cases, int(os.environ.get("ROUNDS", "5")),
                          int(os.environ.get("CALLS", "1000")))
    report(comm, f"{nbytes} B", medians, modes)
    comm.close()


if __name__ == "__main__":
    main()
