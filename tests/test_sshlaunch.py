"""The ssh launcher without a cluster: host lists, and whole jobs through tests/fake_ssh
(which runs the agent on this machine, as sshd would on a host). Needs no root; the real
multi-host runs are in test_multihost.py."""
import glob
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from minicomm.launch.agent import EVENT
from minicomm.launch.ssh import (
    LAUNCH_FAILURE,
    LaunchError,
    cap_slots,
    parse_hostfile,
    parse_hosts,
    run_multihost,
)

FAKE_SSH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_ssh")


# ------------------------------------------------------------------ host lists
def test_parse_hosts():
    assert parse_hosts("a:2,b:2") == [("a", 2), ("b", 2)]
    assert parse_hosts("a, b:3 ,") == [("a", 1), ("b", 3)]
    assert parse_hosts("a:1,b:2,a:2") == [("a", 3), ("b", 2)]          # mpirun: slots add up
    assert parse_hosts("[fe80::1]:2,10.0.0.1") == [("fe80::1", 2), ("10.0.0.1", 1)]
    assert parse_hosts("a:2,b:2,c:2", n=3) == [("a", 2), ("b", 1)]
    for bad in ("", "a:0", "a:x", "a:2:3", "a:-1"):
        with pytest.raises(LaunchError):
            parse_hosts(bad)


def test_parse_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the cluster\nnode1 slots=2   # big one\n\nnode2\nnode3:4\n  node1 slots=1\n")
    assert parse_hostfile(str(f)) == [("node1", 3), ("node2", 1), ("node3", 4)]
    assert parse_hostfile(str(f), n=4) == [("node1", 3), ("node2", 1)]
    for text in ("a slots=0\n", "a cpus=2\n", "a:2 slots=2\n", "# nothing\n"):
        f.write_text(text)
        with pytest.raises(LaunchError, match="hosts"):
            parse_hostfile(str(f))


def test_cap_slots():
    assert cap_slots([("a", 2), ("b", 2)], None) == [("a", 2), ("b", 2)]
    assert cap_slots([("a", 2), ("b", 2)], 2) == [("a", 2)]
    with pytest.raises(LaunchError, match="exceeds the 4 slots"):
        cap_slots([("a", 2), ("b", 2)], 5)


def test_cli_bad_host_list_is_a_usage_error(tmp_path):
    """`minicomm run` with a bad --hosts/--hostfile: one clear line, exit status 2, no traceback."""
    bad_file = tmp_path / "hosts"
    bad_file.write_text("node1 slots=0\n")
    cases = [(["--hosts", "a:x"], "--hosts 'a:x': slots must be a positive integer, not 'x'"),
             (["--hostfile", str(bad_file)], f"{bad_file}:1: slots must be a positive integer"),
             (["--hostfile", str(tmp_path / "missing")], "hostfile: [Errno 2] No such file"),
             (["--hosts", "a:2", "-n", "5"], "-n 5 exceeds the 2 slots of the host list")]
    for args, message in cases:
        res = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", *args, "job.py"],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.startswith("minicomm run: ") and message in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr


# ------------------------------------------------------------------ whole jobs, locally
def _job(tmp_path, body, hosts, **kw):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    out, err = io.BytesIO(), io.BytesIO()
    t0 = time.monotonic()
    rc = run_multihost(hosts, [str(script)], {"JOB_EXTRA": "yes"}, ssh=FAKE_SSH,
                       master_addr="127.0.0.1", cwd=str(tmp_path), out=out, err=err, **kw)
    return rc, out.getvalue().decode(), err.getvalue().decode(), time.monotonic() - t0


REPORT = """
    import json, os, sys
    keys = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "NODE", "NUM_NODES")
    info = {k.lower(): int(os.environ["MINICOMM_" + k]) for k in keys}
    info.update(cwd=os.getcwd(), extra=os.environ.get("JOB_EXTRA"),
                token=len(os.environ["MINICOMM_JOB_TOKEN"]), master=os.environ["MASTER_ADDR"],
                parent_cmdline=open(f"/proc/{os.getppid()}/cmdline").read())
    print(json.dumps(info))
    print("to stderr", file=sys.stderr)
"""


def test_layout_env_and_prefixed_output(tmp_path):
    rc, out, err, _ = _job(tmp_path, REPORT, [("nodeA", 2), ("nodeB", 1)])
    assert rc == 0, err
    rows = {}
    for line in out.splitlines():
        prefix, _, payload = line.partition(" ")
        info = json.loads(payload)
        assert prefix == f"[{info['rank']}]"
        rows[info["rank"]] = info
    assert sorted(rows) == [0, 1, 2]
    for rank, node, local in ((0, 0, 0), (1, 0, 1), (2, 1, 0)):
        r = rows[rank]
        assert (r["node"], r["local_rank"], r["size"], r["num_nodes"]) == (node, local, 3, 2)
        assert r["local_size"] == (2 if node == 0 else 1)
        assert r["cwd"] == str(tmp_path) and r["extra"] == "yes" and r["master"] == "127.0.0.1"
        assert r["token"] == 64 and "minicomm.launch.agent" in r["parent_cmdline"]
    assert sorted(err.splitlines()) == ["[0] to stderr", "[1] to stderr", "[2] to stderr"]
    assert EVENT.decode() not in out


def test_failing_rank_ends_the_job(tmp_path):
    body = """
        import os, sys, time
        rank = int(os.environ["MINICOMM_RANK"])
        seg = f"/dev/shm/minicomm-{os.environ['MINICOMM_JOB_ID']}-r{rank}"
        open(seg, "w").close()
        print(seg, flush=True)
        if rank == 1:
            time.sleep(0.5)
            sys.exit("rank 1 gives up")
        time.sleep(60)
    """
    rc, out, err, took = _job(tmp_path, body, [("nodeA", 2), ("nodeB", 2)])
    assert rc == 1
    assert "job failed: rank 1 (host nodeA, node 0, local rank 1) exited with status 1" in err
    assert "rank 1 gives up" in err.split("job failed:")[1]          # its error, repeated
    assert took < 15                                                  # the sleepers were ended
    segments = [line.split(" ", 1)[1] for line in out.splitlines()]
    assert len(segments) == 4 and not any(os.path.exists(s) for s in segments)



def test_forced_shm_across_hosts_is_a_clear_error(tmp_path):
    """Hosts of the list are machines: shm cannot reach another one (unlike emulated nodes of
    one machine), so forcing it says so instead of hanging or falling back."""
    script = tmp_path / "job.py"
    script.write_text("import minicomm as mc\nmc.init(timeout=30)\n")
    out, err = io.BytesIO(), io.BytesIO()
    rc = run_multihost([("nodeA", 1), ("nodeB", 1)], [str(script)],
                       {"MINICOMM_TRANSPORT": "shm"}, ssh=FAKE_SSH, master_addr="127.0.0.1",
                       cwd=str(tmp_path), out=out, err=err)
    text = err.getvalue().decode()
    assert rc != 0
    assert "transport 'shm' cannot reach ranks [1] on other hosts; use 'auto' or 'tcp'" in text

def test_rank_ignoring_sigterm_is_killed(tmp_path):
    body = """
        import os, signal, sys, time
        rank = int(os.environ["MINICOMM_RANK"])
        signal.signal(signal.SIGTERM, signal.SIG_IGN)       # only SIGKILL ends this one
        print(os.getpid(), flush=True)
        if rank == 0:
            time.sleep(0.5)
            sys.exit(7)
        time.sleep(60)
    """
    rc, out, err, took = _job(tmp_path, body, [("nodeA", 1), ("nodeB", 1)], kill_grace=1.0)
    assert rc == 7 and "rank 0 (host nodeA, node 0, local rank 0) exited with status 7" in err
    assert "rank 1" not in err.split("job failed:")[1]     # killed by us: not a cause
    assert took < 10
    for line in out.splitlines():
        assert _gone(int(line.split()[1]))


def test_unreachable_host_is_named(tmp_path):
    rc, out, err, took = _job(tmp_path, "import time; time.sleep(60)",
                              [("nodeA", 1), ("unreachable-b", 1)])
    assert rc == LAUNCH_FAILURE
    assert "host unreachable-b: cannot start the agent: ssh: connect to host unreachable-b" in err
    assert took < 10


@pytest.mark.parametrize("how", ["stdin closed", "SIGTERM", "SIGINT"])
def test_agent_ends_its_ranks(tmp_path, how):
    """ssh closing the agent's stdin (launcher SIGKILLed, network gone), or a signal to the
    agent itself, ends the ranks and sweeps the job's segments."""
    job_id = "agenttest" + str(os.getpid())
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    open(f"/dev/shm/minicomm-{job_id}-x", "w").close()
    job = dict(job_id=job_id, token="ab" * 32, node=0, num_nodes=1, world_size=2,
               first_rank=0, local_size=2, master_addr="127.0.0.1", master_port=1,
               cwd=str(tmp_path), python=sys.executable, argv=[str(script)], env={},
               pythonpath="", kill_grace=3.0)
    agent = subprocess.Popen([sys.executable, "-m", "minicomm.launch.agent"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        agent.stdin.write(json.dumps(job).encode() + b"\n")
        agent.stdin.flush()
        pids = []
        deadline = time.monotonic() + 20
        while len(pids) < 2 and time.monotonic() < deadline:
            line = agent.stdout.readline()
            if line.startswith(b"["):
                pids.append(int(line.split()[1]))
        assert len(pids) == 2
        if how == "stdin closed":
            agent.stdin.close()
        else:
            agent.send_signal(getattr(signal, how))
        assert agent.wait(timeout=10) == 128 + signal.SIGTERM   # the ranks died of our SIGTERM
        for pid in pids:
            assert _gone(pid)
        assert not os.path.exists(f"/dev/shm/minicomm-{job_id}-x")
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(timeout=10)
        for stream in (agent.stdin, agent.stdout, agent.stderr):
            stream.close()
        for f in glob.glob(f"/dev/shm/minicomm-{job_id}-*"):
            os.unlink(f)


def _gone(pid):
    """Exited (a zombie waiting for PID 1 counts as gone)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_token_is_on_no_command_line_of_the_ssh_launch(tmp_path):
    # SECURITY.md: `minicomm run --hosts` sends the token on the ssh session's stdin; no command
    # line (the ssh argv, the agent's, the ranks') carries it. Each rank scans every process's
    # command line on the box while its agent and the launcher's ssh session are alive.
    body = """
        import glob, json, os
        token = os.environ["MINICOMM_JOB_TOKEN"]
        hits = []
        for path in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                with open(path, "rb") as f:
                    if token.encode() in f.read():
                        hits.append(path)
            except OSError:
                pass
        agent = open(f"/proc/{os.getppid()}/cmdline", "rb").read()
        print(json.dumps(dict(rank=int(os.environ["MINICOMM_RANK"]), hits=hits,
                              token=len(token), agent="minicomm.launch.agent" in agent.decode())))
    """
    rc, out, err, _ = _job(tmp_path, body, [("nodeA", 1), ("nodeB", 1)])
    assert rc == 0, err
    rows = [json.loads(line.partition(" ")[2]) for line in out.splitlines()]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert r["token"] == 64 and r["agent"], r
        assert r["hits"] == [], r
