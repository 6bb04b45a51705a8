"""Registered memory of the shm transport (base.RegisteredMemory).

``register_memory(nbytes)`` gives a page-aligned array backed by its own segment
``minicomm-<job>-<rank>-reg<serial>`` (what ``comm.empty`` / ``comm.register`` hand out, like
NCCL's user-buffer registration or MPI_Win_allocate_shared). A message larger than the
receiver's chunk (one the ring would stream) whose bytes lie in such memory travels as a
descriptor naming (serial, offset) (chunk length ``-3``); the receiver maps the segment on first
use (cached, at most ``_REG_MAPS``) and copies -- or reduces -- straight from the sender's memory
into the destination: one memcpy, no system call, for every call including reducing ones. A
message of up to a chunk takes the ring as one record, registered or not (the small path moves
it with no request and no wait for the receiver's read): docs/decisions/registered-buffers.md;
examples/registered_ab.py times registered against plain buffers. The segment's name stays in
/dev/shm while it is registered (peers map it lazily), and goes on ``free_memory``, close, exit
and the launcher's sweep (the names match ``minicomm-<job>-*``); the pages live until the last
mapping goes.
"""
from __future__ import annotations

import bisect
import mmap
import os
from typing import Optional

import numpy as np

from .. import bytecopy
from ..progress import deliver
from .layout import _MAP_FLAGS, _PIECE, PAGE, segment_path
from .peer import _Peer
from .segments import _linked, _reserve_and_map, _unlink

_REG_MAPS = 64                        # peers' registered segments kept mapped per rank


class RegisteredMixin:
    """ShmTransport's registered memory (the module doc). Its state: ``_reg`` (start address ->
    (end, serial, path, mmap)), ``_reg_starts`` (sorted), ``_reg_serial``, and ``_reg_maps``
    ((peer, serial) -> (mmap, u8): the peers' segments mapped here)."""

    def register_memory(self, nbytes: int) -> np.ndarray:
        """A page-aligned uint8 array of ``nbytes`` in a segment of its own that the peers of
        this node map when a message comes from it (module doc, "Registered memory")."""
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            self._reg_serial += 1
            serial = self._reg_serial
        path = f"{segment_path(self.job_id, self.rank)}-reg{serial}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _linked.add(path)
        try:
            mm = _reserve_and_map(fd, size, f"{size} bytes of registered memory",
                                  "enlarge /dev/shm or free registered buffers", mmap.MAP_SHARED)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        u8 = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        start = u8.__array_interface__["data"][0]
        with self._lock:
            self._reg[start] = (start + size, serial, path, mm)
            self._reg_starts = sorted(self._reg)
        return u8

    def free_memory(self, arr: np.ndarray) -> bool:
        """Stop sharing the registered memory ``arr`` lies in (its name goes; the array stays
        valid, now private). False if it is not registered here."""
        key = self._region_of(arr.__array_interface__["data"][0], 0)
        if key is None:
            return False
        with self._lock:
            entry = self._reg.pop(key, None)
            self._reg_starts = sorted(self._reg)
        if entry is not None:
            _unlink(entry[2])
        return entry is not None

    def is_registered(self, arr: np.ndarray) -> bool:
        return self._region_of(arr.__array_interface__["data"][0], arr.nbytes) is not None

    def _region_of(self, addr: int, nbytes: int) -> Optional[int]:
        starts = self._reg_starts
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0:
            return None
        start = starts[i]
        entry = self._reg.get(start)
        if entry is None or addr + nbytes > entry[0]:
            return None
        return start

    def _registered(self, u8: np.ndarray) -> Optional[tuple]:
        """(serial, offset) of a send buffer lying wholly in registered memory, else None."""
        addr = u8.__array_interface__["data"][0]
        start = self._region_of(addr, u8.nbytes)
        if start is None:
            return None
        return self._reg[start][1], addr - start

    def _copy_registered(self, p: _Peer, target, serial: int, off: int, total: int) -> None:
        """Copy (or reduce) ``total`` bytes at ``off`` of ``p``'s registered segment ``serial``
        into ``target``, mapping the segment on first use."""
        key = (p.rank, serial)
        m = self._reg_maps.pop(key, None)
        if m is None:
            path = f"{segment_path(self.job_id, p.rank)}-reg{serial}"
            fd = os.open(path, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            m = (mm, np.frombuffer(mm, dtype=np.uint8))
            while len(self._reg_maps) >= _REG_MAPS:      # forget the least recently used
                self._reg_maps.pop(next(iter(self._reg_maps)))
        self._reg_maps[key] = m                          # most recently used last
        if off + total > m[1].shape[0]:
            raise ValueError(f"registered descriptor past the end of {key}")
        src = m[1]
        # in cache-sized pieces: one memcpy (or ufunc) of many MiB runs slower here (executor.py);
        # a copy through bytecopy: a registered (page-aligned) source and a plain numpy
        # destination lie 16 bytes apart modulo a page, memmove's slow case
        for lo in range(0, total, _PIECE):
            hi = min(total, lo + _PIECE)
            if target.reduce is None:
                bytecopy.copy(target.u8[lo:hi], src[off + lo:off + hi])
            else:
                deliver(target, lo, src[off + lo:off + hi])

    def _release_registered(self) -> None:
        """Unlink our registered segments (the arrays stay valid, private, until they are
        garbage) and forget the peers' mapped ones (teardown)."""
        for entry in self._reg.values():
            _unlink(entry[2])
        self._reg.clear()
        self._reg_starts = []
        self._reg_maps.clear()
