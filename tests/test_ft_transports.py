"""The transports' side of fault tolerance (issue 35): what revoke, agree and shrink rely on.

* ``dead_peers()``: the links this rank knows closed (died, aborted, finished or excluded), from
  link state; a peer's break notice never puts a live rank there, and the error a notice raises
  names no failed peer (``peer`` None, ``notice`` True) -- E1.
* ``exclude_peer(peer, reason)``: ends that one link (the peer reads ``reason``, this side
  ``FENCED``); every other link goes on.
* A wait on a point-to-point receive ends at once when any peer's notice for its context arrives
  (the awaited peer's, or a third rank's): E4 at the transport level.
* shm: a large single-copy message for a cancelled context is consumed and dropped (E2).
* inproc: one rank's failure fails only the waits on that rank (E3).
"""
import os

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401  (autouse fixture)
from minicomm.errors import Revoked, pack_call
from minicomm.transports.base import ABORT_CALL, ABORT_KINDS, EXCLUDED, FENCED, Tag

KINDS = ["inproc", "shm", "tcp", "rdma", "ub"]
CTX = 987_654 << 2                    # a collective context no communicator of the test uses
P2P_CTX = CTX | 1
DONE_CTX = (987_655 << 2) | 1
ALLREDUCE = pack_call("allreduce", "sum", "ring", np.float64, -1)
P2P = pack_call("p2p", "none", "none", None, -1)
WAIT_S = 20.0                         # a wait that should end at once, bounded


def _deadline():
    import time
    return time.monotonic() + WAIT_S


def _notice(kind: str) -> tuple:
    return np.empty(0, np.uint8), ABORT_KINDS.index(kind)


def _send(t, peer, ctx, buf, tag):
    t.wait_all([t.isend(peer, buf, tag)], _deadline(), "test send")


def _done(t, peer):
    _send(t, peer, DONE_CTX, np.ones(1), Tag(DONE_CTX, 0, 0, P2P, 8))


def _await_done(t, peer):
    t.wait_all([t.irecv(peer, np.empty(1), Tag(DONE_CTX, 0, 0, P2P, 8))], _deadline(), "done")


def _failure(e):
    return [type(e).__name__, getattr(e, "peer", "unset"), bool(getattr(e, "notice", False)),
            str(e)]


# ------------------------------------------------------------------ E1: notices name no dead peer
def _notice_body(comm):
    t = comm.transport
    if comm.rank == 0:
        buf, step = _notice("PeerFailure")
        _send(t, 1, CTX, buf, Tag(CTX, -1, step, ABORT_CALL, 1))
        _await_done(t, 1)
        return None
    try:
        t.wait_all([t.irecv(0, np.empty(1), Tag(CTX, 1, 0, ALLREDUCE, 1))], _deadline(), "recv")
        out = ["received"]
    except mc.CommError as e:
        out = _failure(e)
    out.append(sorted(t.dead_peers()))
    _done(t, 0)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_notice_error_names_no_failed_peer(kind):
    got = mc.spawn(_notice_body, 2, transport=kind, timeout=30)[1]
    name, peer, notice, text, dead = got
    assert name == "PeerFailure" and "rank 0 broke this communicator" in text, got
    assert peer is None and notice, got           # rank 0 is alive: not a failed peer
    assert dead == [], got                        # link state: nobody died


# ------------------------------------------------------------- E4: p2p waits end on any notice
def _p2p_notice_body(comm, notifier):
    t = comm.transport
    if comm.rank == notifier:
        buf, step = _notice("Revoked")
        _send(t, 1, P2P_CTX, buf, Tag(P2P_CTX, -1, step, ABORT_CALL, 3))
    if comm.rank != 1:
        _await_done(t, 1)
        return None
    try:
        t.wait_all([t.irecv(0, np.empty(1), Tag(P2P_CTX, 0, 7, P2P, 8))], _deadline(), "recv(0)")
        out = ["received"]
    except mc.CommError as e:
        out = _failure(e)
    _done(t, 0)
    _done(t, 2)
    return out


@pytest.mark.parametrize("notifier", [0, 2], ids=["awaited-peer", "third-rank"])
@pytest.mark.parametrize("kind,nodes", [(k, 1) for k in KINDS] + [("rdma", 2), ("ub", 2)])
def test_a_p2p_wait_ends_on_a_revoke_notice(kind, nodes, notifier):
    got = mc.spawn(_p2p_notice_body, 3, args=(notifier,), transport=kind, nodes=nodes,
                   timeout=30)[1]
    assert got[0] == "Revoked" and f"rank {notifier} broke" in got[3], got
    assert got[1] is None and got[2], got


def test_revoked_is_a_comm_error():
    assert issubclass(Revoked, mc.CommError)


# -------------------------------------------------------- dead_peers / exclude_peer per transport
def _exclude_body(comm):
    t = comm.transport
    rank = comm.rank
    if rank == 0:
        t.exclude_peer(2, EXCLUDED + " by a test")
        t.exclude_peer(2, EXCLUDED + " again")              # idempotent: the first reason stays
        dead = {p: r for p, r in t.dead_peers().items()}
        _send(t, 1, P2P_CTX, np.full(4, 5.0), Tag(P2P_CTX, 0, 0, P2P, 32))
        _await_done(t, 1)
        # the excluding side's reason never reads EXCLUDED (that says "this rank was fenced")
        why = dead.get(2, "")
        return [sorted(dead), why.startswith(FENCED) and EXCLUDED not in why, "again" in why]
    if rank == 1:
        buf = np.empty(4)
        t.wait_all([t.irecv(0, buf, Tag(P2P_CTX, 0, 0, P2P, 32))], _deadline(), "recv")
        dead = sorted(t.dead_peers())
        _done(t, 0)
        _await_done(t, 2)             # each rank stays until the others looked (a close ends
        _done(t, 2)                   # a link too)
        return [buf.tolist(), dead]
    try:
        t.wait_all([t.irecv(0, np.empty(1), Tag(P2P_CTX, 0, 0, P2P, 8))], _deadline(), "recv")
        out = ["received"]
    except mc.PeerFailure as e:
        out = [type(e).__name__, e.peer, EXCLUDED in str(e)]
    except mc.CommError as e:
        out = _failure(e)
    dead = t.dead_peers()
    out += [sorted(dead), EXCLUDED in dead.get(0, "")]
    _done(t, 1)
    _await_done(t, 1)
    return out


# rdma and ub also across emulated nodes (ranks 0, 1 | 2): rank 2 is told over the NIC agent
@pytest.mark.parametrize("kind,nodes", [(k, 1) for k in KINDS] + [("rdma", 2), ("ub", 2)])
def test_exclude_peer_ends_only_that_link(kind, nodes):
    r0, r1, r2 = mc.spawn(_exclude_body, 3, transport=kind, nodes=nodes, timeout=30)
    assert r0 == [[2], True, False], r0
    assert r1 == [[5.0] * 4, []], r1
    assert r2 == ["PeerFailure", 0, True, [0], True], r2


def _killed_body(comm):
    t = comm.transport
    if comm.rank == 2:
        os._exit(3)
    try:
        t.wait_all([t.irecv(2, np.empty(1), Tag(P2P_CTX, 0, 0, P2P, 8))], _deadline(), "recv")
    except mc.PeerFailure:
        pass
    dead = sorted(t.dead_peers())
    assert dead == [2], f"dead_peers() {dead} after rank 2 was killed"
    if comm.rank == 0:                # each stays until the other looked (a close ends a link)
        _done(t, 1)
        _await_done(t, 1)
    else:
        _await_done(t, 0)
        _done(t, 0)
    return dead


@pytest.mark.parametrize("kind", ["shm", "tcp", "rdma", "ub"])
def test_dead_peers_lists_a_killed_rank(kind):
    with pytest.raises(mc.SpawnError) as ei:
        mc.spawn(_killed_body, 3, transport=kind, timeout=30)
    assert [r for r, _ in ei.value.failures] == [2], str(ei.value)[:2000]


# ------------------------------------------------------------------------- E3: inproc, per rank
def test_inproc_one_ranks_failure_fails_only_the_waits_on_it():
    from minicomm.transports.inproc import Fabric, InprocTransport
    fab = Fabric(3)
    t = [InprocTransport(fab, r) for r in range(3)]
    fab.abort(2, RuntimeError("rank 2 fails"))
    tag = Tag(P2P_CTX, 0, 0, P2P, 8)
    with pytest.raises(mc.PeerFailure) as ei:
        t[0].wait_all([t[0].irecv(2, np.empty(1), tag)], _deadline(), "recv(2)")
    assert ei.value.peer == 2 and "rank 2 fails" in str(ei.value)
    t[0].isend(1, np.full(1, 4.0), tag)
    got = np.empty(1)
    t[1].wait_all([t[1].irecv(0, got, tag)], _deadline(), "recv(0)")   # 0 and 1 go on
    assert got[0] == 4.0
    assert sorted(t[0].dead_peers()) == [2] and sorted(t[1].dead_peers()) == [2]


def _e3_body(comm):
    from minicomm.communicator.lifecycle import SPLIT_BASE
    sub = comm._subgroup([0, 1], 9 * SPLIT_BASE + 1) if comm.rank < 2 else None
    if comm.rank == 2:
        raise RuntimeError("rank 2 fails")
    try:
        comm.allreduce(np.ones(2))
        first = "ok"
    except mc.CommError as e:
        first = type(e).__name__
    return [first, sub.allreduce(np.ones(2)).tolist()]


def test_inproc_survivors_communicator_works_after_a_rank_fails():
    with pytest.raises(mc.SpawnError) as ei:
        mc.spawn(_e3_body, 3, transport="inproc", timeout=10)
    # the survivors returned (only rank 2 failed): their subcommunicator's allreduce worked
    assert [r for r, _ in ei.value.failures] == [2], str(ei.value)[:3000]


# --------------------------------------------------------- E2: shm single-copy of a dropped context
def _e2_body(comm):
    comm.timeout = 20.0
    sub = comm.split(0)
    if comm.rank == 1:
        sub.abort("drop it")              # rank 1 cancels sub's contexts, here only
        got = comm.recv(0)[:3].tolist()
        comm.send(np.ones(1), 0)
        return got
    try:
        sub.broadcast(np.arange(1 << 17, dtype=np.float64), root=0)    # 1 MiB, single-copy
    except mc.CommError:
        pass                              # its outcome is not the point: the next messages are
    comm.send(np.arange(3.0), 1)
    return comm.recv(1).tolist()


def test_shm_single_copy_message_of_a_cancelled_context_is_dropped(monkeypatch):
    monkeypatch.setenv("MINICOMM_CMA_MIN", "65536")
    assert mc.spawn(_e2_body, 2, transport="shm", timeout=30) == [[1.0], [0.0, 1.0, 2.0]]


# ------------------------------------------------- a revoked context's messages: drained, dropped
def _dropped_body(comm):
    t = comm.transport
    big = np.arange(1 << 20, dtype=np.float64)            # 8 MiB: single-copy on shm here
    if comm.rank == 1:
        t.cancel_context(CTX, Revoked("revoked by a test"))
        _done(t, 0)                                        # cancelled before rank 0 sends
        got = np.empty(3)
        t.wait_all([t.irecv(0, got, Tag(P2P_CTX, 0, 0, P2P, 24))], _deadline(), "recv")
        return got.tolist()
    _await_done(t, 1)
    # the receiver drains it unread: the send completes (no receive is ever posted for it)
    t.wait_all([t.isend(1, big, Tag(CTX, 1, 0, ALLREDUCE, big.size))], _deadline(), "big send")
    _send(t, 1, P2P_CTX, np.arange(3.0), Tag(P2P_CTX, 0, 0, P2P, 24))
    return None


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_contexts_large_message_is_drained_and_dropped(kind, monkeypatch):
    monkeypatch.setenv("MINICOMM_CMA_MIN", "65536")
    assert mc.spawn(_dropped_body, 2, transport=kind, timeout=30)[1] == [0.0, 1.0, 2.0]
