"""Communicators that survive a failure (issue 35): ``revoke``, ``agree``, ``shrink``,
``failed_ranks``.

A victim rank dies with ``os._exit`` at a chosen point (before a collective, or inside an
agreement before its k-th message of a kind, through ``faulttolerance.TEST_HOOKS``). The
survivors write what they decided to a file each; spawn then reports the victim's death
(``SpawnError``), and the test compares the survivors' files: the same decision on every survivor,
the survivors renumbered in old order, and collectives on the shrunk communicator correct.
"""
import json
import os

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401  (autouse fixture)

PROCESS_TRANSPORTS = ["shm", "tcp"]
ALL_PROCESS = PROCESS_TRANSPORTS + ["rdma", "ub"]
TIMEOUT = 8.0


def _write(path, rank, obj):
    with open(os.path.join(path, f"r{rank}.json"), "w") as f:
        json.dump(obj, f)


def _read(path, ranks):
    out = {}
    for r in ranks:
        with open(os.path.join(path, f"r{r}.json")) as f:
            out[r] = json.load(f)
    return out


def _check_collectives(comm, times=5):
    """``times`` allreduces and broadcasts on ``comm``, checked against numpy; the count done."""
    done = 0
    for i in range(times):
        x = np.arange(7, dtype=np.float64) + comm.rank + i
        want = sum(np.arange(7, dtype=np.float64) + r + i for r in range(comm.size))
        assert np.array_equal(comm.allreduce(x), want)
        root = i % comm.size
        b = comm.broadcast(np.full(3, float(comm.rank)), root=root)
        assert np.array_equal(b, np.full(3, float(root)))
        done += 1
    return done


# ---------------------------------------------------------------------------------- no failure
@pytest.mark.parametrize("transport", ["inproc"] + PROCESS_TRANSPORTS)
def test_agree_is_the_and_of_every_flag_and_the_same_everywhere(transport):
    def prog(comm):
        a = comm.agree(True)
        b = comm.agree(comm.rank != comm.size - 1)
        return a, b, comm.failed_ranks(), comm.failed_ranks(agreed=True)

    got = mc.spawn(prog, 3, transport=transport, timeout=TIMEOUT)
    assert got == [(True, False, [], [])] * 3


@pytest.mark.parametrize("transport", ["inproc"] + PROCESS_TRANSPORTS)
def test_shrink_without_failure_keeps_every_rank_on_a_new_context(transport):
    def prog(comm):
        new = comm.shrink()
        try:
            comm.barrier()
        except mc.errors.Revoked as e:
            revoked = str(e)
        done = _check_collectives(new)
        new.barrier()
        new.close()                   # the shrunk world's close closes the world it came from
        try:
            comm.agree(True)
            world = "open"
        except mc.CommError as e:
            world = "closed" if "closed" in str(e) else str(e)
        return new.rank, new.size, new.comm_id != comm.comm_id, done, "revoked" in revoked, \
            world

    got = mc.spawn(prog, 3, transport=transport, timeout=TIMEOUT)
    assert got == [(r, 3, True, 5, True, "closed") for r in range(3)]


@pytest.mark.parametrize("transport", ["inproc"] + PROCESS_TRANSPORTS)
def test_many_agreements_back_to_back(transport):
    def prog(comm):
        return [comm.agree((i + comm.rank) % 7 != 0) for i in range(60)]

    got = mc.spawn(prog, 3, transport=transport, timeout=TIMEOUT)
    want = [all((i + r) % 7 != 0 for r in range(3)) for i in range(60)]
    assert got == [want] * 3


# ---------------------------------------------------------------------------------- revoke
@pytest.mark.parametrize("transport", ["inproc"] + ALL_PROCESS)
def test_revoke_wakes_every_blocked_rank_with_revoked(transport):
    """Rank 0 revokes while the others wait for it in an allreduce (rank 1) and in a barrier of
    the world behind it (rank 2 waits on rank 1 in the ring): both wake with Revoked long before
    their timeout; every later call raises Revoked; shrink gives a working world of all three."""
    import time

    def prog(comm):
        if comm.rank == 0:
            time.sleep(0.5)           # the scenario: the others are blocked by now
            comm.revoke()
            kind = "revoker"
        else:
            t0 = time.monotonic()
            try:
                comm.allreduce(np.ones(4))
                kind = "completed"
            except mc.CommError as e:
                kind = type(e).__name__
            assert time.monotonic() - t0 < TIMEOUT
        try:
            comm.allreduce(np.ones(2))
            later = "completed"
        except mc.CommError as e:
            later = type(e).__name__
        new = comm.shrink()
        return kind, later, new.size, _check_collectives(new)

    got = mc.spawn(prog, 3, transport=transport, timeout=TIMEOUT)
    assert got == [("revoker", "Revoked", 3, 5), ("Revoked", "Revoked", 3, 5),
                   ("Revoked", "Revoked", 3, 5)]


@pytest.mark.parametrize("transport", ["inproc"] + PROCESS_TRANSPORTS)
def test_shrink_does_not_break_a_call_the_shrinker_has_done(transport):
    """Rank 0 ends a chain broadcast (0 -> 1 -> 2) and shrinks at once; rank 2 waits in that
    broadcast on rank 1, which comes late. Rank 0 did its part: rank 2's broadcast completes
    (shrink's notice wakes only calls the shrinker has not done), then all three shrink."""
    import time

    def prog(comm):
        if comm.rank == 1:
            time.sleep(0.5)           # the scenario: rank 2 waits on rank 1, rank 0 has shrunk
        b = comm.broadcast(np.full(50_000, float(comm.rank)), root=0, algorithm="ring")[:3]
        new = comm.shrink()
        return b.tolist(), new.size, _check_collectives(new)

    for _ in range(3):                # the race needs rank 2 blocked when the notice arrives
        got = mc.spawn(prog, 3, transport=transport, timeout=TIMEOUT)
        assert got == [([0.0] * 3, 3, 5)] * 3


def test_a_shrink_notice_breaks_only_calls_the_shrinker_has_not_done():
    """The rule behind the test above, on the notice itself: a shrinker that did calls up to #7
    sends count 8; a peer's call #7 goes on, its call #8 (or a point-to-point wait) raises."""
    from minicomm.transports.base import ABORT_CALL, ABORT_KINDS, Tag, check_foreign
    shrink = Tag(4, -1, ABORT_KINDS.index("Shrink"), ABORT_CALL, 8)
    revoke = Tag(4, -1, ABORT_KINDS.index("Revoked"), ABORT_CALL, 8)
    collective = 2195969                          # a broadcast's call code (call & 31 != 0)
    check_foreign(0, Tag(4, 7, 0, collective, 1000), shrink)      # done by rank 0: goes on
    for expected, notice in ((Tag(4, 8, 0, collective, 1000), shrink),
                             (Tag(4, 7, 0, collective, 1000), revoke),
                             (Tag(4, 7, 0, 32, 1000), shrink)):   # point-to-point (call & 31 == 0)
        with pytest.raises(mc.errors.Revoked, match="rank 0"):
            check_foreign(0, expected, notice)


# ---------------------------------------------------------------------------------- deaths
def _die_at_call(comm, victim, at, path, calls=8):
    """Allreduces; ``victim`` dies before call ``at``; the survivors shrink after their error,
    check collectives on the new communicator and record what they saw."""
    error = None
    for i in range(calls):
        if comm.rank == victim and i == at:
            os._exit(3)
        try:
            y = comm.allreduce(np.full(1000, 1.0 + i))
            assert np.array_equal(y, np.full(1000, (1.0 + i) * comm.size))
        except (mc.PeerFailure, mc.CommTimeout, mc.errors.Revoked) as e:
            error = type(e).__name__
            break
    seen = comm.failed_ranks()       # what this rank knows now: the victim, or nobody yet
    ok = comm.agree(error is None)
    failed = comm.failed_ranks(agreed=True)
    new = comm.shrink()
    _write(path, comm.rank, {"error": error, "ok": ok, "failed": failed,
                             "group": list(new.world_ranks), "rank": new.rank, "id": new.comm_id,
                             "done": _check_collectives(new), "agree": new.agree(True),
                             "new_failed": new.failed_ranks(), "seen": seen})
    new.close()


@pytest.mark.parametrize("transport", ALL_PROCESS)
@pytest.mark.parametrize("n,victim,at", [(3, 2, 3), (4, 0, 0), (4, 1, 5), (5, 3, 2)])
def test_shrink_after_a_death_in_a_collective(transport, n, victim, at, tmp_path):
    with pytest.raises(mc.SpawnError):
        mc.spawn(_die_at_call, n, args=(victim, at, str(tmp_path)), transport=transport,
                 timeout=TIMEOUT)
    survivors = [r for r in range(n) if r != victim]
    got = _read(tmp_path, survivors)
    first = got[survivors[0]]
    for r in survivors:
        g = got[r]
        assert g["error"] is not None
        assert (g["ok"], g["failed"], g["group"], g["id"]) == \
            (False, [victim], survivors, first["id"]), (r, g)
        assert g["rank"] == survivors.index(r)
        assert g["seen"] in ([], [victim]), g
        assert (g["done"], g["agree"], g["new_failed"]) == (5, True, [])


def _die_in_agreement(comm, victim, kind, k, path):
    """``victim`` dies inside the agreement, before its k-th message of ``kind``."""
    from minicomm.communicator import faulttolerance as ft
    if comm.rank == victim:
        def hook(kind_now, count):
            if kind_now == kind and count == k:
                os._exit(3)
        ft.TEST_HOOKS["ft_send"] = hook
    value = comm.agree(comm.rank != 1)
    failed = comm.failed_ranks(agreed=True)
    ft.TEST_HOOKS.pop("ft_send", None)
    _write(path, comm.rank, {"value": value, "failed": failed})


KINDS = {"report": 1, "propose": 2, "ack": 3, "commit": 4}


@pytest.mark.parametrize("transport", ALL_PROCESS)
@pytest.mark.parametrize("n,victim,phase,k", [
    (4, 0, "propose", 0), (4, 0, "propose", 1), (4, 0, "propose", 2),
    (3, 0, "commit", 0), (4, 0, "commit", 1), (5, 0, "commit", 3),
    (4, 2, "report", 0), (4, 3, "ack", 0)])
def test_agree_decides_the_same_everywhere_when_a_rank_dies_inside_it(
        transport, n, victim, phase, k, tmp_path):
    """The coordinator (rank 0) dies after k of its PROPOSE or COMMIT messages; a participant
    dies before its REPORT or ACK. Every survivor returns the same value and failed set; the
    value is the AND over the ranks (rank 1 votes False), and the failed set names only the
    dead rank."""
    with pytest.raises(mc.SpawnError):
        mc.spawn(_die_in_agreement, n, args=(victim, KINDS[phase], k, str(tmp_path)),
                 transport=transport, timeout=TIMEOUT)
    survivors = [r for r in range(n) if r != victim]
    got = _read(tmp_path, survivors)
    decisions = {json.dumps(g, sort_keys=True) for g in got.values()}
    assert len(decisions) == 1, got
    g = got[survivors[0]]
    assert g["value"] is False and set(g["failed"]) <= {victim}, g


def test_failed_ranks_and_agree_on_a_closed_communicator():
    def prog(comm):
        sub = comm.split(0)
        sub.close()
        out = []
        for call in (lambda: sub.agree(True), sub.shrink, sub.revoke):
            try:
                call()
                out.append("returned")
            except mc.CommError as e:
                out.append("closed" in str(e))
        return out, comm.failed_ranks()

    got = mc.spawn(prog, 2, transport="inproc", timeout=TIMEOUT)
    assert got == [([True, True, True], [])] * 2


@pytest.mark.parametrize("transport", ["inproc"] + PROCESS_TRANSPORTS)
def test_shrink_after_a_comm_timeout_keeps_the_slow_rank(transport):
    """Rank 2 is late for an allreduce: the others time out (CommTimeout); every rank, the late
    one too, shrinks: the new communicator has the same members on a new context."""
    import time

    def prog(comm):
        error = None
        if comm.rank == 2:
            time.sleep(1.5)           # the scenario: later than the others' timeout
        try:
            comm.allreduce(np.ones(3))
        except mc.CommError as e:
            error = type(e).__name__
        new = comm.shrink(timeout=10.0)
        return (error is not None, new.world_ranks, new.comm_id != comm.comm_id,
                _check_collectives(new))

    got = mc.spawn(prog, 3, transport=transport, timeout=0.5)
    assert got == [(True, (0, 1, 2), True, 5)] * 3


@pytest.mark.parametrize("transport", ["inproc"] + ALL_PROCESS)
def test_revoke_wakes_point_to_point_and_async_waits(transport):
    """Rank 0 revokes while rank 1 waits in ``recv(0)``, rank 2 in ``recv(ANY_SOURCE)`` and
    rank 3 on an async allreduce (waiting on rank 2, not on the revoker): each wakes with
    Revoked before its timeout; then all shrink (so nobody is woken by a peer finishing)."""
    import time

    def prog(comm):
        t0 = time.monotonic()
        if comm.rank == 0:
            time.sleep(0.5)           # the scenario: the others are blocked by now
            comm.revoke()
            got = "revoker"
        else:
            try:
                if comm.rank == 1:
                    comm.recv(0)
                elif comm.rank == 2:
                    comm.recv(mc.ANY_SOURCE)
                else:
                    comm.allreduce(np.ones(3), async_op=True).wait()
                got = "completed"
            except mc.CommError as e:
                got = type(e).__name__
        woke = time.monotonic() - t0 < TIMEOUT - 1
        return got, woke, comm.shrink().size

    got = mc.spawn(prog, 4, transport=transport, timeout=TIMEOUT)
    assert got == [("revoker", True, 4)] + [("Revoked", True, 4)] * 3


def _crash_somewhere(comm, path, calls=30):
    """Allreduces and broadcasts until the injected crash (MINICOMM_FAULT) breaks one; the
    survivors agree, shrink and check collectives on the new communicator."""
    error = None
    for i in range(calls):
        try:
            x = np.full(300 + 97 * i, 1.0 + comm.rank)
            y = comm.allreduce(x) if i % 3 else comm.broadcast(x, root=i % comm.size)
            want = sum(1.0 + r for r in range(comm.size)) if i % 3 else 1.0 + i % comm.size
            assert np.array_equal(y, np.full(x.size, want))
        except (mc.PeerFailure, mc.CommTimeout, mc.errors.Revoked) as e:
            error = type(e).__name__
            break
    ok = comm.agree(error is None)
    failed = []
    while True:                       # the crash may hit the agreement: shrink until it works
        new = comm.shrink()
        failed.append(comm.failed_ranks(agreed=True))
        try:
            done = _check_collectives(new)
            break
        except (mc.PeerFailure, mc.CommTimeout, mc.errors.Revoked):
            comm = new
    _write(path, comm.rank, {"ok": ok, "failed": failed, "group": list(new.world_ranks),
                             "done": done})
    new.close()


@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)
@pytest.mark.parametrize("n,victim,crash", [(3, 1, 60), (4, 3, 85), (5, 0, 110)])
def test_shrink_after_a_crash_at_a_message_inside_a_collective(
        transport, n, victim, crash, tmp_path, monkeypatch):
    """MINICOMM_FAULT kills the victim as it posts its ``crash``-th message (agreement messages
    count too): every survivor decides the same; a death after an agreement decided leaves a
    dead member, whose next call fails, and the survivors shrink again; the last communicator
    is the survivors in old order and computes correctly."""
    monkeypatch.setenv("MINICOMM_FAULT", f"crash:{crash}:exit,ranks:{victim}")
    with pytest.raises(mc.SpawnError):
        mc.spawn(_crash_somewhere, n, args=(str(tmp_path),), transport=transport,
                 timeout=TIMEOUT)
    survivors = [r for r in range(n) if r != victim]
    got = _read(tmp_path, survivors)
    first = got[survivors[0]]
    assert all(g == first for g in got.values()), got
    assert first["group"] == survivors and first["done"] == 5, first
    assert first["failed"][-1] == [victim] and all(f in ([], [victim]) for f in first["failed"])
