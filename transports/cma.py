"""cma: single-copy transfers between processes of one node (Linux cross-memory attach).

``process_vm_readv(pid, local_iov, remote_iov)`` copies bytes from another process's address
space into ours in one pass inside the kernel: no shared staging buffer, no copy into it. The
shm transport uses it for large messages (shm/singlecopy.py): the sender publishes
(address, length) of its buffer in a ring record, the receiver reads it straight into the
destination (or, for a reducing receive, into a small cache-resident scratch it reduces from),
then hands the record's ring space back, which tells the sender its buffer is free again. MPICH
and Open MPI move large intra-node messages the same way.

Restrictions. Linux >= 3.2 and a C library that exports the calls (glibc >= 2.15, musl), reached
through ctypes. The kernel allows it only where the reader may ptrace the target
(PTRACE_MODE_ATTACH: same user, and ``kernel.yama.ptrace_scope`` 0, or the reader has
CAP_SYS_PTRACE); containers often forbid it by seccomp, and ranks in different pid namespaces
cannot name each other. None of that is assumed: ``probe`` reads a known token from each peer at
setup, and a pair whose probe fails (or ``MINICOMM_CMA=0``) keeps the ring path: the same
algorithms, the data copied twice through shared memory. The choice per peer is logged under
``MINICOMM_DEBUG=info`` and shown by ``ShmTransport.describe_copies()``.

Cost: one system call per transfer plus one copy of the bytes, the kernel pinning the remote
pages as it goes. How fast that copy is, against a user-space memcpy, differs from machine to
machine (docs/decisions/shm-single-copy-threshold.md). So the setup probe also times the pair
(``pace``: the best of three 256 KiB reads of the peer's probe buffer, and of three local copies
of as many bytes), and ``choose_min`` picks the size from which that peer's collective sends go
single-copy: ``DEFAULT_MIN`` where the read keeps up with the ring's two copies, ``SLOW_MIN``
where it does not. ``MINICOMM_CMA_MIN`` fixes the size for every pair instead.
"""
from __future__ import annotations

import ctypes
import errno
import os
import time
from typing import Optional

import numpy as np

ENV = "MINICOMM_CMA"                 # "0" / "off": never use single-copy reads
MIN_ENV = "MINICOMM_CMA_MIN"         # messages of at least this many bytes go single-copy
# A collective's messages go single-copy from DEFAULT_MIN (its schedule is verified deadlock-free
# under rendezvous sends); point-to-point sends stay eager, through the ring, up to P2P_MIN: such
# a send returns at once, while its receiver computes (a parameter server's push), where a
# single-copy send waits for the receiver to enter the library. Where the kernel's read is slow
# against a local copy (``choose_min``), only from SLOW_MIN. The thresholds:
# docs/decisions/shm-single-copy-threshold.md
DEFAULT_MIN = 256 << 10
P2P_MIN = 2 << 20
SLOW_MIN = 16 << 20
PACE_BYTES = 256 << 10               # what the setup probe reads and copies to time the pair


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_calls = None                        # (readv, writev), bound on first use
_unbound: Optional[str] = None       # why they could not be bound


def _bind():
    global _calls, _unbound
    if _calls is None and _unbound is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fns = []
            for name in ("process_vm_readv", "process_vm_writev"):
                fn = getattr(libc, name)
                fn.restype = ctypes.c_ssize_t
                fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                               ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
                fns.append(fn)
            _calls = tuple(fns)
        except (OSError, AttributeError) as e:
            _unbound = f"process_vm_readv is not available from the C library ({e})"
    return _calls


def disabled() -> Optional[str]:
    """Why single-copy transfers are off in this process before any probe (None: not off)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "no", "false"):
        return f"{ENV}={os.environ[ENV]}"
    if _bind() is None:
        return _unbound
    return None


def choose_min(read_s: float, copy_s: float) -> int:
    """The size from which a collective's messages to a peer go single-copy, from the setup
    probe's best-of-3 times for reading ``PACE_BYTES`` of the peer's memory and for a local copy
    of as many bytes: ``DEFAULT_MIN`` where the read keeps up with the ring's two copies of a
    record (``read_s <= 2 * copy_s``), ``SLOW_MIN`` where it does not."""
    return DEFAULT_MIN if read_s <= 2 * copy_s else SLOW_MIN


def min_override() -> bool:
    """Whether ``MINICOMM_CMA_MIN`` fixes the threshold (the probe's pace is then not used)."""
    return os.environ.get(MIN_ENV) is not None


def min_bytes(p2p: bool = False) -> int:
    """The size from which a message goes single-copy: ``MINICOMM_CMA_MIN`` where set (for every
    message), else ``DEFAULT_MIN`` for a collective's, ``P2P_MIN`` for a point-to-point send's."""
    raw = os.environ.get(MIN_ENV)
    if raw is None:
        return P2P_MIN if p2p else DEFAULT_MIN
    try:
        v = int(raw)
    except ValueError:
        v = -1
    if v < 0:
        raise ValueError(f"{MIN_ENV}={raw!r}: expected a byte count >= 0")
    return v


class CmaError(OSError):
    """A single-copy transfer failed; ``errno`` says why (ESRCH: the peer is gone)."""


def _address(buf: np.ndarray) -> int:
    return buf.__array_interface__["data"][0]


def _transfer(which: int, pid: int, local: np.ndarray, remote_addr: int) -> None:
    fns = _bind()
    if fns is None:
        raise CmaError(errno.ENOSYS, _unbound)
    if not local.flags.c_contiguous:
        raise ValueError("cma: the local buffer must be contiguous")
    n = local.nbytes
    base = _address(local)
    fn = fns[which]
    done = 0
    lv, rv = _IoVec(), _IoVec()
    lp, rp = ctypes.byref(lv), ctypes.byref(rv)
    while done < n:                   # the kernel may move fewer bytes than asked: go on
        lv.iov_base, lv.iov_len = base + done, n - done
        rv.iov_base, rv.iov_len = remote_addr + done, n - done
        got = fn(pid, lp, 1, rp, 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EIO
            verb = "process_vm_readv from" if which == 0 else "process_vm_writev to"
            raise CmaError(err, f"{verb} pid {pid} at {remote_addr + done:#x} "
                                f"({n - done} bytes): {os.strerror(err)}")
        done += got


def read(pid: int, remote_addr: int, dst: np.ndarray) -> None:
    """Copy ``dst.nbytes`` bytes at ``remote_addr`` in process ``pid`` into ``dst``."""
    _transfer(0, pid, dst, remote_addr)


def write(pid: int, remote_addr: int, src: np.ndarray) -> None:
    """Copy ``src`` to ``remote_addr`` in process ``pid``."""
    _transfer(1, pid, src, remote_addr)


def pace(pid: int, remote_addr: int, scratch: np.ndarray, local: np.ndarray,
         tries: int = 3) -> tuple:
    """(read seconds, copy seconds): the best of ``tries`` reads of ``scratch.nbytes`` bytes at
    ``remote_addr`` of ``pid`` into ``scratch``, and of as many local copies of ``local`` into
    ``scratch`` (the caller places ``scratch`` at the remote buffer's page offset and ``local``
    at its own, so neither copy meets the page skew of bytecopy.py)."""
    best_read = best_copy = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        read(pid, remote_addr, scratch)
        t1 = time.perf_counter()
        scratch[...] = local
        t2 = time.perf_counter()
        best_read, best_copy = min(best_read, t1 - t0), min(best_copy, t2 - t1)
    return best_read, best_copy


def probe(pid: int, remote_addr: int, expected: bytes) -> Optional[str]:
    """None if this process can read ``expected`` at ``remote_addr`` of ``pid``, else why not
    (the reason names the errno and the usual cause)."""
    why = disabled()
    if why is not None:
        return why
    got = np.zeros(len(expected), dtype=np.uint8)
    try:
        read(pid, remote_addr, got)
    except CmaError as e:
        hint = {errno.EPERM: " (ptrace access denied: kernel.yama.ptrace_scope, a container's "
                             "seccomp profile, or another user)",
                errno.ENOSYS: " (the kernel or a seccomp filter lacks the call)",
                errno.ESRCH: " (no such process here: another pid namespace?)"}.get(e.errno, "")
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}{hint}"
    if got.tobytes() != expected:
        return f"pid {pid} holds other bytes at {remote_addr:#x} (another pid namespace?)"
    return None
