"""shm: two-sided transport over /dev/shm for peers on the same node.

Memory. Each rank creates one segment, ``/dev/shm/minicomm-<job_id>-<rank>``, holding one inbound
ring per peer on its node (sender -> this rank). A ring is a control page (``head``: bytes the
sender has published, ``tail``: bytes the receiver has consumed, on separate cache lines, each
written by one side only) and a byte ring of records: a 64-byte header (the Tag, the message
length, the chunk's offset and length) followed by the chunk, padded to 64 bytes. A record never
wraps (a marker sends the reader back to the start), so every chunk is contiguous: the receiver
copies it, or hands it to ``req.reduce(dst, chunk_view)`` straight out of the shared memory; the
data crosses memory once on each side. Messages larger than a chunk (1 MiB) are streamed record
by record, so the sender's copy-in of chunk k+1 overlaps the receiver's reduce-out of chunk k,
and messages larger than the ring simply flow through it. Chunks other than a message's last are
multiples of 4096 bytes, so they always end on an element boundary.

Ordering. ``head``/``tail`` are stored through a ``memoryview`` cast to int64: one aligned
8-byte store, made after the record is written (``struct.pack_into`` would not do: it zeroes the
field before writing it, and a reader can see the zero). On x86-64 (TSO) that store publishes
the record. Weakly ordered CPUs (arm64) would need fences pure Python cannot issue: a known
limitation of this transport.

Waiting. Per peer pair one authenticated AF_UNIX stream connection (abstract name from the job id)
carries doorbells. A waiting rank spins briefly on the rings, then raises the ``sleeping`` word of
its segment, fences, re-checks its rings once, and sleeps in epoll on these sockets
(progress.py). After publishing records or freeing ring space for a peer, a rank fences and reads
that peer's ``sleeping`` word, and writes one byte to the doorbell only if it is raised: an awake
peer costs no system call. The two fences make the handshake sound (Dekker): either the sleeper's
re-check sees the new head/tail, or the publisher sees the flag and rings. A full doorbell socket
means unread doorbells are already pending, so a failed (EAGAIN) ring loses nothing. A dead peer's
kernel closes its end: EOF -> PeerFailure, with no heartbeat. ``abort`` sends a reason first.

Lifetime. A segment is unlinked as soon as every peer has attached to it (every peer maps all
segments of its node before it completes the doorbell handshake, so a finished handshake with every
peer proves it), on close, on any setup error and at exit; ``sweep_job_segments`` removes what a
SIGKILLed rank left (the launcher calls it).
"""
from __future__ import annotations

import glob
import mmap
import os
import re
import socket
import struct
import time
from collections import deque
from typing import Dict, List, Optional

import numpy as np

from minicomm.errors import CommError, CommTimeout, PeerFailure
from minicomm.rendezvous import accept_peers, dial_peer
from . import segment
from .base import ReduceFn, Request, Tag
from .progress import CLEAN_CLOSE, Inbox, LinkEngine, Progress, Req, deliver, fence

SHM_DIR = "/dev/shm"
PAGE = 4096
HDR = 64                              # record header: 8 int64
CHUNK = 1 << 20                       # streaming unit of large messages
EARLY_RING = 64 << 10                 # ring the doorbell at once after a record this large
EAGER = 16 << 10                      # isend/irecv move a message this small on the spot
_U8 = np.dtype(np.uint8)
_MAGIC = b"MCSHM\x00\x01\x00"
_HDR = struct.Struct("@8q")           # record header; written before head publishes it
_SEG = struct.Struct("@8sqqqq")       # magic, owner rank, ring bytes, chunk bytes, number of rings
_HEAD, _TAIL = 0, 16                  # int64 index in a ring's control page (own cache lines)
_SLEEPING = 32                        # int64 index in the segment's first page: owner may sleep
_RANKS_AT = 512                       # byte offset of the senders' ranks, after the flag's line
_NOWAIT = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
# Fault the pages in at setup, not on the first large transfer.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_WAKE = b"\x01"
_ABORT = b"\x00"                      # then the reason, then EOF
_ABORTED = "it aborted: "
_BYE = b"\x02"                        # an orderly close: then EOF
_JOB_ID = re.compile(r"[A-Za-z0-9_.-]+")

# One registry of the segments this process created and has not unlinked (segment.py's, shared
# with the rdma / ub arenas and the windows), emptied at exit and when a rank's parent dies.
_linked, _unlink, _unlink_at_exit = segment._linked, segment.unlink, segment._unlink_at_exit


def segment_path(job_id: str, rank: int) -> str:
    return os.path.join(SHM_DIR, f"minicomm-{job_id}-{rank}")


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


def _default_ring_bytes(npeers: int) -> int:
    env = os.environ.get("MINICOMM_SHM_RING_BYTES")
    if env:
        ring = int(env)
        if ring % PAGE or ring < 16 * PAGE:
            raise ValueError("MINICOMM_SHM_RING_BYTES must be a multiple of 4096, at least 64 KiB")
        return ring
    # 4 MiB per ring keeps 4 chunks in flight; with many peers, cap a rank's inbound memory at
    # 64 MiB (the rings are reserved up front: a full /dev/shm must fail here, not SIGBUS later).
    ring = 4 << 20
    while ring > (256 << 10) and ring * npeers > (64 << 20):
        ring //= 2
    return ring


class _Peer:
    """Both directions with one peer: the outbound ring (in the peer's segment), the inbound ring
    (in ours), the doorbell socket, and the receive matching."""
    __slots__ = ("rank", "sock", "fd", "flag_q", "tx_mm", "tx_u8", "tx_ctl", "tx_data", "tx_size",
                 "tx_head", "tx_tail", "tx_chunk", "txq", "tx_q", "rx_mm", "rx_u8", "rx_ctl",
                 "rx_data", "rx_size", "rx_q", "rx_head", "rx_tail", "rx_cur", "inbox", "owed",
                 "closed")

    def __init__(self, rank: int):
        self.rank = rank
        self.sock: Optional[socket.socket] = None
        self.fd = -1
        self.txq: deque = deque()
        self.tx_head = self.tx_tail = 0
        self.rx_head = self.rx_tail = 0
        self.rx_cur = None
        self.inbox = Inbox(rank)
        self.owed = False             # a doorbell is due at the end of this pass
        self.closed: Optional[str] = None


class ShmTransport(LinkEngine):
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
        self._path: Optional[str] = None
        self._aborted: Optional[str] = None
        self._cancelled: Dict[int, BaseException] = {}
        self._closed = False
        self._listener: Optional[socket.socket] = None
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

    # ---------------------------------------------------------------------------- setup
    def _setup(self, store, deadline: float) -> None:
        me, peers = self.rank, self.peer_ranks
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._sock_name(me))
        self._listener.listen(len(peers))

        ring = _default_ring_bytes(len(peers))
        chunk = min(CHUNK, ring // 4 // PAGE * PAGE)
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
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                raise CommError(f"shm: cannot reserve {total >> 20} MiB in {SHM_DIR} ({e}); "
                                f"enlarge /dev/shm or lower MINICOMM_SHM_RING_BYTES") from None
            self._mm = mmap.mmap(fd, total, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        _SEG.pack_into(self._mm, 0, _MAGIC, me, ring, chunk, len(peers))
        struct.pack_into(f"@{len(peers)}q", self._mm, _RANKS_AT, *peers)
        self._flag_q = memoryview(self._mm)[:PAGE].cast("q")
        own_u8 = np.frombuffer(self._mm, dtype=np.uint8)
        for i, pr in enumerate(peers):
            p = self._peers[pr]
            p.rx_mm, p.rx_u8, p.rx_size = self._mm, own_u8, ring
            p.rx_ctl = head_bytes + i * (PAGE + ring)
            p.rx_data = p.rx_ctl + PAGE
            p.rx_q = memoryview(self._mm)[p.rx_ctl:p.rx_ctl + PAGE].cast("q")
        store.set(f"shm/{me}", b"ready")      # segment and listener exist

        for pr in peers:                       # map every peer's segment before any handshake
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeout(f"rank {me}: shm setup timed out waiting for rank {pr}")
            store.get(f"shm/{pr}", timeout=left)
            self._attach(self._peers[pr])

        for pr in peers:
            if pr < me:
                s = dial_peer(socket.AF_UNIX, self._sock_name(pr), self._token, me, pr, deadline)
                self._peers[pr].sock = s
        accepted = accept_peers(self._listener, self._token, me, [p for p in peers if p > me],
                                deadline)
        for pr, s in accepted.items():
            self._peers[pr].sock = s
        # Every peer mapped our segment before its handshake with us: the name can go now.
        _unlink(self._path)
        for p in self._peers.values():
            p.sock.setblocking(False)
            p.fd = p.sock.fileno()
            self._progress.register(p.fd, lambda ev, p=p: self._on_doorbell(p))

    def _sock_name(self, rank: int) -> str:
        return f"\0minicomm-{self.job_id}-{rank}"

    def _attach(self, p: _Peer) -> None:
        path = segment_path(self.job_id, p.rank)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            # it said "ready", then left (failed or timed out in setup, unlinking its segment)
            err = PeerFailure(f"shm: rank {p.rank} left during setup: its segment {path} is "
                              f"gone")
            err.peer = p.rank
            raise err from None
        try:
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

    # ------------------------------------------------------------------------- data path
    def _peer(self, peer: int) -> _Peer:
        try:
            return self._peers[peer]
        except KeyError:
            raise ValueError(f"rank {self.rank}: no shm route to rank {peer} "
                             f"(shm peers: {self.peer_ranks})") from None

    def isend(self, peer: int, buf: np.ndarray, tag: Tag) -> Request:
        p = self._peers.get(peer) or self._peer(peer)
        with self._lock:
            q = p.txq
            if not q and p.closed is None and buf.nbytes <= EAGER and self._put(p, buf, tag):
                fence()
                self._ring_if_sleeping(p)
                req = Request(peer, buf, tag, None, True)
                req.done = True
                return req
            req = Req(self, peer, buf, tag, None, True)
            q.append(req)
            self._active[p] = None
            if len(q) == 1 and p.closed is None:
                self._push(p)         # eager: the first chunk is in the ring before wait_all
                if p.owed:
                    fence()
                    self._ring_if_sleeping(p)
        return req

    def irecv(self, peer: int, buf: np.ndarray, tag: Tag,
              reduce: Optional[ReduceFn] = None) -> Request:
        p = self._peers.get(peer) or self._peer(peer)
        with self._lock:
            if buf.nbytes <= EAGER and p.rx_cur is None and self._take(p, buf, tag, reduce):
                req = Request(peer, buf, tag, reduce, False)
                req.done = True
                return req
            req = Req(self, peer, buf, tag, reduce, False)
            ib = p.inbox
            ib.post(req)
            self._active[p] = None
            # eager: a small message that is already in the ring is taken now (a large one waits
            # for wait_all, so that the step's sends are posted first)
            if req.nbytes <= EAGER and ib.n_posted and p.rx_cur is None and self._pull(p):
                fence()
                self._ring_if_sleeping(p)
        return req

    def _take(self, p: _Peer, buf: np.ndarray, tag: Tag, reduce: Optional[ReduceFn]) -> bool:
        """Receive a small message on the spot if it is the next record of the ring, whole, and
        no earlier receive of its communicator waits: no request object, no matching queue.
        False (nothing consumed): the caller posts the receive as usual."""
        ib = p.inbox
        if ib.errors or ib.posted.get(tag[0]) or ib.unexpected.get(tag[0]):
            return False
        tail = p.rx_tail
        if tail == p.rx_head:
            p.rx_head = p.rx_q[_HEAD]
            if tail == p.rx_head:
                return False
        h = p.rx_data + tail % p.rx_size
        comm, seq, _, call, count, total, off, c = _HDR.unpack_from(p.rx_mm, h)
        n = buf.nbytes
        if not (c == total == n and comm == tag[0] and seq == tag[1] and call == tag[3]
                and count == tag[4]) or not buf.flags.c_contiguous:
            return False              # a wrap marker, a chunk, another call: the usual path
        if n:
            flat = buf if buf.ndim == 1 else buf.reshape(-1)
            if reduce is None:
                flat.view(_U8)[...] = p.rx_u8[h + HDR:h + HDR + n]
            else:
                reduce(flat, np.ndarray(flat.shape, flat.dtype, p.rx_mm, h + HDR))
        tail += HDR + ((n + 63) & ~63)
        p.rx_tail = tail
        p.rx_q[_TAIL] = tail          # hand the space back
        fence()
        self._ring_if_sleeping(p)
        return True

    def _put(self, p: _Peer, buf: np.ndarray, tag: Tag) -> bool:
        """Write a small message as one record if it fits where the ring's head is (the caller
        checked that no send is queued before it): no request object, no queue. False: it does
        not fit now; the caller queues it."""
        n = buf.nbytes
        size, head = p.tx_size, p.tx_head
        pos = head % size
        need = HDR + ((n + 63) & ~63)
        if need > size - pos or need > size - head + p.tx_tail:
            return False
        if not buf.flags.c_contiguous:
            raise ValueError("transport buffers must be contiguous")
        h = p.tx_data + pos
        mm = p.tx_mm
        _HDR.pack_into(mm, h, tag[0], tag[1], tag[2], tag[3], tag[4], n, 0, n)
        if n:
            mm[h + HDR:h + HDR + n] = buf       # buffer protocol: a memcpy, no numpy views
        head += need
        p.tx_head = head
        p.tx_q[_HEAD] = head          # publish the record
        return True

    def wait_all(self, requests: List[Request], deadline: float, what: str) -> None:
        self._progress.wait(requests, deadline, what)

    def wait_any(self, requests: List[Request], deadline: float, what: str) -> None:
        self._progress.wait(requests, deadline, what, any_done=True)

    def progress(self) -> bool:
        """One non-blocking pass over every peer with work (called under the progress lock)."""
        active = self._active
        if not active:
            return False
        moved = False
        peers = list(active)
        for p in peers:
            if p.txq and p.closed is None and self._push(p):
                moved = True
            if (p.inbox.n_posted or p.rx_cur is not None) and self._pull(p):
                moved = True
            if not (p.txq or p.inbox.n_posted or p.rx_cur is not None):
                del active[p]
        if moved:
            fence()                   # our head/tail stores before reading their flags
            for p in peers:
                if p.owed:
                    self._ring_if_sleeping(p)
        return moved

    def sleep(self, flag: bool) -> None:
        if self._flag_q is not None:
            self._flag_q[_SLEEPING] = int(flag)

    def _push(self, p: _Peer) -> bool:
        """Write records of the queued sends into the outbound ring while it has room."""
        size, data, chunk = p.tx_size, p.tx_data, p.tx_chunk
        head, tail = p.tx_head, p.tx_tail
        moved = False
        q = p.txq
        while q:
            req = q[0]
            off = req.off
            nbytes = req.nbytes
            want = nbytes - off
            if want > chunk:
                want = chunk
            pos = head % size
            contig = size - pos
            free = size - head + tail
            fit = (free if free < contig else contig) - HDR
            if fit >= want:
                c = want
            elif fit >= PAGE:
                c = fit - fit % PAGE  # not the last chunk: keep it a whole number of pages
            elif contig <= free:
                _HDR.pack_into(p.tx_mm, data + pos, 0, 0, 0, 0, 0, 0, 0, -1)   # wrap marker
                head += contig
                continue
            else:
                tail = p.tx_q[_TAIL]
                if size - head + tail == free:
                    break             # ring full: the receiver's doorbell will wake us
                continue
            h = data + pos
            t = req.tag
            _HDR.pack_into(p.tx_mm, h, t[0], t[1], t[2], t[3], t[4], nbytes, off, c)
            if c == nbytes:
                p.tx_mm[h + HDR:h + HDR + c] = req.u8
            elif c:
                p.tx_mm[h + HDR:h + HDR + c] = req.u8[off:off + c]
            head += HDR + ((c + 63) & ~63)
            p.tx_q[_HEAD] = head      # publish the record
            moved = True
            p.owed = True
            if c >= EARLY_RING:       # a sleeping receiver starts on this chunk now
                fence()
                self._ring_if_sleeping(p)
            off += c
            req.off = off
            if off == nbytes:
                req.done = True
                q.popleft()
        p.tx_head, p.tx_tail = head, tail
        return moved

    def _pull(self, p: _Peer) -> bool:
        """Consume records of the inbound ring into their receives (or out of the way)."""
        mm, u8, size, data = p.rx_mm, p.rx_u8, p.rx_size, p.rx_data
        ib = p.inbox
        tail, head = p.rx_tail, p.rx_head
        moved = False
        while True:
            if tail == head:
                head = p.rx_q[_HEAD]
                if tail == head:
                    break
            pos = tail % size
            h = data + pos
            comm, seq, step, call, count, total, off, c = _HDR.unpack_from(mm, h)
            if c < 0:                 # wrap marker
                tail += size - pos
                continue
            target = p.rx_cur
            if target is None:
                target = ib.match_header(comm, seq, step, call, count, total)
                if target is None:
                    break             # its receive is not posted yet: leave it in the ring
                p.rx_cur = target
            if c == total and target.reduce is not None and target.buf.ndim == 1:
                # a whole message reduced straight from a typed view of the landing memory
                buf = target.buf
                target.reduce(buf, np.ndarray(buf.shape, buf.dtype, mm, h + HDR))
            elif c:
                deliver(target, off, u8[h + HDR:h + HDR + c])
            tail += HDR + ((c + 63) & ~63)
            p.rx_q[_TAIL] = tail      # hand the space back at once
            off += c
            target.off = off
            moved = True
            if off == total:
                p.rx_cur = None
                if target.__class__ is Req:
                    target.done = True
                else:
                    ib.complete(target)
        if moved:
            p.owed = True
        p.rx_tail, p.rx_head = tail, head
        return moved

    def _ring_if_sleeping(self, p: _Peer) -> None:
        """Ring ``p``'s doorbell if it may be asleep; the caller fenced after its last store."""
        p.owed = False
        if not p.flag_q[_SLEEPING] or p.sock is None:
            return
        try:
            p.sock.send(_WAKE, _NOWAIT)
        except BlockingIOError:
            pass                      # unread doorbells are pending: the peer will wake anyway
        except OSError as e:
            if p.closed is None:
                p.closed = f"its shm link failed ({e.strerror or e})"

    def _on_doorbell(self, p: _Peer) -> None:
        """Drain the doorbell socket (epoll is edge-triggered); EOF means the peer is gone."""
        while p.sock is not None:
            try:
                data = p.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as e:
                p.closed = p.closed or f"its shm link failed ({e.strerror or e})"
                data = b""
            if not data:
                p.closed = p.closed or "it closed its shm link (exited or crashed)"
                self._progress.unregister(p.fd)
                return
            if p.closed is not None and p.closed.startswith(_ABORTED):
                p.closed += data.decode(errors="replace")     # the reason, continued
            elif _ABORT in data:
                p.closed = _ABORTED + data[data.index(_ABORT) + 1:].decode(errors="replace")
            elif _BYE in data and p.closed is None:
                p.closed = CLEAN_CLOSE + " (it finished)"

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
        self._progress.detach(self)
        self._teardown()

    def _teardown(self) -> None:
        """Release sockets, mappings and the segment name; safe on a half-built transport.
        Messages already in a peer's ring stay readable by it: its own mapping outlives ours."""
        if self._path is not None:
            _unlink(self._path)
        maps = []
        for p in self._peers.values():
            if p.sock is not None:
                p.sock.close()
                p.sock = None
            if getattr(p, "tx_mm", None) is not None:
                maps.append(p.tx_mm)
            for name in ("tx_q", "rx_q", "flag_q"):  # release the exports before unmapping
                view = getattr(p, name, None)
                if view is not None:
                    view.release()
            for name in ("tx_mm", "tx_u8", "tx_q", "rx_mm", "rx_u8", "rx_q", "flag_q"):
                setattr(p, name, None)
            p.txq.clear()
            p.rx_cur = None
        if self._flag_q is not None:
            self._flag_q.release()
            self._flag_q = None
        if self._mm is not None:
            maps.append(self._mm)
            self._mm = None
        for mm in maps:
            try:
                mm.close()
            except BufferError:       # a caller still holds a view: the GC unmaps it later
                pass
