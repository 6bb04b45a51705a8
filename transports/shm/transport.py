"""``ShmTransport``: the shm transport's parts (one mixin per concern, see the package doc)
composed into one engine of the progress loop, with its capabilities, ``abort`` and ``close``.

The mixins only split the source: every method is the class's own at run time (one attribute
lookup, as before), so the hot paths (``send_now`` / ``recv_now`` / ``_take`` / ``_put``) gain no
call layer.
"""
from __future__ import annotations

import mmap
import os
import socket
import time
from typing import Dict, List, Optional

import numpy as np

from .. import bytecopy, cma
from ..base import Capabilities
from ..progress import LinkEngine, Progress
from ..shmrma import ShmRma
from .doorbell import _ABORT, _BYE, _NOWAIT, DoorbellMixin, _oversubscribed
from .eager import EagerMixin
from .layout import _JOB_ID
from .peer import _Peer
from .registered import RegisteredMixin
from .ring import RingMixin
from .segments import SegmentsMixin
from .singlecopy import SingleCopyMixin


class ShmTransport(EagerMixin, RingMixin, DoorbellMixin, SingleCopyMixin, RegisteredMixin,
                   SegmentsMixin, LinkEngine):
    """The two-sided transport over /dev/shm between the ranks of one node (the package doc)."""
    name = "shm"

    def __init__(self, rank: int, size: int, store, job_id: str, peers, timeout: float,
                 token: Optional[bytes] = None, progress: Optional[Progress] = None):
        if not _JOB_ID.fullmatch(str(job_id)):
            raise ValueError(f"invalid job id {job_id!r}: letters, digits, '_', '.', '-' only")
        self.rank, self.size, self.job_id = rank, size, str(job_id)
        self.peer_ranks = sorted(int(p) for p in peers if p != rank)
        self._token = token if token is not None else store.token
        self._progress = progress or Progress()
        self._lock = self._progress.lock
        self._peers: Dict[int, _Peer] = {p: _Peer(p) for p in self.peer_ranks}
        self._active: Dict[_Peer, None] = {}     # peers with queued work (an ordered set)
        self._mm: Optional[mmap.mmap] = None
        self._flag_q = None                       # our segment's first page as int64 words
        self._futex_i = None                      # ... and as int32 words (our futex word)
        self._futex_addr = 0
        self._wake_seq = 0
        self.futex_ok = False                     # the progress engine may sleep on our word
        self.futex_sleeps = 0                     # how often it did (tests, profiles)
        self._path: Optional[str] = None
        self._aborted: Optional[str] = None
        self._cancelled: Dict[int, BaseException] = {}
        self._closed = False
        self._listener: Optional[socket.socket] = None
        self._cma_min, self._cma_min_p2p = cma.min_bytes(), cma.min_bytes(p2p=True)
        self._cma_off = cma.disabled()           # why this side never sends single-copy
        # reducing calls keep the ring: docs/decisions/shm-single-copy-threshold.md
        self._cma_reduce = False
        # the setup probe's buffer: a random token at its start, and PACE_BYTES that a peer reads
        # to time its single-copy pace against ours (page-aligned: no skew, bytecopy.py)
        self._probe_buf = bytecopy.page_aligned(cma.PACE_BYTES)
        self._probe_buf[:16] = np.frombuffer(os.urandom(16), dtype=np.uint8)
        self._reg_starts: List[int] = []         # registered memory: sorted start addresses,
        self._reg: Dict[int, tuple] = {}         # start -> (end, serial, path, mmap)
        self._reg_serial = 0
        self._reg_maps: Dict[tuple, tuple] = {}  # (peer, serial) -> (mmap, u8): peers' memory
        self.received_single_copy = {"cma": 0, "registered": 0}   # messages, by path
        self._scratch: Optional[np.ndarray] = None   # a reducing single-copy receive's pieces
        # ranks of this node outnumber its cores: a waiting rank yields its core between polls
        self._spin_yields = self.oversubscribed = _oversubscribed(len(self.peer_ranks) + 1)
        try:
            if self.peer_ranks:
                self._setup(store, time.monotonic() + timeout)
        except BaseException:
            self._teardown()
            raise
        finally:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        self._progress.attach(self, True)

    def capabilities(self) -> Capabilities:
        """Every capability: the eager channel, registered memory and single-copy reads are this
        transport's own; one-sided access maps the windows' memory directly (shmrma.py)."""
        return Capabilities(eager=self, registered=self, single_copy=self, one_sided=ShmRma(self),
                            oversubscribed=self.oversubscribed, describe=self.describe,
                            job_id=self.job_id)

    def _peer(self, peer: int) -> _Peer:
        try:
            return self._peers[peer]
        except KeyError:
            raise ValueError(f"rank {self.rank}: no shm route to rank {peer} "
                             f"(shm peers: {self.peer_ranks})") from None

    def _link(self, peer: int):
        return self._peers[peer]

    def _links(self):
        return self._peers.values()

    # --------------------------------------------------------------------------- lifetime
    def abort(self, reason: str) -> None:
        with self._lock:
            if self._aborted is not None or self._closed:
                return
            self._aborted = reason
            for p in self._peers.values():
                if p.sock is None:
                    continue
                try:
                    p.sock.send(_ABORT + reason.encode()[:2000], _NOWAIT)
                    p.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self._futex_wake(p)   # a peer asleep on its word reads the reason now

    def _exclude(self, p: _Peer, reason: str) -> None:
        """Under the lock: ``p``'s link alone ends as ``abort`` ends all (the reason, then EOF;
        ours shut both ways so nothing it sends is read as news)."""
        if p.sock is None:
            return
        try:
            p.sock.send(_ABORT + reason.encode()[:2000], _NOWAIT)
            p.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._futex_wake(p)           # a peer asleep on its word reads the reason now

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in self._peers.values():
                if p.fd >= 0:
                    self._progress.unregister(p.fd)
                if p.sock is not None and self._aborted is None:
                    try:
                        p.sock.send(_BYE, _NOWAIT)    # orderly: peers tell it from a crash
                    except OSError:
                        pass
                    self._futex_wake(p)
        self._progress.detach(self)
        self._teardown()
