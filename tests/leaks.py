"""The check every real-process test module shares: after each test, no /dev/shm segment of the
job and no rank process of this test process is left (import ``nothing_left_behind``)."""
import contextlib
import os
import subprocess
import threading

import pytest


def job_segments(job_id):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"minicomm-{job_id}"))


def my_worker_processes():
    """Rank processes that are children of this test process (other jobs may run alongside)."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "minicomm.launch.worker"],
                         capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


@pytest.fixture(autouse=True)
def nothing_left_behind():
    from minicomm.launch import local as launch
    launch.last_job_id = None
    yield
    if launch.last_job_id:
        assert job_segments(launch.last_job_id) == [], "a /dev/shm segment leaked"
    assert my_worker_processes() == [], "a rank process was left running"


@contextlib.contextmanager
def thread_exceptions():
    """Every exception that escapes a background thread of this process while the block runs,
    as text (thread: type: message); the previous ``threading.excepthook`` is restored after."""
    caught = []
    old = threading.excepthook
    threading.excepthook = lambda args: caught.append(
        f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")
    try:
        yield caught
    finally:
        threading.excepthook = old
