"""The executor: runs a schedule on real numpy buffers through a transport.

A schedule is compiled once per (schedule, communicator) into a ``Plan``: per step, the local ops
and the (world peer, buffer, slice, reduce?) of every message, so that a call does no per-op
lookups beyond slicing the caller's arrays. Per step the executor runs the local ops, posts every
receive, then every send, then waits for all of them: exactly the semantics the verifier proved.
One reordering that cannot change a result: a send that reads no region the step's local ops
write is posted before them (``_early_sends``), so a root's copy of its own block does not hold
back the messages to its peers (with registered memory they read it in place meanwhile).
Receives with ``reduce=True`` hand the transport a kernel that reduces straight from its landing
memory into the destination (no staging copy).

One compilation moves data fewer times than the schedule spells out: a step that copies a block
of ``in`` into a region and receives-with-reduce into that same region (the first step of every
reduce-scatter) becomes a receive whose kernel computes ``region = in_block op incoming`` as the
data lands, one pass instead of a copy pass plus a reduce pass. It is done only where nothing
else in the step touches the region, so the result is the one the verifier proved.
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np

from . import trace as _trace
from .errors import CommTimeout
from .schedule import IN, OUT, TMP, Copy, Recv, Reduce, Schedule, Send
from .settings import byte_setting, env_flag
from .transports.base import Tag
from .transports.bytecopy import copy

_LOCAL_COPY, _LOCAL_REDUCE = 0, 1
_BUF_INDEX = {IN: 0, OUT: 1, TMP: 2}
# Below this many elements the copy and the separate reduce are cheaper than the fused kernel's
# per-chunk offset arithmetic (and small messages arrive in one piece anyway).
FUSE_MIN_COUNT = 4096

_new_tag = tuple.__new__
# A step's local ops of at least this many bytes run on a helper thread beside the step's
# messages where the plan allows it (``_background_steps``) and the node has the cores
# (``_helpers_allowed``): a root's copy of its own large block takes as long as reading the
# peer's, and a thread costs a small fraction of that to start.
BACKGROUND_MIN_BYTES = byte_setting("MINICOMM_LOCAL_THREAD_BYTES", 4 << 20)
LOCAL_THREADS = env_flag("MINICOMM_LOCAL_THREADS", True)
HELPER_JOIN_S = 60.0          # the longest an error path waits for a helper's local copy to end
# Large local copies go in cache-sized pieces of this many bytes, faster than one memcpy of many
# MiB; every local copy goes through bytecopy.copy, since an out-of-place call's input and output
# are often 16 bytes apart modulo a page, where memmove is slow on some CPUs
# (docs/decisions/glibc-copy-workaround.md).
_COPY_PIECE = 256 << 10


def _copy_pieces(d: np.ndarray, s: np.ndarray) -> None:
    k = max(1, _COPY_PIECE // d.itemsize)
    for lo in range(0, d.shape[0], k):
        copy(d[lo:lo + k], s[lo:lo + k])


def local_copy(d: np.ndarray, s: np.ndarray) -> None:
    """A schedule's local Copy, as every interpreter of it makes one (this executor and the small
    path): through bytecopy.copy, in pieces when large (above)."""
    if d.nbytes < _COPY_PIECE << 2:
        copy(d, s)
    else:
        _copy_pieces(d, s)


class Plan:
    """A schedule compiled for one communicator: peers already translated to world ranks.

    ``steps``: per step ``(early, local, posts)``. ``local`` holds (kind, src buffer, src
    offset, dst buffer, dst offset, count, whole) with buffers as indices into (in, out, tmp)
    and ``whole`` saying both regions are entire buffers. ``posts`` holds, in posting order
    (receives, then sends), (is_send, world peer, buffer, lo, hi, whole, reduce, fused) where
    ``whole`` says the slice is the entire buffer, and ``fused`` is the ``in`` offset of a copy
    folded into a reduce-receive (-1: none). ``early`` holds, in the same form, the sends
    posted before the local ops (``_early_sends``); ``posts`` then has the rest.
    ``recv_peers``: the world ranks it receives from.
    ``background``: per step, the step at whose end its local ops must be done if they may run
    on a helper thread while the messages move (``_background_steps``), else -1; None where no
    step's may."""
    __slots__ = ("schedule", "steps", "tmp_count", "_alias", "background", "recv_peers")

    def __init__(self, schedule: Schedule, world_ranks: Sequence[int]):
        self.schedule = schedule
        self.tmp_count = schedule.tmp_count
        self._alias = {}
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
                    sb, db = _BUF_INDEX[o.src], _BUF_INDEX[o.dst]
                    whole = (o.src_offset == 0 and o.count == sizes[sb]
                             and o.dst_offset == 0 and o.count == sizes[db])
                    local.append((_LOCAL_COPY if isinstance(o, Copy) else _LOCAL_REDUCE,
                                  sb, o.src_offset, db, o.dst_offset, o.count, whole))
            early, late = _early_sends(sends, local)
            steps.append((early, tuple(local), tuple(recvs) + late))
        self.steps = tuple(steps)
        self.recv_peers = frozenset(p[1] for _, _, posts in self.steps for p in posts
                                    if not p[0])
        bg = _background_steps(self.steps)
        self.background = bg if any(j >= 0 for j in bg) else None

    def alias_safe(self, shift: int) -> bool:
        """``alias_safe`` of this plan's schedule, memoised per shift."""
        ok = self._alias.get(shift)
        if ok is None:
            ok = self._alias[shift] = alias_safe(self.schedule.steps, shift)
        return ok


def writes_region(local, b: int, lo: int, hi: int) -> bool:
    """Whether a local op of ``local`` ((kind, src buffer, src offset, dst buffer, dst offset,
    count, whole) tuples) writes into elements [lo, hi) of buffer ``b``."""
    return any(db == b and do < hi and lo < do + n and n > 0 for _, _, _, db, do, n, _ in local)


def _early_sends(sends: list, local: list):
    """Split a step's sends into those posted before its local ops and the rest. A send goes
    first when no local op of the step writes the region it reads, and no other send to its peer
    must wait (per-peer order is the order receives match in): the bytes it carries are the same
    either way, and it starts moving while the local ops run -- a root's copy of its own block
    (scatter, alltoall) no longer delays the messages to its peers. Under an in-place call the
    names are enough: ``alias_safe`` already refuses plans where a send from ``in`` reads what a
    local op of its step writes. Returns (early, late) as tuples, each in posting order."""
    late_peers = {s[1] for s in sends if writes_region(local, s[2], s[3], s[4])}
    early = tuple(s for s in sends if s[1] not in late_peers)
    return early, tuple(s for s in sends if s[1] in late_peers)


def _background_steps(steps) -> tuple:
    """Per step, where its local ops may be joined if they run beside the messages (-1: they
    run first, as the schedule says). A step's local ops may run on a helper thread when no
    message of the step, nor any op of the next step, touches what they write, and no receive
    of either writes what they read: every op then sees the bytes the sequential order gives
    it. They are joined at the end of the next step when that step is also free of them (a
    copy-only step followed by a message step: ring gather, scatter and alltoall), else at the
    end of their own step if it receives or has late sends (its early sends overlap the local
    ops already: a broadcast root's copy gains nothing from a thread); a step whose ops run
    beside the previous step's helper starts none of its own, so at most one helper runs at a
    time."""
    def regions(local):
        reads = [(sb, so, so + n) for _, sb, so, _, _, n, _ in local if n > 0]
        writes = [(db, do, do + n) for _, _, _, db, do, n, _ in local if n > 0]
        return reads, writes

    def hit(rs, b, lo, hi):
        return any(rb == b and rlo < hi and lo < rhi for rb, rlo, rhi in rs)

    def free_of(reads, writes, step, with_local: bool) -> bool:
        early, local, posts = step
        for is_send, _, b, lo, hi, _, _, fused in early + posts:
            if hit(writes, b, lo, hi) or (not is_send and hit(reads, b, lo, hi)):
                return False
            if fused >= 0 and hit(writes, 0, fused, fused + hi - lo):
                return False
        if with_local:
            r2, w2 = regions(local)
            if any(hit(writes, b, lo, hi) for b, lo, hi in r2 + w2) or \
                    any(hit(reads, b, lo, hi) for b, lo, hi in w2):
                return False
        return True
    out = [-1] * len(steps)
    busy_until = -1
    for i, st in enumerate(steps):
        early, local, posts = st
        if not local or i <= busy_until:
            continue
        reads, writes = regions(local)
        if not free_of(reads, writes, st, False):
            continue
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        if nxt is not None and (nxt[0] or nxt[2]) and free_of(reads, writes, nxt, True):
            out[i] = busy_until = i + 1
        elif posts:
            # its own step's receives or late sends overlap the ops; its early sends already do
            out[i] = busy_until = i
    return tuple(out)


class _Helper:
    """One step's local ops on a thread of their own (``run_plan``): numpy's copies and ufuncs
    release the GIL, so they proceed while the calling thread moves the messages."""
    __slots__ = ("thread", "error")
    started = 0                       # helpers this process started (tests, profiles)

    def __init__(self, fn):
        self.error = None
        _Helper.started += 1

        def body():
            try:
                fn()
            except BaseException as e:          # re-raised by join, in the calling thread
                self.error = e
        self.thread = threading.Thread(target=body, name="minicomm-local-ops", daemon=True)
        self.thread.start()

    def join(self, deadline: float, what: str) -> None:
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            raise CommTimeout(f"{what}: the call's local copy did not finish within the timeout")
        if self.error is not None:
            raise self.error


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


def alias_safe(steps, shift: int = 0) -> bool:
    """True if the schedule computes the same result when ``in`` lies inside the memory of
    ``out`` (an in-place call: ``in[i]`` is ``out[i + shift]``), so the caller's input need not
    be copied aside first. Tracks the regions of ``out`` whose content may differ from the
    original input ("dirty"); the schedule is safe when every read of ``in`` (local ops, sends, a
    copy folded into a receive) sees a clean region, and no send from ``in`` or folded copy reads
    a region a receive of the same step writes (those run concurrently). A copy of a clean region
    of ``in`` onto itself (``out[a + shift:]`` from ``in[a:]``) is a no-op."""
    dirty: list = []

    def hits(intervals, lo: int, n: int) -> bool:
        return n > 0 and any(a < lo + n and lo < b for a, b in intervals)

    for st in steps:
        landing = [(o.offset, o.offset + o.count) for o in st
                   if isinstance(o, Recv) and o.buf == OUT and o.count]
        for o in st:
            if not isinstance(o, (Copy, Reduce)):
                continue
            if o.src == IN:
                if hits(dirty, o.src_offset + shift, o.count):
                    return False
                if isinstance(o, Copy):
                    if o.dst == OUT and o.dst_offset == o.src_offset + shift:
                        continue      # in place: the data is already there
                    if hits(landing, o.src_offset + shift, o.count):
                        return False  # folded into a receive, it reads `in` while data lands
            if o.dst == OUT and o.count:
                dirty.append((o.dst_offset, o.dst_offset + o.count))
        for o in st:
            if isinstance(o, Send) and o.buf == IN and (
                    hits(dirty, o.offset + shift, o.count) or hits(landing, o.offset + shift,
                                                                   o.count)):
                return False
        dirty.extend(landing)
    return True


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


class LazyCheck:
    """Receives that must complete, and pass ``check()``, before the call they guard may
    return, without holding the call's data back: the steps' waits also watch them and run
    ``check`` (which raises) as soon as all have arrived. The communicator uses it for the call
    fingerprints of rooted collectives, so they cost no round trip before the data moves.

    ``later``: ``(peer, buffer, tag)`` of guarded receives posted only by ``finish``, from
    peers the call receives no data from (a gather's root, for its other ranks): nothing
    waits on them before the end, and posting them there keeps their cost off the path to the
    call's first send. Each is its peer's first message of the call, so FIFO matching finds
    it however late it is posted."""
    __slots__ = ("recvs", "sends", "check", "settled", "later")

    def __init__(self, recvs, check, sends=(), later=()):
        self.recvs, self.check, self.settled = recvs, check, False
        self.sends = sends            # waited for at the end: the peers need them to return
        self.later = later

    def wait(self, transport, reqs, deadline: float, what: str) -> None:
        """Wait for ``reqs`` as ``wait_all`` does, checking the guarded receives on arrival."""
        while not self.settled:
            fp = [r for r in self.recvs if not r.done]
            if not fp:
                self.check()          # the rows of ``later`` peers still hold our own
                self.settled = not self.later
                break
            pending = [r for r in reqs if not r.done]
            if not pending:
                return
            transport.wait_any(pending + fp, deadline, what)
        if reqs:
            transport.wait_all(reqs, deadline, what)

    def finish(self, transport, deadline: float, what: str) -> None:
        """At the end of the call: every guarded receive arrived and passed, every send left."""
        if self.later:
            self.recvs = list(self.recvs) + [transport.irecv(peer, buf, tag)
                                             for peer, buf, tag in self.later]
            self.later = ()
            self.settled = False
        pending = [r for r in self.recvs if not r.done] + [r for r in self.sends if not r.done]
        if pending:
            transport.wait_all(pending, deadline, what)
        if not self.settled:
            self.settled = True
            self.check()


def run_plan(plan: Plan, transport, bufs, kernel, tag: Tag, deadline: float, what: str,
             guard: "LazyCheck | None" = None, *, oversubscribed: bool = True) -> None:
    """Execute ``plan`` with flat buffers ``bufs`` = (in, out, tmp); ``kernel(dst, src)``
    reduces in place (and carries its ufunc as ``kernel.ufunc``). ``tag`` is the call's tag;
    its ``step`` field is set per step. ``guard``: receives checked as they arrive, all of
    them before the call returns (``LazyCheck``). ``oversubscribed``: the transport's
    capability of that name (this node's ranks outnumber its cores: no helper threads).
    With ``MINICOMM_TRACE`` set, each step is clocked and the call traced (``_TracedCall``,
    minicomm.trace)."""
    isend, irecv, wait_all = transport.isend, transport.irecv, transport.wait_all
    if guard is not None:
        def wait_all(reqs, dl, w):
            guard.wait(transport, reqs, dl, w)
    comm, seq, call, count = tag[0], tag[1], tag[3], tag[4]
    background = plan.background
    if background is not None and not _helpers_allowed(oversubscribed, bufs):
        background = None
    tracer = _trace.TRACER            # None unless MINICOMM_TRACE: then a clock per step
    clock = None if tracer is None else _TracedCall(tracer, transport.rank, plan, what, tag,
                                                     bufs[1].itemsize)
    helper = joins = None
    try:
        i = -1
        for early, local, posts in plan.steps:
            i += 1
            if clock is not None:
                clock.begin(i)
            if early:
                t = _new_tag(Tag, (comm, seq, i, call, count))
                reqs = _post(early, bufs, kernel, t, isend, irecv, [])
            else:
                reqs = None
            if local:
                if background is not None and background[i] >= 0 and \
                        _local_bytes(local, bufs) >= BACKGROUND_MIN_BYTES:
                    helper = _Helper(lambda local=local: _run_local(local, bufs, kernel))
                    joins = background[i]
                else:
                    _run_local(local, bufs, kernel)
            if posts:
                if reqs is None:
                    t = _new_tag(Tag, (comm, seq, i, call, count))
                    reqs = []
                _post(posts, bufs, kernel, t, isend, irecv, reqs)
            if clock is not None:
                clock.posted()
            if reqs:
                wait_all(reqs, deadline, what)
            if joins == i:
                h, helper, joins = helper, None, None
                h.join(deadline, what)
            if clock is not None:
                clock.end()
        if guard is not None:
            guard.finish(transport, deadline, what)
    except BaseException as e:
        if clock is not None:
            clock.error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if helper is not None:
            # an error ended the call early: once it returns, nothing writes the caller's buffers
            # (a local copy ends; the bound only keeps this wait from being unbounded)
            helper.thread.join(max(HELPER_JOIN_S, deadline - time.monotonic()))
        if clock is not None:
            clock.write()


def _post(posts, bufs, kernel, t: Tag, isend, irecv, reqs: list) -> list:
    """Post a step's messages (``Plan.steps``' form) as ``run_plan`` does, onto ``reqs``."""
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
    return reqs


class _TracedCall:
    """One traced call's clock readings, step by step, and the events made of them
    (minicomm.trace's format): what each step sends and receives is read off the plan."""
    __slots__ = ("tracer", "rank", "plan", "what", "tag", "isz", "t0", "steps", "step", "error")

    def __init__(self, tracer, rank: int, plan: Plan, what: str, tag: Tag, itemsize: int):
        self.tracer, self.rank, self.plan, self.what, self.tag = tracer, rank, plan, what, tag
        self.isz, self.steps, self.step, self.error = itemsize, [], None, None
        self.t0 = time.perf_counter()

    def begin(self, i: int) -> None:
        now = time.perf_counter()
        self.step = [i, now, now, None]         # index, start, posted, end

    def posted(self) -> None:
        self.step[2] = time.perf_counter()

    def end(self) -> None:
        self.step[3] = time.perf_counter()
        self.steps.append(self.step)
        self.step = None

    def write(self) -> None:
        """The call's events, to this rank's file (a failed call: up to the step it failed in)."""
        tracer = self.tracer
        now, us, span, isz = time.perf_counter(), tracer.us, _trace.to_us, self.isz
        if self.step is not None:                # the step the call failed in
            self.step[3] = now
            self.steps.append(self.step)
        comm, seq, count = self.tag[0] >> 2, self.tag[1], self.tag[4]   # Tag.comm: id << 2 | kind
        sched = self.plan.schedule
        events = [_trace.call_event(self.rank, comm, self.what, us(self.t0), span(now - self.t0),
                                    sched.collective, sched.algorithm, seq, count, count * isz,
                                    self.error)]
        for i, start, posted, end in self.steps:
            early, local, posts = self.plan.steps[i]
            copied = sum(n for kind, _, _, _, _, n, _ in local if kind == _LOCAL_COPY) + sum(
                hi - lo for s, _, _, lo, hi, _, _, fused in posts if not s and fused >= 0)
            reduced = sum(n for kind, _, _, _, _, n, _ in local if kind == _LOCAL_REDUCE)
            events.append(_trace.step_event(
                self.rank, comm, seq, i, us(start), span(end - start),
                [(p[1], (p[4] - p[3]) * isz) for p in early + posts if p[0]],
                [(p[1], (p[4] - p[3]) * isz, p[6]) for p in posts if not p[0]],
                copied * isz, reduced * isz, span(end - posted)))
        tracer.log(self.rank).add(events)


def _run_local(local, bufs, kernel) -> None:
    for kind, sb, so, db, do, n, whole in local:
        if whole:
            d, s = bufs[db], bufs[sb]
        else:
            d, s = bufs[db][do:do + n], bufs[sb][so:so + n]
        if kind != _LOCAL_COPY:
            kernel(d, s)
        else:
            local_copy(d, s)


def _local_bytes(local, bufs) -> int:
    return sum(op[5] for op in local) * bufs[1].itemsize


def _helpers_allowed(oversubscribed: bool, bufs) -> bool:
    """Local ops may run on a helper thread (``Plan.background``): this node's ranks do not
    outnumber its cores (the transport's ``oversubscribed`` capability, passed in by the
    caller), the caller's input and output are separate memory (an in-place call's ``in`` lies
    inside ``out``, where the regions the plan names do not say what overlaps), and
    ``MINICOMM_LOCAL_THREADS`` is not 0."""
    return (LOCAL_THREADS and oversubscribed is False
            and not np.may_share_memory(bufs[0], bufs[1]))
