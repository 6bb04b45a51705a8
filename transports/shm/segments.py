"""Segments of the shm transport: created, attached, unlinked; the setup handshake and probe.

Setup. Each rank creates its segment (layout.py) with ``O_EXCL`` and mode 0600, reserves its
bytes (a full /dev/shm is a ``CommError`` now, not a SIGBUS on a later store) and announces it in
the store with the abstract name of its doorbell listener, which has a random part (a name
guessed from the job id cannot be squatted first). It then maps every peer's segment (trusting
only files of its own uid), probes each peer's memory for single-copy reads (singlecopy.py) and
leaves the verdict in the control page of the ring that peer sends into. Per peer pair one
authenticated AF_UNIX stream connection then carries doorbells (doorbell.py): connections from
another uid are refused (SO_PEERCRED), and strays are handled as rendezvous.py describes
(bounded, no thread each; dialers retry).

Lifetime. A segment is unlinked as soon as every peer has attached to it (every peer maps all
segments of its node before it completes the doorbell handshake, so a finished handshake with
every peer proves it), on close, on any setup error and at exit; ``sweep_job_segments`` removes
what a SIGKILLed rank left (the launcher calls it).
"""
from __future__ import annotations

import glob
import mmap
import os
import secrets
import socket
import struct
import sys
import time
from typing import List

import numpy as np

from minicomm.errors import CommError, CommTimeout, PeerFailure
from minicomm.rendezvous import accept_peers, dial_peer
from minicomm.settings import byte_setting
from .. import bytecopy, cma, futex, segment
from .layout import (
    _CMA_FROM,
    _CMA_OK,
    _FUTEX_WORD,
    _JOB_ID,
    _MAGIC,
    _MAP_FLAGS,
    _PROBE,
    _PROBE_AT,
    _RANKS_AT,
    _SEG,
    CHUNK,
    EAGER,
    PAGE,
    SHM_DIR,
    _default_ring_bytes,
    segment_path,
)
from .peer import _Peer

# One registry of the segments this process created and has not unlinked (segment.py's, shared
# with the rdma / ub arenas and the windows), emptied at exit and when a rank's parent dies.
_linked, _unlink = segment._linked, segment.unlink


def sweep_job_segments(job_id: str) -> List[str]:
    """Unlink every /dev/shm/minicomm-<job_id>-* (after ranks were killed); returns the paths."""
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"invalid job id {job_id!r}")
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"minicomm-{glob.escape(job_id)}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _reserve_and_map(fd: int, size: int, what: str, remedy: str, flags: int) -> mmap.mmap:
    """Reserve ``size`` bytes of a new segment's file now (``posix_fallocate``: a full /dev/shm
    is this CommError at setup, not a SIGBUS on a later store) and map it."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise CommError(f"shm: cannot reserve {what} in {SHM_DIR} ({e.strerror or e}); "
                        f"{remedy}") from None
    return mmap.mmap(fd, size, flags=flags)


def _release_peer(p: _Peer) -> None:
    """Close ``p``'s doorbell socket and drop its views of the rings (the caller unmaps)."""
    if p.sock is not None:
        p.sock.close()
        p.sock = None
    p.futex_addr = 0
    for view in (p.tx_q, p.rx_q, p.flag_q, p.futex_i):    # release the exports first
        if view is not None:
            view.release()
    p.tx_mm = p.tx_u8 = p.tx_q = p.rx_mm = p.rx_u8 = p.rx_q = p.flag_q = p.futex_i = None
    p.txq.clear()
    p.cma_wait.clear()
    p.rx_cur = None
    p.rx_typed = {}


class SegmentsMixin:
    """ShmTransport's setup and teardown (the module doc). Its state: ``_mm`` (our segment),
    ``_path`` (its name until unlinked), ``_flag_q`` / ``_futex_i`` (its first page as int64 /
    int32 words), ``_listener``, and each peer's mapped rings."""

    def _setup(self, store, deadline: float) -> None:
        me, peers = self.rank, self.peer_ranks
        # The listener's name has a random part (published below): nobody can bind it first.
        # Its queue is the kernel's maximum, not the number of peers: strays may fill it.
        nonce = secrets.token_hex(8)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._sock_name(me, nonce))
        self._listener.listen(socket.SOMAXCONN)

        ring = _default_ring_bytes(len(peers))
        chunk = min(byte_setting("MINICOMM_SHM_CHUNK", CHUNK, minimum=PAGE, multiple=PAGE),
                    ring // 4 // PAGE * PAGE)
        self.small_bytes = max(EAGER, chunk)     # the small path's messages: one record each
        head_bytes = -(-(_RANKS_AT + 8 * len(peers)) // PAGE) * PAGE
        total = head_bytes + len(peers) * (PAGE + ring)
        path = segment_path(self.job_id, me)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            # not ours: never unlink it (the name may be guessable under a foreign launcher)
            raise CommError(f"shm: {path} already exists: another job (or another user) uses "
                            f"job id {self.job_id!r}; refusing to touch it") from None
        self._path = path             # recorded only once we created it: teardown unlinks ours
        _linked.add(path)
        try:
            self._mm = _reserve_and_map(fd, total, f"{total >> 20} MiB",
                                        "enlarge /dev/shm or lower MINICOMM_SHM_RING_BYTES",
                                        _MAP_FLAGS)
        finally:
            os.close(fd)
        _SEG.pack_into(self._mm, 0, _MAGIC, me, ring, chunk, len(peers))
        struct.pack_into(f"@{len(peers)}q", self._mm, _RANKS_AT, *peers)
        _PROBE.pack_into(self._mm, _PROBE_AT, os.getpid(),
                         bytecopy.address(self._probe_buf), self._probe_buf[:16].tobytes())
        self._flag_q = memoryview(self._mm)[:PAGE].cast("q")
        self._futex_i = memoryview(self._mm)[:PAGE].cast("i")
        if futex.AVAILABLE:
            self._futex_addr = futex.address_of(self._mm, _FUTEX_WORD * 4)
            self.futex_ok = True
        own_u8 = np.frombuffer(self._mm, dtype=np.uint8)
        for i, pr in enumerate(peers):
            p = self._peers[pr]
            p.rx_mm, p.rx_u8, p.rx_size = self._mm, own_u8, ring
            p.rx_ctl = head_bytes + i * (PAGE + ring)
            p.rx_data = p.rx_ctl + PAGE
            p.rx_q = memoryview(self._mm)[p.rx_ctl:p.rx_ctl + PAGE].cast("q")
        store.set(f"shm/{me}", f"ready {nonce}".encode())   # segment and listener exist

        nonces = {}
        for pr in peers:                       # map every peer's segment before any handshake
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeout(f"rank {me}: shm setup timed out waiting for rank {pr}")
            ready = store.get(f"shm/{pr}", timeout=left).decode(errors="replace").split()
            if len(ready) != 2 or ready[0] != "ready" or not _JOB_ID.fullmatch(ready[1]):
                raise CommError(f"shm: rank {pr}'s setup record in the store is malformed")
            nonces[pr] = ready[1]
            self._attach(self._peers[pr], segment_path(self.job_id, pr))

        for pr in peers:
            if pr < me:
                # published after listen(): a refused dial means rank pr is gone
                s = dial_peer(socket.AF_UNIX, self._sock_name(pr, nonces[pr]), self._token, me,
                              pr, deadline, refused_is_final=True)
                self._peers[pr].sock = s
        accepted = accept_peers(self._listener, self._token, me, [p for p in peers if p > me],
                                deadline)
        for pr, s in accepted.items():
            self._peers[pr].sock = s
        # Every peer mapped our segment before its handshake with us: the name can go now.
        _unlink(self._path)
        # ... and probed our memory, leaving its verdict in the ring we send it through
        for p in self._peers.values():
            p.cma = self._cma_off is None and p.tx_q[_CMA_OK] == 1
            p.cma_min = (self._cma_min if cma.min_override() or not p.tx_q[_CMA_FROM]
                         else p.tx_q[_CMA_FROM])
        if os.environ.get("MINICOMM_DEBUG", "").lower() in ("info", "detail"):
            print(f"[minicomm rank {me}] {self.describe_copies()}", file=sys.stderr, flush=True)
        for p in self._peers.values():
            p.sock.setblocking(False)
            p.fd = p.sock.fileno()
            self._progress.register(p.fd, lambda ev, p=p: self._on_doorbell(p))

    def _sock_name(self, rank: int, nonce: str) -> str:
        return f"\0minicomm-{self.job_id}-{rank}-{nonce}"

    def _attach(self, p: _Peer, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            # it said "ready", then left (failed or timed out in setup, unlinking its segment)
            err = PeerFailure(f"shm: cannot open rank {p.rank}'s segment {path} ({e.strerror}): "
                              f"it failed or exited during setup")
            err.peer = p.rank
            raise err from None
        try:
            segment.check_owner(fd, path)     # a guessable name: trust only our own file
            mm = mmap.mmap(fd, 0, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        magic, owner, ring, chunk, n = _SEG.unpack_from(mm, 0)
        if magic != _MAGIC or owner != p.rank:
            mm.close()
            raise CommError(f"shm: {path} is not rank {p.rank}'s segment of this job")
        senders = struct.unpack_from(f"@{n}q", mm, _RANKS_AT)
        if self.rank not in senders:
            mm.close()
            raise CommError(f"shm: rank {p.rank} has no ring for rank {self.rank} "
                            f"(ranks disagree on the node layout)")
        head_bytes = -(-(_RANKS_AT + 8 * n) // PAGE) * PAGE
        p.tx_mm, p.tx_u8, p.tx_size, p.tx_chunk = mm, np.frombuffer(mm, dtype=np.uint8), ring, chunk
        p.tx_ctl = head_bytes + senders.index(self.rank) * (PAGE + ring)
        p.tx_data = p.tx_ctl + PAGE
        p.tx_q = memoryview(mm)[p.tx_ctl:p.tx_ctl + PAGE].cast("q")
        p.flag_q = memoryview(mm)[:PAGE].cast("q")
        pid, addr, token = _PROBE.unpack_from(mm, _PROBE_AT)
        p.pid = pid
        p.cma_read = cma.probe(pid, addr, token)
        if p.cma_read is None:
            # how fast we read it against a copy of our own: the size from which its
            # collective sends to us should go single-copy (cma.choose_min)
            try:
                p.cma_pace = cma.pace(pid, addr, bytecopy.page_aligned(cma.PACE_BYTES),
                                      self._probe_buf)
                p.rx_q[_CMA_FROM] = cma.choose_min(*p.cma_pace)
            except cma.CmaError as e:
                p.cma_read = f"its probe buffer could not be read whole ({e})"
        p.rx_q[_CMA_OK] = int(p.cma_read is None)   # before our handshake with it
        p.futex_i = memoryview(mm)[:PAGE].cast("i")
        if futex.AVAILABLE:
            p.futex_addr = futex.address_of(mm, _FUTEX_WORD * 4)

    def _teardown(self) -> None:
        """Release sockets, mappings and the segment name; safe on a half-built transport.
        Messages already in a peer's ring stay readable by it: its own mapping outlives ours."""
        if self._path is not None:
            _unlink(self._path)
        self._release_registered()
        maps = [p.tx_mm for p in self._peers.values() if p.tx_mm is not None]
        for p in self._peers.values():
            _release_peer(p)
        if self._flag_q is not None:
            self._flag_q.release()
            self._flag_q = None
        self.futex_ok, self._futex_addr = False, 0
        if self._futex_i is not None:
            self._futex_i.release()
            self._futex_i = None
        if self._mm is not None:
            maps.append(self._mm)
            self._mm = None
        for mm in maps:
            try:
                mm.close()
            except BufferError:       # a caller still holds a view: the GC unmaps it later
                pass
