"""Hardening (issue 14, first part): defects a red-team pass found, each reproduced here first."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import minicomm as mc
from minicomm.transports import shm


def test_failed_shm_setup_never_deletes_a_segment_it_did_not_create(tmp_path):
    job = f"t{os.getpid()}x"
    path = shm.segment_path(job, 0)
    with open(path, "wb") as f:                     # someone else's file, with a guessable name
        f.write(b"not yours")
    try:
        with pytest.raises(mc.CommError, match="exists"):
            shm.ShmTransport(0, 2, None, job, [1], 1.0, token=b"k" * 32)
        assert open(path, "rb").read() == b"not yours"
    finally:
        os.unlink(path)


def test_spawn_timeout_is_a_per_wait_limit_not_a_job_deadline():
    def fn(comm, seconds):
        comm.barrier()
        time.sleep(seconds)              # both ranks compute for longer than timeout + 5 s
        return float(comm.allreduce(np.ones(1))[0])
    assert mc.spawn(fn, 2, args=(7.0,), transport="shm", timeout=1.5) == [2.0, 2.0]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_spawn_caller_leaves_no_segment_and_no_rank(tmp_path, sig):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import numpy as np
        import minicomm as mc
        from minicomm.launch import local
        def fn(comm):
            comm.barrier()
            print("ready", flush=True) if comm.rank == 0 else None
            time.sleep(60)
        orig = local._collect
        def collect(*a, **k):
            print("job", local.last_job_id, flush=True)
            return orig(*a, **k)
        local._collect = collect
        mc.spawn(fn, 2, transport="shm", timeout=120)
    """))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    job = None
    try:
        for line in p.stdout:
            if line.startswith("job "):
                job = line.split()[1]
            if line.startswith("ready"):
                break
        assert job is not None
        os.kill(p.pid, sig)
        p.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            left = [f for f in os.listdir("/dev/shm") if f.startswith(f"minicomm-{job}-")]
            ranks = subprocess.run(["pgrep", "-f", "minicomm.launch.worker", "-s", str(p.pid)],
                                   capture_output=True, text=True).stdout.split()
            if not left and not ranks:
                break
            time.sleep(0.2)          # polling the outcome, bounded by the deadline
        assert left == [] and ranks == [], (left, ranks)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        subprocess.run(["pkill", "-9", "-s", str(p.pid)], capture_output=True)
