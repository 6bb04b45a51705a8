"""One-sided access over the shm transport: a window's memory as a shared mapping, nothing more.

Every rank puts its window memory in ``/dev/shm/minicomm-<job>-<name>-<rank>`` (segment.py's
``Arena``: the first page holds the mutex, the window's bytes follow); every peer maps it.
``put`` and ``get`` are one memcpy into / out of the target's memory; a read-modify-write
(``update``: accumulate, fetch-and-op, compare-and-swap, the window's lock word) runs under the
target's process-shared mutex, so every one of them on a target is atomic with respect to the
others, whatever the op or dtype. Nothing on the target side takes part (its process may be busy
computing). The names are unlinked once every member has mapped them (``seal``, after the
window's creation barrier), on close and at exit. ``peer_gone`` tells a window waiting for a
lock whether the rank holding it is gone, from what the transport knows of that peer's link.

This is MPI_Win_allocate_shared's mechanism (what MPICH does for ranks of one node), the fastest
way one process can reach another's memory; the rdma and ub transports simulate NICs instead.

Cost: put / get of n bytes: one copy (n / memory bandwidth); an atomic: a mutex round trip
(through ctypes) plus the operation.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from minicomm.errors import CommError
from .base import ChannelBase
from .bytecopy import copy
from .segment import PAGE, Arena, SharedMutex, hung_up, round_up


class ShmRma:
    """The one-sided interface of a ShmTransport (what ``transports.rma_backend`` returns)."""

    def __init__(self, transport):
        self.t = transport
        self.rank = transport.rank

    def rma_expose(self, nbytes: int, name: str) -> "ShmExposure":
        path = os.path.join("/dev/shm", f"minicomm-{self.t.job_id}-{name}-{self.rank}")
        return ShmExposure(path, nbytes)

    def rma_attach(self, peer: int, descriptor: bytes, channel: int) -> "ShmChannel":
        return ShmChannel(descriptor.decode(), self.t, peer)


class ShmExposure:
    def __init__(self, path: str, nbytes: int):
        self.arena = Arena.create(path, round_up(PAGE + max(nbytes, 1)))
        try:
            self.arena.reserve(0, PAGE + nbytes)
            SharedMutex.initialize(self.arena, 0)
        except BaseException:
            self.arena.close()
            raise
        self.u8 = self.arena.u8[PAGE:PAGE + nbytes]
        self.descriptor = path.encode()

    def seal(self) -> None:
        """Every member mapped it: the name can go."""
        self.arena.unlink()

    def close(self) -> None:
        if self.arena is not None:
            self.u8 = None
            self.arena.close()
            self.arena = None


class ShmChannel(ChannelBase):
    """Direct access to one target's window memory (module doc)."""
    mapped = True             # typed views, update() and the target's mutex
    native_atomics = False    # fadd / cas are updates under the mutex
    native_swap = False

    def __init__(self, path: str, transport, peer: int):
        self.t, self.peer = transport, peer
        try:
            self.arena = Arena.attach(path)
        except FileNotFoundError:
            raise CommError(f"shm window: {path} is gone (its owner closed the window)") from None
        self.mutex = SharedMutex(self.arena, 0, f"window memory {os.path.basename(path)}")
        self.u8 = self.arena.u8[PAGE:]

    def typed(self, off: int, dtype, count: int) -> np.ndarray:
        return self.u8[off:off + count * np.dtype(dtype).itemsize].view(dtype)

    def put(self, off: int, src: np.ndarray) -> None:
        copy(self.u8[off:off + src.nbytes], src)

    def get(self, off: int, dst: np.ndarray) -> None:
        copy(dst, self.u8[off:off + dst.nbytes])

    def update(self, off: int, nbytes: int, fn):
        """``fn(view)`` on the target's bytes [off, off+nbytes) under its mutex."""
        m = self.mutex
        m.acquire()
        try:
            return fn(self.u8[off:off + nbytes])
        finally:
            m.release()

    def fadd(self, off: int, value: int) -> int:
        def op(v):
            w = v.view(np.int64)
            old = int(w[0])
            w += np.int64(value)
            return old
        return self.update(off, 8, op)

    def cas(self, off: int, compare: int, swap: int) -> int:
        def op(v):
            w = v.view(np.int64)
            old = int(w[0])
            if old == compare:
                w[0] = swap
            return old
        return self.update(off, 8, op)

    def flush(self) -> None:
        pass

    def peer_gone(self) -> Optional[str]:
        """Why this channel's peer is known gone (exited, crashed, aborted, closed its transport), or
        None while it is up; never blocks. The shm transport records it when it reads the
        peer's doorbell socket; a socket that hung up (``hung_up``, nothing read) is read here
        under the transport's lock, as its progress engine would."""
        t = self.t
        p = t._peers.get(self.peer)   # None: this rank itself
        if p is None:
            return None
        if p.closed is None and p.sock is not None and hung_up(p.fd):
            with t._lock:
                if p.closed is None:
                    t._on_doorbell(p)
        return p.closed

    def close(self) -> None:
        if self.arena is not None:
            self.u8 = None
            self.arena.close()
            self.arena = None
