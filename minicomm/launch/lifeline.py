"""Ranks die with their launcher, and clean up on the way out.

Three pieces, used by every launcher of this package (``mc.spawn``'s worker, ``minicomm run``,
the ssh agent):

* ``arm_parent_death(parent)``: ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` through ctypes, so the
  kernel sends this process SIGTERM when its parent dies, even by SIGKILL. The parent may already
  have died before the request took effect (between fork and prctl), so right after arming it
  compares ``getppid()`` with the parent it was started by, and reports the race.
  Linux only; elsewhere it returns False and the launchers' other paths (the spawn worker's
  stdin lifeline, the ssh agent's stdin) remain.
* ``install_orderly_exit(parent, job_id)``: a SIGTERM handler (only where the program left the
  default one) that raises ``Terminated`` (a ``SystemExit``) in the main thread, so ``finally``
  blocks and ``atexit`` run and the rank's /dev/shm segments are unlinked; a watchdog thread
  bounds it: ``EXIT_GRACE`` seconds later it unlinks what is left and ``os._exit``s. When the
  parent is gone (``getppid()`` changed), the rank also sweeps its job's segments by name: no
  launcher is left to do it, and a segment created an instant before the signal may not be in
  the unlink registry yet. Job ids of this package's launchers are random, so the sweep only
  ever touches this job.
* ``EXEC_UNDER_LIFELINE``: the few lines ``minicomm run`` starts each rank with
  (``python -S -c EXEC_UNDER_LIFELINE <launcher pid> python script.py ...``): arm the death signal,
  check the race, then ``execv`` the real command. The death signal survives ``execve``, so the
  user's script runs unchanged, as the direct child of the launcher. (A ``preexec_fn`` would do
  the same without the exec, but is unsafe in a launcher that runs threads: the store's.)

Cost: one prctl at start; one extra small interpreter start per rank under ``minicomm run``.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import threading
from typing import Optional

PR_SET_PDEATHSIG = 1
EXIT_GRACE = 5.0          # seconds an orderly exit may take before it is made abrupt
ORPHAN_EXIT = 70          # exit status of a rank that found its parent gone

# What ``minicomm run`` execs each rank through (see the module doc). Kept to the standard
# library and run with -S: it costs a bare interpreter start, not an import of minicomm.
EXEC_UNDER_LIFELINE = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    sys.exit(70)
os.execv(sys.argv[2], sys.argv[2:])
"""

_state = {"parent": None, "job": None, "terminating": False, "installed": False}


class Terminated(SystemExit):
    """Raised in the main thread by the orderly SIGTERM handler: exit status 128 + signal."""

    def __init__(self, signum: int, orphaned: bool):
        super().__init__(128 + signum)
        self.signum, self.orphaned = signum, orphaned

    def __str__(self) -> str:
        why = " (its launcher died)" if self.orphaned else ""
        return f"rank terminated by {signal.Signals(self.signum).name}{why}"


def arm_parent_death(parent: int, sig: int = signal.SIGTERM) -> Optional[bool]:
    """Have the kernel send ``sig`` when our parent dies. Returns True when armed and the parent
    is still ``parent``, False when the parent is already gone (the caller should leave), None
    where the platform has no PR_SET_PDEATHSIG."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return None
    return os.getppid() == parent


def orphaned() -> bool:
    parent = _state["parent"]
    return parent is not None and os.getppid() != parent


def cleanup_now() -> None:
    """Unlink this process's segments, and the job's when its launcher is gone. Idempotent."""
    try:
        from ..transports import segment
        segment._unlink_at_exit()       # shm rings, rdma / ub arenas, windows: one registry
    except Exception:
        pass
    job = _state["job"]
    if job and orphaned():
        try:
            from ..transports.shm import sweep_job_segments
            sweep_job_segments(job)
        except Exception:
            pass


def _abrupt_exit_after(grace: float, code: int) -> None:
    threading.Event().wait(grace)      # the bound on the orderly exit (never set: a timed wait)
    cleanup_now()
    os._exit(code)


def _on_sigterm(signum, frame):
    if _state["terminating"]:          # a second SIGTERM: the first one's exit is under way
        return
    _state["terminating"] = True
    threading.Thread(target=_abrupt_exit_after, args=(EXIT_GRACE, 128 + signum), daemon=True,
                     name="minicomm-exit-watchdog").start()
    raise Terminated(signum, orphaned())


def install_orderly_exit(parent: Optional[int] = None, job_id: Optional[str] = None) -> bool:
    """SIGTERM -> ``Terminated`` in the main thread, bounded by a watchdog; at exit, the job's
    segments are swept if the parent (``parent``) is gone. Does nothing (returns False) off the
    main thread or where the program installed its own SIGTERM handler."""
    if parent is not None:
        _state["parent"] = parent
    if job_id:
        _state["job"] = job_id
    if _state["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    atexit.register(cleanup_now)
    _state["installed"] = True
    return True


def terminate_self() -> None:
    """From any thread: leave the way SIGTERM does (orderly, then abrupt after the grace)."""
    os.kill(os.getpid(), signal.SIGTERM)
    _abrupt_exit_after(EXIT_GRACE, ORPHAN_EXIT)
