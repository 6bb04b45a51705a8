"""The shm transport's two-sided data path: isend / irecv / progress over the rings.

A send is queued per peer and pushed into the peer's inbound ring record by record while the
ring has room (``_push``): a message of up to ``EAGER`` bytes as one record on the spot, a larger
one in chunks (layout.py), or as one descriptor record where it goes single-copy (singlecopy.py)
or lies in registered memory (registered.py). ``_pull`` consumes the records of our inbound
rings into their receives, matched per communicator in FIFO order (progress.Inbox), copying out
of the ring or reducing straight from it; a record whose receive is not posted yet stays in the
ring. After publishing records or freeing ring space, a rank rings the peer's doorbell only if
the peer may be asleep (doorbell.py).
"""
from __future__ import annotations

import errno
from typing import Optional

import numpy as np

from .. import cma
from ..base import ReduceFn, Request, Tag
from ..progress import Req, deliver, fence
from .layout import (
    _CMA_ADDR,
    _CMA_REC,
    _CMA_RECORD,
    _HDR,
    _HEAD,
    _REG_DESC,
    _REG_REC,
    _TAIL,
    _WRAP_REC,
    EAGER,
    HDR,
    PAGE,
)
from .peer import _Peer

EARLY_RING = 64 << 10                 # ring the doorbell at once after a record this large
PEEK_RECORDS = 1024                   # records _peek_all reads before a rank blocks (bounded)


class RingMixin:
    """ShmTransport's data path (the module doc). Its state: ``_peers`` (rank -> ``_Peer``),
    ``_active`` (the peers with queued work, an ordered set) and ``_lock`` (the progress
    engine's)."""

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
            if p.cma_wait and self._read_done(p):
                moved = True
            if not (p.txq or p.inbox.n_posted or p.rx_cur is not None or p.cma_wait):
                del active[p]
        if moved:
            fence()                   # our head/tail stores before reading their flags
            for p in peers:
                if p.owed:
                    self._ring_if_sleeping(p)
        return moved

    def _push(self, p: _Peer) -> bool:
        """Write records of the queued sends into the outbound ring while it has room."""
        size, data, chunk = p.tx_size, p.tx_data, p.tx_chunk
        head, tail = p.tx_head, p.tx_tail
        moved = False
        q = p.txq
        single = p.cma_min if p.cma else -1
        regs = self._reg_starts
        while q:
            req = q[0]
            off = req.off
            nbytes = req.nbytes
            where = (self._registered(req.u8) if regs and off == 0 and nbytes > chunk
                     else None)
            if where is not None or (off == 0 and 0 <= single <= nbytes
                                     and self._single_copy(req.tag[3], nbytes)):
                # one descriptor record; the receiver reads the buffer itself (module doc)
                pos = head % size
                contig = size - pos
                free = size - head + tail
                if (free if free < contig else contig) >= _CMA_RECORD:
                    h = data + pos
                    t = req.tag
                    if where is None:
                        _HDR.pack_into(p.tx_mm, h, t[0], t[1], t[2], t[3], t[4], nbytes, 0,
                                       _CMA_REC)
                        _CMA_ADDR.pack_into(p.tx_mm, h + HDR,
                                            req.u8.__array_interface__["data"][0])
                    else:
                        _HDR.pack_into(p.tx_mm, h, t[0], t[1], t[2], t[3], t[4], nbytes, 0,
                                       _REG_REC)
                        _REG_DESC.pack_into(p.tx_mm, h + HDR, *where)
                    head += _CMA_RECORD
                    p.tx_q[_HEAD] = head          # publish the record
                    moved = True
                    q.popleft()
                    req.off = nbytes
                    p.cma_wait.append((head, req))
                    fence()                       # a sleeping receiver starts reading now
                    self._ring_if_sleeping(p)
                elif contig <= free:
                    _HDR.pack_into(p.tx_mm, data + pos, 0, 0, 0, 0, 0, 0, 0, _WRAP_REC)
                    head += contig
                else:
                    tail = p.tx_q[_TAIL]
                    if size - head + tail == free:
                        break             # ring full: the receiver's doorbell will wake us
                continue
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
                _HDR.pack_into(p.tx_mm, data + pos, 0, 0, 0, 0, 0, 0, 0, _WRAP_REC)
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
            if c == _WRAP_REC:
                tail += size - pos
                continue
            target = p.rx_cur
            if target is None:
                target = ib.match_header(comm, seq, step, call, count, total)
                if target is None:
                    break             # its receive is not posted yet: leave it in the ring
                p.rx_cur = target
            if c == _CMA_REC or c == _REG_REC:
                try:
                    if target.__class__ is not Req and target.dropped:
                        pass          # a cancelled context's: consumed unread, the sender freed
                    elif c == _REG_REC:
                        self._copy_registered(p, target, *_REG_DESC.unpack_from(mm, h + HDR),
                                              total)
                        self.received_single_copy["registered"] += 1
                    else:
                        self._read_from(p, target, _CMA_ADDR.unpack_from(mm, h + HDR)[0], total)
                        self.received_single_copy["cma"] += 1
                except (cma.CmaError, OSError, ValueError) as e:
                    gone = getattr(e, "errno", None) == errno.ESRCH   # a ValueError has none
                    p.closed = p.closed or (
                        "it has exited (a single-copy read found no such process)"
                        if gone else f"a single-copy read from it failed: {e}")
                    break
                tail += _CMA_RECORD
                p.rx_q[_TAIL] = tail  # the sender's buffer is free again
                target.off = total
                moved = True
                p.rx_cur = None
                if target.__class__ is Req:
                    target.done = True
                else:
                    ib.complete(target)
                continue
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

    def _peek_all(self, p: _Peer):
        """The headers (comm, seq, step, call, count) of the records in ``p``'s inbound ring,
        oldest first, at most ``PEEK_RECORDS``, none consumed: a rank about to block sees an
        abort notice that sits behind a message nobody has received yet (a message of this very
        call, for a later step), not only the head of the stream. A closed peer's too: what it
        published before it left stays readable (the ring is in our segment), and the notice
        of a rank that broke the communicator and then finished is its last record."""
        if p.rx_mm is None:
            return
        tail, head = p.rx_tail, p.rx_q[_HEAD]
        size, data, mm = p.rx_size, p.rx_data, p.rx_mm
        seen = 0
        while tail != head and seen < PEEK_RECORDS:
            pos = tail % size
            comm, seq, step, call, count, total, off, c = _HDR.unpack_from(mm, data + pos)
            if c == _WRAP_REC:
                tail += size - pos
                continue
            seen += 1
            yield comm, seq, step, call, count
            # a descriptor record (single copy, registered) has a fixed size, a chunk its bytes
            tail += _CMA_RECORD if c < 0 else HDR + ((c + 63) & ~63)
