"""Persistent requests (``*_init``: start, wait, free) and ``comm.group()`` (fusion, point-to-
point inside, mismatches), against an independent numpy reference, on every transport."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minicomm as mc
from collective_check import ops_for, rank_input, reference
from leaks import nothing_left_behind  # noqa: F401

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "gather", "reduce_scatter",
               "alltoall", "scatter")
TRANSPORTS = ("inproc", "shm", "tcp", "rdma", "ub")


def _input(coll, p, q, n, dtype, salt):
    """Rank ``q``'s input at start number ``salt``: blocks for the blocked collectives."""
    shape = (p, n) if coll in ("reduce_scatter", "alltoall", "scatter") else (n,)
    return rank_input(q, shape, dtype, salt=salt)


def _same(got, want, op, what):
    if want is None:
        assert got is None, what
        return
    want = np.asarray(want)
    if op == "avg":
        assert np.allclose(got, want), (what, got, want)
    else:
        assert got.shape == want.shape and np.array_equal(got, want.astype(got.dtype)), \
            (what, got, want)


def _persistent_rounds(comm, seed, dtype, starts):
    """Every collective as a persistent request, started ``starts`` times with new contents
    written into the bound buffers each time; every result against numpy. Returns checks."""
    p, r = comm.size, comm.rank
    rng = np.random.default_rng(seed)
    ops = ops_for(dtype)
    n, checks = int(rng.integers(1, 40)), 0
    for coll in COLLECTIVES:
        op = ops[int(rng.integers(0, len(ops)))] if coll in ("allreduce", "reduce",
                                                            "reduce_scatter") else None
        root = int(rng.integers(0, p))
        algorithm = ("ring", "tree", "rhd", "hier", "auto")[int(rng.integers(0, 5))]
        x = _input(coll, p, r, n, dtype, 0).copy()
        kw = {"algorithm": algorithm}
        if op is not None:
            kw["op"] = op
        if coll in ("reduce", "broadcast", "gather", "scatter"):
            kw["root"] = root
        req = getattr(comm, coll + "_init")(x, **kw)
        with req:
            for k in range(starts):
                x[...] = _input(coll, p, r, n, dtype, k)
                req.start()
                got = req.wait()
                want = reference(coll, p, r, [_input(coll, p, q, n, dtype, k) for q in range(p)],
                                 op=op, root=root)
                _same(got, want, op, f"{coll} {algorithm} start {k}")
                checks += 1
    # in place, and the uneven and prefix forms
    y = np.arange(6, dtype=np.float64) + r
    with comm.allreduce_init(y, out=y) as req:
        for k in range(starts):
            y[:] = k * (r + 1)
            req.start()
            assert req.wait() is y
            assert np.array_equal(y, np.full(6, k * p * (p + 1) / 2)), y
            checks += 1
    rows = np.full((r % 3, 2), r, dtype=np.int64)
    with comm.allgatherv_init(rows) as req:
        for k in range(starts):
            rows[:] = r + 10 * k
            req.start()
            want = np.concatenate([np.full((q % 3, 2), q + 10 * k) for q in range(p)])
            assert np.array_equal(req.wait(), want)
            checks += 1
    v = np.zeros(3, dtype=np.int64)
    with comm.scan_init(v) as req:
        for k in range(starts):
            v[:] = r + k
            req.start()
            assert np.array_equal(req.wait(), np.full(3, sum(q + k for q in range(r + 1))))
            checks += 1
    b = comm.barrier_init()
    for _ in range(starts):
        b.start()
        assert b.wait() is None
    b.free()
    return checks


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.integers(1, 5), seed=st.integers(0, 10 ** 6),
       dtype=st.sampled_from(["int32", "float64", "bool", "float32", "uint8"]))
def test_persistent_requests_started_many_times_inproc(p, seed, dtype):
    checks = mc.spawn(_persistent_rounds, p, args=(seed, dtype, 4), transport="inproc",
                      nodes=min(2, p))
    assert checks[0] == len(COLLECTIVES) * 4 + 12


@pytest.mark.parametrize("transport", ["shm", "tcp", "rdma", "ub"])
def test_persistent_requests_on_every_transport(transport):
    checks = mc.spawn(_persistent_rounds, 3, args=(7, "float32", 3), transport=transport,
                      nodes=3 if transport in ("rdma", "ub") else 1, timeout=60)
    assert checks == [len(COLLECTIVES) * 3 + 9] * 3


def _mixed_group(comm, seed, dtype):
    """A group of random collectives (allreduces to fuse among them) and a ring of sends and
    receives, each against numpy after the exit. Returns the number of calls checked."""
    p, r = comm.size, comm.rank
    rng = np.random.default_rng(seed)
    ops = ops_for(dtype)
    plan = []
    for i in range(int(rng.integers(1, 12))):
        coll = ("allreduce", "allreduce", "allreduce", "broadcast", "allgather",
                "reduce_scatter", "alltoall", "reduce", "p2p")[int(rng.integers(0, 9))]
        op = ops[int(rng.integers(0, len(ops)))]
        n = int(rng.integers(0 if coll == "allreduce" else 1, 30))
        plan.append((coll, op, n, int(rng.integers(0, p)), i))
    works = []
    with comm.group():
        for coll, op, n, root, i in plan:
            x = _input(coll if coll != "p2p" else "allreduce", p, r, n, dtype, i)
            if coll == "p2p":
                works.append(comm.recv((r - 1) % p, tag=i))
                works.append(comm.isend(x, (r + 1) % p, tag=i))
            elif coll == "allreduce":
                works.append(comm.allreduce(x, op=op, out=x if i % 2 else None))
            elif coll in ("reduce", "reduce_scatter"):
                kw = {"root": root} if coll == "reduce" else {}
                works.append(getattr(comm, coll)(x, op=op, **kw))
            elif coll == "broadcast":
                works.append(comm.broadcast(x, root=root))
            else:
                works.append(getattr(comm, coll)(x))
    checked = 0
    it = iter(works)
    for coll, op, n, root, i in plan:
        if coll == "p2p":
            got = next(it).wait()
            assert next(it).wait() is None
            _same(got, _input("allreduce", p, (r - 1) % p, n, dtype, i), None, "recv")
        else:
            want = reference(coll, p, r, [_input(coll, p, q, n, dtype, i) for q in range(p)],
                             op=op, root=root)
            _same(next(it).wait(), want, op, f"group {coll} {op} #{i}")
        checked += 1
    return checked


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.integers(1, 5), seed=st.integers(0, 10 ** 6),
       dtype=st.sampled_from(["int32", "float64", "float32", "uint8"]))
def test_groups_of_mixed_calls_inproc(p, seed, dtype):
    checked = mc.spawn(_mixed_group, p, args=(seed, dtype), transport="inproc")
    assert checked[0] >= 1 and len(set(checked)) == 1


@pytest.mark.parametrize("transport", ["shm", "tcp", "rdma", "ub"])
def test_groups_of_mixed_calls_on_every_transport(transport):
    for seed in (3, 17):
        checked = mc.spawn(_mixed_group, 3, args=(seed, "float64"), transport=transport,
                           nodes=3 if transport in ("rdma", "ub") else 1, timeout=60)
        assert checked[0] >= 1


def test_allreduces_in_a_group_are_fused_into_one_call():
    """64 allreduces of one op and dtype: one fused allreduce (one sequence number besides the
    group's check), and the results those of 64 plain calls."""
    def f(comm):
        xs = [np.full(256, float(comm.rank + i), dtype=np.float32) for i in range(64)]
        before = comm._seq
        with comm.group():
            works = [comm.allreduce(x, out=x) for x in xs]
        used = comm._seq - before
        ok = all(w.wait() is x and np.array_equal(x, np.full(256, 2.0 * i + 1))
                 for i, (w, x) in enumerate(zip(works, xs)))
        return used, ok
    assert mc.spawn(f, 2, transport="shm") == [(2, True)] * 2


def test_the_fusion_limit_splits_a_group(monkeypatch):
    monkeypatch.setenv("MINICOMM_FUSION_BYTES", "4096")

    def f(comm):
        xs = [np.full(512, 1.0) for _ in range(4)]    # 4 KiB each: one per fused call
        before = comm._seq
        with comm.group():
            for x in xs:
                comm.allreduce(x, out=x, op="avg")
        return comm._seq - before, all(np.array_equal(x, np.ones(512)) for x in xs)
    assert mc.spawn(f, 2, transport="shm") == [(5, True)] * 2


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_large_sends_both_ways_in_one_group_do_not_deadlock(transport):
    def f(comm):
        big = np.full(1 << 20, comm.rank, dtype=np.float32)
        with comm.group():
            comm.send(big, 1 - comm.rank)
            w = comm.recv(1 - comm.rank)
        return bool((w.wait() == 1 - comm.rank).all())
    assert mc.spawn(f, 2, transport=transport, timeout=30) == [True, True]


def test_a_mismatched_group_fails_on_every_rank_naming_the_call():
    def f(comm):
        with pytest.raises(mc.MismatchError) as e:
            with comm.group():
                comm.allreduce(np.ones(4))
                comm.allreduce(np.ones(8 if comm.rank == 1 else 9))
                comm.broadcast(np.ones(2))
        return str(e.value)
    msgs = mc.spawn(f, 3, transport="shm", timeout=30)
    for m in msgs:
        assert "call 2 of a comm.group()" in m and "count=8" in m and "count=9" in m, m


def test_a_group_with_a_missing_call_fails_on_every_rank():
    def f(comm):
        with pytest.raises(mc.MismatchError) as e:
            with comm.group():
                comm.allreduce(np.ones(4))
                if comm.rank:
                    comm.allgather(np.ones(2))
        return str(e.value)
    msgs = mc.spawn(f, 2, transport="inproc", timeout=30)
    assert all("grouped 1 calls" in m or "has no match" in m for m in msgs), msgs


def test_request_misuse_is_a_named_error():
    def f(comm):
        req = comm.allreduce_init(np.ones(3))
        with pytest.raises(mc.CommError, match="not started"):
            req.wait()
        req.start()
        with pytest.raises(mc.CommError, match="still running"):
            req.start()
        req.wait()
        req.free()
        with pytest.raises(mc.CommError, match="freed"):
            req.start()
        with pytest.raises(ValueError, match="unknown algorithm"):
            comm.allreduce_init(np.ones(3), algorithm="nope")
        with pytest.raises(mc.CommError, match="cannot be grouped"):
            with comm.group():
                comm.broadcast_object("x")
        return comm.allreduce(np.ones(1)).tolist()
    assert mc.spawn(f, 2, transport="inproc") == [[2.0], [2.0]]


def test_started_requests_progress_while_another_call_blocks():
    """A receive after a start cannot deadlock: the other rank sends only after its own wait,
    so the first rank's request must run on the worker while its receive waits."""
    def f(comm):
        x = np.ones(4)
        req = comm.allreduce_init(x, out=x)
        req.start()
        if comm.rank == 0:
            got = comm.recv(1)
            y = req.wait()
        else:
            y = req.wait()
            comm.send(np.array([5]), 0)
            got = np.array([5])
        req.free()
        return y.tolist(), int(got[0])
    assert mc.spawn(f, 2, transport="shm", timeout=30) == [([2.0] * 4, 5)] * 2


def test_requests_match_in_start_order_with_plain_calls_between():
    def f(comm):
        a, b = comm.allreduce_init(np.ones(2)), comm.allgather_init(np.array([comm.rank]))
        a.start()
        b.start()
        mid = comm.allreduce(np.full(2, 3.0))       # runs after both requests
        gb, ga = b.wait(), a.wait()                 # waited out of order
        return ga.tolist(), gb.ravel().tolist(), mid.tolist()
    assert mc.spawn(f, 2, transport="shm", timeout=30) == [([2.0, 2.0], [0, 1], [6.0, 6.0])] * 2


def test_persistent_requests_are_fingerprinted_under_detail(monkeypatch):
    monkeypatch.setenv("MINICOMM_DEBUG", "detail")

    def f(comm):
        req = comm.allreduce_init(np.ones(3 + comm.rank))
        req.start()
        with pytest.raises(mc.MismatchError, match="ranks disagree"):
            req.wait()
        return True
    assert mc.spawn(f, 2, transport="inproc", timeout=30) == [True, True]


def test_a_request_started_inside_a_group_runs_at_its_exit_fused():
    def f(comm):
        x, y = np.ones(3), np.full(2, 2.0)
        req = comm.allreduce_init(x, out=x)
        before = comm._seq
        with comm.group():
            req.start()
            with pytest.raises(mc.CommError, match="inside its comm.group"):
                req.wait()
            with pytest.raises(mc.CommError, match="still running"):
                req.start()
            comm.allreduce(y, out=y)
        used = comm._seq - before
        got = req.wait()
        req.free()
        return used, got.tolist(), y.tolist()
    assert mc.spawn(f, 2, transport="shm") == [(2, [2.0] * 3, [4.0] * 2)] * 2


def test_an_exception_in_the_block_issues_nothing():
    def f(comm):
        with pytest.raises(KeyError):
            with comm.group():
                w = comm.allreduce(np.ones(2))
                raise KeyError("user code")
        with pytest.raises(mc.CommError, match="not issued"):
            w.wait()
        return comm.allreduce(np.ones(2)).tolist()        # nothing was issued: still in step
    assert mc.spawn(f, 2, transport="inproc") == [[2.0, 2.0]] * 2


def test_plain_calls_still_take_their_fast_path_after_groups_and_requests():
    def f(comm):
        x = np.ones(4)
        for _ in range(2):
            with comm.group():
                comm.allreduce(x)
            req = comm.allreduce_init(x)
            req.start()
            req.wait()
            req.free()
            comm.allreduce(x)
        c = comm._calls.get(("allreduce", "sum", "auto", x.dtype, 4, 0))
        return comm._pending, c is not None and c.hot
    assert mc.spawn(f, 2, transport="shm") == [(0, True)] * 2

