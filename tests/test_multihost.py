"""`minicomm run --hostfile` across the namespace test bed (tests/netns): three hosts, each
with its own sshd, hostname and /dev/shm; the launcher runs in the root namespace and serves
the store on the bridge. Needs root (skips, saying why, otherwise).

The rank scripts report what they see (environment, host, communicator, transports), and
examples/multihost_check.py checks every collective with every algorithm against numpy on 2x2
(shm inside a host, tcp between) and 3x1 (tcp only) layouts.
"""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.register_assert_rewrite("netns.fixture")
from netns.fixture import processes_mentioning, reap  # noqa: E402

pytest_plugins = ["netns.fixture"]   # one session cluster, however many modules use it

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

REPORT = """
    import json, os, socket, sys
    token = os.environ["MINICOMM_JOB_TOKEN"]
    on_cmdline = []          # the token must not be on any command line on this host
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if token in open(f"/proc/{pid}/cmdline", errors="replace").read():
                on_cmdline.append(pid)
        except OSError:
            pass
    env = {k: os.environ[k] for k in ("MINICOMM_RANK", "MINICOMM_SIZE", "MINICOMM_LOCAL_RANK",
           "MINICOMM_LOCAL_SIZE", "MINICOMM_NODE", "MINICOMM_NUM_NODES", "MASTER_ADDR",
           "MINICOMM_JOB_ID")}
    info = dict(host=socket.gethostname(), env=env, token_len=len(token), on_cmdline=on_cmdline)
    import numpy as np
    import minicomm as mc
    comm = mc.init()
    info.update(comm=[comm.rank, comm.size, comm.local_rank, comm.local_size, comm.node,
                      comm.num_nodes],
                allreduce=float(comm.allreduce(np.array([comm.rank + 1.0]))[0]))
    comm.close()
    print(json.dumps(info))
    print(f"stderr of rank {env['MINICOMM_RANK']}", file=sys.stderr)
"""

SLEEPER = """
    import os, sys, time
    rank = int(os.environ["MINICOMM_RANK"])
    open(f"/dev/shm/minicomm-{os.environ['MINICOMM_JOB_ID']}-r{rank}", "w").close()  # a 'segment'
    print("pid", os.getpid(), os.environ["MINICOMM_JOB_ID"], flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
"""


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def _hostfile(cluster, tmp_path, layout):
    """layout: slots per host, e.g. [2, 2] -> h1 slots=2, h2 slots=2."""
    lines = ["# minicomm multi-host test"] + [f"{ip} slots={n}" for ip, n in zip(cluster.hosts, layout)]
    return _write(tmp_path, "hostfile", "\n".join(lines) + "\n")


def _cli(cluster, hostfile, script, *args, ssh_config=None):
    return [sys.executable, "-m", "minicomm.cli", "run", "--hostfile", str(hostfile),
            f"--ssh-opts=-F {ssh_config or cluster.ssh_config}", "--", str(script), *args]


def _run(cluster, tmp_path, cmd, timeout=90, env=None):
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL, env=env)
    return res, time.monotonic() - t0


def _start(cluster, tmp_path, cmd):
    """The launcher in a session of its own (a terminal's Ctrl-C would reach only it)."""
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    p = subprocess.Popen(cmd, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                         start_new_session=True)
    return p, out, err


def _wait_for_ranks(outfile, n, timeout=30):
    """{rank: (pid, job_id)} once all n ranks printed their pid line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outfile.seek(0)
        found = {int(m[1]): (int(m[2]), m[3])
                 for m in re.finditer(r"^\[(\d+)\] pid (\d+) (\S+)$", outfile.read(), re.M)}
        if len(found) == n:
            return found
        time.sleep(0.1)
    raise AssertionError(f"only {len(found)} of {n} ranks started within {timeout} s")


def _leftovers(cluster, script, job_id, settle=10.0):
    """Ranks, agents, ssh clients and segments of the job that still exist (waits for them to go)."""
    deadline = time.monotonic() + settle
    while True:
        left = [f"process {pid}: {cmd[:100]}" for text in (str(script), "-m minicomm.launch.agent", cluster.ssh_config)
                for pid, cmd in processes_mentioning(text)]
        for name in cluster.names:
            shm = cluster.exec(name, "ls", "/dev/shm").stdout.split()
            left += [f"{name}:/dev/shm/{s}" for s in shm if job_id in s]
        left += [f"root:/dev/shm/{s}" for s in os.listdir("/dev/shm") if job_id in s]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _expected_transports(layout, rank):
    """What ``describe()`` of an "auto" transport says: shm to the ranks of its own host, tcp
    to the others (RoutedTransport lists shm first)."""
    nodes = [node for node, slots in enumerate(layout) for _ in range(slots)]
    same = [q for q in range(len(nodes)) if q != rank and nodes[q] == nodes[rank]]
    other = [q for q in range(len(nodes)) if nodes[q] != nodes[rank]]
    parts = ([f"shm to {same}"] if same else []) + ([f"tcp to {other}"] if other else [])
    return f"rank {rank}: " + ", ".join(parts)


def _block_layout(layout):
    """(rank, node, local rank, ranks on the node) for ranks laid out in blocks by host."""
    rank = 0
    for node, slots in enumerate(layout):
        for local in range(slots):
            yield rank, node, local, slots
            rank += 1


def _reports(stdout, size):
    """{rank: JSON object} from the ranks' one-line reports; every line must be prefixed."""
    reports = {}
    for line in stdout.splitlines():
        m = re.match(r"^\[(\d+)\] (\{.*\})$", line)
        assert m, f"unprefixed output line {line!r}"
        reports[int(m[1])] = json.loads(m[2])
    assert sorted(reports) == list(range(size))
    return reports


@pytest.mark.parametrize("layout", [[2, 2], [1, 1, 1]], ids=["2x2", "3x1"])
def test_layout_and_environment(netns_cluster, tmp_path, layout):
    c = netns_cluster
    script = _write(tmp_path, "report.py", REPORT)
    res, took = _run(c, tmp_path, _cli(c, _hostfile(c, tmp_path, layout), script),
                     env=dict(os.environ, MINICOMM_DEBUG="info"))
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    size = sum(layout)
    reports = _reports(res.stdout, size)
    for rank, node, local, slots in _block_layout(layout):
        r = reports[rank]
        expect = [rank, size, local, slots, node, len(layout)]
        env = r["env"]
        assert [int(env[k]) for k in ("MINICOMM_RANK", "MINICOMM_SIZE", "MINICOMM_LOCAL_RANK",
                                      "MINICOMM_LOCAL_SIZE", "MINICOMM_NODE",
                                      "MINICOMM_NUM_NODES")] == expect
        assert r["host"] == c.names[node]                 # really ran on that host
        assert env["MASTER_ADDR"] == c.gateway
        assert r["token_len"] == 64 and r["on_cmdline"] == []
        assert r["comm"] == expect
        assert r["allreduce"] == size * (size + 1) / 2
        # MINICOMM_DEBUG=info (forwarded by the launcher) logs each rank's transports
        assert (f"[{rank}] [minicomm rank {rank}] transports: "
                f"{_expected_transports(layout, rank)}") in res.stderr.splitlines()
    assert len({r["env"]["MINICOMM_JOB_ID"] for r in reports.values()}) == 1
    assert sorted(l for l in res.stderr.splitlines() if "stderr of rank" in l) == sorted(
        f"[{r}] stderr of rank {r}" for r in range(size))
    print(f"layout {layout}: {took:.1f} s")


@pytest.mark.parametrize("layout", [[2, 2], [1, 1, 1]], ids=["2x2", "3x1"])
def test_every_collective_and_algorithm_across_hosts(netns_cluster, tmp_path, layout):
    """examples/multihost_check.py: every collective (and barrier, send/recv) with ring, tree,
    rhd, hier and auto, checked against numpy on every rank; on 2x2 over shm and tcp at once."""
    c = netns_cluster
    script = os.path.join(EXAMPLES, "multihost_check.py")
    res, took = _run(c, tmp_path, _cli(c, _hostfile(c, tmp_path, layout), script), timeout=120)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    size = sum(layout)
    reports = _reports(res.stdout, size)
    for rank, node, local, _ in _block_layout(layout):
        r = reports[rank]
        assert (r["size"], r["host"], r["node"], r["local_rank"]) == (
            size, c.names[node], node, local)
        assert r["transports"] == _expected_transports(layout, rank)
        assert r["algorithms"] == ["ring", "tree", "rhd", "hier", "auto"]
    # the same number of checks on every rank (each rank checks its own part of every call)
    assert len({r["checks"] for r in reports.values()}) == 1 and reports[0]["checks"] > 1000
    print(f"layout {layout}: {reports[0]['checks']} checks per rank in {took:.1f} s")


def test_unreachable_host_is_a_clear_error(netns_cluster, tmp_path):
    c = netns_cluster
    script = _write(tmp_path, "sleeper.py", SLEEPER)
    hostfile = _write(tmp_path, "hostfile", f"{c.hosts[0]} slots=2\n{c.subnet}.200\n")  # no such host
    res, took = _run(c, tmp_path, _cli(c, hostfile, script))
    assert res.returncode == 255
    assert f"host {c.subnet}.200: cannot start the agent: ssh: connect to host {c.subnet}.200" in res.stderr
    assert took < 15
    started = re.search(r"^\[\d+\] pid \d+ (\S+)$", res.stdout, re.M)   # h1's ranks may have begun
    assert _leftovers(c, script, started[1] if started else "no-job-id") == []


def test_refused_login_is_a_clear_error(netns_cluster, tmp_path):
    c = netns_cluster
    key = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    config = tmp_path / "ssh_config"   # the cluster's ssh settings with a key no host accepts
    config.write_text(open(c.ssh_config).read().replace(os.path.join(c.dir, "id_ed25519"), str(key)))
    script = _write(tmp_path, "sleeper.py", SLEEPER)
    res, took = _run(c, tmp_path, _cli(c, _hostfile(c, tmp_path, [1, 1]), script, ssh_config=config))
    assert res.returncode == 255
    assert re.search(rf"host {re.escape(c.hosts[0])}: cannot start the agent: .*Permission denied", res.stderr)
    assert took < 15
    assert _leftovers(c, script, "no-job-id") == []


def test_killing_a_remote_rank_ends_the_job(netns_cluster, tmp_path):
    c = netns_cluster
    script = _write(tmp_path, "sleeper.py", SLEEPER)
    p, out, err = _start(c, tmp_path, _cli(c, _hostfile(c, tmp_path, [2, 2, 2]), script))
    try:
        ranks = _wait_for_ranks(out, 6)
        job_id = ranks[0][1]
        t0 = time.monotonic()
        os.kill(ranks[3][0], signal.SIGKILL)        # rank 3: h2, local rank 1
        rc = p.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        reap(p, 0.1)
        out.close()
    err.seek(0)
    text = err.read()
    err.close()
    assert rc == 128 + signal.SIGKILL
    assert f"job failed: rank 3 (host {c.hosts[1]}, node 1, local rank 1) was killed by signal 9 (SIGKILL)" in text
    assert took < 10, f"the job took {took:.1f} s to end"
    assert _leftovers(c, script, job_id) == []
    print(f"killed rank 3: the launcher exited {took:.2f} s later")


def test_ctrl_c_is_relayed_to_every_rank(netns_cluster, tmp_path):
    c = netns_cluster
    script = _write(tmp_path, "sleeper.py", SLEEPER)
    p, out, err = _start(c, tmp_path, _cli(c, _hostfile(c, tmp_path, [1, 2]), script))
    try:
        job_id = _wait_for_ranks(out, 3)[0][1]
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
    finally:
        reap(p, 0.1)
    out.seek(0)
    assert rc == 128 + signal.SIGINT
    assert sorted(l for l in out.read().splitlines() if "interrupted" in l) == [
        "[0] interrupted", "[1] interrupted", "[2] interrupted"]
    out.close()
    err.close()
    assert _leftovers(c, script, job_id) == []


def test_launcher_killed_leaves_nothing(netns_cluster, tmp_path):
    """SIGKILL the launcher: ssh loses its stdin, each agent sees EOF and ends its ranks."""
    c = netns_cluster
    script = _write(tmp_path, "sleeper.py", SLEEPER)
    p, out, err = _start(c, tmp_path, _cli(c, _hostfile(c, tmp_path, [1, 1, 1]), script))
    try:
        job_id = _wait_for_ranks(out, 3)[0][1]
        p.kill()
        p.wait(timeout=10)
    finally:
        reap(p, 0.1)
        out.close()
        err.close()
    assert _leftovers(c, script, job_id) == []
