"""User-written algorithms: mc.algorithms.register, its proof, and the same executor, verifier
and simulator as the built-in families (issue 40's contract)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401
from minicomm.schedule import IN, OUT, Copy, Recv, Reduce, Schedule, ScheduleBuilder, Send

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BRUCK = os.path.join(REPO, "examples", "algorithms", "bruck_allgather.py")


def ring_allgather(name):
    def build(collective, rank, size, count, root, topology):
        b = ScheduleBuilder(collective, name, rank, size, count, root)
        out = b.chunks(OUT, size)
        b.step(b.chunks(IN, 1)[0].copy_to(out[rank]))
        for s in range(size - 1):
            b.step(out[(rank - s) % size].send((rank + 1) % size),
                   out[(rank - s - 1) % size].recv((rank - 1) % size))
        return b.build()
    return build


@pytest.fixture
def clean():
    yield
    for n in list(mc.algorithms.names()):
        mc.algorithms.unregister(n)


def test_the_contract(clean):
    mc.algorithms.register("mine", ring_allgather("mine"), collectives=("allgather",),
                           verify=True)
    assert "mine" in mc.algorithms.names() and "ring" in mc.algorithms.names()
    with pytest.raises(ValueError, match="taken"):
        mc.algorithms.register("mine", ring_allgather("mine"), collectives=("allgather",))
    with pytest.raises(ValueError, match="taken"):
        mc.algorithms.register("ring", ring_allgather("ring"))

    def f(comm):
        y = comm.allgather(np.array([comm.rank, 10 * comm.rank]), algorithm="mine")
        with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
            comm.allgather(np.ones(1), algorithm="nope")
        with pytest.raises(ValueError, match="has no allreduce"):
            comm.allreduce(np.ones(1), algorithm="mine")
        return y.tolist()
    want = [[0, 0], [1, 10], [2, 20]]
    for transport in ("inproc", "shm", "tcp"):       # the parent's registration travels
        assert mc.spawn(f, 3, transport=transport) == [want] * 3


def _broken(kind):
    def build(collective, rank, size, count, root, topology):
        b = ScheduleBuilder(collective, kind, rank, size, count, root)
        out = b.chunks(OUT, size)
        b.step(b.chunks(IN, 1)[0].copy_to(out[rank]))
        rounds = size - 1 - (kind == "dropped")
        for s in range(rounds):
            if kind == "deadlock" and size > 1:    # everyone receives before anyone sends
                b.step(out[(rank - s - 1) % size].recv((rank - 1) % size))
                b.step(out[(rank - s) % size].send((rank + 1) % size))
                continue
            b.step(out[(rank - s) % size].send((rank + 1) % size),
                   out[(rank - s - 1) % size].recv((rank - 1) % size))
        if kind == "double" and size > 1:
            b.step(Reduce(IN, 0, OUT, rank * count, count))    # its own block counted twice
        if kind == "offset":
            b.step(Copy(IN, 0, OUT, size * count, max(count, 1)))   # past the end of out
        return b.build()
    return build


@pytest.mark.parametrize("kind,what", [
    ("dropped", "nothing"), ("double", "twice"), ("deadlock", "deadlock|stuck|wait"),
    ("offset", "out of bounds")])
def test_verify_refuses_broken_schedules_with_a_counter_example(kind, what, clean):
    with pytest.raises(mc.algorithms.ScheduleError) as e:
        mc.algorithms.register(kind, _broken(kind), collectives=("allgather",), verify=True)
    msg = str(e.value)
    assert f"algorithm {kind!r} refused" in msg
    assert "p=" in msg and "rank" in msg, msg            # world size and rank
    assert "step" in msg or "no step of rank" in msg, msg   # the step that wrote it, or none did
    import re
    assert re.search(what, msg), msg
    assert kind not in mc.algorithms.names()             # refused: not registered


def test_a_bad_schedule_at_run_time_points_at_the_op(clean):
    def build(collective, rank, size, count, root, topology):
        return Schedule(collective, "typo", rank, size, count, root,
                        [(Send((rank + 1) % size, "input", 0, count),
                          Recv((rank - 1) % size, OUT, 0, count))], count, size * count)
    mc.algorithms.register("typo", build, collectives=("allgather",))

    def f(comm):
        with pytest.raises(mc.algorithms.ScheduleError, match="unknown buffer 'input'"):
            comm.allgather(np.ones(2), algorithm="typo")
        return True
    assert mc.spawn(f, 2, transport="inproc") == [True, True]


def test_auto_considers_a_registered_algorithm_only_when_asked(clean):
    from minicomm import cost
    m = cost.LinkModel.for_transports("shm", "tcp")
    mc.algorithms.register("quiet", ring_allgather("quiet"), collectives=("allgather",))
    mc.algorithms.register("eager", ring_allgather("eager"), collectives=("allgather",),
                           auto=True)
    costs = cost.model_costs("allgather", 4, 4096, (0, 0, 0, 0), m)
    assert "eager" in costs and "quiet" not in costs
    # the same schedules as the ring: priced the same
    assert costs["eager"] == pytest.approx(costs["ring"], rel=1e-9)


def test_load_under_verify_sim_bench_and_run(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "minicomm.cli", *args], capture_output=True,
                              text=True, timeout=300)
    v = cli("verify", "--load", BRUCK, "--algorithms", "bruck", "--max-world", "64",
            "--collective", "allgather")
    assert v.returncode == 0 and "1/1 cells pass" in v.stdout, v.stdout + v.stderr
    s = cli("sim", "--load", BRUCK, "--topology", "dgx-h100", "--nodes", "128", "--collective",
            "allgather", "--algorithms", "ring,bruck", "--sizes", "1M", "--json")
    assert s.returncode == 0, s.stderr
    assert '"algorithm": "bruck"' in s.stdout and '"ranks": 1024' in s.stdout
    out = tmp_path / "b.json"
    b = cli("bench", "allgather", "--load", BRUCK, "--algorithms", "ring,bruck", "-n", "3",
            "--sizes", "4K", "--batches", "1", "--iters", "3", "--json", str(out))
    assert b.returncode == 0, b.stderr
    import json
    rows = json.loads(out.read_text())["rows"]
    assert {r["algo"] for r in rows} == {"ring", "bruck"} and all(r["wrong"] == 0 for r in rows)
    script = tmp_path / "job.py"
    script.write_text(f"import runpy, numpy as np, minicomm as mc\n"
                      f"runpy.run_path({BRUCK!r})\n"
                      f"comm = mc.init()\n"
                      f"y = comm.allgather(np.array([comm.rank]), algorithm='bruck')\n"
                      f"print('got', y.ravel().tolist(), flush=True)\n"
                      f"comm.close()\n")
    r = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "3", str(script)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("got [0, 1, 2]") == 3
