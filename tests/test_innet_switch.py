"""innet at run time: the emulated in-network switch (launch/switch.py, launch/switchagent.py),
its limits, its failure, and auto's use of it. Real processes over shm and tcp."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import minicomm as mc
from collective_check import matrix
from leaks import nothing_left_behind  # noqa: F401
from minicomm.algorithms import innet
from minicomm.errors import MismatchError, PeerFailure, SpawnError

INNET = tuple(c for c in innet.COLLECTIVES if c != "barrier")


def _switch_processes():
    out = subprocess.run(["pgrep", "-f", "minicomm.launch.switchagent"], capture_output=True,
                         text=True)
    return {int(x) for x in out.stdout.split()}


@pytest.fixture(autouse=True)
def no_switch_left():
    """A switch ends when rank 0 does (its orderly exit is bounded by lifeline.EXIT_GRACE)."""
    from minicomm.launch.lifeline import EXIT_GRACE
    before = _switch_processes()
    yield
    deadline = time.monotonic() + EXIT_GRACE + 2.0
    while _switch_processes() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _switch_processes() - before == set(), "a switch process was left running"


def _matrix(comm, counts, dtypes, every_op=True):
    return matrix(comm, "innet", counts=counts, dtypes=dtypes, colls=INNET,
                  all_roots=comm.size <= 3, every_op=every_op)


@pytest.mark.parametrize("transport,nodes", [("shm", 1), ("tcp", 1), ("auto", 2)])
def test_the_collective_matrix_through_the_switch(transport, nodes):
    """Its collectives, every op of int32, float64 and bool, counts 0, 1 and odd, in place and
    not, every root: against an independent numpy reference in every rank."""
    n = mc.spawn(_matrix, 3, args=((0, 1, 7), ("int32", "float64", "bool")),
                 transport=transport, nodes=nodes, switch=True, timeout=60)
    assert n[0] == n[1] == n[2] > 100


def test_more_dtypes_and_a_long_vector_that_pipelines():
    counts = (innet.CHUNK_SCALE * 4 + 5,)     # two chunks
    n = mc.spawn(_matrix, 4, args=(counts, ("float32", "int64", "uint8", "complex64", "float16"),
                                   False), transport="shm", switch=True, timeout=60)
    assert n[0] > 20


def test_innet_without_a_switch_says_how_to_start_one():
    def f(comm):
        with pytest.raises(ValueError, match=r"switch=True.*minicomm run --switch"):
            comm.allreduce(np.ones(4), algorithm="innet")
        return comm.allreduce(np.ones(2))[0]     # the communicator is still whole
    assert mc.spawn(f, 2, transport="shm") == [2.0, 2.0]


def test_innet_names_what_it_cannot_do():
    def f(comm):
        with pytest.raises(ValueError, match="'innet' has no alltoall"):
            comm.alltoall(np.ones((2, 2)), algorithm="innet")
        return True
    assert mc.spawn(f, 2, transport="shm", switch=True) == [True, True]
    with pytest.raises(ValueError, match="process world"):
        mc.spawn(f, 2, transport="inproc", switch=True)


def test_auto_considers_innet_only_with_a_switch():
    def f(comm):
        chosen = {comm._prepare("allreduce", "sum", "auto", np.dtype("float32"), n, 0).algo
                  for n in (1, 256, 1 << 14, 1 << 20)}
        return chosen
    without = mc.spawn(f, 2, transport="shm")
    assert all("innet" not in c for c in without)
    # with one: the cost model decides, on every rank alike
    with_switch = mc.spawn(f, 2, transport="shm", switch=True)
    assert with_switch[0] == with_switch[1]


def test_mismatched_calls_are_named_by_the_switch():
    def f(comm):
        n = 4 if comm.rank == 0 else 5
        with pytest.raises(MismatchError, match="the switch compared the group's calls"):
            comm.allreduce(np.ones(n), algorithm="innet")
        return True
    assert mc.spawn(f, 2, transport="tcp", switch=True) == [True, True]


def test_over_the_byte_limit_auto_falls_back_and_innet_raises(monkeypatch):
    monkeypatch.setenv("MINICOMM_SWITCH_MAX_BYTES", "4096")

    def f(comm):
        big, small = np.ones(1024), np.ones(8)          # 8 KiB over the limit, 64 B under
        with pytest.raises(mc.CommError, match="over .*limit of 4096 bytes"):
            comm.allreduce(big, algorithm="innet")
        algo = comm._prepare("allreduce", "sum", "auto", big.dtype, big.size, 0).algo
        return (algo, comm.allreduce(big)[0], comm.allreduce(small, algorithm="innet")[0])
    for algo, a, b in mc.spawn(f, 2, transport="shm", switch=True):
        assert algo != "innet" and a == 2.0 and b == 2.0


def test_a_busy_switch_refuses_a_second_group_and_auto_falls_back(monkeypatch, capfd):
    """MINICOMM_SWITCH_GROUPS=1: the world holds the switch's one aggregation group; a split's
    call that named innet raises, one that came from auto (MINICOMM_ALGO) runs on a host
    family, says so in the debug log, and is right."""
    monkeypatch.setenv("MINICOMM_SWITCH_GROUPS", "1")
    monkeypatch.setenv("MINICOMM_DEBUG", "info")
    monkeypatch.setenv("MINICOMM_ALGO", "allreduce:innet")

    def f(comm):
        assert comm.allreduce(np.ones(3), algorithm="innet")[0] == comm.size
        sub = comm.split(comm.rank % 2)
        with pytest.raises(mc.CommError, match="holds its 1 aggregation groups"):
            sub.allreduce(np.ones(3), algorithm="innet")
        sub.close()
        sub = comm.split(comm.rank % 2)
        y = sub.allreduce(np.full(3, comm.rank + 1.0))
        again = sub._algo_env["allreduce"]
        sub.close()
        return y.tolist(), again
    res = mc.spawn(f, 4, transport="shm", switch=True, timeout=60)
    assert [r[0] for r in res] == [[4.0] * 3, [6.0] * 3, [4.0] * 3, [6.0] * 3]
    assert all(r[1] == "innet" for r in res)      # the env asks; the call itself falls back
    assert "the switch declined innet" in capfd.readouterr().err


def test_a_released_group_frees_the_switch(monkeypatch):
    monkeypatch.setenv("MINICOMM_SWITCH_GROUPS", "1")

    def f(comm):
        sub = comm.split(0)
        a = sub.allreduce(np.ones(2), algorithm="innet")[0]
        sub.close()                   # gives its group back
        comm.barrier()                # every member has released before the world asks
        return a, comm.allreduce(np.ones(2), algorithm="innet")[0]
    assert mc.spawn(f, 2, transport="tcp", switch=True) == [(2.0, 2.0)] * 2


def test_killing_the_switch_fails_every_rank_with_a_named_peer_failure():
    def f(comm):
        comm.allreduce(np.ones(2), algorithm="innet")
        pid = comm._switch.pid
        comm.barrier()
        if comm.rank == 0:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(PeerFailure, match=r"the in-network switch \(pid \d+.*failed"):
            comm.allreduce(np.ones(1 << 16), algorithm="innet")
        return pid
    pids = mc.spawn(f, 3, transport="shm", switch=True, timeout=30)
    assert len(set(pids)) == 1


def test_minicomm_run_switch_starts_it_for_mc_init(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np, minicomm as mc\n"
        "comm = mc.init()\n"
        "y = comm.allreduce(np.arange(4.0), algorithm='innet')\n"
        "print('result', comm.rank, y.tolist(), flush=True)\n"
        "comm.close()\n")
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "3", "--switch",
                          "--transport", "tcp", str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("[0.0, 3.0, 6.0, 9.0]") == 3


def test_a_rank_that_fails_fails_the_job_without_leaks():
    def f(comm):
        comm.allreduce(np.ones(2), algorithm="innet")
        if comm.rank == 1:
            raise RuntimeError("boom")
        comm.allreduce(np.ones(2), algorithm="innet")
    with pytest.raises(SpawnError, match="boom"):
        mc.spawn(f, 3, transport="shm", switch=True, timeout=20)
