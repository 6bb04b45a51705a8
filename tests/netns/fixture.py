"""pytest fixture: a namespace cluster (tests/netns/cluster) shared by one test session.

    pytest_plugins = ["netns.fixture"]           # in a test module under tests/ (after putting
                                                 # tests/ on sys.path); not an import: a fixture
                                                 # imported into two modules would be two clusters

    def test_x(netns_cluster):
        netns_cluster.hosts        # ["10.78.0.1", "10.78.0.2", "10.78.0.3"]  (h1..h3)
        netns_cluster.ssh_opts     # ["-F", ".../ssh_config"]: ssh to a host address or hI
        netns_cluster.gateway      # the root-namespace address every host can reach
        netns_cluster.exec("h1", "hostname")

The session cluster has its own state directory, name prefix and subnet, so it never touches
a cluster brought up by hand with the script's defaults. An exclusive lock serialises test
sessions that would share it. Tests skip, naming the reason, where the machine cannot host
the cluster (not root, `ip netns add` refused, no sshd to install); any other failure to
bring it up is a test error. Teardown checks that no namespace, interface or sshd is left.
"""
import fcntl
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "cluster"
UNMET = 3          # the script's exit status for "this machine cannot host a cluster"
SESSION_HOSTS = 3
SESSION_SETTINGS = dict(dir="/tmp/minicomm-netns-pytest", prefix="mcpt", subnet="10.78.0")
LOCK_WAIT_S = 300


class ClusterUnavailable(Exception):
    """The machine cannot host a namespace cluster (the reason is the message)."""


class Cluster:
    """A running test bed: addresses, ssh settings, and helpers to run things in hosts."""

    def __init__(self, n, dir, prefix, subnet):
        self.n, self.dir, self.prefix, self.subnet = n, dir, prefix, subnet
        self.hosts = [f"{subnet}.{i}" for i in range(1, n + 1)]
        self.names = [f"h{i}" for i in range(1, n + 1)]
        self.gateway = f"{subnet}.254"
        self.ssh_config = os.path.join(dir, "ssh_config")
        self.ssh_opts = ["-F", self.ssh_config]

    def _env(self):
        return dict(os.environ, MINICOMM_NETNS_DIR=self.dir, MINICOMM_NETNS_PREFIX=self.prefix,
                    MINICOMM_NETNS_SUBNET=self.subnet)

    def script(self, *args, timeout=180, check=True):
        """Run tests/netns/cluster ARGS for this cluster; CompletedProcess with text output."""
        res = subprocess.run([str(SCRIPT), *args], env=self._env(), capture_output=True,
                             text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"cluster {' '.join(args)} exited {res.returncode}: {res.stderr.strip()}")
        return res

    def exec(self, host, *cmd, timeout=60, check=True):
        """Run CMD inside host (net, UTS and mount namespaces of its sshd)."""
        return self.script("exec", host, *cmd, timeout=timeout, check=check)

    def popen_exec(self, host, *cmd):
        """Start CMD inside host without waiting; the caller reaps it (see reap())."""
        return subprocess.Popen([str(SCRIPT), "exec", host, *cmd], env=self._env(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def ssh(self, host, command, timeout=60, check=True):
        """Run a shell command on host over ssh, as a launcher would."""
        res = subprocess.run(["ssh", *self.ssh_opts, host, command], capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise RuntimeError(f"ssh {host} {command!r} exited {res.returncode}: {res.stderr.strip()}")
        return res

    def shape(self, rate):
        """Set the per-host link rate (tc rate string such as '1gbit'), or None for unshaped."""
        self.script("shape", "--rate", rate or "none", timeout=60)

    def up(self, rate=None):
        res = self.script("up", str(self.n), *(["--rate", rate] if rate else []), check=False)
        if res.returncode == UNMET:
            raise ClusterUnavailable(res.stderr.strip().splitlines()[-1])
        if res.returncode != 0:
            raise RuntimeError(f"cluster up {self.n} exited {res.returncode}:\n{res.stderr}")
        return self

    def down(self):
        self.script("down", timeout=120)

    def leftovers(self):
        """What of this cluster still exists: namespaces, the root veth, sshd processes, files."""
        found = []
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        found += [f"netns {l.split()[0]}" for l in netns.splitlines() if l.startswith(self.prefix + "-")]
        if subprocess.run(["ip", "link", "show", self.prefix + "0"], capture_output=True,
                          timeout=30).returncode == 0:
            found.append(f"link {self.prefix}0")
        found += [f"process {pid}: {cmd}" for pid, cmd in processes_mentioning(self.dir)]
        if os.path.exists(self.dir):
            found.append(f"dir {self.dir}: {sorted(os.listdir(self.dir))}")
        return found


def processes_mentioning(text):
    """(pid, command line) of live processes whose command line contains text."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append((int(pid), cmd.strip()))
    return out


def reap(proc, timeout=10):
    """Wait for a Popen; kill it if it outlives timeout. Returns (stdout, stderr)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate(timeout=10)


def measure_goodput(cluster, src, dst, seconds=2.0):
    """TCP goodput in bit/s from host src to host dst (hI names), measured at the receiver."""
    probe = str(HERE / "throughput.py")
    dst_ip = cluster.hosts[int(dst[1:]) - 1]
    server = cluster.popen_exec(dst, sys.executable, probe, "server", dst_ip)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 30)
        line = server.stdout.readline().split() if ready else []
        if line[:1] != ["ready"]:
            raise RuntimeError(f"throughput server on {dst} did not start: {reap(server, 5)}")
        cluster.exec(src, sys.executable, probe, "client", dst_ip, line[1], str(seconds),
                     timeout=seconds + 30)
        out, err = server.communicate(timeout=30)
        nbytes, secs = out.split()
        return int(nbytes) * 8 / float(secs)
    finally:
        if server.poll() is None:
            reap(server, 0.1)


_held = set()   # lock paths this process holds: flock would make a second taker wait on itself


def _lock_session(path):
    """Exclusive flock held for the whole session, waiting at most LOCK_WAIT_S."""
    if path in _held:
        raise RuntimeError(f"this process already holds {path}: is the netns_cluster fixture "
                           "imported into several modules? Use pytest_plugins = ['netns.fixture']")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _held.add(path)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise RuntimeError(f"another test session has held {path} for {LOCK_WAIT_S} s")
            time.sleep(0.2)


def require_namespaces():
    """Skip the calling test unless this process may create network namespaces."""
    if os.geteuid() != 0:
        pytest.skip("multi-host tests need root (network namespaces, per-host sshd)")
    probe = f"mcprobe{os.getpid()}"
    try:
        res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("multi-host tests need iproute2 ('ip' not found)")
    if res.returncode != 0:
        pytest.skip(f"'ip netns add' is not permitted here: {res.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30, check=True)


@pytest.fixture(scope="session")
def netns_cluster():
    require_namespaces()
    lock = SESSION_SETTINGS["dir"] + ".lock"
    fd = _lock_session(lock)
    cluster = Cluster(SESSION_HOSTS, **SESSION_SETTINGS)
    try:
        try:
            cluster.up()
        except ClusterUnavailable as e:
            pytest.skip(f"cannot build the namespace cluster: {e}")
        yield cluster
    finally:
        try:
            cluster.down()
            left = cluster.leftovers()
            assert not left, f"cluster teardown left: {left}"
        finally:
            os.close(fd)
            _held.discard(lock)


__all__ = ["Cluster", "ClusterUnavailable", "measure_goodput", "netns_cluster",
           "processes_mentioning", "reap", "require_namespaces"]
