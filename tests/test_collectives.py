"""Every collective x every algorithm x world sizes 1..16 x counts x dtypes x ops x roots x
in/out of place, with ranks as threads (inproc), against an independent numpy reference."""
import numpy as np
import pytest

import minicomm as mc
from collective_check import matrix

ALGORITHMS = ["ring", "tree", "rhd", "hier", "auto"]
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16]


def _run_matrix(comm, algorithm):
    p = comm.size
    small = p <= 8
    return matrix(comm, algorithm, counts=(0, 1, 7, 2 * p + 1) if small else (1, 2 * p + 1),
                  dtypes=("int32", "float64", "bool") if small else ("int64", "float32"),
                  all_roots=small, every_op=small)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("p", SIZES)
def test_matrix_inproc(p, algorithm):
    nodes = 1 if p < 3 else (2 if p % 2 == 0 else 3)   # hier crosses real node boundaries
    checks = mc.spawn(_run_matrix, p, args=(algorithm,), transport="inproc", nodes=nodes, timeout=120)
    assert len(checks) == p and all(c == checks[0] and c > 0 for c in checks)


def _every_dtype(comm):
    n = 0
    for dt in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
               np.float16, np.float32, np.float64, np.complex64, np.complex128, np.bool_):
        x = (np.arange(5) % 2 + comm.rank).astype(dt)
        want = (np.arange(5) % 2 * comm.size + sum(range(comm.size))).astype(dt)
        if np.dtype(dt).kind == "b":
            want = np.logical_or.reduce([(np.arange(5) % 2 + r).astype(bool) for r in range(comm.size)])
        got = comm.allreduce(x)
        assert got.dtype == np.dtype(dt) and np.array_equal(got, want), (dt, got, want)
        n += 1
    return n


def test_every_numeric_dtype():
    assert mc.spawn(_every_dtype, 3, transport="inproc") == [14, 14, 14]


def test_multidimensional_shapes_and_noncontiguous_input():
    def fn(comm):
        x = np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::2, :] + comm.rank   # not contiguous
        y = comm.allreduce(x, algorithm="rhd")
        assert y.shape == (2, 2, 4)
        np.testing.assert_array_equal(y, np.arange(24.0).reshape(2, 3, 4)[:, ::2, :] * comm.size
                                      + sum(range(comm.size)))
        g = comm.allgather(x[0])
        assert g.shape == (comm.size, 2, 4)
        return True
    assert all(mc.spawn(fn, 4, transport="inproc"))


@pytest.mark.parametrize("channels", [2, 4])
@pytest.mark.parametrize("transport,p,nodes", [("shm", 2, 1), ("shm", 4, 2), ("tcp", 3, 1),
                                               ("tcp", 4, 2)])
def test_channelled_ring_and_tree_matrix(transport, p, nodes, channels, monkeypatch):
    monkeypatch.setenv("MINICOMM_CHANNELS", str(channels))
    checks = mc.spawn(_run_channel_matrix, p, args=(channels,), transport=transport, nodes=nodes,
                      timeout=120)
    assert len(checks) == p and all(c == checks[0] and c > 0 for c in checks)


def _run_channel_matrix(comm, channels):
    """The ring matrix, the tree matrix (its allreduce is the double binary tree on
    ``channels``), and a tree allreduce long enough to be cut into several chunks per channel."""
    from minicomm.algorithms import tree
    assert comm.channels == channels
    n = matrix(comm, "ring", counts=(0, 1, 7, 2 * comm.size + 1, 1000),
               dtypes=("int32", "float64"), all_roots=False, every_op=False)
    n += matrix(comm, "tree", counts=(0, 1, 7, 2 * comm.size + 1),
                dtypes=("int32", "float64"), all_roots=False, every_op=False)
    count = 3 * tree.TREE_MIN_CHUNK * channels + 5
    for dtype, op, ref in (("int32", "max", np.maximum.reduce), ("float64", "sum", sum)):
        xs = [(np.arange(count) * (r + 1) % 97).astype(dtype) for r in range(comm.size)]
        got = comm.allreduce(xs[comm.rank], op=op, algorithm="tree")
        np.testing.assert_array_equal(got, ref(xs))
        n += 1
    return n
