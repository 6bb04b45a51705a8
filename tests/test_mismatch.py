"""Mismatched collectives are detected the same way by every family (issue 14).

One rank (the misbehaving one) makes a different call from the others: another collective,
another root, dtype, count or op. Every rank must end in a named error (MismatchError, or a
PeerFailure naming the abort of a peer that found the mismatch) — never the timeout — and at
least one rank's MismatchError names both calls and the misbehaving rank (the misbehaving rank
itself names the other side). Runs with the default ``check="header"`` (the fingerprint exchange
of MINICOMM_DEBUG=detail is not what is tested here), on inproc threads for the whole matrix and
on shm processes for a slice.
"""
import re
import threading
import time

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401
from minicomm.communicator import Communicator
from minicomm.cost import LinkModel
from minicomm.transports.inproc import Fabric, InprocTransport

FAMILIES = ("ring", "tree", "rhd", "hier")
TIMEOUT = 20.0         # what a missed mismatch would cost; the check is on the error type


def call(comm, spec):
    """Run one collective described by ``spec``: (collective, kwargs, dtype, count)."""
    coll, kw, dtype, count = spec
    p = comm.size
    algo = kw.get("algorithm")
    root = kw.get("root", 0)
    x = np.ones(count, dtype=dtype)
    if coll == "barrier":
        return comm.barrier(algorithm=algo)
    if coll in ("scatter", "reduce_scatter", "alltoall"):
        x = np.ones((p, count), dtype=dtype)
    if coll == "scatter":
        return comm.scatter(x, root=root, algorithm=algo)
    if coll in ("broadcast", "gather"):
        return getattr(comm, coll)(x, root=root, algorithm=algo)
    if coll in ("reduce",):
        return comm.reduce(x, root=root, op=kw.get("op", "sum"), algorithm=algo)
    if coll in ("allreduce", "reduce_scatter"):
        return getattr(comm, coll)(x, op=kw.get("op", "sum"), algorithm=algo)
    return getattr(comm, coll)(x, algorithm=algo)


def S(coll, dtype=np.float64, count=5, **kw):
    return (coll, kw, np.dtype(dtype), count)


# (good call, bad call, words both must appear in the detecting rank's message)
PAIRS = [
    (S("allreduce"), S("barrier"), ("allreduce", "barrier")),
    (S("barrier"), S("allreduce"), ("barrier", "allreduce")),
    (S("broadcast"), S("reduce"), ("broadcast", "reduce")),
    (S("reduce"), S("broadcast"), ("reduce", "broadcast")),
    (S("allgather"), S("allreduce"), ("allgather", "allreduce")),
    (S("reduce_scatter"), S("alltoall"), ("reduce_scatter", "alltoall")),
    (S("gather"), S("scatter"), ("gather", "scatter")),
    (S("broadcast", root=0), S("broadcast", root=1), ("root=0", "root=1")),
    (S("allreduce", dtype=np.float64), S("allreduce", dtype=np.float32), ("float64", "float32")),
    (S("allreduce", count=5), S("allreduce", count=6), ("count=5", "count=6")),
    (S("allreduce", op="sum"), S("allreduce", op="max"), ("op=sum", "op=max")),
    (S("alltoall"), S("barrier"), ("alltoall", "barrier")),
    (S("allreduce"), S("broadcast"), ("allreduce", "broadcast")),     # rooted vs not
    (S("scatter"), S("allgather"), ("scatter", "allgather")),
]
PAIR_IDS = [f"{g[0]}-vs-{b[0]}" + ("" if g[0] != b[0] else f"-{w[1]}") for g, b, w in PAIRS]


def run_threads(size, bad, good_spec, bad_spec, family):
    """Run the calls on inproc threads with check='header'; return each rank's exception."""
    fabric = Fabric(size)
    topology = [r * 2 // size for r in range(size)] if family == "hier" else [0] * size
    model = LinkModel.for_transports("inproc", "inproc")
    errors = [None] * size
    comms = [Communicator(InprocTransport(fabric, r), r, size, topology=topology,
                          timeout=TIMEOUT, check="header", link_model=model)
             for r in range(size)]

    def body(r):
        coll, kw, dtype, count = bad_spec if r == bad else good_spec
        try:
            call(comms[r], (coll, dict(kw, algorithm=family), dtype, count))
        except BaseException as e:      # the test inspects it
            errors[r] = e
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a rank hung past the timeout"
    for c in comms:
        c.close()
    return errors


def check_errors(errors, bad, words):
    texts = [f"{type(e).__name__}: {e}" for e in errors]
    for r, e in enumerate(errors):
        assert isinstance(e, (mc.MismatchError, mc.PeerFailure)), \
            f"rank {r} (misbehaving: {bad}) got {texts[r]}"
    named = [r for r, e in enumerate(errors)
             if isinstance(e, mc.MismatchError) and all(w in str(e) for w in words)
             and (r == bad or f"rank {bad}" in str(e))]
    assert named, f"no rank named both calls and rank {bad}: {texts}"


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("good,bad_spec,words", PAIRS, ids=PAIR_IDS)
def test_mismatch_is_named_on_every_rank(size, family, good, bad_spec, words):
    if "root=1" in words and size < 2:
        pytest.skip("needs two roots")
    for bad in sorted({size - 1, 0}):
        errors = run_threads(size, bad, good, bad_spec, family)
        check_errors(errors, bad, words)


# a slice on real processes, through the transports' own headers: the cases that escaped
# (a CommTimeout on some rank) before check_foreign, plus one of each transport
PROC_CASES = [("ring", 12, 3, 0, "shm"), ("tree", 5, 4, 3, "shm"), ("tree", 11, 3, 0, "shm"),
              ("rhd", 1, 3, 0, "shm"), ("rhd", 5, 3, 2, "shm"), ("tree", 12, 3, 2, "shm"),
              ("hier", 0, 4, 3, "shm"), ("tree", 11, 3, 0, "tcp"), ("rhd", 1, 3, 0, "tcp"),
              ("ring", 12, 3, 0, "tcp"), ("tree", 11, 3, 0, "rdma"), ("rhd", 5, 3, 2, "ub")]


def _proc_job(comm, bad, good, bad_spec, family):
    coll, kw, dtype, count = bad_spec if comm.rank == bad else good
    try:
        call(comm, (coll, dict(kw, algorithm=family), dtype, count))
    except mc.CommError as e:
        return type(e).__name__, str(e)
    return None, ""


@pytest.mark.parametrize("family,pair,size,bad,transport", PROC_CASES,
                         ids=[f"{t}-{f}-{PAIR_IDS[i]}-{n}-bad{b}" for f, i, n, b, t in PROC_CASES])
def test_mismatch_on_processes(family, pair, size, bad, transport):
    good, bad_spec, words = PAIRS[pair]
    out = mc.spawn(_proc_job, size, args=(bad, good, bad_spec, family), transport=transport,
                   nodes=2 if family == "hier" else 1, timeout=TIMEOUT)
    for r, (kind, text) in enumerate(out):
        assert kind in ("MismatchError", "PeerFailure"), f"rank {r}: {kind} {text}"
    assert any(kind == "MismatchError" and all(w in text for w in words)
               and (r == bad or f"rank {bad}" in text) for r, (kind, text) in enumerate(out)), out


def _notice_behind_data(comm):
    # rank 0 sends rank 1 a message of call #1 that rank 1 has not reached yet, then the abort
    # notice of a communicator broken in call #1; rank 1 waits in call #1 for rank 2, which
    # sends nothing. The notice is the second record of rank 0's stream, behind the data.
    from minicomm.errors import pack_call
    from minicomm.transports.base import ABORT_CALL, ABORT_KINDS, Tag
    t, ctx = comm.transport, comm._ctx
    call = pack_call("allreduce", "sum", "ring", np.dtype(np.float64), -1)
    seq = comm._seq + 1               # the call this communicator makes next (world start made some)
    result = None
    if comm.rank == 0:
        t.wait_all([t.isend(1, np.ones(5), Tag(ctx, seq, 1, call, 5)),
                    t.isend(1, np.empty(0, np.uint8),
                            Tag(ctx, -1, ABORT_KINDS.index("MismatchError"), ABORT_CALL, seq))],
                   time.monotonic() + 10, "send")
    elif comm.rank == 1:
        req = t.irecv(2, np.empty(5), Tag(ctx, seq, 0, call, 5))
        try:
            t.wait_all([req], time.monotonic() + 10, "allreduce (ring)")
        except mc.CommError as e:
            result = type(e).__name__, str(e)
        for peer in (0, 2):
            comm.send(np.zeros(1), peer)
        return result
    comm.recv(1)
    return result


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_abort_notice_behind_unclaimed_data_is_found_while_waiting(transport):
    # found by CI: a rank waiting on a third rank saw only the head of each peer's stream, a
    # message of this very call, and timed out while the notice that ends the call sat behind it
    got = mc.spawn(_notice_behind_data, 3, transport=transport, timeout=60)[1]
    assert got is not None and got[0] in ("MismatchError", "PeerFailure"), got
    assert "rank 0" in got[1], got


# The notice tests below drive the transport directly (the wait a collective's step makes) with
# a context of no communicator for their own coordination (ASIDE: point-to-point, so the
# collective waits never look at it), and end with every rank releasing the others.
ASIDE = 7_000_001
NOTICE_WAIT = 20.0


def _notice_tags(comm):
    from minicomm.errors import pack_call
    from minicomm.transports.base import ABORT_CALL, ABORT_KINDS, Tag
    call = pack_call("allreduce", "sum", "ring", np.dtype(np.float64), -1)
    seq = comm._seq + 1               # the call this communicator makes next (world start made some)
    notice = Tag(comm._ctx, -1, ABORT_KINDS.index("MismatchError"), ABORT_CALL, seq)
    return notice, (lambda step: Tag(comm._ctx, seq, step, call, 5)), Tag


def _wait_for_error(t, req):
    try:
        t.wait_all([req], time.monotonic() + NOTICE_WAIT, "allreduce (ring)")
    except mc.CommError as e:
        return type(e).__name__, str(e)
    return None


def _notice_from_a_finished_peer(comm):
    # rank 0 sends rank 2 the abort notice of the call rank 2 is about to make, and leaves (its
    # transport says goodbye); once rank 2 has seen that goodbye, it waits in that call for
    # rank 1, which sends nothing
    notice, call_tag, Tag = _notice_tags(comm)
    t = comm.transport
    if comm.rank == 0:
        t.wait_all([t.isend(2, np.empty(0, np.uint8), notice)], time.monotonic() + 10, "send")
        return None
    if comm.rank == 1:
        t.wait_all([t.irecv(2, np.empty(1), Tag(ASIDE, 1, 0, 0, 0))], time.monotonic() + 60, "x")
        return None
    never = t.irecv(1, np.empty(1), Tag(ASIDE, 0, 0, 0, 0))     # sent by nobody: waited on
    while t._link(0).closed is None:        # until rank 0's goodbye has been read here
        try:
            t.wait_all([never], time.monotonic() + 0.1, "rank 0's goodbye")
        except mc.CommTimeout:
            pass
    result = _wait_for_error(t, t.irecv(1, np.empty(5), call_tag(0)))
    t.wait_all([t.isend(1, np.zeros(1), Tag(ASIDE, 1, 0, 0, 0))], time.monotonic() + 10, "x")
    return result


@pytest.mark.parametrize("transport", ["shm", "rdma", "ub"])
def test_an_abort_notice_from_a_peer_that_has_closed_is_found_while_waiting(transport):
    # found by CI (shm-tree-reduce_scatter-vs-alltoall-4-bad3): ranks 0 and 1 broke the
    # communicator, left their notices in rank 2's rings and closed; rank 2, waiting on rank 3,
    # read their goodbyes and from then on skipped their rings, timing out with both notices there
    got = mc.spawn(_notice_from_a_finished_peer, 3, transport=transport, timeout=60)[2]
    assert got is not None and got[0] in ("MismatchError", "PeerFailure"), got
    assert "rank 0" in got[1], got


def _notice_claimed_by_a_receive_not_waited_on(comm):
    # rank 2 has posted a receive from rank 0 for a later step of the call; rank 0's abort notice
    # is matched against it (poisoning the communicator on that link) while rank 2 waits for
    # another message of rank 0's; then rank 2 waits in the call's first step for rank 1
    notice, call_tag, Tag = _notice_tags(comm)
    t = comm.transport
    if comm.rank == 0:
        t.wait_all([t.isend(2, np.empty(0, np.uint8), notice),
                    t.isend(2, np.zeros(1), Tag(ASIDE, 0, 0, 0, 0))], time.monotonic() + 10, "x")
    if comm.rank in (0, 1):
        t.wait_all([t.irecv(2, np.empty(1), Tag(ASIDE, 1, 0, 0, 0))], time.monotonic() + 60, "x")
        return None
    t.irecv(0, np.empty(5), call_tag(1))                        # posted, not waited on yet
    t.wait_all([t.irecv(0, np.empty(1), Tag(ASIDE, 0, 0, 0, 0))], time.monotonic() + 60, "x")
    result = _wait_for_error(t, t.irecv(1, np.empty(5), call_tag(0)))
    t.wait_all([t.isend(p, np.zeros(1), Tag(ASIDE, 1, 0, 0, 0)) for p in (0, 1)],
               time.monotonic() + 10, "x")
    return result


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_abort_notice_taken_by_a_receive_not_waited_on_is_found_while_waiting(transport):
    got = mc.spawn(_notice_claimed_by_a_receive_not_waited_on, 3, transport=transport,
                   timeout=60)[2]
    assert got is not None and got[0] in ("MismatchError", "PeerFailure"), got
    assert "rank 0" in got[1], got


def _notice_behind_the_last_check(comm):
    # rank 2's checks of the other peers' messages made before it raises its sleeping flag all
    # miss rank 0's notice (as if it always landed just after them; such a notice rings no
    # doorbell, since the flag was down when it landed); the check made with the flag raised
    # must find it
    from minicomm.transports.shm import layout as shm_layout
    notice, call_tag, Tag = _notice_tags(comm)
    t = comm.transport
    if comm.rank == 0:
        t.wait_all([t.isend(2, np.empty(0, np.uint8), notice)], time.monotonic() + 10, "send")
    if comm.rank in (0, 1):
        t.wait_all([t.irecv(2, np.empty(1), Tag(ASIDE, 1, 0, 0, 0))], time.monotonic() + 60, "x")
        return None
    check = t.check_foreign

    def check_only_while_flagged(tag):
        if t._flag_q[shm_layout._SLEEPING]:
            check(tag)
    t.check_foreign = check_only_while_flagged
    result = _wait_for_error(t, t.irecv(1, np.empty(5), call_tag(0)))
    del t.check_foreign
    t.wait_all([t.isend(p, np.zeros(1), Tag(ASIDE, 1, 0, 0, 0)) for p in (0, 1)],
               time.monotonic() + 10, "x")
    return result


def test_an_abort_notice_landing_after_the_check_before_sleep_is_found():
    got = mc.spawn(_notice_behind_the_last_check, 3, transport="shm", timeout=60)[2]
    assert got is not None and got[0] in ("MismatchError", "PeerFailure"), got
    assert "rank 0" in got[1], got


def _notice_queued_behind_a_large_send(comm, big):
    # rank 0 breaks the communicator while a large message to rank 2 (of another context) is
    # still flowing through its small ring: the notice is queued behind it, and the cancellation
    # that follows the notice must not drop it; rank 2 takes the large message while it waits in
    # the broken call for rank 1
    notice, call_tag, Tag = _notice_tags(comm)
    t = comm.transport
    if comm.rank == 0:
        t.isend(2, np.ones(big, np.uint8), Tag(ASIDE, 2, 0, 0, 0))
        comm._break(mc.MismatchError("this rank called another collective (the test's)"))
    if comm.rank in (0, 1):
        t.wait_all([t.irecv(2, np.empty(1), Tag(ASIDE, 1, 0, 0, 0))], time.monotonic() + 60, "x")
        return None
    t.irecv(0, np.empty(big, np.uint8), Tag(ASIDE, 2, 0, 0, 0))
    result = _wait_for_error(t, t.irecv(1, np.empty(5), call_tag(0)))
    t.wait_all([t.isend(p, np.zeros(1), Tag(ASIDE, 1, 0, 0, 0)) for p in (0, 1)],
               time.monotonic() + 10, "x")
    return result


# shm: 16 times its ring, under the single-copy size of a send; tcp: more than the sockets hold
@pytest.mark.parametrize("transport,big", [("shm", 1 << 20), ("tcp", 64 << 20)])
def test_an_abort_notice_queued_behind_a_send_survives_the_cancellation(transport, big,
                                                                       monkeypatch):
    monkeypatch.setenv("MINICOMM_SHM_RING_BYTES", str(64 << 10))
    got = mc.spawn(_notice_queued_behind_a_large_send, 3, args=(big,), transport=transport,
                   timeout=60)[2]
    assert got is not None and got[0] in ("MismatchError", "PeerFailure"), got
    assert "rank 0" in got[1], got


# The call number a MismatchError names counts the user's collectives on that communicator from
# 1: not the world's setup calls (link agreement), not the extra internal exchanges of rooted
# calls (fingerprints) or of calls made of calls (split, object collectives).
USER_CALL = "the user's collective call #{} on this communicator"


def _error_text(fn):
    try:
        fn()
    except mc.CommError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _first_call_mismatch(comm):
    return [_error_text(lambda: comm.allreduce(np.ones(4 + comm.rank)))]


def _later_calls_mismatch(comm):
    sub = comm.split(0)                                       # world: the user's call #1
    comm.broadcast(np.ones(3), root=0)                        # #2 (rooted: two exchanges)
    sub.barrier()                                             # sub: #1
    sub.broadcast_object({"a": 1})                            # #2 (two broadcasts inside)
    in_sub = _error_text(lambda: sub.allreduce(np.ones(4 + sub.rank)))                  # #3
    in_world = _error_text(lambda: comm.allreduce(np.ones(4 + comm.rank), async_op=True).wait())
    return [in_world, in_sub]                                 # world #3, run by its worker


@pytest.mark.parametrize("transport", ["inproc", "shm"])
@pytest.mark.parametrize("job,numbers", [(_first_call_mismatch, [1]),
                                         (_later_calls_mismatch, [3, 3])],
                         ids=["first-call", "later-calls"])
def test_a_mismatch_names_the_users_call_number(transport, job, numbers):
    out = mc.spawn(job, 2, transport=transport, timeout=TIMEOUT)
    for r, texts in enumerate(out):
        for text, n in zip(texts, numbers):
            assert text is not None and text.startswith(("MismatchError", "PeerFailure")), \
                (r, text)
            assert USER_CALL.format(n) in text, (r, text)
            # every call number the message shows is the user's; internal ones say "sequence"
            assert re.findall(r"call #\d+", text) == [f"call #{n}"], (r, text)
