"""The executor: runs a schedule on real numpy buffers through a transport.

A schedule is compiled once per (schedule, communicator) into a ``Plan``: per step, the local ops
and the (world peer, buffer, slice, reduce?) of every message, so that a call does no per-op
lookups beyond slicing the caller's arrays. Per step the executor runs the local ops, posts every
receive, then every send, then waits for all of them: exactly the semantics the verifier proved.
Receives with ``reduce=True`` hand the transport a kernel that reduces straight from its landing
memory into the destination (no staging copy).
"""
from __future__ import annotations

import time
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .transports.base import Tag
from .schedule import Copy, Recv, Reduce, Schedule, Send

_LOCAL_COPY, _LOCAL_REDUCE = 0, 1


class Plan:
    """A schedule compiled for one communicator: peers already translated to world ranks."""
    __slots__ = ("schedule", "steps")

    def __init__(self, schedule: Schedule, world_ranks: Sequence[int]):
        self.schedule = schedule
        steps = []
        for st in schedule.steps:
            local = []
            recvs = []
            sends = []
            for o in st:
                if isinstance(o, Recv):
                    recvs.append((world_ranks[o.peer], o.buf, o.offset, o.offset + o.count, o.reduce))
                elif isinstance(o, Send):
                    sends.append((world_ranks[o.peer], o.buf, o.offset, o.offset + o.count))
                elif isinstance(o, Copy):
                    local.append((_LOCAL_COPY, o.src, o.src_offset, o.dst, o.dst_offset, o.count))
                elif isinstance(o, Reduce):
                    local.append((_LOCAL_REDUCE, o.src, o.src_offset, o.dst, o.dst_offset, o.count))
            steps.append((tuple(local), tuple(recvs), tuple(sends)))
        self.steps = tuple(steps)


def run_plan(plan: Plan, transport, bufs: Dict[str, np.ndarray], kernel, tag: Tag,
             deadline: float, what: str) -> None:
    """Execute ``plan`` with flat buffers ``bufs`` ('in', 'out', 'tmp'); ``kernel(dst, src)``
    reduces in place. ``tag`` is the call's tag; its ``step`` field is set per step."""
    isend, irecv, wait_all = transport.isend, transport.irecv, transport.wait_all
    comm, seq, call, count = tag.comm, tag.seq, tag.call, tag.count
    for i, (local, recvs, sends) in enumerate(plan.steps):
        for kind, src, so, dst, do, n in local:
            s = bufs[src][so:so + n]
            d = bufs[dst][do:do + n]
            if kind == _LOCAL_COPY:
                d[...] = s
            else:
                kernel(d, s)
        if not recvs and not sends:
            continue
        t = Tag(comm, seq, i, call, count)
        reqs = [irecv(peer, bufs[b][lo:hi], t, kernel if red else None)
                for peer, b, lo, hi, red in recvs]
        reqs += [isend(peer, bufs[b][lo:hi], t) for peer, b, lo, hi in sends]
        wait_all(reqs, deadline, what)
