"""The modelled timeline of one simulated call, step by step, as plain data: what
``minicomm sim --trace`` turns into the trace events a run with ``MINICOMM_TRACE`` writes
(``minicomm.trace.SimulatedTrace`` formats them; the simulator imports nothing of it).

Per rank, per step of its schedule: the step's modelled start and end, the modelled time of its
local ops, the messages it sends and receives (peers are ranks of the call, bytes are elements x
``itemsize``) and the bytes of its local copies and reductions. The engine's programs keep no
buffer names or offsets, so none are given.
"""
from __future__ import annotations

from typing import Iterator, List, NamedTuple, Tuple


class ModelledStep(NamedTuple):
    """One step of one rank as ``run_program`` timed it (seconds from the call's start)."""
    step: int                                  # its index in the rank's schedule
    start_s: float
    end_s: float
    local_s: float                             # its local ops' modelled time
    sends: List[Tuple[int, int]]               # (peer, bytes), in op order
    recvs: List[Tuple[int, int, bool]]         # (peer, bytes, reduce on arrival)
    copy_bytes: int
    reduce_bytes: int


def modelled_steps(prog, stats, itemsize: int) -> Iterator[Tuple[int, float, List[ModelledStep]]]:
    """Per rank of ``prog`` (engine.Program), timed as ``stats`` (engine.RunStats from
    ``run_program``, which has every step's start and end): (rank, its end in seconds, its
    steps as ``ModelledStep``)."""
    start, end, local = stats.step_start, stats.step_end, stats.step_local
    for r in range(prog.size):
        first = int(prog.rank_first[r])
        steps = []
        for s in range(first, int(prog.rank_first[r + 1])):
            sends = [(int(prog.msg_dst[m]), int(prog.msg_count[m]) * itemsize)
                     for m in range(int(prog.send_ptr[s]), int(prog.send_ptr[s + 1]))]
            recvs = [(int(prog.msg_src[m]), int(prog.msg_count[m]) * itemsize,
                      bool(prog.msg_reduce[m]))
                     for m in prog.recv_order[prog.recv_ptr[s]:prog.recv_ptr[s + 1]]]
            steps.append(ModelledStep(s - first, float(start[s]), float(end[s]),
                                      float(local[s]), sends, recvs,
                                      int(prog.step_copy[s]) * itemsize,
                                      int(prog.step_reduce[s]) * itemsize))
        yield r, float(stats.rank_end[r]), steps
