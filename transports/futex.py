"""Futex waits on a 32-bit word of a shared mapping, through the C library's ``syscall`` (ctypes).

shm's doorbell: a rank about to sleep publishes the value of a word in its own segment and waits
in ``futex(FUTEX_WAIT)`` while the word still holds it; a peer that published data for it changes
the word and calls ``futex(FUTEX_WAKE)``. The kernel checks the value and queues the sleeper
atomically, so a change made before the wait starts makes the wait return at once: no lost
wake-up (the shm module doc has the full handshake). Shared (not ``FUTEX_PRIVATE``) futexes:
the word lives in memory several processes map.

Available on Linux x86-64 and arm64 (the syscall number is per architecture); elsewhere, when the
C library cannot be loaded, or with ``MINICOMM_FUTEX=0``, ``AVAILABLE`` is False and shm keeps
its socket doorbell. Every wait has a timeout. Cost: one system call per wake, none
when the peer is awake (the caller checks the peer's sleeping flag first).
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import Optional

FUTEX_WAIT, FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load():
    if os.environ.get("MINICOMM_FUTEX", "1").strip().lower() in ("0", "off", "no", "false"):
        return None
    if _SYS_FUTEX is None or not hasattr(os, "sched_getaffinity"):   # not Linux
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load()
AVAILABLE = _syscall is not None


def address_of(buffer, offset: int) -> int:
    """The address of byte ``offset`` of a writable buffer (an mmap). The buffer must stay mapped
    for as long as the address is used (the transport unmaps only after its last wait)."""
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(anchor) + offset
    finally:
        del anchor                    # release the export: the mapping may be closed later


def wait(addr: int, expected: int, timeout: Optional[float]) -> bool:
    """Sleep while the 32-bit word at ``addr`` equals ``expected``, at most ``timeout`` seconds.
    Returns False on a timeout, True otherwise (woken, the word had changed, or a signal)."""
    ts = None
    if timeout is not None:
        t = max(0.0, timeout)
        ts = ctypes.byref(_Timespec(int(t), int((t - int(t)) * 1e9)))
    r = _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(FUTEX_WAIT),
                 ctypes.c_int(expected), ts, None, ctypes.c_int(0))
    if r == 0:
        return True
    e = ctypes.get_errno()
    if e == errno.ETIMEDOUT:
        return False
    if e in (errno.EAGAIN, errno.EINTR):
        return True
    raise OSError(e, f"futex wait: {os.strerror(e)}")


def wake(addr: int, n: int = 1) -> int:
    """Wake up to ``n`` waiters on the word at ``addr``; returns how many were woken."""
    r = _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(FUTEX_WAKE),
                 ctypes.c_int(n), None, None, ctypes.c_int(0))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"futex wake: {os.strerror(e)}")
    return r
