"""The small-message path (minicomm.smallpath): the compiled form is the schedule, its results
are numpy's, a mismatched call is still detected, and MINICOMM_SMALL_PATH=0 switches it off."""
import dataclasses

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401
from minicomm.algorithms import FAMILIES, build_all, build_schedule
from minicomm.schedule import COLLECTIVES, Copy, Recv, Reduce, Send
from minicomm.smallpath import (
    SmallPlan,
    check_compiled,
    compile_small,
    decompile,
    eligible,
    verify_compiled,
)
from minicomm.verifier import VerificationError


@pytest.mark.parametrize("coll", COLLECTIVES)
@pytest.mark.parametrize("algo", FAMILIES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_compiled_plans_verify_as_their_schedule(coll, algo, p):
    topo = tuple(r * 2 // p for r in range(p)) if algo == "hier" else None
    for count in (0, 1, 7):
        scheds = build_all(coll, algo, p, count, p - 1, topo)
        plans = [compile_small(s, range(p)) for s in scheds]
        verify_compiled(plans, topology=topo)
        for s, sp in zip(scheds, plans):
            back = decompile(sp)
            assert (back.collective, back.rank, back.count, len(back.steps)) == \
                (s.collective, s.rank, s.count, len(s.steps))


def test_compiled_plan_world_ranks_are_translated():
    s = build_schedule("allreduce", "ring", 1, 3, 5, 0)
    sp = compile_small(s, (10, 20, 30))
    peers = {op[0] for _, _, sends, recvs in sp.steps for op in sends + recvs}
    assert peers <= {10, 30} and peers
    assert decompile(sp).steps[1] == tuple(
        o for o in s.steps[1] if not isinstance(o, (Send, Recv))) + tuple(
        o for o in s.steps[1] if isinstance(o, Recv)) + tuple(
        o for o in s.steps[1] if isinstance(o, Send))


def _tampered(sp: SmallPlan, fn) -> SmallPlan:
    steps = [list(st) for st in sp.steps]
    fn(steps)
    return SmallPlan(tuple(tuple(st) for st in steps), sp.tmp_count, sp.group, sp.schedule)


def test_check_compiled_catches_a_wrong_plan():
    """Negative controls: each corruption of a correct compiled plan is caught."""
    s = build_schedule("allreduce", "rhd", 0, 4, 8, 0)
    sp = compile_small(s, range(4))
    check_compiled(sp, s)

    def wrong_offset(steps):
        i = next(k for k, st in enumerate(steps) if st[2])
        peer, b, lo, hi, whole = steps[i][2][0]
        steps[i][2] = ((peer, b, lo + 1, hi + 1, whole),) + tuple(steps[i][2][1:])

    def dropped_recv(steps):
        i = next(k for k, st in enumerate(steps) if st[3])
        steps[i][3] = steps[i][3][1:]

    def flipped_reduce(steps):
        i = next(k for k, st in enumerate(steps) if st[3])
        peer, b, lo, hi, red, whole = steps[i][3][0]
        steps[i][3] = ((peer, b, lo, hi, not red, whole),) + tuple(steps[i][3][1:])

    def wrong_whole_flag(steps):
        i = next(k for k, st in enumerate(steps) if st[3])
        peer, b, lo, hi, red, whole = steps[i][3][0]
        steps[i][3] = ((peer, b, lo, hi, red, not whole),) + tuple(steps[i][3][1:])

    def local_copy_for_reduce(steps):
        i = next(k for k, st in enumerate(steps) if st[1])
        red, *rest = steps[i][1][0]
        steps[i][1] = ((not red, *rest),) + tuple(steps[i][1][1:])

    def renumbered(steps):
        steps[0][0] = 5

    for corrupt in (wrong_offset, dropped_recv, flipped_reduce, local_copy_for_reduce,
                    wrong_whole_flag, renumbered):
        with pytest.raises(VerificationError):
            check_compiled(_tampered(sp, corrupt), s)


def test_verify_compiled_catches_a_plan_that_is_not_a_correct_schedule():
    """A compiled plan that matches a *wrong* schedule passes check_compiled but fails the
    symbolic verifier: rank 0's reductions (on arrival or local) become plain copies."""
    scheds = build_all("allreduce", "rhd", 2, 3, 0)

    def unreduced(o):
        if isinstance(o, Recv):
            return dataclasses.replace(o, reduce=False)
        if isinstance(o, Reduce):
            return Copy(o.src, o.src_offset, o.dst, o.dst_offset, o.count)
        return o
    bad0 = dataclasses.replace(scheds[0], steps=[tuple(unreduced(o) for o in st)
                                                 for st in scheds[0].steps])
    plans = [compile_small(bad0, range(2)), compile_small(scheds[1], range(2))]
    with pytest.raises(VerificationError):
        verify_compiled(plans)


def test_eligibility():
    s = build_schedule("allreduce", "ring", 0, 4, 4096, 0)
    assert eligible(s, 4, 16 << 10)
    assert not eligible(s, 8, 1 << 10)            # 1024-element blocks of 8 bytes > 1 KiB


def _reference_run(comm):
    """Every collective at small sizes against numpy references, on every family."""
    p, r = comm.size, comm.rank
    bad = []
    for algo in ("ring", "tree", "rhd", "hier", "auto"):
        for n in (0, 1, 5, 33):
            for dt in (np.float32, np.int64, np.complex128):
                x = ((np.arange(n) % 7 + 1) * (r + 1)).astype(dt)
                everyone = [((np.arange(n) % 7 + 1) * (q + 1)).astype(dt) for q in range(p)]
                total = sum(everyone) if n else np.zeros(0, dt)
                blocks = np.stack([(np.arange(n) % 5 + q * 10 + r).astype(dt)
                                   for q in range(p)])
                kw = {"algorithm": algo}
                checks = {
                    "allreduce": (comm.allreduce(x, **kw), total),
                    "allreduce out=x": (comm.allreduce(x.copy(), out=None, **kw), total),
                    "broadcast": (comm.broadcast(x, root=p - 1, **kw), everyone[p - 1]),
                    "reduce": (comm.reduce(x, root=0, **kw), total if r == 0 else None),
                    "allgather": (comm.allgather(x, **kw), np.stack(everyone)),
                    "gather": (comm.gather(x, root=p - 1, **kw),
                               np.stack(everyone) if r == p - 1 else None),
                    "reduce_scatter": (comm.reduce_scatter(blocks, **kw),
                                       sum((np.arange(n) % 5 + r * 10 + q).astype(dt)
                                           for q in range(p))),
                    "alltoall": (comm.alltoall(blocks, **kw),
                                 np.stack([(np.arange(n) % 5 + r * 10 + q).astype(dt)
                                           for q in range(p)])),
                    "scatter": (comm.scatter(blocks if r == 0 else None, root=0, **kw),
                                (np.arange(n) % 5 + r * 10 + 0).astype(dt)),
                }
                inplace = x.copy()
                comm.allreduce(inplace, out=inplace, **kw)
                checks["allreduce in place"] = (inplace, total)
                for name, (got, want) in checks.items():
                    if want is None:
                        ok = got is None
                    else:
                        ok = got is not None and got.dtype == want.dtype and \
                            np.array_equal(got, want)
                    if not ok:
                        bad.append((algo, n, np.dtype(dt).name, name))
                comm.barrier(algorithm=algo if algo != "auto" else None)
    smalls = sum(1 for c in comm._calls.values() if c.small is not None)
    return bad, smalls


@pytest.mark.parametrize("p", [2, 3, 4])
def test_small_path_results_match_numpy_over_shm(p):
    res = mc.spawn(_reference_run, world_size=p, transport="shm", timeout=240)
    for bad, smalls in res:
        assert bad == []
        assert smalls > 0                         # the small path really ran


def test_small_path_off_switch(monkeypatch):
    monkeypatch.setenv("MINICOMM_SMALL_PATH", "0")

    def run(comm):
        y = comm.allreduce(np.ones(3, np.float32), algorithm="rhd")
        import minicomm.communicator.calls as cm
        return y.tolist(), cm.SMALL_OFF, sum(1 for c in comm._calls.values() if c.small)
    for y, off, smalls in mc.spawn(run, world_size=2, transport="shm", timeout=120):
        assert y == [2.0, 2.0, 2.0] and off and smalls == 0


def _mismatch(comm):
    x = np.ones(4, np.float32)
    try:
        if comm.rank == 0:
            comm.allreduce(x, op="sum", algorithm="rhd")
        else:
            comm.allreduce(x, op="max", algorithm="rhd")
    except mc.MismatchError as e:
        return "mismatch", str(e)
    except mc.CommError as e:
        return type(e).__name__, str(e)
    return "none", ""


def test_small_path_still_detects_a_mismatch():
    res = mc.spawn(_mismatch, world_size=2, transport="shm", timeout=120)
    kinds = [k for k, _ in res]
    assert "mismatch" in kinds, res
    assert "none" not in kinds, res


def _shape_mismatch(comm):
    x = np.ones(4 if comm.rank == 0 else 5, np.float32)
    try:
        comm.allreduce(x, algorithm="ring")
    except mc.CommError as e:
        return type(e).__name__
    return "none"


def test_small_path_detects_a_count_mismatch():
    res = mc.spawn(_shape_mismatch, world_size=3, transport="shm", timeout=120)
    assert "none" not in res and "MismatchError" in res, res


def _count_executor_runs():
    """Make the communicator record each call it hands to the executor (``run_plan``); returns
    the list it fills and the function that undoes it."""
    import minicomm.communicator.calls as cm
    ran = []
    real = cm.run_plan

    def counting(*a, **k):
        ran.append(a[0].schedule.collective)
        return real(*a, **k)
    cm.run_plan = counting

    def undo():
        cm.run_plan = real
    return ran, undo


def _rooted_on_small_path(comm):
    """Rooted small calls run on the small path with their fingerprints (no executor run)."""
    ran, undo = _count_executor_runs()
    p, r = comm.size, comm.rank
    got = []
    for algo in ("ring", "tree", "rhd"):
        for root in range(p):
            x = np.arange(6, dtype=np.float64) + r
            got.append(np.array_equal(comm.broadcast(x, root=root, algorithm=algo),
                                      np.arange(6.0) + root))
            g = comm.gather(x, root=root, algorithm=algo)
            got.append(np.array_equal(g, np.stack([np.arange(6.0) + q for q in range(p)]))
                       if r == root else g is None)
            red = comm.reduce(x, root=root, algorithm=algo)
            got.append(np.array_equal(red, sum(np.arange(6.0) + q for q in range(p)))
                       if r == root else red is None)
            blocks = np.arange(p * 3, dtype=np.int32).reshape(p, 3) * (root + 1)
            got.append(np.array_equal(comm.scatter(blocks if r == root else None, root=root,
                                                   algorithm=algo), blocks[r]))
    undo()
    return all(got), ran


@pytest.mark.parametrize("p", [2, 3])
def test_rooted_small_calls_take_the_small_path_with_their_fingerprints(p):
    for ok, ran in mc.spawn(_rooted_on_small_path, world_size=p, transport="shm", timeout=120):
        assert ok
        assert ran == []                          # every call (and its guard) ran on the path


def _medium_on_small_path(comm):
    """Calls whose messages lie above shm's EAGER and within a chunk: on the small path now (one
    ring record per message), each result numpy's; float64 blocks of 40,000 (312 KiB)."""
    from minicomm.transports import shm
    ran, undo = _count_executor_runs()
    p, r, n = comm.size, comm.rank, 40_000
    bad = []
    try:
        for algo in ("ring", "tree", "rhd"):
            x = (np.arange(n) % 11 + 1.0) * (r + 1)
            every = [(np.arange(n) % 11 + 1.0) * (q + 1) for q in range(p)]
            blocks = np.stack([np.arange(n) % 7 + 100.0 * q + r for q in range(p)])
            mine = [np.arange(n) % 7 + 100.0 * r + q for q in range(p)]
            root = p - 1
            got = {
                "allreduce": (comm.allreduce(x, algorithm=algo), sum(every)),
                "broadcast": (comm.broadcast(x, root=root, algorithm=algo), every[root]),
                "reduce": (comm.reduce(x, root=0, algorithm=algo), sum(every) if r == 0 else None),
                "allgather": (comm.allgather(x, algorithm=algo), np.stack(every)),
                "gather": (comm.gather(x, root=root, algorithm=algo),
                           np.stack(every) if r == root else None),
                "reduce_scatter": (comm.reduce_scatter(blocks, algorithm=algo), sum(mine)),
                "alltoall": (comm.alltoall(blocks, algorithm=algo), np.stack(mine)),
                "scatter": (comm.scatter(blocks if r == 0 else None, root=0, algorithm=algo),
                            np.arange(n) % 7 + 100.0 * r),
            }
            for name, (have, want) in got.items():
                ok = have is None if want is None else np.array_equal(have, want)
                if not ok:
                    bad.append((algo, name))
    finally:
        undo()
    return bad, ran, comm.transport.small_bytes == shm.CHUNK


@pytest.mark.parametrize("p", [2, 3])
def test_calls_with_messages_up_to_a_chunk_take_the_small_path(p):
    for bad, ran, chunk in mc.spawn(_medium_on_small_path, world_size=p, transport="shm",
                                    timeout=180):
        assert bad == []
        assert ran == []                          # no call went through the executor
        assert chunk


def _root_and_shape_mismatches(comm, case):
    x = np.ones(8, np.float32)
    try:
        if case == "root":
            comm.broadcast(x, root=comm.rank % 2, algorithm="tree")
        elif case == "shape":
            comm.gather(x.reshape((2, 4) if comm.rank == 0 else (4, 2)), root=0, algorithm="tree")
        else:                         # a rank that only sends, and a root that only receives
            comm.reduce(x, root=0 if comm.rank != 1 else 1, algorithm="ring")
    except mc.CommError as e:
        return type(e).__name__, str(e)
    return "none", ""


@pytest.mark.parametrize("case", ["root", "shape", "roots"])
def test_guarded_small_calls_name_a_mismatch_on_every_rank(case):
    res = mc.spawn(_root_and_shape_mismatches, world_size=3, args=(case,), transport="shm",
                   timeout=60)
    for kind, text in res:
        assert kind in ("MismatchError", "PeerFailure"), res
    assert any(kind == "MismatchError" for kind, _ in res), res
    if case == "shape":
        assert any("different shapes" in text for _, text in res), res


def test_large_local_ops_let_the_sends_they_do_not_touch_go_first():
    from minicomm.smallpath import early_sends
    copy_out = ((False, 0, 0, 1, 0, 5000, False),)          # in[0:5000] -> out[0:5000]
    to_3, to_4 = (3, 1, 0, 5000, False), (4, 0, 0, 10, False)   # out[0:5000], in[0:10]
    assert early_sends(copy_out, (to_3, to_4)) == ((to_4,), (to_3,))
    # a send to a peer that also gets a late one stays behind it (per-peer order)
    assert early_sends(copy_out, (to_3, (3, 0, 0, 10, False))) == ((), (to_3, (3, 0, 0, 10, False)))
    # a latency-bound step keeps its order
    small = ((False, 0, 0, 1, 0, 6, False),)
    assert early_sends(small, (to_4,)) == ((), (to_4,))
    # a scatter root's copy of its own block no longer holds its message back
    s = build_schedule("scatter", "tree", 0, 2, 4096, 0)
    (_, local, sends, _), = [st for st in compile_small(s, range(2)).steps if st[1] and st[2]]
    assert early_sends(local, sends) == (sends, ())


class _Recorder:
    """A transport that records every call the small path makes; ``send_now`` / ``recv_now``
    succeed or not by a fixed pattern, so both forms meet the same fallbacks."""
    small_bytes = 1 << 30

    def __init__(self, bufs, pattern):
        self.bufs, self.pattern, self.n, self.log = bufs, pattern, 0, []

    def _where(self, v):
        a = v.__array_interface__["data"][0]
        for b, base in enumerate(self.bufs):
            lo = base.__array_interface__["data"][0]
            if lo <= a <= lo + base.nbytes:
                return b, (a - lo) // base.itemsize, v.size
        raise AssertionError("a view outside the call's buffers")

    def _ok(self):
        self.n += 1
        return self.pattern[self.n % len(self.pattern)]

    def send_now(self, peer, v, tag):
        self.log.append(("send_now", peer, self._where(v), tuple(tag)))
        return self._ok()

    def recv_now(self, peer, v, tag, k, spin):
        self.log.append(("recv_now", peer, self._where(v), tuple(tag), k is None, spin > 0))
        return self._ok()

    def sendrecv_now(self, peer, sv, rv, tag, k, spin):
        # by its definition: send_now, then recv_now only if the send went
        if not self.send_now(peer, sv, tag):
            return 0
        return 3 if self.recv_now(peer, rv, tag, k, spin) else 1

    def recv_now_many(self, waiting, tag, spin):
        self.log.append(("many", tuple((p, self._where(v), k is None) for p, v, k in waiting),
                         tuple(tag), spin > 0))
        return [w for w in waiting if not self._ok()]

    def isend(self, peer, v, tag):
        self.log.append(("isend", peer, self._where(v), tuple(tag)))
        return peer

    def irecv(self, peer, v, tag, k=None):
        self.log.append(("irecv", peer, self._where(v), tuple(tag), k is None))
        return peer

    def wait_all(self, reqs, deadline, what):
        self.log.append(("wait_all", tuple(reqs), what))


@pytest.mark.parametrize("coll", COLLECTIVES)
@pytest.mark.parametrize("algo", FAMILIES)
def test_straight_line_form_makes_the_same_calls_as_run_small(coll, algo):
    from minicomm.smallpath import run_small, straight_line
    from minicomm.transports.base import Tag

    def kernel(d, s):
        d += s
    for p in (2, 3, 4, 5):
        topo = tuple(r * 2 // p for r in range(p)) if algo == "hier" else None
        for count in (0, 1, 6, 4096):             # 4096: local ops large enough for early sends
            for s in build_all(coll, algo, p, count, p - 1, topo):
                sp = compile_small(s, range(10, 10 + p))
                for pattern in ((True,), (False,), (True, False, False)):
                    logs = []
                    for form in ("loop", "straight", "exchange"):
                        bufs = (np.arange(max(s.in_count, 1), dtype=np.float64)[:s.in_count],
                                np.zeros(s.out_count), np.zeros(sp.tmp_count))
                        t = _Recorder(bufs, pattern)
                        if form == "loop":
                            run_small(sp, t, bufs, kernel, Tag(8, 3, 0, 99, count), 1.0, "w",
                                      spin=1e-5)
                        else:
                            straight_line(sp, form == "exchange")(
                                bufs, t, kernel, 8, 3, 99, count, 1.0, "w", 1e-5)
                        logs.append((t.log, [b.tolist() for b in bufs]))
                    assert logs[0] == logs[1] == logs[2], (s.summary(), pattern)


@pytest.mark.parametrize("coll", ("broadcast", "reduce", "gather", "scatter"))
@pytest.mark.parametrize("algo", FAMILIES)
def test_guarded_straight_line_form_makes_the_same_calls_as_run_small(coll, algo):
    """A rooted call's unrolled form with its fingerprint exchange (``guarded``) issues the same
    transport calls as ``run_small`` with the guard, in the same order: fingerprints out before
    step 0, each peer's taken before the first step that receives from it (never inside a fused
    exchange), the rest at the end, late fingerprint sends waited for last; a fingerprint that
    differs calls ``check`` at the same point."""
    from minicomm.smallpath import Guard, run_small, straight_line
    from minicomm.transports.base import Tag

    def kernel(d, s):
        d += s
    for p in (2, 3, 4, 5):
        topo = tuple(r * 2 // p for r in range(p)) if algo == "hier" else None
        for count in (1, 6, 4096):
            for s in build_all(coll, algo, p, count, 1 % p, topo):
                sp = compile_small(s, range(10, 10 + p))
                for pattern in ((True,), (False,), (True, False, False)):
                    for odd in (None, (s.rank + 1) % p):      # a peer whose fingerprint differs
                        logs = []
                        for form in ("loop", "straight", "exchange"):
                            bufs = (np.arange(max(s.in_count, 1), dtype=np.float64)[:s.in_count],
                                    np.zeros(s.out_count), np.zeros(sp.tmp_count))
                            mine = np.array([7, count, 5], dtype=np.int64)
                            rows = np.tile(mine, (p, 1))
                            if odd is not None and odd != s.rank:
                                rows[odd, 2] = 6
                            t = _Recorder(bufs + (mine, rows), pattern)
                            guard = Guard(Tag(8, 2, 0, 98, 3), mine, rows,
                                          lambda: t.log.append("check"))
                            if form == "loop":
                                run_small(sp, t, bufs, kernel, Tag(8, 3, 0, 99, count), 1.0,
                                          "w", spin=1e-5, guard=guard)
                            else:
                                straight_line(sp, form == "exchange", guarded=True)(
                                    bufs, t, kernel, 8, 3, 99, count, 1.0, "w", 1e-5, guard)
                            logs.append((t.log, [b.tolist() for b in bufs]))
                        assert logs[0] == logs[1] == logs[2], (s.summary(), pattern, odd)
                        assert any(e[0] == "send_now" and e[3][3] == 98 for e in logs[0][0]
                                   if e != "check"), "the fingerprints went out"
