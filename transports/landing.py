"""Two-sided messages over one-sided writes, the way NCCL's IB transport builds them.

The collectives need send/recv; an RDMA NIC (or a UB Jetty) offers WRITE and WRITE_WITH_IMM. For
every ordered pair sender -> receiver:

  * the receiver registers a *landing ring* for that sender (``RING`` bytes, 4 MiB as NCCL's
    buffSize, remote-writable), the sender a 16-byte *credit word* pair the receiver may write;
    both publish (va, key, token) through the rendezvous store at setup;
  * a message travels as records of a 64-byte header (the Tag, the message length, the chunk's
    offset and length) and a chunk (at most ``CHUNK``, 1 MiB, padded to 64 bytes). A record
    never wraps: a wrap marker sends the reader back to the start, so every chunk is contiguous;
  * the sender places the next record at byte ``head`` while the ring has room -- ``head - tail``
    where ``tail`` is the receiver's last credit -- and fewer than ``RECORDS`` records are
    outstanding: it WRITEs the chunk, then WRITE_WITH_IMMs the header with imm = DATA; the
    reliable, in-order path makes the chunk land before the header's completion;
  * the receiver's completion queue reports the imm; it matches the record against its posted
    receive (``Inbox``: FIFO per communicator, tag checks), copies -- or reduces -- the chunk
    straight out of the landing ring into the destination (one copy on each side, like shm),
    and returns credits by WRITE_WITH_IMM of (tail bytes, records consumed) into the sender's
    credit words (imm = CREDIT), which also wakes a sender that waits for room.

A record whose receive is not posted stays in the ring (rendezvous: the sender stalls on
credits, nothing is copied), unless it blocks a receive of another communicator, when ``Inbox``
moves it out of the way. Chunks other than a message's last are multiples of 4096 bytes, so they
end on an element boundary for reduce. (NCCL's Simple protocol cuts its buffer into 8 fixed
steps; a byte ring keeps mid-size messages from taking a whole step each.)

Subclasses (rdma.py, ub.py) say how a record and a credit are written with their own verbs
(``_write_record``, ``_write_credit``) and drain their completion queue in ``_poll``, calling
``_on_arrival`` / ``_on_sent``. Same-node writes complete inside the call (a memcpy into the
peer's mapped arena); cross-node writes complete when the peer's NIC agent has applied them.

Cost per chunk of c bytes: alpha = two writes + one event (+ a doorbell if the peer sleeps) +
one credit write back; beta = one copy in, one copy (or reduce) out, as the shm transport.
"""
from __future__ import annotations

import struct
import time
from collections import deque
from typing import Dict, Optional

import numpy as np

from minicomm.errors import CommError, CommTimeout, PeerFailure
from minicomm.settings import byte_setting
from .base import ReduceFn, Request, Tag
from .nic import (
    LOCAL_WRITE,
    OK,
    REMOTE_WRITE,
    STATUS_TEXT,
    Device,
    LinkParams,
)
from .progress import CLEAN_CLOSE, Inbox, LinkEngine, Progress, Req, deliver

# a chunk is RING // 4 (at least 1 KiB, 64-byte aligned): a smaller ring could move nothing
RING = byte_setting("MINICOMM_LANDING_BYTES", 4 << 20, minimum=4096, multiple=4096)
CHUNK = min(1 << 20, RING // 4)
RECORDS = 64                          # records in flight per pair: bounds events and receives
HDR = 64
PAGE = 4096
_HDR = struct.Struct("@8q")
DATA, CREDIT = 1, 2                   # imm kinds (imm = kind << 32)
LANDING_QP = 1                        # the channel (QP number / JFR id) of the landing traffic
_DESC = struct.Struct("<6q")


class _Link:
    """Both directions with one peer."""
    __slots__ = ("peer", "inbox", "txq", "rx_cur", "closed", "r_va", "r_key", "r_token",
                 "c_va", "c_key", "c_token", "sent", "head", "tail", "credit_q", "arrived",
                 "consumed",
                 "landing", "landing_region", "credit_region", "mm_off",
                 "qp", "local_node", "tseg", "cseg", "jfs")   # the last five: subclass verbs

    def __init__(self, peer: int):
        self.peer = peer
        self.inbox = Inbox(peer)
        self.txq: deque = deque()
        self.rx_cur = None
        self.closed: Optional[str] = None
        self.sent = self.arrived = self.consumed = 0   # records
        self.head = self.tail = 0                      # bytes of the ring written / consumed


class Waiter:
    """Something a verbs-level caller waits for through the shared Progress engine: ``done``
    becomes true when ``test()`` does; ``check`` raises if it can never come."""
    __slots__ = ("engine", "test", "peer", "what_for", "is_send", "nbytes", "tag")

    def __init__(self, engine, test, peer: int, what_for: str):
        self.engine, self.test, self.peer, self.what_for = engine, test, peer, what_for
        self.is_send, self.nbytes = True, 0
        self.tag = Tag(-1, 0, 0, 0, 0)

    @property
    def done(self) -> bool:
        return self.test()


class LandingEngine(LinkEngine):
    """The two-sided transport over a ``Device`` (module doc); subclasses add their verbs."""
    name = "landing"
    kind = "landing"
    link: LinkParams

    def __init__(self, rank: int, size: int, store, job_id: str, token: bytes, peers,
                 local_peers, timeout: float, bind_host: str = "127.0.0.1",
                 progress: Optional[Progress] = None):
        self.rank, self.size = rank, size
        self.peer_ranks = sorted(int(p) for p in peers if p != rank)
        self._progress = progress or Progress()
        self._lock = self._progress.lock
        self._aborted: Optional[str] = None
        self._cancelled: Dict[int, BaseException] = {}
        self._closed = False
        self._by_peer: Dict[int, _Link] = {p: _Link(p) for p in self.peer_ranks}
        self._active: Dict[_Link, None] = {}
        self._inflight: Dict[int, Req] = {}       # wr id -> send waiting for its completion
        self._next_wr = 1
        deadline = time.monotonic() + timeout
        self.device = Device(self.kind, rank, store, job_id, token, self.peer_ranks,
                             local_peers, deadline, bind_host, self._progress, self.link)
        try:
            self.device.on_peer_closed = self._peer_closed
            self._setup_verbs()
            # attached before the landing setup: importing a segment may wait for an answer
            self._progress.attach(self, True)
            self._setup_landing(store, deadline)
        except BaseException:
            self._progress.detach(self)
            self.device.close()
            raise

    def _setup_verbs(self) -> None:
        raise NotImplementedError

    def _setup_landing(self, store, deadline: float) -> None:
        dev, me = self.device, self.rank
        for p, link in self._by_peer.items():
            link.landing_region = dev.register(RING, LOCAL_WRITE | REMOTE_WRITE,
                                               token=self._landing_token())
            link.landing = link.landing_region.buf
            link.mm_off = link.landing_region.offset
            link.credit_region = dev.register(16, LOCAL_WRITE | REMOTE_WRITE,
                                              token=self._landing_token())
            link.credit_q = dev.arena.q
            lr, cr = link.landing_region, link.credit_region
            store.set(f"{self.kind}/landing/{me}/{p}",
                      _DESC.pack(lr.va, lr.key, lr.token, cr.va, cr.key, cr.token))
        for p, link in self._by_peer.items():
            left = max(0.0, deadline - time.monotonic())
            (link.r_va, link.r_key, link.r_token, link.c_va, link.c_key,
             link.c_token) = _DESC.unpack(store.get(f"{self.kind}/landing/{p}/{me}", timeout=left))
            self._connect_peer(link, store, deadline)

    def _landing_token(self) -> int:
        return 0

    def _connect_peer(self, link: _Link, store, deadline: float) -> None:
        """Subclass hook: per-peer verbs objects (a QP, an imported segment...)."""

    # ----------------------------------------------------------------- subclass hooks
    def _write_record(self, link: _Link, pos: int, header: np.ndarray, data: np.ndarray,
                      wr_id: int) -> Optional[int]:
        """Write ``data`` at byte ``pos + 64`` of the peer's ring and ``header`` (with imm DATA)
        at ``pos``. Same node: returns the status. Other node: None; ``_on_sent(wr_id, status)``
        follows (``wr_id`` 0: no completion wanted)."""
        raise NotImplementedError

    def _write_credit(self, link: _Link, value: np.ndarray) -> None:
        raise NotImplementedError

    def _poll(self) -> bool:
        raise NotImplementedError

    # ------------------------------------------------------------------ completions in
    def _on_arrival(self, peer: int, imm: int) -> None:
        link = self._by_peer.get(peer)
        if link is None:
            return
        if imm >> 32 == DATA:
            link.arrived += 1
            if link.inbox.n_posted or link.rx_cur is not None:
                self._active[link] = None
        elif link.txq:                # CREDIT: room for queued sends
            self._active[link] = None

    def _on_sent(self, wr_id: int, status: int) -> None:
        req = self._inflight.pop(wr_id, None)
        if req is None:
            return
        if status == OK:
            req.done = True
        else:
            link = self._by_peer[req.peer]
            if not link.closed:
                self._link_failed(link, f"its {self.kind} write failed: {STATUS_TEXT[status]}")

    def _link_failed(self, link: _Link, what: str) -> None:
        """End ``link`` with ``what`` plus the link's own reason (a protocol violation, an exit)
        where the device knows it, whichever of the two was noticed first; a write that failed
        after the peer's goodbye ends it as finished (its goodbye came first)."""
        why = self.device.link_reason(link.peer)
        if why is not None and why.startswith(CLEAN_CLOSE):
            link.closed = why         # a write after its goodbye fails: it finished, no crash
        else:
            link.closed = f"{what} ({why})" if why else what

    def _peer_closed(self, peer: int, reason: str) -> None:
        link = self._by_peer.get(peer)
        if link is not None and link.closed is None:
            link.closed = reason

    # ------------------------------------------------------------------------ data path
    def dead_peers(self) -> Dict[int, str]:
        """Links closed here, and peers the device saw end (doorbell, NIC agent)."""
        with self._lock:
            dead = {p: r for p, r in self.device.closed_peers.items() if p != self.rank}
            for link in self._by_peer.values():
                if link.closed is not None:
                    dead.setdefault(link.peer, link.closed)
            return dead

    def _exclude(self, link: _Link, reason: str) -> None:
        self.device.exclude(link.peer, reason, link.closed)

    def _link_of(self, peer: int) -> _Link:
        try:
            return self._by_peer[peer]
        except KeyError:
            raise ValueError(f"rank {self.rank}: no {self.kind} route to rank {peer} "
                             f"({self.kind} peers: {self.peer_ranks})") from None

    def isend(self, peer: int, buf: np.ndarray, tag: Tag) -> Request:
        link = self._by_peer.get(peer) or self._link_of(peer)
        req = Req(self, peer, buf, tag, None, True)
        with self._lock:
            link.txq.append(req)
            self._active[link] = None
            if len(link.txq) == 1 and link.closed is None:
                self._push(link)      # eager: the first chunks land before wait_all
        return req

    def irecv(self, peer: int, buf: np.ndarray, tag: Tag,
              reduce: Optional[ReduceFn] = None) -> Request:
        link = self._by_peer.get(peer) or self._link_of(peer)
        req = Req(self, peer, buf, tag, reduce, False)
        with self._lock:
            link.inbox.post(req)
            self._active[link] = None
        return req

    def progress(self) -> bool:
        """One non-blocking pass: drain completions, then push and pull every active link."""
        moved = self._poll()
        active = self._active
        if not active:
            return moved
        for link in list(active):
            if link.txq and link.closed is None and self._push(link):
                moved = True
            if (link.inbox.n_posted or link.rx_cur is not None) and self._pull(link):
                moved = True
            if not (link.txq or link.inbox.n_posted or link.rx_cur is not None):
                del active[link]
        return moved

    def _push(self, link: _Link) -> bool:
        q = link.txq
        moved = False
        cq, ci = link.credit_q, link.credit_region.offset >> 3
        head = link.head
        while q:
            if moved:
                # Credits are read straight from memory, but each credit also consumed one of
                # our posted receives (its imm): drain the completion queue, which re-posts
                # them, before using more -- else a long burst runs our receive queue dry.
                self._poll()
            if link.sent - cq[ci + 1] >= RECORDS:
                break
            req = q[0]
            off, n = req.off, req.nbytes
            pos = head % RING
            contig = RING - pos
            free = RING - (head - cq[ci])
            fit = min(free, contig) - HDR
            want = min(n - off, CHUNK)
            if fit >= want:
                c = want
            elif fit >= PAGE:
                c = fit - fit % PAGE  # not the last chunk: keep it a whole number of pages
            elif contig <= free:      # too little room before the end: a wrap marker
                if self._emit(link, pos, np.array((0, 0, 0, 0, 0, 0, 0, -1), np.int64), None,
                              0) not in (None, OK):
                    break
                head += contig
                link.head = head
                moved = True
                continue
            else:
                break                 # the ring is full: the receiver's credit wakes us
            t = req.tag
            header = np.array((t[0], t[1], t[2], t[3], t[4], n, off, c), dtype=np.int64)
            last = off + c == n
            wr_id = 0
            if last:
                wr_id = self._next_wr
                self._next_wr += 1
            status = self._emit(link, pos, header, req.u8[off:off + c], wr_id)
            head += HDR + ((c + 63) & ~63)
            link.head = head
            req.off = off + c
            moved = True
            if status is not None and status != OK:
                break
            if last:
                q.popleft()
                if status is None:
                    self._inflight[wr_id] = req
                else:
                    req.done = True
        return moved

    def _emit(self, link: _Link, pos: int, header, data, wr_id: int):
        """One record through the subclass; a failure closes the link (returns the status)."""
        status = self._write_record(link, pos, header, data, wr_id)
        link.sent += 1
        if status is not None and status != OK:
            self._link_failed(link, f"its {self.kind} write failed: {STATUS_TEXT[status]}")
        return status

    def _pull(self, link: _Link) -> bool:
        ib = link.inbox
        mm = self.device.arena.mm
        landing = link.landing
        moved = False
        tail = link.tail
        while link.consumed < link.arrived:
            pos = tail % RING
            comm, seq, step, call, count, total, off, c = _HDR.unpack_from(mm, link.mm_off + pos)
            if c < 0:                 # wrap marker
                tail += RING - pos
                link.consumed += 1
                moved = True
                continue
            target = link.rx_cur
            if target is None:
                target = ib.match_header(comm, seq, step, call, count, total)
                if target is None:
                    break             # its receive is not posted yet: leave it in the ring
                link.rx_cur = target
            if c:
                deliver(target, off, landing[pos + HDR:pos + HDR + c])
            target.off = off + c
            tail += HDR + ((c + 63) & ~63)
            link.consumed += 1
            moved = True
            if off + c == total:
                link.rx_cur = None
                if target.__class__ is Req:
                    target.done = True
                else:
                    ib.complete(target)
        link.tail = tail
        if moved and link.closed is None:
            self._write_credit(link, np.array([tail, link.consumed], dtype=np.int64))
        return moved

    def sleep(self, flag: bool) -> None:
        self.device.sleep(flag)

    def check(self, req, what: str) -> None:
        if req.__class__ is Waiter:
            reason = self.device.closed_peers.get(req.peer)
            if reason is not None and req.peer != self.rank:
                e = PeerFailure(f"{what}: rank {self.rank} waiting for {req.what_for} of rank "
                                f"{req.peer} over {self.name}: {reason}")
                e.peer, e.clean = req.peer, reason.startswith(CLEAN_CLOSE)
                raise e
            if self._aborted is not None:
                raise PeerFailure(f"{what}: this rank aborted: {self._aborted}")
            return
        link = self._by_peer.get(req.peer)
        if link is not None and link.closed is not None:
            # the agent thread may have taken the peer's last completions and its goodbye
            # after this pass: finish what arrived before believing the link is gone
            self.progress()
            if req.done:
                return
        super().check(req, what)

    def wait_for(self, test, peer: int, what: str, what_for: str, timeout: float) -> None:
        """Block (through the shared progress engine) until ``test()`` is true."""
        if test():
            return
        w = Waiter(self, test, peer, what_for)
        try:
            self._progress.wait([w], time.monotonic() + timeout, what)
        except CommTimeout:
            raise CommTimeout(f"{what}: rank {self.rank} timed out after {timeout:.1f}s waiting "
                              f"for {what_for} of rank {peer} over {self.name}") from None

    def _link(self, peer: int):
        return self._by_peer[peer]

    def _peek(self, link: _Link):
        # a closed peer's records too: what arrived before it left is whole in our landing ring
        if getattr(link, "landing", None) is None:
            return None
        mm = self.device.arena.mm
        tail, n = link.tail, link.consumed
        while n < link.arrived:
            pos = tail % RING
            comm, seq, step, call, count, total, off, c = _HDR.unpack_from(mm, link.mm_off + pos)
            if c >= 0:
                return comm, seq, step, call, count
            tail += RING - pos                  # wrap marker
            n += 1
        return None

    def _links(self):
        return self._by_peer.values()

    def describe(self) -> str:
        dev = self.device
        return (f"rank {self.rank}: {self.name} to {self.peer_ranks} (same node, shared "
                f"mappings: {dev.local_peers}; other nodes, NIC agent: {dev.remote_peers})")

    # --------------------------------------------------------------------------- lifetime
    def abort(self, reason: str) -> None:
        with self._lock:
            if self._aborted is not None or self._closed:
                return
            self._aborted = reason
            self.device.abort(reason)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._close_verbs()
        self._progress.detach(self)
        self.device.close()
        for link in self._by_peer.values():
            link.txq.clear()
            link.rx_cur = None
            link.landing = None

    def _close_verbs(self) -> None:
        pass


def status_error(kind: str, what: str, status: int, name: str, extra: str = "") -> CommError:
    """The named error of a failed one-sided operation (an RMAError naming the status)."""
    from minicomm.errors import RMAError
    e = RMAError(f"{what}: {name} -- {STATUS_TEXT.get(status, 'error')}{extra}")
    e.status = name
    return e
