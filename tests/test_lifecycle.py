"""Process lifecycle (issue 14): every rank dies with its launcher and cleans up after itself;
``timeout`` is a per-wait limit whose CommTimeout reaches the caller.

Each test drives a real launcher in a process of its own (a caller script of ``mc.spawn``, or
``minicomm run``), kills it from outside, and then polls — with a bounded deadline — for what must
follow: no rank process left, no /dev/shm segment of the job left.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401  (autouse fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FAKE_SSH = os.path.join(HERE, "fake_ssh")


def _segments(job):
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"minicomm-{job}-"))


def _pids_with(marker):
    """Processes whose command line carries ``marker``, or (an int) of session ``marker``."""
    how = ["-s", str(marker)] if isinstance(marker, int) else ["-f", marker]
    out = subprocess.run(["pgrep", *how], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


def _wait_until_clean(job, marker, within=30.0):
    """Poll (bounded) until the job has no segment and no process carrying ``marker``."""
    deadline = time.monotonic() + within
    while True:
        left, procs = _segments(job), _pids_with(marker)
        if (not left and not procs) or time.monotonic() > deadline:
            return left, procs
        time.sleep(0.1)              # polling the outcome, bounded by the deadline


def _kill_all(marker):
    for pid in _pids_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _assert_all_cleaned_up(job, marker):
    """No segment of ``job`` and no process carrying ``marker`` remain (waits up to 30 s)."""
    left, procs = _wait_until_clean(job, marker)
    assert left == [] and procs == [], (left, procs)


def _reap(p, marker):
    """However the test ended: the launcher and every rank it started are gone."""
    if p.poll() is None:
        p.kill()
        p.wait()
    _kill_all(marker)


def _wait_for_segment(job_of, within=60.0):
    """Poll /dev/shm every millisecond until a segment of the job exists (setup is under way)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        job = job_of()
        if job and _segments(job):
            return job
        time.sleep(0.001)
    return None


# ------------------------------------------------------------------ mc.spawn's caller dies
SPAWN_CALLER = """
import sys, time
import minicomm as mc
from minicomm.launch import local
marker = sys.argv[1]
def fn(comm):
    comm.barrier()
    if comm.rank == 0:
        print("ready", flush=True)
    time.sleep(120)
orig = local._collect
def collect(*a, **k):
    print("job", local.last_job_id, flush=True)
    return orig(*a, **k)
local._collect = collect
mc.spawn(fn, 4, transport=sys.argv[2], timeout=120)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_spawn_caller_during_setup_leaves_no_segment_and_no_rank(tmp_path, sig):
    """The issue's ~12 MB leak: the caller dies while the ranks are still connecting (their
    segments exist, not every peer has attached). Every rank must unlink what it made and go."""
    marker = f"mc-life-{uuid.uuid4().hex[:10]}"
    script = tmp_path / f"{marker}.py"
    script.write_text(textwrap.dedent(SPAWN_CALLER))
    p = subprocess.Popen([sys.executable, str(script), marker, "shm"], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        job = p.stdout.readline().split()[1]          # "job <id>": every rank is started
        assert _wait_for_segment(lambda: job) == job
        os.kill(p.pid, sig)
        p.wait(30)
        _assert_all_cleaned_up(job, p.pid)      # the caller's session: its ranks
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        subprocess.run(["pkill", "-9", "-s", str(p.pid)], capture_output=True)


def test_a_rank_whose_parent_died_before_it_armed_the_death_signal_exits(tmp_path):
    """The race PR_SET_PDEATHSIG leaves open: the parent dies between fork and prctl. The worker
    checks getppid() against the parent it was started by, right after arming, and leaves."""
    r = subprocess.run([sys.executable, "-m", "minicomm.launch.worker", "1"],   # pid 1: not ours
                       input=b"", capture_output=True, timeout=60)
    assert r.returncode == 70, r


# ------------------------------------------------------------------ `minicomm run` dies
RUN_RANK = """
import os, sys, time
import minicomm as mc
print("job", os.environ["MINICOMM_JOB_ID"], flush=True)
comm = mc.init()
comm.barrier()
print("ready", flush=True)
time.sleep(120)
"""


def _start_run(tmp_path, marker, n=3, extra=()):
    script = tmp_path / f"{marker}.py"
    script.write_text(textwrap.dedent(RUN_RANK))
    return subprocess.Popen([sys.executable, "-m", "minicomm.cli", "run", "-n", str(n), *extra,
                             "--transport", "shm", str(script), marker],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=REPO)


@pytest.mark.parametrize("when", ["during setup", "after setup"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_minicomm_run_leaves_no_rank_and_no_segment(tmp_path, sig, when):
    marker = f"mc-life-{uuid.uuid4().hex[:10]}"
    p = _start_run(tmp_path, marker)
    try:
        job, ready = None, 0
        for line in p.stdout:
            if " job " in line:
                job = line.split()[-1]
                if when == "during setup":
                    break
            if line.rstrip().endswith("ready"):
                ready += 1
                if ready == 3:
                    break
        assert job is not None
        if when == "during setup":
            assert _wait_for_segment(lambda: job) == job
        os.kill(p.pid, sig)
        p.wait(30)
        assert p.returncode != 0
        _assert_all_cleaned_up(job, marker)
    finally:
        _reap(p, marker)


SSH_LAUNCHER = """
import sys
from minicomm.launch.ssh import run_multihost
sys.exit(run_multihost([("localhost", 2)], sys.argv[2:], {"MINICOMM_TRANSPORT": "shm"},
                       ssh=sys.argv[1], master_addr="127.0.0.1"))
"""


def test_killing_the_ssh_launcher_leaves_no_rank_and_no_segment(tmp_path):
    """The ssh path through tests/fake_ssh: SIGKILL the launcher, fake ssh and agent together
    (a host's agent killed with its session): the ranks get the death signal and clean up."""
    marker = f"mc-life-{uuid.uuid4().hex[:10]}"
    script = tmp_path / f"{marker}.py"
    script.write_text(textwrap.dedent(RUN_RANK))
    launcher = tmp_path / "launcher.py"
    launcher.write_text(textwrap.dedent(SSH_LAUNCHER))
    p = subprocess.Popen([sys.executable, str(launcher), FAKE_SSH, str(script), marker],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, cwd=str(tmp_path))
    try:
        job, ready = None, 0
        for line in p.stdout:
            if " job " in line:
                job = line.split()[-1]
            if line.rstrip().endswith("ready"):
                ready += 1
                if ready == 2:
                    break
        assert job is not None
        os.killpg(p.pid, signal.SIGKILL)        # launcher, fake ssh and agent alike
        p.wait(30)
        _assert_all_cleaned_up(job, marker)
    finally:
        _reap(p, marker)


# ------------------------------------------------------------------ timeout is per wait
def _stall_rank_1(comm, seconds):
    comm.barrier()
    if comm.rank == 1:
        time.sleep(seconds)          # silent: computes far past the others' per-wait timeout
    return float(comm.allreduce(np.ones(1))[0])


@pytest.mark.parametrize("transport", ["shm", "tcp", "inproc"])
def test_the_callers_error_is_the_commtimeout_that_names_the_silent_peer(transport):
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(_stall_rank_1, 2, args=(20.0,), transport=transport, timeout=1.0)
    text = str(info.value)
    root = text.splitlines()[0]
    assert "root cause: rank 0: CommTimeout" in root, text
    assert "rank 1" in root.split("CommTimeout", 1)[1], text      # the silent peer, named


def test_inproc_spawn_timeout_is_a_per_wait_limit_not_a_job_deadline():
    def fn(comm, seconds):
        comm.barrier()
        time.sleep(seconds)                 # longer than timeout + the 5 s grace
        return float(comm.allreduce(np.ones(1))[0])
    assert mc.spawn(fn, 2, args=(7.0,), transport="inproc", timeout=1.0) == [2.0, 2.0]


STALL_RANK = """
import sys, time
import numpy as np
import minicomm as mc
comm = mc.init()
comm.barrier()
if comm.rank == 1:
    time.sleep(float(sys.argv[2]))
print("sum", comm.allreduce(np.ones(1))[0], flush=True)
"""


def test_minicomm_run_timeout_is_per_wait_and_names_the_silent_peer(tmp_path):
    marker = f"mc-life-{uuid.uuid4().hex[:10]}"
    script = tmp_path / f"{marker}.py"
    script.write_text(textwrap.dedent(STALL_RANK))
    run = [sys.executable, "-m", "minicomm.cli", "run", "-n", "2", "--transport", "tcp",
           "--timeout", "1.5"]
    try:
        healthy = subprocess.run(run + [str(script), marker, "0"], capture_output=True,
                                 text=True, timeout=120, cwd=REPO)
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        assert healthy.stdout.count("sum 2.0") == 2
        stalled = subprocess.run(run + [str(script), marker, "30"], capture_output=True,
                                 text=True, timeout=120, cwd=REPO)
        out = stalled.stdout + stalled.stderr
        assert stalled.returncode != 0, out
        assert "[0] minicomm.errors.CommTimeout" in out and "rank 1" in out, out
    finally:
        _kill_all(marker)


# ------------------------------------------------------------------ a peer leaves during setup
class _ReadyStore:
    """A store in which every peer says its segment is ready (and then it is not there)."""
    token = b"k" * 32

    def set(self, key, value):
        pass

    def get(self, key, timeout=None):
        return b"ready 0123456789abcdef"


def test_a_peer_that_left_during_shm_setup_is_a_peerfailure_not_a_filenotfounderror():
    """Found by the chaos suite under load: a peer timed out in setup and unlinked its segment
    between announcing it and our attach; the attach raised a bare FileNotFoundError."""
    from minicomm.transports import shm
    job = f"t{os.getpid()}{uuid.uuid4().hex[:6]}"
    with pytest.raises(mc.PeerFailure, match="rank 1") as info:
        shm.ShmTransport(0, 2, _ReadyStore(), job, [1], 5.0, token=b"k" * 32)
    assert info.value.peer == 1
    assert _segments(job) == []                 # ours was unlinked on the way out


def _one_lost_a_peer_one_hangs(comm):
    if comm.rank == 1:
        raise mc.PeerFailure("rank 1 lost a peer (made up)")
    time.sleep(60)                      # never fails by itself: the launcher kills it


def test_a_rank_killed_after_the_grace_is_never_the_root_cause():
    """Found by the chaos suite: ranks killed after the grace period were stamped with the
    monotonic clock, the ranks' own failures with the wall clock, so a killed rank sorted first."""
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(_one_lost_a_peer_one_hangs, 2, transport="shm", timeout=30)
    root = str(info.value).splitlines()[0]
    assert "root cause: rank 1: PeerFailure" in root, str(info.value)
