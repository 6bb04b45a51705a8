"""Point-to-point matching scales with what it matches (issue 35, defect 4).

Work is counted, never timed: ``P2PEngine.examined`` counts the matching entries (posted receives
and unexpected messages) the engine looks at. Posting k receives and completing them must cost
O(k) in total, whatever their patterns (specific, ANY_SOURCE, ANY_TAG, mixed). The semantics are
checked against a reference matcher on plain lists: MPI's rule, the earliest posted receive that
matches a message takes it, a receive takes the earliest unexpected message it matches.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minicomm as mc
from minicomm.p2p import ANY_SOURCE, ANY_TAG, P2PEngine, encode_header

SMALL, LARGE = 1000, 8000
MODES = ["specific", "any_source", "any_tag", "mixed"]


# ---------------------------------------------------------------- the reference matcher
class Reference:
    """MPI matching on two plain lists, scanned from the front every time."""

    def __init__(self):
        self.posted = []          # (rid, src, tag, bad_out), in posting order
        self.unexpected = []      # (mid, src, tag), in arrival order
        self.got = {}             # rid -> mid, or "error" (a wrong out=)

    @staticmethod
    def matches(rsrc, rtag, msrc, mtag) -> bool:
        return rsrc in (ANY_SOURCE, msrc) and rtag in (ANY_TAG, mtag)

    def post(self, rid, src, tag, bad_out=False):
        for m in self.unexpected:
            if self.matches(src, tag, m[1], m[2]):
                if bad_out:
                    self.got[rid] = "error"          # the message stays for the next receive
                else:
                    self.unexpected.remove(m)
                    self.got[rid] = m[0]
                return
        self.posted.append((rid, src, tag, bad_out))

    def arrive(self, mid, src, tag):
        for r in list(self.posted):
            if self.matches(r[1], r[2], src, tag):
                self.posted.remove(r)
                if r[3]:
                    self.got[r[0]] = "error"         # that receive fails; the message looks on
                    continue
                self.got[r[0]] = mid
                return
        self.unexpected.append((mid, src, tag))

    def cancel(self, rid):
        self.posted = [r for r in self.posted if r[0] != rid]


def _pattern(mode: str, j: int):
    if mode == "specific":
        return 1, j
    if mode == "any_source":
        return ANY_SOURCE, j
    if mode == "any_tag":
        return 1, ANY_TAG
    return [(1, j), (ANY_SOURCE, j), (1, ANY_TAG), (ANY_SOURCE, ANY_TAG)][j % 4]


def _receives(mode: str, k: int, unexpected_first: bool):
    """The receives rank 0 posts, in posting order. With the messages already unexpected, the
    tag-specific ones go in reverse tag order (the far end of the list each time) and the
    wildcard-tag ones after them, so that every receive gets a message."""
    pats = [_pattern(mode, j) for j in range(k)]
    if not unexpected_first:
        return pats
    specific = [p for p in pats if p[1] != ANY_TAG]
    return specific[::-1] + [p for p in pats if p[1] == ANY_TAG]


def _expected(pats, k: int, unexpected_first: bool):
    """The tag each receive gets: a tag-specific receive its own, the wildcard-tag ones the
    tags left, in order (checked against the reference at the small size)."""
    own = {tag for _, tag in pats if tag != ANY_TAG}
    rest = iter(sorted(set(range(k)) - own))
    got = [tag if tag != ANY_TAG else next(rest) for _, tag in pats]
    if k <= SMALL:
        assert got == _reference(pats, k, unexpected_first)
    return got


def _reference(pats, k: int, unexpected_first: bool):
    ref = Reference()
    if unexpected_first:
        for j in range(k):
            ref.arrive(j, 1, j)
    for i, (src, tag) in enumerate(pats):
        ref.post(i, src, tag)
    if not unexpected_first:
        for j in range(k):
            ref.arrive(j, 1, j)
    return [ref.got.get(i) for i in range(len(pats))]


def _job(comm, k: int, mode: str, unexpected_first: bool):
    """Rank 1 sends k messages, tags 0..k-1 (payload: the tag), then one of tag k; rank 0 posts
    k receives before (or, ``unexpected_first``, after) reading them. Rank 0 returns the
    entries its engine examined and the tag each receive got."""
    if comm.rank == 1:
        works = [comm.isend(np.array([j]), 0, tag=j) for j in range(k + 1)]
        comm.barrier()                         # every message is sent before rank 0 starts
        for w in works:
            w.wait(60)
        return None
    comm.barrier()
    pats = _receives(mode, k, unexpected_first)
    engine = comm._p2p
    start = engine.examined
    if unexpected_first:
        assert int(comm.recv(1, tag=k, timeout=60)[0]) == k    # reads all k first: unexpected
        works = [comm.irecv(src, tag=tag) for src, tag in pats]
    else:
        works = [comm.irecv(src, tag=tag) for src, tag in pats]
        assert int(comm.recv(1, tag=k, timeout=60)[0]) == k
    got = [int(w.wait(60)[0]) for w in works]
    assert got == [w.status.tag for w in works]
    return engine.examined - start, got


def _examined(k: int, mode: str, unexpected_first: bool) -> int:
    count, got = mc.spawn(_job, 2, args=(k, mode, unexpected_first), transport="inproc",
                          timeout=60)[0]
    pats = _receives(mode, k, unexpected_first)
    assert got == _expected(pats, k, unexpected_first)
    return count


@pytest.mark.parametrize("unexpected_first", [False, True], ids=["posted-first",
                                                                 "unexpected-first"])
@pytest.mark.parametrize("mode", MODES)
def test_matching_work_per_receive_does_not_grow_with_the_number_posted(mode, unexpected_first):
    small = _examined(SMALL, mode, unexpected_first)
    large = _examined(LARGE, mode, unexpected_first)
    per_small, per_large = small / SMALL, large / LARGE
    # a constant per receive (a few queue heads each), the same at 1,000 and at 8,000 posted
    assert per_large <= 8, (mode, per_small, per_large)
    assert per_large <= 1.25 * per_small + 0.5, (mode, per_small, per_large)


# ---------------------------------------------------------------- the engine on a fake transport
class _Req:
    __slots__ = ("buf", "done")

    def __init__(self, buf):
        self.buf, self.done = buf, False


class FakeTransport:
    """Payload receives of ``P2PEngine``: each one takes the next payload queued for its peer
    (FIFO per peer, as a real link). A payload in ``slow`` is held back until ``finish``."""

    def __init__(self):
        self.payloads = {}        # peer -> [message id], in send order
        self.slow = set()
        self.held = {}            # message id -> request

    def irecv(self, peer, buf, tag):
        mid = self.payloads[peer].pop(0)
        req = _Req(buf)
        if mid in self.slow:
            self.held[mid] = req
        else:
            self._fill(req, mid)
        return req

    @staticmethod
    def _fill(req, mid):
        req.buf.view(np.int64)[0] = mid
        req.done = True

    def finish(self, mid):
        self._fill(self.held.pop(mid), mid)

    def detach(self, req):
        req.buf = np.empty(req.buf.nbytes, dtype=np.uint8)      # lands privately from now on
        return req.buf


def _engine():
    t = FakeTransport()
    return t, P2PEngine(t, 0, (0, 1, 2), ctx=5)


def _message(t, engine, mid, src, tag):
    """Message ``mid`` from ``src`` with ``tag`` reaches the engine (its header, then its
    payload when the engine asks for it)."""
    t.payloads.setdefault(src, []).append(mid)
    engine._on_header(src, encode_header(tag, np.array([mid], dtype=np.int64)))


def _pump(engine):
    """Completed payloads are delivered (what a progress pass does after its wait)."""
    engine._settle()


def _outcome(r):
    if r.error is not None:
        assert isinstance(r.error, TypeError)
        return "error"
    return None if r.result is None else int(r.result[0])


SRC = st.sampled_from([1, 2, ANY_SOURCE])
TAG = st.sampled_from([0, 1, 2, ANY_TAG])
OPS = st.lists(st.one_of(
    st.tuples(st.just("post"), SRC, TAG, st.sampled_from([False, False, False, True])),
    st.tuples(st.just("arrive"), st.sampled_from([1, 2]), st.sampled_from([0, 1, 2])),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
), max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_indexed_matching_equals_the_reference_on_random_posts_and_arrivals(ops):
    t, engine = _engine()
    ref = Reference()
    recvs = []
    mid = 0
    for op in ops:
        if op[0] == "post":
            _, src, tag, bad = op
            out = np.empty(1, np.float32) if bad else None      # a wrong out= fails the receive
            recvs.append(engine.post(src, tag, out, None))
            ref.post(len(recvs) - 1, src, tag, bad)
        elif op[0] == "arrive":
            _, src, tag = op
            _message(t, engine, mid, src, tag)
            ref.arrive(mid, src, tag)
            mid += 1
        else:
            live = [i for i, r in enumerate(recvs) if r.msg is None and not r.done()]
            if live:
                i = live[op[1] % len(live)]
                engine.cancel(recvs[i])
                ref.cancel(i)
    _pump(engine)
    assert [_outcome(r) for r in recvs] == [ref.got.get(i) for i in range(len(recvs))]
    assert [int(m.data.view(np.int64)[0]) for m in engine._unexpected] == \
        [m[0] for m in ref.unexpected]
    assert len(engine._posted) == len(ref.posted)


def test_a_cancelled_receive_puts_its_message_back_in_arrival_order_for_the_next_receive():
    t, engine = _engine()
    t.slow.add(1)
    _message(t, engine, 0, 1, 5)                  # unexpected, arrived
    _message(t, engine, 1, 1, 6)                  # unexpected, its payload still arriving
    _pump(engine)
    out = np.empty(1, np.int64)
    r = engine.post(1, 6, out, None)              # takes message 1 (its payload is not here)
    assert r.msg is not None and not r.done()
    later = engine.post(1, ANY_TAG, None, None)   # takes message 0, the earliest
    _pump(engine)
    assert _outcome(later) == 0
    waiting = engine.post(1, 6, None, None)       # posted while message 1 is taken
    assert waiting.msg is None
    engine.cancel(r)                              # times out: message 1 goes to `waiting`
    t.finish(1)
    _pump(engine)
    assert _outcome(waiting) == 1 and not r.done()
    assert engine.buffered_bytes == 0             # its private buffer is counted once, freed once

    t, engine = _engine()
    t.slow.add(1)
    _message(t, engine, 0, 1, 5)
    _message(t, engine, 1, 1, 6)
    _message(t, engine, 2, 1, 7)
    r = engine.post(1, 6, None, None)
    engine.cancel(r)                              # nobody else wants it: back in its place
    assert [m.seq for m in engine._unexpected] == [0, 1, 2]
    first = engine.post(1, ANY_TAG, None, None)
    _pump(engine)
    assert _outcome(first) == 0
    second = engine.post(1, ANY_TAG, None, None)
    t.finish(1)
    _pump(engine)
    assert _outcome(second) == 1                  # message 1 before message 2 (non-overtaking)
    third = engine.post(ANY_SOURCE, ANY_TAG, None, None)
    _pump(engine)
    assert _outcome(third) == 2 and engine.buffered_bytes == 0


def test_dead_peers_fail_only_the_receives_that_name_them_at_the_cost_of_those():
    t, engine = _engine()
    live = [engine.post(2, tag, None, None) for tag in range(1000)]
    doomed = [engine.post(1, tag, None, None) for tag in range(10)]
    anys = [engine.post(ANY_SOURCE, 0, None, None) for _ in range(3)]
    err = mc.PeerFailure("rank 1 died")
    err.peer = 1
    engine.dead[1] = err
    start = engine.examined
    for _ in range(100):                          # many progress passes after the death
        engine._fail_hopeless()
    assert engine.examined - start <= 2 * (len(doomed) + 1)
    assert all(isinstance(r.error, mc.PeerFailure) for r in doomed)
    assert isinstance(anys[0].error, mc.PeerFailure) and anys[0].error.peer == 1
    assert all(r.error is None for r in anys[1:] + live)       # reported once, to the first

