"""The executor: runs a schedule on real numpy buffers through a transport.

A schedule is compiled once per (schedule, communicator) into a ``Plan``: per step, the local ops
and the (world peer, buffer, slice, reduce?) of every message, so that a call does no per-op
lookups beyond slicing the caller's arrays. Per step the executor runs the local ops, posts every
receive, then every send, then waits for all of them: exactly the semantics the verifier proved.
Receives with ``reduce=True`` hand the transport a kernel that reduces straight from its landing
memory into the destination (no staging copy).

One compilation moves data fewer times than the schedule spells out: a step that copies a block
of ``in`` into a region and receives-with-reduce into that same region (the first step of every
reduce-scatter) becomes a receive whose kernel computes ``region = in_block op incoming`` as the
data lands, one pass instead of a copy pass plus a reduce pass. It is done only where nothing
else in the step touches the region, so the result is the one the verifier proved.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .transports.base import Tag
from .schedule import Copy, Recv, Reduce, Schedule, Send, IN, OUT, TMP

_LOCAL_COPY, _LOCAL_REDUCE = 0, 1
_BUF_INDEX = {IN: 0, OUT: 1, TMP: 2}
# Below this many elements the copy and the separate reduce are cheaper than the fused kernel's
# per-chunk offset arithmetic (and small messages arrive in one piece anyway).
FUSE_MIN_COUNT = 4096

_new_tag = tuple.__new__


class Plan:
    """A schedule compiled for one communicator: peers already translated to world ranks.

    ``steps``: per step ``(local, posts)``; ``local`` holds (kind, src buffer, src offset, dst
    buffer, dst offset, count) with buffers as indices into (in, out, tmp); ``posts`` holds, in
    posting order (receives, then sends), (is_send, world peer, buffer, lo, hi, whole, reduce,
    fused) where ``whole`` says the slice is the entire buffer, and ``fused`` is the ``in`` offset
    of a copy folded into a reduce-receive (-1: none)."""
    __slots__ = ("schedule", "steps", "tmp_count")

    def __init__(self, schedule: Schedule, world_ranks: Sequence[int]):
        self.schedule = schedule
        self.tmp_count = schedule.tmp_count
        sizes = (schedule.in_count, schedule.out_count, schedule.tmp_count)
        steps = []
        for i, st in enumerate(schedule.steps):
            fused = _fusable(st)
            folded = {id(c) for c in fused.values()}
            local, recvs, sends = [], [], []
            for o in st:
                if isinstance(o, Recv):
                    b = _BUF_INDEX[o.buf]
                    recvs.append((False, world_ranks[o.peer], b, o.offset, o.offset + o.count,
                                  o.offset == 0 and o.count == sizes[b], o.reduce,
                                  fused[o].src_offset if o in fused else -1))
                elif isinstance(o, Send):
                    b = _BUF_INDEX[o.buf]
                    sends.append((True, world_ranks[o.peer], b, o.offset, o.offset + o.count,
                                  o.offset == 0 and o.count == sizes[b], False, -1))
                elif isinstance(o, (Copy, Reduce)) and id(o) not in folded:
                    local.append((_LOCAL_COPY if isinstance(o, Copy) else _LOCAL_REDUCE,
                                  _BUF_INDEX[o.src], o.src_offset, _BUF_INDEX[o.dst],
                                  o.dst_offset, o.count))
            steps.append((tuple(local), tuple(recvs + sends)))
        self.steps = tuple(steps)


def _fusable(step) -> dict:
    """{Recv: Copy} pairs of ``step`` that may run as one ``dst = in op incoming`` pass: the copy
    reads ``in`` (never written) into exactly the receive's region, and no other op of the step
    reads or writes that region."""
    out = {}
    copies = [o for o in step if isinstance(o, Copy) and o.src == IN]
    for r in step:
        if not (isinstance(r, Recv) and r.reduce and r.count >= FUSE_MIN_COUNT):
            continue
        for c in copies:
            if c.dst == r.buf and c.dst_offset == r.offset and c.count == r.count:
                if not any(o is not r and o is not c and _touches(o, r.buf, r.offset, r.count)
                           for o in step):
                    out[r] = c
                break
    return out


def _touches(o, buf: str, lo: int, n: int) -> bool:
    def hit(b, off, cnt):
        return b == buf and off < lo + n and lo < off + cnt and cnt > 0
    if isinstance(o, (Send, Recv)):
        return hit(o.buf, o.offset, o.count)
    return hit(o.src, o.src_offset, o.count) or hit(o.dst, o.dst_offset, o.count)


class _InOp:
    """Reduce kernel of a fused copy+receive: ``dst = src_block op incoming``. Transports call it
    with any sub-range ``dst`` of the receive buffer (chunks); the matching range of the ``in``
    block is found from the byte distance between ``dst`` and the buffer's start."""
    __slots__ = ("ufunc", "base", "src", "isz")

    def __init__(self, ufunc, dst: np.ndarray, src: np.ndarray):
        self.ufunc, self.src, self.isz = ufunc, src, dst.itemsize
        self.base = dst.__array_interface__["data"][0]

    def __call__(self, dst: np.ndarray, incoming: np.ndarray) -> None:
        lo = (dst.__array_interface__["data"][0] - self.base) // self.isz
        self.ufunc(self.src[lo:lo + dst.shape[0]], incoming, out=dst)


def run_plan(plan: Plan, transport, bufs, kernel, tag: Tag, deadline: float, what: str) -> None:
    """Execute ``plan`` with flat buffers ``bufs`` = (in, out, tmp); ``kernel(dst, src)``
    reduces in place (and carries its ufunc as ``kernel.ufunc``). ``tag`` is the call's tag;
    its ``step`` field is set per step."""
    isend, irecv, wait_all = transport.isend, transport.irecv, transport.wait_all
    comm, seq, call, count = tag[0], tag[1], tag[3], tag[4]
    i = -1
    for local, posts in plan.steps:
        i += 1
        for kind, sb, so, db, do, n in local:
            d = bufs[db][do:do + n]
            if kind == _LOCAL_COPY:
                d[...] = bufs[sb][so:so + n]
            else:
                kernel(d, bufs[sb][so:so + n])
        if not posts:
            continue
        t = _new_tag(Tag, (comm, seq, i, call, count))
        reqs = []
        for is_send, peer, b, lo, hi, whole, red, fused in posts:
            view = bufs[b] if whole else bufs[b][lo:hi]
            if is_send:
                reqs.append(isend(peer, view, t))
            elif not red:
                reqs.append(irecv(peer, view, t))
            elif fused < 0:
                reqs.append(irecv(peer, view, t, kernel))
            else:
                src = bufs[0][fused:fused + hi - lo]
                reqs.append(irecv(peer, view, t, _InOp(kernel.ufunc, view, src)))
        wait_all(reqs, deadline, what)
