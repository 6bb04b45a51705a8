"""Shared memory for the one-sided transports: /dev/shm arenas, a process-shared lock, event rings.

What is real here. An ``Arena`` is a POSIX shared-memory file ``/dev/shm/minicomm-<job>-<what>``
mapped MAP_SHARED by its owner and by every peer on the same host: a store by one process is a
load by the other, with no system call and no involvement of the owner (that is what makes the
simulated RDMA WRITE and UB store inside a node truly one-sided). The file is sparse: pages are
reserved (``posix_fallocate``, so a full /dev/shm fails at registration, never as a SIGBUS later)
only when a region is carved out of it. The name is unlinked as soon as every peer has mapped it,
on close, on every setup error and at exit; the launcher sweeps what a SIGKILLed rank left.

``SharedMutex`` is a robust, process-shared pthread mutex living inside an arena (reached through
ctypes; Linux/glibc). It is the "atomic unit" of a simulated NIC: every atomic on a region
(FETCH_ADD, CMP_SWAP, UB's FAND/FOR/...) runs under its region's mutex, whoever runs it (a peer's
process inside the node, the owner's NIC agent thread for a peer on another node, the owner
itself), so atomics on one region are atomic with respect to each other, as on a real NIC. A
holder that dies releases it (EOWNERDEAD makes the next holder take over). Acquiring it has a
deadline.

``EventRing`` is a single-producer / single-consumer ring of 64-byte records in an arena, the
shared half of a completion queue: a peer inside the node appends "your region received a
WRITE_WITH_IMM / SEND" records, the owner consumes them. ``head`` (producer) and ``tail``
(consumer) live on separate cache lines and are published with one aligned 8-byte store each,
after the record (x86-64 TSO orders the stores; weakly ordered CPUs would need fences pure Python
cannot issue, the same limitation as the shm transport).

Cost: an access is a memcpy; an atomic is a mutex round trip (through ctypes); an event is a
record store plus, if the consumer sleeps, one doorbell write on a socket.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import mmap
import os
import select
import struct
import time
from typing import Optional

import numpy as np

from minicomm.errors import CommError, CommTimeout

SHM_DIR = "/dev/shm"
PAGE = 4096
_linked: set = set()                  # arena files this process created and has not unlinked


def unlink(path: Optional[str]) -> None:
    if path is None:
        return
    _linked.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_at_exit() -> None:
    for path in list(_linked):
        unlink(path)


def check_owner(fd: int, path: str) -> None:
    """Refuse a segment this user did not create: names under /dev/shm can be guessed, so a file
    another user made there first (or one anybody may write) is never mapped."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise CommError(f"shm: {path} is owned by uid {st.st_uid}, not by this job's user "
                        f"({os.geteuid()}); refusing to map it")
    if st.st_mode & 0o077:
        raise CommError(f"shm: {path} has permissions {st.st_mode & 0o777:o}, not owner-only "
                        f"(0600); refusing to map it")


def hung_up(fd: int) -> bool:
    """Whether the far end of the stream socket ``fd`` hung up (its process exited, crashed, or
    shut its side down), seen without reading: a recv would take a doorbell byte that the
    progress engine's blocked waiter needs; poll() reports POLLRDHUP / POLLHUP / POLLERR and
    consumes nothing."""
    if fd < 0:
        return False
    p = select.poll()
    p.register(fd, select.POLLRDHUP)
    return bool(p.poll(0))


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


class Arena:
    """A sparse shared-memory file mapped in this process (see module doc)."""

    def __init__(self, path: str, mm: mmap.mmap, fd: int, owner: bool):
        self.path, self.mm, self.owner = path, mm, owner
        self._fd = fd                 # the owner keeps it to reserve pages later
        self.size = len(mm)
        self.u8 = np.frombuffer(mm, dtype=np.uint8)
        self.q = memoryview(mm).cast("q")          # aligned 8-byte loads / stores
        ptr = ctypes.c_char.from_buffer(mm)
        self.address = ctypes.addressof(ptr)       # for SharedMutex (no lasting buffer export)
        del ptr

    @classmethod
    def create(cls, path: str, size: int) -> "Arena":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _linked.add(path)
        try:
            os.ftruncate(fd, size)                 # sparse: no page is taken yet
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            unlink(path)
            raise
        return cls(path, mm, fd, True)

    @classmethod
    def attach(cls, path: str) -> "Arena":
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            check_owner(fd, path)
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(path, mm, -1, False)

    def reserve(self, off: int, n: int) -> None:
        """Take the pages of [off, off+n) now, so a full /dev/shm is an error here."""
        if self._fd < 0 or n == 0:
            return
        try:
            os.posix_fallocate(self._fd, off, n)
        except OSError as e:
            raise CommError(f"cannot reserve {n} bytes in {SHM_DIR} ({e.strerror}); "
                            f"enlarge /dev/shm") from None

    def release(self, off: int, n: int) -> None:
        """Give the pages of a freed range back (they read as zeros when reused)."""
        start, end = round_up(off), (off + n) // PAGE * PAGE
        if end > start and hasattr(mmap, "MADV_REMOVE"):
            try:
                self.mm.madvise(mmap.MADV_REMOVE, start, end - start)
            except OSError:
                self.u8[start:end] = 0

    def unlink(self) -> None:
        unlink(self.path)

    def close(self) -> None:
        if self.owner:
            self.unlink()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.mm is not None:
            self.q.release()
            self.u8 = None
            try:
                self.mm.close()
            except BufferError:       # a caller still holds a view: the GC unmaps it later
                pass
            self.mm = None


# ------------------------------------------------------------------------------- the mutex
MUTEX_BYTES = 64                      # glibc x86-64 pthread_mutex_t is 40 bytes
_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        for name in ("pthread_mutex_trylock", "pthread_mutex_timedlock", "pthread_mutex_unlock",
                     "pthread_mutex_consistent", "pthread_mutex_init"):
            getattr(lib, name).argtypes = [ctypes.c_void_p] + (
                [ctypes.c_void_p] if name in ("pthread_mutex_timedlock", "pthread_mutex_init")
                else [])
        _libc = lib
    return _libc


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class SharedMutex:
    """A robust process-shared pthread mutex at ``arena.address + off`` (see module doc)."""
    __slots__ = ("addr", "what", "_try", "_unlock")

    def __init__(self, arena: Arena, off: int, what: str = "region"):
        lib = _lib()
        self.addr = ctypes.c_void_p(arena.address + off)
        self.what = what
        self._try, self._unlock = lib.pthread_mutex_trylock, lib.pthread_mutex_unlock

    @staticmethod
    def initialize(arena: Arena, off: int) -> None:
        """Owner side, once: a fresh robust, process-shared mutex."""
        lib = _lib()
        attr = ctypes.create_string_buffer(64)
        lib.pthread_mutexattr_init(attr)
        if lib.pthread_mutexattr_setpshared(attr, 1) or lib.pthread_mutexattr_setrobust(attr, 1):
            raise CommError("this libc has no process-shared robust mutexes")
        if lib.pthread_mutex_init(ctypes.c_void_p(arena.address + off), attr):
            raise CommError("pthread_mutex_init failed")
        lib.pthread_mutexattr_destroy(attr)

    def acquire(self, timeout: float = 60.0) -> None:
        rc = self._try(self.addr)
        if rc == 0:
            return
        if rc == errno.EBUSY:
            deadline = time.time() + timeout
            ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
            rc = _lib().pthread_mutex_timedlock(self.addr, ctypes.byref(ts))
            if rc == 0:
                return
        if rc == errno.EOWNERDEAD:    # its holder died mid-operation: take it over
            _lib().pthread_mutex_consistent(self.addr)
            return
        if rc == errno.ETIMEDOUT:
            raise CommTimeout(f"the atomic unit of {self.what} stayed locked for {timeout:.0f} s")
        raise CommError(f"locking the atomic unit of {self.what} failed: {os.strerror(rc)}")

    def release(self) -> None:
        self._unlock(self.addr)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self._unlock(self.addr)


# --------------------------------------------------------------------------- event rings
EVENT = struct.Struct("@8q")          # one 64-byte record: kind, channel, imm, nbytes, a, b, c, d
EVENT_BYTES = 64
_HEAD, _TAIL = 0, 8                   # int64 index within the ring's control block (own lines)
RING_CONTROL = 128


def ring_bytes(entries: int) -> int:
    return RING_CONTROL + entries * EVENT_BYTES


class EventRing:
    """One direction of the shared event path: the producer's or the consumer's handle."""
    __slots__ = ("arena", "off", "entries", "q", "mm", "data", "head", "tail")

    def __init__(self, arena: Arena, off: int, entries: int):
        self.arena, self.off, self.entries = arena, off, entries
        self.mm = arena.mm
        self.q = arena.q
        self.data = off + RING_CONTROL
        self.head = self.q[(off >> 3) + _HEAD]
        self.tail = self.q[(off >> 3) + _TAIL]

    def push(self, *fields) -> bool:
        """Producer: append one record (up to 8 ints); False if the ring is full."""
        head = self.head
        if head - self.tail >= self.entries:
            self.tail = self.q[(self.off >> 3) + _TAIL]
            if head - self.tail >= self.entries:
                return False
        EVENT.pack_into(self.mm, self.data + (head % self.entries) * EVENT_BYTES,
                        *fields, *(0,) * (8 - len(fields)))
        self.head = head + 1
        self.q[(self.off >> 3) + _HEAD] = head + 1           # publish
        return True

    def pop_all(self):
        """Consumer: every published record, oldest first (the space is handed back at once)."""
        head = self.q[(self.off >> 3) + _HEAD]
        tail = self.tail
        if head == tail:
            return ()
        out = [EVENT.unpack_from(self.mm, self.data + (i % self.entries) * EVENT_BYTES)
               for i in range(tail, head)]
        self.tail = head
        self.q[(self.off >> 3) + _TAIL] = head
        return out
