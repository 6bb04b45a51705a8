"""`minicomm bench`: results checked (#wrong == 0), outputs parse, busbw factors, peers.

Not timed: the benchmark is run briefly to prove it works and checks results; speed is what the
benchmark itself reports.
"""
import csv
import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from extras import module_missing, require
from minicomm.tools import bench, benchspec, peers
from minicomm.tools.benchspec import (
    COLLECTIVES,
    BenchConfig,
    BenchError,
    Buffers,
    Case,
    busbw_factor,
    expected_result,
    make_cases,
    parse_size,
    size_steps,
)

QUICK = dict(iters=2, warmup=1, batches=2)


def _cli(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "minicomm.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _all_wrong(rows):
    return sum((r.get("wrong") or 0) + (r.get("ip_wrong") or 0) for r in rows)


# ---------------------------------------------------------------------------- units
@pytest.mark.parametrize("coll,n,factor", [
    ("allreduce", 2, 1.0), ("allreduce", 4, 1.5), ("allreduce", 1, 0.0),
    ("reduce_scatter", 4, 0.75), ("allgather", 8, 7 / 8), ("alltoall", 4, 0.75),
    ("gather", 4, 0.75), ("scatter", 2, 0.5), ("broadcast", 4, 1.0), ("reduce", 16, 1.0),
    ("barrier", 4, 0.0)])
def test_busbw_factors_are_nccl_tests(coll, n, factor):
    assert busbw_factor(coll, n) == pytest.approx(factor)


def test_busbw_factor_rejects_unknown():
    with pytest.raises(ValueError):
        busbw_factor("allscatter", 2)


def test_sizes_parse_and_step_like_nccl_tests():
    assert parse_size("8") == 8 and parse_size("4K") == 4096 and parse_size("64M") == 64 << 20
    assert parse_size("1g") == 1 << 30 and parse_size("2KB") == 2048
    with pytest.raises(ValueError):
        parse_size("lots")
    assert size_steps(8, 64 << 20, 4)[-1] == 32 << 20
    assert size_steps(8, 128, 2) == [8, 16, 32, 64, 128]
    assert size_steps(100, 400, step=100) == [100, 200, 300, 400]


def test_cases_round_to_whole_blocks():
    # 8 bytes of float32 over 4 ranks is half an element per block: one element per block
    (c,) = make_cases("allgather", [8], 4, "float32")
    assert (c.count, c.size, c.in_count, c.out_count) == (1, 16, 1, 4)
    cs = make_cases("reduce_scatter", [8, 16, 1024], 4, "float32")
    assert [x.count for x in cs] == [1, 64] and cs[1].size == 1024 and cs[1].in_count == 256
    assert [x.count for x in make_cases("allreduce", [0, 8, 10], 2, "float32")] == [0, 2]
    assert make_cases("barrier", [8, 1024], 2, "float32") == [Case("barrier", 2, 0, "float32")]


def _reference(case, op, root, inputs):
    """The collective's meaning, spelled out with numpy over every rank's input."""
    n, c = case.n, case.count
    fold = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
            "max": np.maximum, "bxor": np.bitwise_xor}[op]
    red = fold.reduce(np.stack(inputs), axis=0, dtype=inputs[0].dtype)
    if op == "avg":
        red /= n
    out = {}
    for r in range(n):
        coll = case.collective
        if coll in ("allreduce",) or (coll == "reduce" and r == root):
            out[r] = red
        elif coll == "reduce_scatter":
            out[r] = red[r * c:(r + 1) * c]
        elif coll == "broadcast":
            out[r] = inputs[root]
        elif coll == "scatter":
            out[r] = inputs[root][r * c:(r + 1) * c]
        elif coll == "allgather" or (coll == "gather" and r == root):
            out[r] = np.concatenate(inputs)
        elif coll == "alltoall":
            out[r] = np.concatenate([inputs[j][r * c:(r + 1) * c] for j in range(n)])
        else:
            out[r] = None
    return out


@pytest.mark.parametrize("coll", [c for c in COLLECTIVES if c != "barrier"])
@pytest.mark.parametrize("n,op,dtype", [(1, "sum", "float32"), (3, "sum", "float32"),
                                        (4, "prod", "float64"), (5, "max", "int32"),
                                        (3, "avg", "float32"), (4, "bxor", "uint8")])
def test_closed_form_expected_values_match_the_definition(coll, n, op, dtype):
    case = Case(coll, n, 300, dtype)          # 300 > PERIOD: the pattern wraps inside a block
    root = n - 1
    inputs = [Buffers(case, op, r, root).send.copy() for r in range(n)]
    ref = _reference(case, op, root, inputs)
    for r in range(n):
        got = expected_result(case, op, r, root)
        if ref[r] is None:
            assert got is None
        else:
            np.testing.assert_array_equal(got, ref[r])


def test_batches_are_sized_by_a_timed_block_not_by_slow_warm_up_calls(monkeypatch):
    """A call whose warm-up took 100x its steady time (1 ms against 10 us: the first calls
    after a barrier where ranks share cores) still gets batches of about batch_time: the
    iterations come from timed blocks of back-to-back calls (a quarter batch, resized while it
    came out under an eighth), where the warm-up estimate alone gave 5 calls of 10 us for a
    5 ms batch."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def op():
        clock[0] += 10e-6

    class One:                        # a one-rank world: the agreed maximum is one's own
        def allreduce(self, values, op, algorithm):
            assert op == "max"
            return np.asarray(values)
    call = benchspec.Call(op, lambda: None, None)
    cfg = BenchConfig(collectives=["allreduce"], sizes=[8], batch_time=0.005, max_iters=1000)
    assert bench.batch_iters(One(), cfg, call, est=1e-3) == 500
    assert bench.batch_iters(One(), cfg, call, est=10e-6) == 500
    assert bench.batch_iters(One(), dataclasses.replace(cfg, max_iters=100), call, 1e-3) == 100
    assert math.ceil(cfg.batch_time / 1e-3) == 5              # the old sizing, for the record


# ---------------------------------------------------------------------------- runs
def test_in_place_calls_pass_the_input_array_itself_as_out():
    """An in-place call is ``out=x`` with the very array, as users write it (a second view of
    the same memory would cost the communicator its overlap check: 1.7-3 us of an 8 B call);
    only where the output is part of the buffer (a block of it) is it a view."""
    from minicomm.tools.benchspec import Buffers, Case

    class Recorder:
        size, rank = 2, 0

        def __getattr__(self, name):
            def call(*args, **kw):
                self.seen = (name, args, kw)
            return call

        def barrier(self, algorithm=None):
            pass

    for coll, same in (("allreduce", True), ("broadcast", True), ("reduce", True),
                       ("allgather", False), ("reduce_scatter", False), ("alltoall", True)):
        comm = Recorder()
        b = Buffers(Case(coll, 2, 4, "float32"), "sum", 0, 0)
        bench.MinicommRunner(comm, "ring").prepare(b, True, "sum", 0).op()
        name, args, kw = comm.seen
        out = kw["out"]
        if coll == "alltoall":
            assert out.base is b.ip or out.base is b.ip.base, coll      # the same buffer, 2-D
        elif same:
            assert out is b.ip and args[0] is b.ip, coll
        else:
            assert out is not b.ip and np.shares_memory(out, b.ip), coll


def test_every_collective_and_algorithm_checks_clean_inproc():
    cfg = BenchConfig(collectives=list(COLLECTIVES), sizes=[8, 1000], nranks=3,
                      transport="inproc", algorithms=["ring", "rhd", "tree", "hier", "auto"],
                      root=1, quiet=True, **QUICK)
    rows = bench.run(cfg)
    assert len(rows) == (len(COLLECTIVES) - 1) * 2 * 5 + 5      # barrier: one size
    assert _all_wrong(rows) == 0
    for r in rows:
        assert r["time_us"] > 0 and r["wrong"] == 0
        if r["collective"] != "barrier":
            assert r["ip_time_us"] > 0 and r["ip_wrong"] == 0
            assert r["busbw"] == pytest.approx(r["algbw"] * busbw_factor(r["collective"], 3))
        assert r["root"] == (1 if r["collective"] in benchspec.ROOTED else -1)
    auto = [r["algo"] for r in rows if r["algo"].startswith("auto")]
    assert all(a.split(">")[1] in ("ring", "rhd", "tree", "hier") for a in auto)


def test_wrong_results_are_counted(monkeypatch):
    """Negative control: a library whose result is off by one element on every rank."""
    real = bench.MinicommRunner.prepare

    def corrupt(self, b, inplace, op, root):
        call = real(self, b, inplace, op, root)
        inner = call.op

        def op_then_spoil():
            inner()
            call.result[0] += 1
        return benchspec.Call(op_then_spoil, call.barrier, call.result)
    monkeypatch.setattr(bench.MinicommRunner, "prepare", corrupt)
    rows = bench.run(BenchConfig(collectives=["allreduce"], sizes=[64], nranks=2,
                                 transport="inproc", quiet=True, **QUICK))
    assert rows[0]["wrong"] == 2 and rows[0]["ip_wrong"] == 2


def test_cli_processes_over_shm_write_csv_and_json(tmp_path):
    c, j = tmp_path / "out.csv", tmp_path / "out.json"
    p = _cli("bench", "allreduce,alltoall,broadcast", "-b", "8", "-e", "64K", "-f", "64", "-n",
             "2", "--transport", "shm", "--algorithms", "ring,auto", "--iters", "2",
             "--warmup", "1", "--batches", "2", "--csv", str(c), "--json", str(j))
    assert p.returncode == 0, p.stderr
    assert "# Out of bounds values : 0 OK" in p.stdout
    assert "#wrong" in p.stdout and "busbw" in p.stdout and "in-place" in p.stdout
    with open(c) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 3 * 2
    assert all(r["wrong"] == "0" and r["ip_wrong"] == "0" for r in rows)
    assert {r["size"] for r in rows if r["collective"] == "allreduce"} == {"8", "512", "32768"}
    doc = json.loads(j.read_text())
    assert doc["meta"]["nranks"] == 2 and doc["meta"]["transport"] == "shm"
    assert len(doc["rows"]) == len(rows)
    assert all(len(r["batches_us"]) == 2 for r in doc["rows"])


def test_cli_inside_minicomm_run():
    p = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "2", "--",
                        "-m", "minicomm.cli", "bench", "reduce_scatter", "--sizes", "1K,8",
                        "--iters", "1", "--warmup", "1", "--batches", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[0] # Out of bounds values : 0 OK" in p.stdout
    assert "[1]" not in p.stdout            # only rank 0 reports


def test_bad_options_exit_cleanly():
    p = _cli("bench", "allscatter")
    assert p.returncode == 2 and "unknown collective" in p.stderr
    p = _cli("bench", "allreduce", "-o", "bxor")
    assert p.returncode == 2 and "integer dtype" in p.stderr


def test_tune_writes_the_table_auto_follows(tmp_path):
    from minicomm import tuning
    path = tmp_path / "tune-test.json"
    cfg = BenchConfig(collectives=["allreduce", "allgather"], sizes=[8, 4096], nranks=2,
                      transport="inproc", algorithms=["ring", "rhd", "auto"], batches=1,
                      batch_time=0.001, quiet=True)
    assert bench.tune(cfg, str(path)) == str(path)
    entries = tuning.load_table(str(path))
    # sizes are the bytes the call passes: allgather's 4096-byte output is 2048 per rank
    assert sorted((e["collective"], e["bytes"]) for e in entries) == [
        ("allgather", 4), ("allgather", 2048), ("allreduce", 8), ("allreduce", 4096)]
    for e in entries:
        assert set(e["seconds"]) == {"ring", "rhd"} and e["best"] in ("ring", "rhd")
        assert e["world"] == 2


def test_tune_refuses_benchmark_outputs():
    p = _cli("bench", "--tune", "--csv", "x.csv")
    assert p.returncode == 2 and "--tune writes the tuning table only" in p.stderr


def test_plot(tmp_path):
    require(module_missing("matplotlib", "plot"))
    rows = bench.run(BenchConfig(collectives=["allreduce", "barrier"], sizes=[8, 4096],
                                 nranks=2, transport="inproc", algorithms=["ring", "auto"],
                                 quiet=True, **QUICK))
    out = tmp_path / "busbw.png"
    bench.plot(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- peers
def test_missing_peer_is_a_clean_error(monkeypatch):
    monkeypatch.setattr(benchspec, "gloo_available", lambda: "torch is not installed")
    cfg = BenchConfig(collectives=["allreduce"], sizes=[8], peers=["gloo"])
    with pytest.raises(BenchError, match="torch is not installed"):
        cfg.validate()
    monkeypatch.setattr(benchspec, "mpi_available", lambda: None)
    with pytest.raises(BenchError, match="no 'avg' reduction"):
        BenchConfig(collectives=["allreduce"], sizes=[8], peers=["mpi"], op="avg").validate()


def test_peer_mpi_side_by_side():
    require(peers.mpi_available())
    rows = bench.run(BenchConfig(collectives=["allreduce", "reduce_scatter", "scatter"],
                                 sizes=[4096], nranks=2, transport="shm", peers=["mpi"],
                                 root=1, quiet=True, **QUICK))
    assert [r["library"] for r in rows] == ["minicomm", "mpi"] * 3
    assert _all_wrong(rows) == 0
    for r in rows[1::2]:
        assert r["ratio"] > 0 and r["ip_ratio"] > 0 and r["transport"] == "mpich"


def test_peer_gloo_side_by_side():
    require(peers.gloo_available())
    rows = bench.run(BenchConfig(collectives=["allgather", "alltoall", "gather"], sizes=[4096],
                                 nranks=2, transport="shm", peers=["gloo"], quiet=True, **QUICK))
    assert [r["library"] for r in rows] == ["minicomm", "gloo"] * 3
    assert _all_wrong(rows) == 0
    a2a = rows[3]
    assert a2a["ratio"] > 0 and a2a["ip_time_us"] is None       # gloo has no in-place alltoall


def test_registered_buffers_over_shm_check_clean(tmp_path):
    """--registered: every collective on buffers from comm.empty (256 KiB: above the size that
    travels straight from registered memory), results checked element by element."""
    j = tmp_path / "reg.json"
    p = _cli("bench", "all", "--sizes", "8,256K", "-n", "3", "--transport", "shm",
             "--registered", "--iters", "2", "--warmup", "2", "--batches", "1", "--json", str(j))
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(j.read_text())
    assert data["meta"]["registered"] is True
    rows = data["rows"]
    assert {r["collective"] for r in rows} == set(COLLECTIVES)
    assert _all_wrong(rows) == 0 and all(r["wrong"] == 0 for r in rows)


# ---------------------------------------------------------------------------- --persistent, --group
def _same_argument(x, y) -> bool:
    """Two call arguments are the same: arrays the same view of the same memory (not a copy),
    lists item by item, anything else equal."""
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.shape == y.shape and x.dtype == y.dtype \
            and x.__array_interface__["data"] == y.__array_interface__["data"]
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) \
            and all(map(_same_argument, x, y))
    return x is y or x == y


def test_persistent_requests_are_made_from_the_plain_calls_arguments():
    """--persistent makes ``comm.<collective>_init`` with exactly what the plain call passes
    (the same arrays, the same keywords), once; the timed call is start() + wait()."""
    class Request:
        def __init__(self):
            self.log = []

        def start(self):
            self.log.append("start")

        def wait(self):
            self.log.append("wait")

        def free(self):
            self.log.append("free")

    class Recorder:
        size, rank = 2, 0

        def __init__(self):
            self.seen = []

        def __getattr__(self, name):
            def call(*args, **kw):
                self.seen.append((name, args, kw))
                return Request() if name.endswith("_init") else None
            return call

    for coll in benchspec.BENCHED:
        case = make_cases(coll, [64], 2, "float32")[0]
        for inplace in ((False,) if coll in benchspec.UNEVEN + ("barrier",) else (False, True)):
            b = Buffers(case, "sum", 0, 0)
            comm = Recorder()
            runner = bench.MinicommRunner(comm, "ring")
            runner.prepare(b, inplace, "sum", 0).op()
            call = runner.prepare_persistent(b, inplace, "sum", 0)
            (plain, pargs, pkw), (init, iargs, ikw) = comm.seen
            assert init == plain + "_init" == coll + "_init", (coll, inplace)
            assert len(iargs) == len(pargs) and ikw.keys() == pkw.keys()
            assert _same_argument(list(pargs) + list(pkw.values()),
                                  list(iargs) + list(ikw.values())), (coll, inplace)
            assert len(comm.seen) == 2                  # made at prepare, not per call
            call.op()
            call.op()
            call.free()
            assert len(comm.seen) == 2


def test_persistent_rows_time_requests_and_check_clean_inproc(monkeypatch):
    from minicomm.communicator import persistent
    starts = []
    real = persistent.Request.start

    def counted(self):
        starts.append(self.description)
        return real(self)
    monkeypatch.setattr(persistent.Request, "start", counted)
    rows = bench.run(BenchConfig(collectives=["allreduce", "broadcast", "reduce_scatter",
                                              "barrier", "alltoallv"],
                                 sizes=[8, 1000], nranks=3, transport="inproc", root=1,
                                 algorithms=["ring", "auto"], persistent=True, quiet=True,
                                 **QUICK))
    assert len(rows) == 4 * 2 * 2 + 2
    assert _all_wrong(rows) == 0 and all(r["wrong"] == 0 for r in rows)
    assert all(r["mode"] == "persistent" and r["time_us"] > 0 for r in rows)
    # 3 ranks x 2 algorithms x (warm-up 1 + 2 batches x 2 iters + check 1) per placement and
    # size: 3 collectives x 2 placements x 2 sizes, barrier once, alltoallv out of place only
    assert len(starts) == 3 * 2 * 6 * (3 * 2 * 2 + 1 + 2)
    assert {s.split("_init")[0] for s in starts} == {"allreduce", "broadcast", "reduce_scatter",
                                                    "barrier", "alltoallv"}


def test_group_times_k_calls_and_checks_every_result_inproc():
    rows = bench.run(BenchConfig(collectives=["allreduce", "allgather", "reduce", "alltoall"],
                                 sizes=[8, 4096], nranks=3, transport="inproc", root=2,
                                 algorithms=["rhd", "auto"], group=4, quiet=True, **QUICK))
    assert len(rows) == 4 * 2 * 2
    assert _all_wrong(rows) == 0
    for r in rows:
        assert r["mode"] == "group" and r["group"] == 4 and r["time_us"] > 0
        # algbw counts the group's 4 buffers
        assert r["algbw"] == pytest.approx(4 * r["size"] / r["time_us"] / 1e3)


def test_group_counts_a_wrong_result_in_any_of_its_calls(monkeypatch):
    """Negative control: the last of the group's 4 results is off by one element per rank."""
    real = bench.MinicommRunner.prepare_group

    def corrupt(self, bufs, inplace, op, root):
        call = real(self, bufs, inplace, op, root)
        inner = call.op

        def op_then_spoil():
            inner()
            call.results[-1][0] += 1
        return benchspec.Call(op_then_spoil, call.barrier, call.result, results=call.results)
    monkeypatch.setattr(bench.MinicommRunner, "prepare_group", corrupt)
    rows = bench.run(BenchConfig(collectives=["allreduce"], sizes=[64], nranks=2,
                                 transport="inproc", group=4, quiet=True, **QUICK))
    assert rows[0]["wrong"] == 2 and rows[0]["ip_wrong"] == 2


def test_group_cli_over_shm_says_times_are_per_group(tmp_path):
    c = tmp_path / "group.csv"
    p = _cli("bench", "allreduce,broadcast", "--sizes", "8,4K", "-n", "2", "--transport", "shm",
             "--group", "4", "--iters", "2", "--warmup", "1", "--batches", "2", "--csv", str(c))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "(per group of 4 calls)" in p.stdout and "(us/grp)" in p.stdout
    assert "# Out of bounds values : 0 OK" in p.stdout and "FAILED" not in p.stdout
    with open(c) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["mode"] == "group" and r["group"] == "4" for r in rows)
    assert all(r["wrong"] == "0" and r["ip_wrong"] == "0" for r in rows)


def test_persistent_and_group_bad_combinations_exit_cleanly():
    for args, text in ((("--persistent", "--group", "2"), "separate modes"),
                       (("--group", "0"), "at least 1"),
                       (("--group", "2", "--tune"), "does not apply to --tune"),
                       (("--persistent", "--soak", "1s"), "does not apply to --soak"),
                       (("pushpull", "--group", "2"), "does not apply to pushpull")):
        p = _cli("bench", *args)
        assert p.returncode == 2 and text in p.stderr, (args, p.stderr)
    with pytest.raises(BenchError, match="separate modes"):
        BenchConfig(collectives=["allreduce"], sizes=[8], persistent=True, group=2).validate()


def test_gloo_has_no_persistent_or_grouped_form(monkeypatch):
    monkeypatch.setattr(benchspec, "gloo_available", lambda: None)
    for mode in (dict(persistent=True), dict(group=2)):
        with pytest.raises(BenchError, match="gloo peer has no"):
            BenchConfig(collectives=["allreduce"], sizes=[8], peers=["gloo"], **mode).validate()


def test_mpi_persistent_and_grouped_calls_pass_the_plain_calls_arguments():
    """The MPI peer's _spec (what --persistent's <Name>_init and --group's I<name> get) is the
    call its plain prepare makes, collective by collective, rank by rank."""
    class FakeMPI:
        IN_PLACE = object()

    class Recorder:
        size = 2

        def __init__(self, rank):
            self.rank, self.seen = rank, []

        def __getattr__(self, name):
            return lambda *args: self.seen.append((name, args))

        def Barrier(self):
            self.seen.append(("Barrier", ()))

    for coll in benchspec.BENCHED:
        case = make_cases(coll, [64], 2, "float32")[0]
        for inplace in ((False,) if coll in benchspec.UNEVEN + ("barrier",) else (False, True)):
            for rank in (0, 1):
                runner = object.__new__(peers.MpiRunner)
                runner.MPI, runner.c, runner.mpi_op = FakeMPI, Recorder(rank), "SUM"
                b = Buffers(case, "sum", rank, 1)
                call = runner.prepare(b, inplace, "sum", 1)
                call.op()
                (name, args), = runner.c.seen
                sname, sargs, before, result = runner._spec(b, inplace, 1)
                where = (coll, inplace, rank)
                assert sname == name and _same_argument(list(sargs), list(args)), where
                assert _same_argument(result, call.result)
                assert (before is not None) == (coll == "broadcast" and not inplace and rank == 1)


def test_peer_mpi_persistent_side_by_side():
    require(peers.mpi_available())
    rows = bench.run(BenchConfig(collectives=["allreduce", "broadcast", "reduce_scatter"],
                                 sizes=[8, 4096], nranks=2, transport="shm", peers=["mpi"],
                                 root=1, persistent=True, quiet=True, **QUICK))
    assert [r["library"] for r in rows] == ["minicomm", "mpi"] * 6
    assert _all_wrong(rows) == 0
    assert all(r["mode"] == "persistent" for r in rows)
    for r in rows[1::2]:
        assert r["ratio"] > 0 and r["ip_ratio"] > 0


def test_peer_mpi_group_side_by_side():
    require(peers.mpi_available())
    rows = bench.run(BenchConfig(collectives=["allreduce", "broadcast", "alltoall"],
                                 sizes=[4096], nranks=2, transport="shm", peers=["mpi"],
                                 root=1, group=4, quiet=True, **QUICK))
    assert [r["library"] for r in rows] == ["minicomm", "mpi"] * 3
    assert _all_wrong(rows) == 0
    assert all(r["mode"] == "group" and r["group"] == 4 for r in rows)


def test_headers_say_the_mode_and_auto_names_the_fused_allreduces_choice(monkeypatch):
    class World:
        size = 2

        def _resolve_algorithm(self, coll, algorithm, nbytes):
            return f"{coll}@{nbytes}"
    cfg = BenchConfig(collectives=["allreduce"], sizes=[1024])
    text = bench.header(dataclasses.replace(cfg, persistent=True), "allreduce", World(), [])
    assert "(persistent requests)" in text.splitlines()[0] and "start() + wait()" in text
    text = bench.header(dataclasses.replace(cfg, group=64), "allreduce", World(), [])
    assert "(per group of 64 calls)" in text.splitlines()[0] and "(us/grp)" in text
    assert "(us/grp)" not in bench.header(cfg, "allreduce", World(), [])
    case = make_cases("allreduce", [1024], 2, "float32")[0]
    assert bench.MinicommRunner(World(), "auto").describe(case) == "auto>allreduce@1024"
    # a group of 64 runs one fused allreduce of 64 KiB: auto chooses by that
    assert bench.MinicommRunner(World(), "auto", 64).describe(case) == "auto>allreduce@65536"
    monkeypatch.setenv("MINICOMM_FUSION_BYTES", "4096")          # 4 calls a fused buffer
    assert bench.MinicommRunner(World(), "auto", 64).describe(case) == "auto>allreduce@4096"
    case = make_cases("broadcast", [1024], 2, "float32")[0]       # each runs as itself
    assert bench.MinicommRunner(World(), "auto", 64).describe(case) == "auto>broadcast@1024"
