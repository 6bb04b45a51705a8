"""The public API contract (DESIGN.md) on inproc ranks: errors, out=, async, p2p, objects, split."""

import numpy as np
import pytest

import minicomm as mc


def spawn(fn, p=3, **kw):
    return mc.spawn(fn, p, transport="inproc", timeout=30, **kw)


@pytest.mark.parametrize("what", ["shape", "dtype", "root", "op", "algorithm", "collective"])
def test_mismatched_calls_raise_mismatch_error_on_every_rank(what):
    def fn(comm):
        r = comm.rank
        x = np.ones(4, dtype=np.float32)
        try:
            if what == "shape":
                comm.allreduce(np.ones(4 + (r == 1)))
            elif what == "dtype":
                comm.allreduce(x.astype(np.float64) if r == 2 else x)
            elif what == "root":
                comm.broadcast(x, root=r % 2)
            elif what == "op":
                comm.allreduce(x, op="max" if r == 0 else "sum")
            elif what == "algorithm":
                comm.allreduce(x, algorithm="ring" if r == 0 else "tree")
            else:
                comm.allgather(x) if r == 0 else comm.allreduce(x)
        except mc.MismatchError as e:
            return str(e)
        return None
    msgs = spawn(fn, 3)
    assert all(m is not None and "rank" in m for m in msgs), msgs


def test_a_detected_mismatch_breaks_the_communicator_for_good():
    def fn(comm):
        with pytest.raises(mc.MismatchError):
            comm.allreduce(np.ones(comm.rank + 1))
        with pytest.raises(mc.CommError, match="communicator is broken: MismatchError"):
            comm.allreduce(np.ones(2))
        return True
    assert spawn(fn) == [True] * 3


def test_type_errors_for_meaningless_ops():
    def fn(comm):
        with pytest.raises(TypeError):
            comm.allreduce(np.ones(3), op="bxor")
        with pytest.raises(TypeError):
            comm.allreduce(np.ones(3, dtype=np.int32), op="avg")
        with pytest.raises(ValueError):
            comm.allreduce(np.ones(3), op="median")
        with pytest.raises(ValueError):
            comm.allreduce(np.ones(3), algorithm="butterfly")
        with pytest.raises(ValueError):
            comm.broadcast(np.ones(3), root=comm.size)
        with pytest.raises(ValueError):
            comm.reduce_scatter(np.ones((comm.size + 1, 2)))
        with pytest.raises(ValueError):
            comm.allreduce(np.ones(3), out=np.empty(4))
        return True
    assert all(spawn(fn))


def test_avg_and_ops_as_constants():
    def fn(comm):
        a = comm.allreduce(np.full(3, float(comm.rank)), op=mc.AVG)
        m = comm.allreduce(np.array([comm.rank, -comm.rank]), op=mc.MAX)
        return a.tolist(), m.tolist()
    res = spawn(fn, 4)
    assert res[0] == ([1.5] * 3, [3, 0])


def test_out_in_place_and_returned():
    def fn(comm):
        x = np.arange(6, dtype=np.int64) + comm.rank
        y = comm.allreduce(x, out=x)
        assert y is x
        return x.tolist()
    assert spawn(fn, 3)[1] == [3 * i + 3 for i in range(6)]


def test_async_work_overlaps_and_keeps_order():
    def fn(comm):
        works = [comm.allreduce(np.full(1000, i + comm.rank, dtype=np.float64), async_op=True)
                 for i in range(5)]
        b = comm.broadcast(np.array([comm.rank]), root=1)     # sync call after async ones
        res = [w.wait(timeout=20)[0] for w in works]
        assert all(w.is_completed() for w in works)
        return res, int(b[0])
    res, b = spawn(fn, 3)[0]
    assert res == [3 * i + 3 for i in range(5)] and b == 1


def test_send_recv_learn_shape_and_dtype():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.arange(12, dtype=np.int16).reshape(3, 4), dst=1, tag=7)
            comm.send(np.zeros((0, 2)), dst=1)
            return None
        if comm.rank == 1:
            a = comm.recv(0, tag=7)
            b = comm.recv(0)
            return a.dtype.str, a.shape, a.sum(), b.shape
    assert spawn(fn, 2)[1] == (np.dtype(np.int16).str, (3, 4), 66, (0, 2))


def test_recv_waits_for_its_tag_and_times_out_naming_it():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.ones(2), dst=1, tag=1)
            comm.recv(1, tag=9)                      # alive until rank 1 is done
            return None
        with pytest.raises(mc.CommTimeout, match="tag 2"):
            comm.recv(0, tag=2, timeout=0.5)
        got = comm.recv(0, tag=1).tolist()           # the tag-1 message is still there
        comm.send(np.zeros(1), 0, tag=9)
        return got
    assert spawn(fn, 2)[1] == [1.0, 1.0]


def test_object_collectives():
    def fn(comm):
        r = comm.rank
        b = comm.broadcast_object({"k": [1, 2]} if r == 0 else None, root=0)
        g = comm.allgather_object(("r", r))
        ga = comm.gather_object(r * r, root=1)
        s = comm.scatter_object([f"to{i}" for i in range(comm.size)] if r == 2 else None, root=2)
        if r == 0:
            comm.send_object(lambda v: v + 1, 1)
            f = None
        elif r == 1:
            f = comm.recv_object(0)(41)
        else:
            f = None
        return b, g, ga, s, f
    res = spawn(fn, 3)
    assert res[0][0] == {"k": [1, 2]}
    assert res[2][1] == [("r", 0), ("r", 1), ("r", 2)]
    assert res[1][2] == [0, 1, 4] and res[0][2] is None
    assert [x[3] for x in res] == ["to0", "to1", "to2"]
    assert res[1][4] == 42


def test_split_follows_mpi_semantics():
    def fn(comm):
        sub = comm.split(color=comm.rank % 2, key=-comm.rank)      # reverse order by key
        none = comm.split(color=None if comm.rank == 0 else 1)
        total = sub.allreduce(np.array([comm.rank]))[0]
        both = comm.allreduce(np.array([1]))[0]                      # world still works after
        return sub.rank, sub.size, int(total), none is None, int(both)
    res = spawn(fn, 5)
    assert [r[0] for r in res] == [2, 1, 1, 0, 0]
    assert [r[2] for r in res] == [6, 4, 6, 4, 6]
    assert [r[3] for r in res] == [True, False, False, False, False]
    assert all(r[4] == 5 for r in res)


def test_topology_properties_with_emulated_nodes():
    def fn(comm):
        return comm.node, comm.num_nodes, comm.local_rank, comm.local_size
    assert spawn(fn, 5, nodes=2) == [(0, 2, 0, 3), (0, 2, 1, 3), (0, 2, 2, 3), (1, 2, 0, 2), (1, 2, 1, 2)]


def test_spawn_error_lists_root_cause_first():
    def fn(comm):
        if comm.rank == 2:
            raise ValueError("boom on two")
        comm.allreduce(np.ones(3))     # the others wait on rank 2 and lose it
    with pytest.raises(mc.SpawnError) as ei:
        spawn(fn, 4)
    assert ei.value.failures[0][0] == 2
    assert "boom on two" in str(ei.value).split("\n")[0]
    assert {r for r, _ in ei.value.failures} == {0, 1, 2, 3}


def test_timeout_names_op_step_and_peer():
    import threading
    peer_may_leave = threading.Event()     # rank 0 stays alive but silent: a hung peer

    def fn(comm):
        if comm.rank == 1:
            with pytest.raises(mc.CommTimeout) as ei:
                comm.recv(0)
            peer_may_leave.set()
            return str(ei.value)
        assert peer_may_leave.wait(20)
        return None
    msg = mc.spawn(fn, 2, transport="inproc", timeout=0.5)[1]
    assert "recv from rank 0" in msg and "rank 0" in msg


def test_minicomm_algo_env_overrides_auto(monkeypatch, capsys):
    monkeypatch.setenv("MINICOMM_ALGO", "allreduce:tree")
    monkeypatch.setenv("MINICOMM_DEBUG", "info")
    mc.spawn(lambda c: c.allreduce(np.ones(4)), 2, transport="inproc")
    err = capsys.readouterr().err
    assert "allreduce" in err and "-> tree" in err


def test_zero_sized_world_and_singletons():
    res = mc.spawn(lambda c: (c.allreduce(np.ones(2)).tolist(), c.allgather(np.ones(1)).shape,
                              c.scatter(np.arange(3).reshape(1, 3)).tolist()), 1, transport="inproc")
    assert res == [([1.0, 1.0], (1, 1), [0, 1, 2])]


def _scatter_mixed(comm, root, family):
    """Every third non-root passes no out= (it learns shape and dtype from the root's header
    row); the others pass out= (which names them)."""
    n, r = comm.size, comm.rank
    x = np.arange(n * 6, dtype=np.int32).reshape(n, 2, 3) * (root + 1) if r == root else None
    out = None if r % 3 == 1 else np.empty((2, 3), dtype=np.int32)
    got = comm.scatter(x, root=root, algorithm=family, out=out)
    assert out is None or got is out
    return got.tolist()


@pytest.mark.parametrize("transport,n", [("inproc", 3), ("inproc", 5), ("shm", 4)])
def test_scatter_with_and_without_out_on_the_same_call(transport, n):
    for family in ("ring", "tree", "rhd", "hier"):
        for root in (0, n - 1):
            want = (np.arange(n * 6, dtype=np.int32).reshape(n, 2, 3) * (root + 1)).tolist()
            got = mc.spawn(_scatter_mixed, n, args=(root, family), transport=transport,
                           nodes=2 if family == "hier" else 1, timeout=30)
            assert got == want, (family, root)


def _scatter_wrong_out(comm, what):
    r = comm.rank
    x = np.ones((comm.size, 4), dtype=np.float32) if r == 0 else None
    if r == comm.size - 1:
        out = np.empty(5, np.float32) if what == "shape" else np.empty(4, np.float64)
    else:
        out = np.empty(4, np.float32) if r % 2 == 0 else None
    try:
        comm.scatter(x, root=0, out=out)
    except mc.CommError as e:
        return type(e).__name__, str(e)
    return None, ""


@pytest.mark.parametrize("transport", ["inproc", "shm"])
@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_scatter_out_unlike_the_roots_block_is_a_mismatch_on_every_rank(transport, what):
    # the out= of a non-root names its block; one that disagrees with the root's is a named
    # error on every rank within the timeout, never a hang of the others
    out = mc.spawn(_scatter_wrong_out, 4, args=(what,), transport=transport, timeout=30)
    kinds = [k for k, _ in out]
    assert all(k in ("MismatchError", "PeerFailure") for k in kinds), out
    word = "count=5" if what == "shape" else "float64"
    assert any(k == "MismatchError" and word in t for k, t in out), out


def test_a_new_link_model_drops_the_scatter_calls_chosen_under_the_old_one():
    # scatter's header plans hold the call (algorithm, compiled plan) chosen under the link
    # model of their time; setting another model must make the next scatter choose again
    def fn(comm):
        x = np.ones((comm.size, 3)) if comm.rank == 0 else None
        comm.scatter(x, root=0)
        before = [h[0] for h in comm._scatter_headers.values()]
        comm.link_model = comm.link_model
        emptied = not comm._scatter_headers
        got = comm.scatter(x, root=0).tolist()
        after = [h[0] for h in comm._scatter_headers.values()]
        return emptied, len(before) == len(after) == 1 and before[0] is not after[0], got
    for emptied, rechosen, got in spawn(fn, 3):
        assert emptied and rechosen and got == [1.0, 1.0, 1.0]


def _repeated_calls(comm):
    """Every collective with a hot case (Communicator._fast, the one fast path) called again and
    again with one signature -- the first call validates it, the next ones take the hot case --
    with out= absent, given, and aliasing the input, 1-D and blocked inputs, a result only at the
    root, avg's scaling, scatter's non-roots with x=None; each result against numpy. Returns
    how often the hot case ran."""
    from collective_check import rank_input, reference
    from minicomm.communicator.buffers import MISS
    p, r = comm.size, comm.rank
    taken = []

    def spy(real):
        def spied(*a, **k):
            res = real(*a, **k)
            taken.append(res is not MISS)
            return res
        return spied
    comm._fast = spy(comm._fast)
    for dtype, op in ((np.float64, "sum"), (np.int32, "max"), (np.float32, "avg")):
        for coll, shape, root in (("broadcast", (7,), p - 1), ("reduce", (7,), p - 1),
                                  ("allgather", (5,), 0), ("gather", (2, 3), 1 % p),
                                  ("reduce_scatter", (p, 4), 0), ("alltoall", (p, 3), 0),
                                  ("scatter", (p, 2, 2), p - 1)):
            if op == "avg" and coll not in ("reduce", "reduce_scatter"):
                continue
            for rep in range(3):
                inputs = [rank_input(q, shape, dtype, salt=rep) for q in range(p)]
                want = reference(coll, p, r, inputs, op if coll in ("reduce", "reduce_scatter")
                                 else None, root)
                x = inputs[r].copy()
                for how in ("none", "given", "alias"):
                    out = None
                    if how != "none" and want is not None:
                        out = np.empty(want.shape, want.dtype)
                    if how == "alias":
                        if coll in ("broadcast", "alltoall"):
                            x = out = inputs[r].copy()
                        elif coll == "allgather":
                            out = np.empty((p,) + shape, dtype)
                            out[r] = inputs[r]
                            x = out[r]
                    kw = {"algorithm": "ring" if rep == 2 else "auto"}
                    if coll in ("broadcast", "reduce", "gather", "scatter"):
                        kw["root"] = root
                    if coll == "scatter" and r != root and rep == 1:
                        x = None              # ignored off the root: None is fine
                    if coll in ("reduce", "reduce_scatter"):
                        kw["op"] = op
                    got = getattr(comm, coll)(x, out=out, **kw)
                    if want is None:
                        assert got is None, (coll, how)
                        continue
                    if out is not None:
                        assert got is out, (coll, how)
                    if op == "avg":
                        assert np.allclose(got, want), (coll, how, got, want)
                    else:
                        assert got.shape == want.shape and got.dtype == want.dtype \
                            and np.array_equal(got, want), (coll, how, got, want)
    return sum(taken), len(taken)


@pytest.mark.parametrize("transport,p", [("inproc", 3), ("shm", 2), ("shm", 4)])
def test_repeated_calls_take_the_hot_case_and_agree_with_numpy(transport, p):
    for hot, calls in mc.spawn(_repeated_calls, p, transport=transport, timeout=120):
        assert calls > 0 and hot >= calls // 2, (hot, calls)   # most repeats: the hot case
