"""Real processes over real /dev/shm and real sockets: the collective matrix over shm, tcp and
auto with 2 emulated nodes (hier crossing both), and the failure semantics."""
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import minicomm as mc
from collective_check import matrix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


from leaks import job_segments, my_worker_processes, nothing_left_behind  # noqa: F401


def _all_algorithms(comm):
    n = 0
    for algo in ("ring", "tree", "rhd", "hier", "auto"):
        n += matrix(comm, algo, counts=(0, 1, 2 * comm.size + 1), dtypes=("int32", "float32"),
                    all_roots=comm.size <= 3, every_op=False)
    return n


@pytest.mark.parametrize("transport,nodes", [("shm", 1), ("tcp", 1), ("auto", 2)])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6])
def test_matrix_over_real_processes(transport, nodes, p):
    nodes = min(nodes, p)
    res = mc.spawn(_all_algorithms, p, transport=transport, nodes=nodes, timeout=120)
    assert len(set(res)) == 1 and res[0] > 0



# ---------------------------------------------------------------------------- emulated nodes
def _hier_over_one_transport(comm, kind, nodes):
    """The node map is logical (blocks of consecutive ranks) and every pair uses ``kind``."""
    from minicomm.launch import node_map
    topo = node_map(comm.size, nodes)
    assert comm.topology == topo and comm.num_nodes == nodes and comm.node == topo[comm.rank]
    mine = [r for r in range(comm.size) if topo[r] == comm.node]
    assert (comm.local_rank, comm.local_size) == (mine.index(comm.rank), len(mine))
    assert comm.transport.name == kind, comm.transport.name          # no shm+tcp routing
    assert (comm.link_model.intra, comm.link_model.inter) == (kind, kind)
    # the whole matrix: every root (on every node), every op, odd counts, in and out of place
    return matrix(comm, "hier", counts=(0, 1, 2 * comm.size + 1), dtypes=("int32", "float64"))


@pytest.mark.parametrize("kind", ["shm", "tcp"])
@pytest.mark.parametrize("p,nodes", [(4, 2), (5, 2), (6, 2), (4, 3), (5, 3), (6, 3)])
def test_hier_over_a_forced_transport_with_emulated_nodes(kind, p, nodes):
    """nodes=k is a logical topology for a forced transport too: hier's intra and inter phases
    both run over shm alone (or tcp alone), including uneven nodes (nodes=3)."""
    res = mc.spawn(_hier_over_one_transport, p, args=(kind, nodes), transport=kind, nodes=nodes,
                   timeout=120)
    assert len(set(res)) == 1 and res[0] > 0


def test_minicomm_run_emulates_nodes_over_forced_shm(tmp_path):
    script = tmp_path / "nodes.py"
    script.write_text("import minicomm as mc, numpy as np\n"
                      "comm = mc.init()\n"
                      "y = comm.allreduce(np.arange(5.0) + comm.rank, algorithm='hier')\n"
                      "print(comm.node, comm.local_rank, comm.transport.name, y.tolist())\n"
                      "comm.close()\n")
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "4", "--nodes", "2",
                          "--transport", "shm", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    want = (np.arange(5.0) * 4 + 6).tolist()
    rows = sorted(line for line in out.stdout.splitlines() if line.startswith("["))
    assert rows == [f"[{r}] {r // 2} {r % 2} shm {want}" for r in range(4)]

def _large(comm):
    x = np.arange(3_000_001, dtype=np.float32) % 5 + comm.rank
    y = comm.allreduce(x, algorithm="ring")
    return bool(np.array_equal(y, (np.arange(3_000_001, dtype=np.float32) % 5) * comm.size
                               + sum(range(comm.size))))


@pytest.mark.parametrize("transport,nodes", [("shm", 1), ("tcp", 1), ("auto", 2)])
def test_large_messages_stream_through(transport, nodes):
    assert mc.spawn(_large, 3, transport=transport, nodes=nodes, timeout=120) == [True] * 3


def _killed_mid_allreduce(comm):
    x = np.ones(1 << 20, dtype=np.float32)
    for i in range(100000):
        if comm.rank == 1 and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(x)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sigkill_mid_allreduce_is_reported_fast_and_cleaned_up(transport):
    t0 = time.monotonic()
    with pytest.raises(mc.SpawnError) as ei:
        mc.spawn(_killed_mid_allreduce, 4, transport=transport, timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"took {elapsed:.1f}s"
    assert ei.value.failures[0][0] == 1, str(ei.value)[:500]
    assert "SIGKILL" in str(ei.value).split("\n")[0]
    assert "PeerFailure" in str(ei.value)


def _stray_client(comm):
    # Rank 0 knocks on every listening port of this job's store and peers without the token.
    if comm.rank == 0:
        port = comm._store.port if hasattr(comm._store, "port") else None
        host = "127.0.0.1"
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(b"GET everything please\n" * 10)
        s.settimeout(5)
        try:
            while s.recv(4096):
                pass                       # the store answers nothing useful and closes
        except OSError:
            pass
        s.close()
    return comm.allreduce(np.array([comm.rank + 1]))[0]


def test_stray_connection_without_token_is_refused_and_job_goes_on():
    assert mc.spawn(_stray_client, 3, transport="tcp", timeout=60) == [6, 6, 6]


def _mismatch(comm, kind):
    try:
        if kind == "shape":
            comm.allreduce(np.ones(8 + comm.rank, dtype=np.float32))
        else:
            comm.broadcast(np.ones(8), root=0 if comm.rank == 0 else 1, algorithm="ring")
    except mc.MismatchError:
        return "MismatchError"
    except mc.PeerFailure:
        return "PeerFailure"
    return "no error"


@pytest.mark.parametrize("kind", ["shape", "root"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_mismatches_raise_mismatch_error(kind, transport):
    res = mc.spawn(_mismatch, 3, args=(kind,), transport=transport, timeout=30)
    assert "MismatchError" in res and "no error" not in res, res


def _full_check(comm):
    os.environ["MINICOMM_DEBUG"] = "detail"
    try:
        comm.check = "full"
        comm.broadcast(np.ones(4), root=comm.rank % 2, algorithm="tree")
    except mc.MismatchError:
        return "MismatchError"
    return "no error"


def test_detail_mode_catches_every_mismatch_on_every_rank():
    assert mc.spawn(_full_check, 4, transport="shm", timeout=30) == ["MismatchError"] * 4


def _hung_peer(comm):
    if comm.rank == 2:
        time.sleep(30)                 # alive but silent: a hung peer (not a dead one)
        return None
    comm.allreduce(np.ones(4), algorithm="tree")


def test_hung_peer_gives_comm_timeout_naming_it():
    with pytest.raises(mc.SpawnError) as ei:
        mc.spawn(_hung_peer, 3, transport="shm", timeout=2)
    first = str(ei.value).split("\n")[0]
    # rank 1 waits on rank 0 in the tree, rank 0 waits on rank 2: at least rank 0 names rank 2
    assert "CommTimeout" in first and "allreduce" in first and "step" in first, first
    assert any("CommTimeout" in tb and "rank 2" in tb for _, tb in ei.value.failures)


def test_minicomm_run_prints_one_line_per_rank():
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "4",
                          os.path.join(REPO, "examples", "hello_allreduce.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = sorted(l for l in out.stdout.splitlines() if "allreduce sum" in l)
    assert len(lines) == 4
    for r, line in enumerate(lines):
        assert line.startswith(f"[{r}] rank {r}/4") and "[6, 6, 6, 6]" in line and line.endswith("ok")


def test_minicomm_run_ends_the_job_when_a_rank_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import minicomm as mc, numpy as np, sys\n"
                      "comm = mc.init()\n"
                      "if comm.rank == 1: sys.exit(3)\n"
                      "comm.allreduce(np.ones(4))\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "3", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "rank 1 exited with status 3" in out.stdout
    assert time.monotonic() - t0 < 30


SURVIVE_SCRIPT = """
import os, sys
import numpy as np
import minicomm as mc
comm = mc.init()
comm.timeout = 10.0
if comm.rank == 1:
    os._exit(3)                         # dies before the first collective
try:
    comm.allreduce(np.ones(4))
except mc.CommError as e:
    print("caught", type(e).__name__, flush=True)
new = comm.shrink()
y = new.allreduce(np.ones(4) * (comm.rank + 1))
print("survivor", comm.rank, "->", new.rank, "of", new.size, "sum", y[0], flush=True)
"""


def test_minicomm_run_on_failure_continue_lets_the_survivors_shrink(tmp_path):
    script = tmp_path / "survive.py"
    script.write_text(SURVIVE_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "3",
                          "--on-failure", "continue", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 1 exited with status 3; the others go on" in out.stdout, out.stdout
    lines = sorted(l for l in out.stdout.splitlines() if "survivor" in l)
    # old ranks 0 and 2 become 0 and 1; the sum is (0 + 1) + (2 + 1)
    assert lines == ["[0] survivor 0 -> 0 of 2 sum 4.0", "[2] survivor 2 -> 1 of 2 sum 4.0"], \
        out.stdout


def test_minicomm_run_on_failure_continue_fails_when_every_rank_fails(tmp_path):
    script = tmp_path / "allfail.py"
    script.write_text("import sys\nimport minicomm as mc\ncomm = mc.init()\nsys.exit(4)\n")
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "2",
                          "--on-failure", "continue", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 4, out.stdout + out.stderr
    assert out.stdout.count("exited with status 4; the others go on") == 2, out.stdout


def test_minicomm_run_on_failure_is_checked_by_name():
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "2",
                          "--on-failure", "retry", "x.py"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--on-failure" in out.stderr and "retry" in out.stderr


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_spawn_on_failure_continue_returns_the_survivors_results(transport):
    def prog(comm):
        if comm.rank == 0:
            os._exit(5)
        comm.timeout = 10.0
        try:
            comm.barrier()
        except mc.CommError:
            pass
        new = comm.shrink()
        return new.rank, new.allreduce(np.array([comm.rank]))[0]

    with pytest.raises(mc.SpawnError) as ei:
        mc.spawn(prog, 3, transport=transport, on_failure="continue", timeout=30)
    assert [r for r, _ in ei.value.failures] == [0]
    assert ei.value.results == [None, (0, 3), (1, 3)]


def test_spawn_on_failure_is_checked_by_name():
    with pytest.raises(ValueError, match="on_failure 'retry'"):
        mc.spawn(lambda comm: None, 2, transport="inproc", on_failure="retry")
