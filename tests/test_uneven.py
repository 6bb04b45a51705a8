"""Uneven blocks and prefix reductions (allgatherv, gatherv, scatterv, alltoallv,
reduce_scatter with counts, scan, exscan): every call against an independent numpy reference,
in every rank, over inproc, shm and tcp, with random counts (zeros included)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minicomm as mc
from collective_check import REFERENCE_UFUNC, ops_for, rank_input
from leaks import nothing_left_behind  # noqa: F401
from minicomm.errors import MismatchError

FAMILIES = ("ring", "tree", "rhd", "hier", "auto")


def _counts(rng, p):
    return [int(v) for v in rng.choice([0, 0, 1, 2, 3, 7], size=p)]


def _check_all(comm, seed, dtype, families=FAMILIES):
    """Every call of every family on this rank, against numpy; returns the number checked."""
    p, r = comm.size, comm.rank
    rng = np.random.default_rng(seed)             # the same draws on every rank
    counts = _counts(rng, p)
    matrix = [_counts(rng, p) for _ in range(p)]
    width = int(rng.integers(1, 3))
    root = int(rng.integers(0, p))
    ops = ops_for(dtype)
    op = ops[int(rng.integers(0, len(ops)))]
    rows = [rank_input(q, (counts[q], width), dtype, salt=seed % 7) for q in range(p)]
    full = [rank_input(q, (sum(counts), width), dtype, salt=q) for q in range(p)]
    sends = [rank_input(q, (sum(matrix[q]), width), dtype, salt=3) for q in range(p)]
    vec = [rank_input(q, (5,), dtype, salt=seed % 5) for q in range(p)]
    red = REFERENCE_UFUNC[op]
    n = 0

    def same(got, want, what):
        nonlocal n
        n += 1
        if want is None:
            assert got is None, what
            return
        assert got is not None and got.shape == want.shape and got.dtype == want.dtype, \
            (what, got, want)
        if op == "avg" and "scan" in what or op == "avg" and "reduce_scatter" in what:
            assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (what, got, want)
        else:
            assert np.array_equal(got, want), (what, got, want)

    offs = np.concatenate([[0], np.cumsum(counts)])
    for fam in families:
        cat = np.concatenate(rows)
        same(comm.allgatherv(rows[r], algorithm=fam), cat, f"allgatherv {fam}")
        same(comm.allgatherv(rows[r], counts=counts, algorithm=fam), cat, f"allgatherv+c {fam}")
        same(comm.gatherv(rows[r], root=root, algorithm=fam), cat if r == root else None,
             f"gatherv {fam}")
        same(comm.scatterv(full[root] if r == root else None,
                           counts if r == root else None, root=root, algorithm=fam),
             full[root][offs[r]:offs[r + 1]], f"scatterv {fam}")
        got, rc = comm.alltoallv(sends[r], matrix[r], return_counts=True, algorithm=fam)
        col = [matrix[q][r] for q in range(p)]
        want = np.concatenate([sends[q][sum(matrix[q][:r]):sum(matrix[q][:r + 1])]
                               for q in range(p)])
        same(got, want, f"alltoallv {fam}")
        assert rc == col
        summed = red.reduce(np.stack(full), axis=0, dtype=full[0].dtype)
        if op == "avg":
            summed = (summed / p).astype(summed.dtype)
        same(comm.reduce_scatter(full[r], op=op, counts=counts, algorithm=fam),
             summed[offs[r]:offs[r + 1]], f"reduce_scatter counts {fam} {op}")
        prefix = red.accumulate(np.stack(vec), axis=0, dtype=vec[0].dtype)
        if op == "avg":
            prefix = (prefix / np.arange(1, p + 1)[:, None]).astype(prefix.dtype)
        same(comm.scan(vec[r], op=op, algorithm=fam), prefix[r], f"scan {fam} {op}")
        if r == 0:
            same(comm.exscan(vec[r], op=op, algorithm=fam), None, f"exscan {fam}")
        else:
            ex = red.accumulate(np.stack(vec[:r]), axis=0, dtype=vec[0].dtype)[-1]
            if op == "avg":
                ex = (ex / r).astype(ex.dtype)
            same(comm.exscan(vec[r], op=op, algorithm=fam), ex, f"exscan {fam} {op}")
    # recv_counts given: no exchange, a pairwise family
    got = comm.alltoallv(sends[r], matrix[r], recv_counts=[matrix[q][r] for q in range(p)])
    same(got, np.concatenate([sends[q][sum(matrix[q][:r]):sum(matrix[q][:r + 1])]
                              for q in range(p)]), "alltoallv recv_counts")
    return n


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.integers(1, 5), seed=st.integers(0, 10 ** 6),
       dtype=st.sampled_from(["int32", "float64", "bool", "float32", "uint8"]))
def test_inproc_against_numpy(p, seed, dtype):
    n = mc.spawn(_check_all, p, args=(seed, dtype), transport="inproc", nodes=min(2, p))
    assert n[0] > 30


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.integers(1, 5), seed=st.integers(0, 10 ** 6))
def test_processes_against_numpy(transport, p, seed):
    n = mc.spawn(_check_all, p, args=(seed, "int64"), transport=transport, nodes=min(2, p),
                 timeout=60)
    assert n[0] > 30


def test_counts_that_disagree_with_the_data_fail_every_rank():
    def f(comm):
        x = np.ones((comm.rank + 1, 2))
        wrong = [1, 1, 1]                    # rank 1 has 2 rows, rank 2 has 3
        with pytest.raises(mc.CommError) as e:
            comm.allgatherv(x, counts=wrong)
        return type(e.value).__name__, str(e.value)
    res = mc.spawn(f, 3, transport="shm", timeout=20)
    assert all(name == "MismatchError" for name, _ in res), res
    assert any("counts[1] = 1 but this rank's x has 2 rows" in msg for _, msg in res)


def test_rows_of_different_shapes_are_a_mismatch_on_every_rank():
    def f(comm):
        x = np.ones((2, 3 if comm.rank == 0 else 4))
        with pytest.raises(MismatchError, match="share row shape and dtype"):
            comm.allgatherv(x)
        return True
    assert mc.spawn(f, 2, transport="inproc") == [True, True]


def test_bad_arguments_are_named_before_any_message():
    def f(comm):
        with pytest.raises(ValueError, match="root must pass counts"):
            comm.scatterv(np.ones(3), None, root=comm.rank)
        with pytest.raises(ValueError, match="2 non-negative ints"):
            comm.allgatherv(np.ones(2), counts=[1, -1])
        with pytest.raises(ValueError, match="send_counts add up to 3"):
            comm.alltoallv(np.ones(2), [1, 2])
        with pytest.raises(ValueError, match="counts add up to 3"):
            comm.reduce_scatter(np.ones(4), counts=[1, 2])
        return comm.allgatherv(np.ones(1)).tolist()      # still whole
    assert mc.spawn(f, 2, transport="inproc") == [[1.0, 1.0]] * 2


def test_async_and_out():
    def f(comm):
        out = np.empty(3)
        w = comm.allgatherv(np.full(comm.rank + 1, float(comm.rank)), out=out, async_op=True)
        assert w.wait() is out
        return out.tolist()
    assert mc.spawn(f, 2, transport="inproc") == [[0.0, 1.0, 1.0]] * 2


# ------------------------------------------------------------------ priced and benchmarked
def test_skewed_counts_sum_and_favour_the_same_ranks():
    from minicomm.sim.engine import skewed_counts
    row = skewed_counts("allgatherv", 1 << 20, 8, skew=1.0)
    assert sum(row) == (1 << 20) // 4 and len(row) == 8
    assert max(row) / (sum(row) / 8) == pytest.approx(8 / sum(1 / k for k in range(1, 9)),
                                                       rel=0.01)
    assert skewed_counts("allgatherv", 4096, 8, skew=0.0) == (128,) * 8
    m = skewed_counts("alltoallv", 1 << 20, 4, skew=2.0)
    assert len(m) == 16 and m[:4] == m[4:8] == m[8:12] == m[12:]


def test_the_simulator_prices_a_skewed_alltoallv_by_its_hottest_destination():
    """A hot expert's rank receives most: the call takes at least that rank's bytes over its
    link, and a skew of 0 is faster."""
    from minicomm.sim import presets
    from minicomm.sim.engine import simulate, skewed_counts
    topo = presets.get_topology("dgx-h100", nodes=2)
    p = topo.endpoints
    hot = skewed_counts("alltoallv", 64 << 20, p, skew=1.0)
    even = skewed_counts("alltoallv", 64 << 20, p, skew=0.0)
    r_hot = simulate("alltoallv", "ring", topo, counts=hot)
    r_even = simulate("alltoallv", "ring", topo, counts=even)
    column = max(sum(hot[i * p + j] for i in range(p)) for j in range(p)) * 4
    nic = topo.nic_link.bandwidth
    assert r_hot.time_s >= column / 2 / nic        # at least half of it crosses the NICs
    assert r_hot.time_s > 2 * r_even.time_s


def test_minicomm_sim_takes_the_uneven_collectives():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "sim", "--topology", "dgx-h100",
                          "--nodes", "2", "--collective", "alltoallv", "--sizes", "1M",
                          "--algorithms", "ring,rhd", "--skew", "1.5", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    import json
    rows = json.loads(out.stdout)
    assert {r["algorithm"] for r in rows} == {"ring", "rhd"}
    assert all(r["time_s"] > 0 and r["collective"] == "alltoallv" for r in rows)


def test_the_bench_runs_the_uneven_collectives_and_checks_them(tmp_path):
    import json
    import subprocess
    import sys
    path = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "bench", "allgatherv,alltoallv",
                          "--sizes", "64K", "-n", "2", "--transport", "shm", "--algorithms",
                          "ring,tree", "--batches", "1", "--iters", "3", "--json", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(path.read_text())["rows"]
    seen = {(r["collective"], r["algo"]) for r in rows if r["time_us"] and r["ip_time_us"] is None}
    assert {("allgatherv", "ring"), ("allgatherv", "tree"), ("alltoallv", "ring"),
            ("alltoallv", "tree")} <= seen, rows
    assert all(r["wrong"] == 0 for r in rows)


@pytest.mark.parametrize("transport", ["rdma", "ub"])
def test_the_one_sided_transports_too(transport):
    n = mc.spawn(_check_all, 3, args=(11, "float64", ("ring", "rhd", "auto")),
                 transport=transport, nodes=3, timeout=60)
    assert n[0] > 20


def test_small_uneven_calls_take_the_small_path_on_shm():
    def f(comm):
        counts = (1, 0, 2)
        el = tuple(counts)
        c = comm._prepare("allgatherv", "none", "ring", np.dtype("float32"), sum(el), 0, el)
        got = comm.allgatherv(np.full(counts[comm.rank], comm.rank, dtype=np.float32),
                              counts=counts)
        return c.small is not None, got.tolist()
    res = mc.spawn(f, 3, transport="shm")
    assert all(small for small, _ in res)
    assert all(got == [0.0, 2.0, 2.0] for _, got in res)
