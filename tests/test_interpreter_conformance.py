"""The schedule IR's interpreters agree op for op, on every cell of the algorithm matrix.

One schedule, several interpreters: the executor (``executor.run_plan`` over inproc), the small
path (``smallpath.run_small``, and its generated ``straight_line`` code with and without the
fused exchange), the symbolic verifier (``verifier.verify``'s ``trace``) and the simulator
engine (``engine.run_program``'s ``trace``). For 9 collectives x 4 families, p = 1..8 and counts
0, 1, odd and a few thousand, each rank's ops as every interpreter issues them must be the
schedule's own ops: (step, kind, peer, buffer, offset, count) for messages, (kind, source,
destination, count) for local Copy / Reduce.

What "the same" means, per interpreter:
  * verifier: exactly the schedule's steps in order; within a step the local ops in order, and
    each peer's sends and each peer's receives in order (FIFO matching makes only that order
    observable; the order across peers is free, the verifier completes pairs as they meet);
  * executor and small path, observed on real buffers through a recording transport: the same
    op sequence up to swapping adjacent ops that commute (Mazurkiewicz trace equivalence),
    where two ops commute unless they are messages of different steps, messages of one step in
    the same direction with the same peer, or they touch overlapping memory and one writes.
    Early sends, receives posted before sends and a step's local ops running beside its
    messages are such swaps. The executor's fused receive (a Copy of
    ``in`` folded into a reducing receive) is observed as that Copy followed by the receive;
  * engine: its programs keep no buffer names or offsets, so per step its copied and reduced
    element totals and its messages (kind, peer, count, reduce) in the verifier's order rule.
The real-buffer interpreters must also leave identical ``out`` and ``tmp`` (int64 data: sums are
exact whatever order the reductions run in).
"""
from __future__ import annotations

import functools
import gc
import heapq
import threading
import time
from collections import Counter, defaultdict

import numpy as np
import pytest

from minicomm import executor, smallpath
from minicomm.algorithms import FAMILIES, build_all
from minicomm.executor import Plan, run_plan
from minicomm.schedule import COLLECTIVES, IN, OUT, TMP, Copy, Recv, Reduce, Send
from minicomm.sim.engine import compile_schedules, run_program
from minicomm.sim.topology import Fabric as LinkFabric
from minicomm.sim.topology import LinkSpec, Topology
from minicomm.smallpath import compile_small, eligible, run_small, straight_line
from minicomm.transports.base import Tag
from minicomm.transports.inproc import Fabric, InprocTransport
from minicomm.verifier import verify

SIZES = range(1, 9)
COUNTS = (0, 1, 7, 4099)      # 4099: receives of at least executor.FUSE_MIN_COUNT get fused
TIMEOUT_S = 30.0
NAMES = (IN, OUT, TMP)
# the generated code is run in one of its two forms per count (the exchange form fuses a
# step's send and receive with one peer into one sendrecv_now), both forms for every p
FORMS = ("executor", "run_small", "straight_line")
_current = threading.local()  # the recorder of the running rank's current form


def topology(family, p):
    """Two nodes for hier (one when p = 1), as tests/test_smallpath.py builds them."""
    return tuple(r * 2 // p for r in range(p)) if family == "hier" else None


# ---------------------------------------------------------------------------- op tuples
def op_tuple(o):
    """An IR op as the tuple every interpreter's record is compared in."""
    if isinstance(o, Send):
        return ("send", o.peer, o.buf, o.offset, o.count, False)
    if isinstance(o, Recv):
        return ("recv", o.peer, o.buf, o.offset, o.count, bool(o.reduce))
    kind = "copy" if isinstance(o, Copy) else "reduce"
    return (kind, o.src, o.src_offset, o.dst, o.dst_offset, o.count)


def is_message(t):
    return t[0] in ("send", "recv")


def reference(schedule):
    """The schedule's own record: (step, op tuple), a step's local ops first, as listed."""
    out = []
    for i, st in enumerate(schedule.steps):
        out += [(i, op_tuple(o)) for o in st if isinstance(o, (Copy, Reduce))]
        out += [(i, op_tuple(o)) for o in st if isinstance(o, (Send, Recv))]
    return out


# ---------------------------------------------------------------------------- canonical forms
def by_step(events):
    """Consecutive events of one step as one entry: (step, local ops in order, messages sorted by
    (kind, peer) keeping each peer's order). A step whose events are not contiguous shows up as
    two entries, so it can never equal the reference."""
    out = []
    for step, t in events:
        if not out or out[-1][0] != step:
            out.append((step, [], []))
        out[-1][2 if is_message(t) else 1].append(t)
    return [(s, tuple(loc), tuple(sorted(msg, key=lambda t: (t[0], t[1]))))
            for s, loc, msg in out]


def _regions(t):
    """(reads, writes) of an op tuple as (buffer, lo, hi) with hi > lo."""
    if t[0] == "send":
        reads, writes = [(t[2], t[3], t[4])], []
    elif t[0] == "recv":
        writes = [(t[2], t[3], t[4])]
        reads = writes if t[5] else []
    else:
        writes = [(t[3], t[4], t[5])]
        reads = [(t[1], t[2], t[5])] + (writes if t[0] == "reduce" else [])
    return ([(b, o, o + n) for b, o, n in reads if n > 0],
            [(b, o, o + n) for b, o, n in writes if n > 0])


def _overlap(xs, ys):
    return any(a == b and lo < hi2 and lo2 < hi for a, lo, hi in xs for b, lo2, hi2 in ys)


def trace_normal_form(events, memo):
    """The lexicographically least ordering of ``events`` reachable by swapping adjacent
    independent ops: equal for two sequences exactly when they are trace-equivalent. Two ops
    are dependent (keep their order) when they are messages of different steps, or of one step
    with the same kind and peer, or one writes memory the other touches (module doc). Local ops
    (recorded without a step) sort as step -1. ``memo``: normal forms already computed."""
    key = tuple(events)
    done = memo.get(key)
    if done is not None:
        return done
    n = len(events)
    # per op: (step or None, is a message, kind and peer, regions read or written, written)
    facts = []
    for s, t in events:
        reads, writes = _regions(t)
        facts.append((s, is_message(t), t[:2], reads + writes, writes))
    succ = [[] for _ in range(n)]
    indeg = [0] * n
    for j in range(n):
        sj, mj, kj, tj, wj = facts[j]
        for i in range(j):
            si, mi, ki, ti, wi = facts[i]
            if (mi and mj and (si != sj or ki == kj)) or events[i] == events[j] \
                    or _overlap(wi, tj) or _overlap(wj, ti):
                succ[i].append(j)
                indeg[j] += 1
    order = [repr((-1 if s is None else s, t)) for s, t in events]
    ready = [(order[i], i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(events[i])
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, (order[j], j))
    memo[key] = out
    return out


def as_observed(events):
    """What a real-buffer recording can see of a record: local ops carry no step, and an empty
    message's offset is not in its view's address (numpy points every empty slice at the
    buffer's start; such messages carry only ordering)."""
    return [(s, t[:3] + (0,) + t[4:]) if is_message(t) and t[4] == 0 else
            (s if is_message(t) else None, t) for s, t in events]


def engine_projection(events):
    """The reference in the engine's terms: per step the copied / reduced element totals and
    the messages (kind, peer, count, reduce), messages in ``by_step``'s order rule."""
    out = []
    for step, loc, msg in by_step(events):
        copied = sum(t[5] for t in loc if t[0] == "copy")
        reduced = sum(t[5] for t in loc if t[0] == "reduce")
        out.append((step, copied, reduced, tuple((t[0], t[1], t[4], t[5]) for t in msg)))
    return out


# ---------------------------------------------------------------------------- recording
class _Watched(np.ndarray):
    """The call's buffers: a plain assignment into a view of them (the generated code's small
    local copies, ``d[...] = s``) is recorded as a Copy."""

    def __setitem__(self, key, value):
        rec = getattr(_current, "rec", None)
        if rec is not None and key is Ellipsis and isinstance(value, np.ndarray):
            rec.local("copy", value, self)
            rec.quiet += 1
            try:
                super().__setitem__(key, value)
            finally:
                rec.quiet -= 1
        else:
            super().__setitem__(key, value)


def _arena(n, fill=None):
    """A buffer of n int64 with a guard element either side, so that an empty view at one
    buffer's end never has the address of another buffer's start."""
    a = np.zeros(n + 2, dtype=np.int64).view(_Watched)
    if fill is not None:
        a[1:n + 1] = fill
    return a[1:n + 1]


class Recorder:
    """An inproc transport that records every op a rank's interpreter issues through it, with
    an eager channel (``send_now`` / ``recv_now`` / ``recv_now_many`` / ``sendrecv_now``)
    built from inproc's own calls so the small path runs in-process. Inside a transport call
    (``quiet``) the reductions and copies the transport makes are not the interpreter's ops."""
    small_bytes = 1 << 40

    def __init__(self, inner, bufs):
        self.inner, self.bufs, self.events, self.quiet, self.fused = inner, bufs, [], 0, 0
        self.bases = [(name, b.__array_interface__["data"][0], b.size)
                      for name, b in zip(NAMES, bufs)]

    def where(self, v):
        """(buffer name, element offset, count) of a view of the call's buffers."""
        a = v.__array_interface__["data"][0]
        for name, base, n in self.bases:
            if base <= a <= base + 8 * n:
                assert a + v.nbytes <= base + 8 * n, "a view past its buffer's end"
                return name, (a - base) // 8, v.size
        raise AssertionError("an op on memory outside the call's buffers")

    def message(self, kind, peer, v, tag, reduce=False):
        self.events.append((tag.step, (kind, peer) + self.where(v) + (reduce,)))

    def local(self, kind, src, dst):
        if not self.quiet:
            self.events.append((None, (kind,) + self.where(src)[:2] + self.where(dst)))

    def _inner(self, fn, *args):
        self.quiet += 1
        try:
            return fn(*args)
        finally:
            self.quiet -= 1

    # -- two-sided core
    def isend(self, peer, buf, tag):
        self.message("send", peer, buf, tag)
        return self._inner(self.inner.isend, peer, buf, tag)

    def irecv(self, peer, buf, tag, reduce=None):
        if isinstance(reduce, executor._InOp):
            # the executor's fused receive: ``buf = in_block + incoming`` (module doc)
            self.fused += 1
            self.local("copy", reduce.src, buf)
        self.message("recv", peer, buf, tag, reduce is not None)
        return self._inner(self.inner.irecv, peer, buf, tag, reduce)

    def wait_all(self, reqs, deadline, what):
        self._inner(self.inner.wait_all, reqs, deadline, what)

    def wait_any(self, reqs, deadline, what):
        self._inner(self.inner.wait_any, reqs, deadline, what)

    # -- eager channel: every message fits, a receive waits for its message
    def send_now(self, peer, v, tag):
        self.isend(peer, v, tag)
        return True

    def recv_now(self, peer, v, tag, reduce, spin):
        req = self.irecv(peer, v, tag, reduce)
        self.wait_all([req], time.monotonic() + TIMEOUT_S, "recv_now")
        return True

    def recv_now_many(self, waiting, tag, spin):
        for peer, v, k in waiting:
            self.recv_now(peer, v, tag, k, spin)
        return []

    def sendrecv_now(self, peer, sv, rv, tag, reduce, spin):
        self.send_now(peer, sv, tag)
        self.recv_now(peer, rv, tag, reduce, spin)
        return 3


def kernel_for(rec):
    """The call's reduce kernel (sum), recording the local Reduce ops it makes for ``rec``."""
    def kernel(d, s):
        rec.local("reduce", s, d)
        np.add(d, s, out=d)
    kernel.ufunc = np.add         # the executor's fused receive applies the ufunc itself
    return kernel


def _patched_local_copy(orig):
    def local_copy(d, s):
        rec = getattr(_current, "rec", None)
        if rec is None:
            return orig(d, s)
        rec.local("copy", s, d)
        rec._inner(orig, d, s)
    return local_copy


@pytest.fixture(autouse=True)
def _record_local_copies(monkeypatch):
    """The executor's and the small path's local copies go through ``local_copy`` (the
    generated code binds it when it is generated, after this)."""
    monkeypatch.setattr(executor, "local_copy", _patched_local_copy(executor.local_copy))
    monkeypatch.setattr(smallpath, "local_copy", _patched_local_copy(smallpath.local_copy))


def run_real(scheds, forms, exchange):
    """Run ``forms`` of every rank's schedule on real buffers, one thread per rank, one
    communicator id per form (``exchange``: the straight-line code's form). Returns
    {form: [(events, out, tmp, fused) per rank]}."""
    p, count = len(scheds), scheds[0].count
    fabric = Fabric(p)
    results = {f: [None] * p for f in forms}
    errors = []

    def rank_main(r):
        if not go.wait(TIMEOUT_S):
            errors.append((r, TimeoutError("the ranks were not released")))
            return
        s = scheds[r]
        data = (np.arange(s.in_count, dtype=np.int64) * 7919 + 104729 * r) % 1000
        transport = InprocTransport(fabric, r)
        try:
            sp = compile_small(s, range(p)) if len(forms) > 1 else None
            for c, form in enumerate(forms):
                bufs = (_arena(s.in_count, data),
                        _arena(s.out_count), _arena(s.tmp_count))
                rec = Recorder(transport, bufs)
                kernel = kernel_for(rec)
                tag = Tag(c + 1, 0, 0, 77, count)
                deadline = time.monotonic() + TIMEOUT_S
                _current.rec = rec
                try:
                    if form == "executor":
                        run_plan(Plan(s, range(p)), rec, bufs, kernel, tag, deadline, form)
                    elif form == "run_small":
                        run_small(sp, rec, bufs, kernel, tag, deadline, form)
                    else:
                        fn = straight_line(sp, exchange)
                        fn(bufs, rec, kernel, tag.comm, tag.seq, tag.call, tag.count,
                           deadline, form, 0.0)
                finally:
                    _current.rec = None
                results[form][r] = (rec.events, bufs[1].tobytes(), bufs[2].tobytes(), rec.fused)
        except BaseException as e:
            errors.append((r, e))
            fabric.abort(r, e)

    # every rank starts once all are started: a thread's start waits for it to run, which is
    # slow while other ranks hold the interpreter
    go = threading.Event()
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(p)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive(), "a rank did not finish"
    if errors:
        raise errors[0][1]
    return results


def run_verifier(scheds):
    events = defaultdict(list)
    verify(scheds, trace=lambda r, i, o: events[r].append((i, op_tuple(o))))
    return [events[r] for r in range(len(scheds))]


@functools.lru_cache(maxsize=None)
def flat_network(p):
    """p accelerators on one switch, and its link fabric (built once per p)."""
    ln = LinkSpec("conformance", 10e9, 1e-6)
    topo = Topology("flat", servers=p, gpus_per_server=1, intra="nvswitch", intra_link=ln,
                    nic_link=ln, tiers=1)
    return topo, LinkFabric(topo)


def run_engine(scheds):
    p = len(scheds)
    topo, fabric = flat_network(p)
    events = defaultdict(list)

    def trace(r, step, kind, peer, count, reduce):
        events[r].append((step, kind, peer, count, reduce))
    run_program(compile_schedules(scheds), topo, np.arange(p), fabric=fabric, trace=trace)
    out = []
    for r in range(p):
        rank = []
        for step, kind, peer, count, reduce in events[r]:
            if not rank or rank[-1][0] != step:
                rank.append([step, 0, 0, []])
            if kind == "copy":
                rank[-1][1] += count
            elif kind == "reduce":
                rank[-1][2] += count
            else:
                rank[-1][3].append((kind, peer, count, reduce))
        out.append([(s, c, rd, tuple(sorted(m, key=lambda t: (t[0], t[1]))))
                    for s, c, rd, m in rank])
    return out


# ---------------------------------------------------------------------------- the check
def check_cell(coll, family, p, count, exchange, coverage):
    root = p - 1
    scheds = build_all(coll, family, p, count, root, topology(family, p))
    where = f"{coll}/{family} p={p} count={count} root={root}"
    refs = [reference(s) for s in scheds]
    for r, got in enumerate(run_verifier(scheds)):
        assert by_step(got) == by_step(refs[r]), f"verifier, {where}, rank {r}"
    for r, got in enumerate(run_engine(scheds)):
        assert got == engine_projection(refs[r]), f"engine, {where}, rank {r}"
    small = all(eligible(s, 8, Recorder.small_bytes) for s in scheds)
    forms = FORMS if small else FORMS[:1]
    coverage.update(forms)
    coverage["exchange"] += small and exchange
    results = run_real(scheds, forms, exchange)
    memo = {}
    for r in range(p):
        want = trace_normal_form(as_observed(refs[r]), memo)
        for form in forms:
            events, out, tmp, fused = results[form][r]
            coverage["fused receives"] += fused
            assert trace_normal_form(as_observed(events), memo) == want, \
                f"{form}, {where}, rank {r}"
            if form != "executor":
                assert (out, tmp) == results["executor"][r][1:3], \
                    f"{form} leaves other buffers than the executor, {where}, rank {r}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("coll", COLLECTIVES)
def test_interpreters_issue_the_schedules_ops(coll, family):
    coverage = Counter()
    gc.disable()              # the verifier's symbolic buffers are many small acyclic tuples
    try:
        for p in SIZES:
            for k, count in enumerate(COUNTS):
                check_cell(coll, family, p, count, k % 2 == 1, coverage)
    finally:
        gc.enable()
    # every form ran in this cell (the small path takes all but a few schedules)
    assert coverage["executor"] == len(SIZES) * len(COUNTS)
    assert coverage["straight_line"] > coverage["exchange"] > 0, coverage
    if (coll, family) == ("reduce_scatter", "ring"):
        assert coverage["fused receives"] > 0, "the executor's fused receive was exercised"
