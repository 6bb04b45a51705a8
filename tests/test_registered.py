"""Registered buffers (``comm.empty`` / ``comm.register`` / ``comm.free``): every collective with
registered, plain and mixed buffers, in place, after free, over shm at n=2..4 (the messages
really take the registered path: the receivers count them) and over tcp and inproc (plain
arrays there), against an independent numpy reference."""
import glob

import numpy as np
import pytest

import minicomm as mc
from collective_check import BLOCKED, COLLS, rank_input, reference, run_call
from leaks import job_segments, my_worker_processes, nothing_left_behind  # noqa: F401

COUNT = 20001            # float64 blocks of 160 KB: above the 64 KiB ring chunk set below


@pytest.fixture(autouse=True)
def _small_chunk(monkeypatch):
    """A message from registered memory goes as a descriptor when it is larger than the ring's
    chunk (1 MiB by default); a 64 KiB chunk puts these 160 KB blocks above it, so the tests
    exercise the registered path without MiB-sized data (the ranks inherit the setting)."""
    monkeypatch.setenv("MINICOMM_SHM_CHUNK", str(64 << 10))


def _shm(comm):
    from minicomm.transports import registered_memory
    return registered_memory(comm.transport)


def _reg_names(comm):
    return glob.glob(f"/dev/shm/minicomm-{_shm(comm).job_id}-{_shm(comm).rank}-reg*")


def _case(comm, coll, make_in, make_out, inplace=False, dtype=np.float64, op="sum", root=0):
    p, r = comm.size, comm.rank
    shape = (p, COUNT) if coll in BLOCKED else (COUNT,)
    inputs = [rank_input(q, shape, dtype, salt=7) for q in range(p)]
    want = reference(coll, p, r, inputs, op if coll in ("allreduce", "reduce",
                                                       "reduce_scatter") else None, root)
    x = make_in(inputs[r])
    out = None
    if inplace and coll in ("allreduce", "broadcast", "alltoall"):
        out = x
    elif coll in ("allreduce", "broadcast", "alltoall", "allgather", "reduce_scatter") or (
            coll in ("reduce", "gather", "scatter") and (r == root or coll == "scatter")):
        out_shape = {"allgather": (p, COUNT), "gather": (p, COUNT), "reduce_scatter": (COUNT,),
                     "scatter": (COUNT,)}.get(coll, shape)
        out = make_out(out_shape, dtype)
    got = run_call(comm, coll, x, op, root, "auto", out=out)
    if want is None:
        assert got is None
    else:
        assert got.shape == want.shape and np.array_equal(got, want), (coll, r, inplace)
        if out is not None:
            assert got is out
    return 1


def _registered_everything(comm):
    reg_in = comm.register
    plain_in = np.array
    reg_out = comm.empty
    plain_out = np.empty
    n = 0
    for coll in COLLS:
        for mi, mo in ((reg_in, reg_out), (reg_in, plain_out), (plain_in, reg_out)):
            n += _case(comm, coll, mi, mo)
        if coll in ("allreduce", "broadcast", "alltoall"):
            n += _case(comm, coll, reg_in, reg_out, inplace=True)
    # in-place allgather: our block lies inside the registered output
    p, r = comm.size, comm.rank
    buf = comm.empty((p, COUNT), np.int32)
    buf[r] = r + 1
    comm.allgather(buf[r], out=buf)
    assert np.array_equal(buf, np.repeat(np.arange(1, p + 1)[:, None], COUNT, axis=1))
    # reducing calls too, and other dtypes / ops
    x = comm.register(np.full(COUNT, r + 1, dtype=np.int64))
    assert np.array_equal(comm.allreduce(x, op="max"), np.full(COUNT, p))
    return n, dict(_shm(comm).received_single_copy), len(_reg_names(comm)) > 0


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_collective_with_registered_plain_and_mixed_buffers_over_shm(p):
    res = mc.spawn(_registered_everything, p, transport="shm", timeout=180)
    for n, counts, named in res:
        assert n == res[0][0] > 0
        assert counts["registered"] > 0, counts       # the registered path carried messages
        assert named                                  # registered names live while registered


def _after_free(comm):
    p, r = comm.size, comm.rank
    x = comm.empty(COUNT, np.float64)
    out = comm.empty((p, COUNT), np.float64)
    assert comm.is_registered(x) and comm.is_registered(out) and not comm.is_registered(
        np.empty(3))
    assert comm.register(x) is x                              # already registered: itself
    x[:] = r
    before = len(_reg_names(comm))
    comm.allgather(x, out=out)
    got1 = out.copy()
    t = _shm(comm)
    seen = t.received_single_copy["registered"]
    comm.free(x)
    comm.free(out)
    assert len(_reg_names(comm)) == before - 2                # the names are gone
    assert not comm.is_registered(x)
    with pytest.raises(ValueError, match="not registered"):
        comm.free(x)
    with pytest.raises(ValueError, match="not registered"):
        comm.free(np.empty(5))
    x[:] = r + 10                                             # still valid memory, now plain
    comm.allgather(x, out=out)
    want = np.repeat(np.arange(p, dtype=np.float64)[:, None], COUNT, axis=1)
    assert np.array_equal(got1, want) and np.array_equal(out, want + 10)
    comm.barrier()
    assert t.received_single_copy["registered"] == seen      # no registered copies after free
    # register copies values, shapes and dtypes of a plain array
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    ra = comm.register(a)
    assert ra is not a and ra.dtype == a.dtype and np.array_equal(ra, a) and comm.is_registered(ra)
    with pytest.raises(TypeError):
        comm.empty(4, dtype=object)
    return True


def test_free_ends_the_registration_and_the_array_stays_usable():
    assert mc.spawn(_after_free, 3, transport="shm", timeout=60) == [True] * 3


def _plain_elsewhere(comm):
    x = comm.empty((comm.size, 1000), np.float32)
    assert type(x) is np.ndarray and not comm.is_registered(x)
    x[:] = comm.rank
    y = comm.alltoall(x)
    assert np.array_equal(y, np.repeat(np.arange(comm.size, dtype=np.float32)[:, None], 1000, 1))
    r = comm.register(np.arange(5.0))
    assert np.array_equal(comm.allreduce(r), np.arange(5.0) * comm.size)
    comm.free(r)                                              # a no-op where nothing is shared
    return True


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
def test_registration_is_plain_arrays_where_peers_cannot_map(transport):
    assert mc.spawn(_plain_elsewhere, 3, transport=transport, timeout=60) == [True] * 3


def test_registered_buffers_across_emulated_nodes_shm_and_tcp():
    # auto with 2 nodes: shm inside a node (registered path), tcp between (plain)
    res = mc.spawn(_registered_everything, 4, transport="auto", nodes=2, timeout=180)
    assert all(n == res[0][0] for n, _, _ in res)
