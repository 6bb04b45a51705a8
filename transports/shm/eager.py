"""The shm transport's small-message channel (minicomm.smallpath; base.EagerChannel).

The small path hands messages of up to a chunk (``small_bytes``) straight to ``send_now`` /
``recv_now``: one record, written if the ring has room for it whole, taken if it is the ring's
next record; anything else (no room, a send queued before it, a message isend would stream or
send as a descriptor) goes through ``isend`` / ``irecv`` as usual. No request object, no
matching queue, the lock taken once: docs/decisions/small-message-path.md.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np

from .. import bytecopy
from ..base import ReduceFn, Tag
from ..progress import fence_acquire as _fence_acquire
from ..progress import fence_release as _fence_release
from .layout import _HDR, _HEAD, _SLEEPING, _TAIL, _WRAP_REC, EAGER, HDR
from .peer import _Peer

SMALL_HOT_S = 10e-6                   # recv_now polls this long without yielding (see there)


class EagerMixin:
    """ShmTransport's ``send_now`` / ``recv_now`` / ``sendrecv_now`` / ``recv_now_many``, and
    the one-record ``_put`` / ``_take`` that isend and irecv also try first."""

    # What send_now / recv_now may move as one record: one chunk, set by setup (EAGER until
    # then). Above EAGER, send_now leaves to isend what isend would not put in the ring as one
    # record (``_not_one_record``), and recv_now what did not arrive as one.
    small_bytes = EAGER

    def _not_one_record(self, p: _Peer, buf: np.ndarray, tag: Tag) -> bool:
        """Whether a message above EAGER is one that isend sends otherwise than as one ring
        record: above the receiver's chunk (streamed, or a registered-memory descriptor), or
        as a descriptor the receiver reads from our memory (single copy). send_now leaves those
        to isend."""
        n = buf.nbytes
        return (n > p.tx_chunk
                or (p.cma and n >= p.cma_min and self._single_copy(tag[3], n)))

    def send_now(self, peer: int, buf: np.ndarray, tag: Tag) -> bool:
        """Write a small message into ``peer``'s ring now, with no request object; False (nothing
        written): no room now, a send to ``peer`` is queued, or the link is closed -- the caller
        posts it with ``isend``."""
        p = self._peers.get(peer) or self._peer(peer)
        lock = self._lock
        lock.acquire()
        try:
            if p.txq or p.closed is not None or (buf.nbytes > EAGER and self._not_one_record(
                    p, buf, tag)) or not self._put(p, buf, tag):
                return False
            _fence_acquire()          # fence(), inline: this runs once per small message
            _fence_release()
            if p.flag_q[_SLEEPING]:
                self._ring_if_sleeping(p)
            else:
                p.owed = False        # awake: nothing to ring (what _ring_if_sleeping decides)
        finally:
            lock.release()
        return True

    def recv_now(self, peer: int, buf: np.ndarray, tag: Tag, reduce: Optional[ReduceFn],
                 spin: float) -> bool:
        """Take (or reduce) this receive's message if it is the next record of ``peer``'s ring,
        waiting up to ``spin`` seconds for a record to arrive (polling the ring's head word, no
        lock held; between polls a yield of the core when ranks outnumber cores). False (nothing
        consumed): the caller posts it with ``irecv``."""
        p = self._peers.get(peer) or self._peer(peer)
        lock = self._lock
        lock.acquire()
        try:
            if p.rx_cur is None and self._take(p, buf, tag, reduce):
                return True
        finally:
            lock.release()
        return self._take_within(p, buf, tag, reduce, spin)

    def sendrecv_now(self, peer: int, sbuf: np.ndarray, rbuf: np.ndarray, tag: Tag,
                     reduce: Optional[ReduceFn], spin: float) -> int:
        """``send_now(peer, sbuf, tag)`` and, if it went, ``recv_now(peer, rbuf, tag, reduce,
        spin)``, as one call: a step that exchanges with one peer (every step of a 2-rank call,
        each round of recursive doubling) looks the peer up and takes the lock once. Returns 0
        (nothing sent, nothing received: the caller goes on as after a failed ``send_now``),
        1 (sent; the receive is the caller's to post) or 3 (both done).

        ``_take`` is tried under the lock only if the peer's head word has moved; else
        ``_take_within`` polls that word without the lock."""
        p = self._peers.get(peer) or self._peer(peer)
        lock = self._lock
        lock.acquire()
        try:
            if p.txq or p.closed is not None or (sbuf.nbytes > EAGER and self._not_one_record(
                    p, sbuf, tag)) or not self._put(p, sbuf, tag):
                return 0
            _fence_acquire()                  # fence(), inline (send_now)
            _fence_release()
            if p.flag_q[_SLEEPING]:
                self._ring_if_sleeping(p)
            else:
                p.owed = False
            if p.rx_cur is None and p.rx_q[_HEAD] != p.rx_tail and self._take(p, rbuf, tag,
                                                                                reduce):
                return 3
        finally:
            lock.release()
        return 3 if self._take_within(p, rbuf, tag, reduce, spin) else 1

    def _take_within(self, p: _Peer, buf: np.ndarray, tag: Tag, reduce: Optional[ReduceFn],
                     spin: float) -> bool:
        """``recv_now``'s wait: poll ``p``'s ring for up to ``spin`` seconds, then ``_take``."""
        if spin <= 0.0 or p.rx_q is None:
            return False
        q, clock = p.rx_q, time.monotonic
        now = clock()
        end = now + spin
        # poll hot for a few microseconds (a running peer answers within that), then hand the
        # core over between polls; at once when ranks outnumber cores
        hot_end = now if self._spin_yields else now + SMALL_HOT_S
        while q[_HEAD] == p.rx_tail:
            now = clock()
            if now > end:
                return False
            if now > hot_end:
                os.sched_yield()
        with self._lock:
            return p.rx_cur is None and self._take(p, buf, tag, reduce)

    def recv_now_many(self, waiting: list, tag: Tag, spin: float) -> list:
        """``recv_now`` for receives from distinct peers, ``[(peer, buf, reduce), ...]``: takes
        whichever arrive within ``spin`` seconds in all; returns the ones still waiting."""
        lock = self._lock
        end = time.monotonic() + spin
        while True:
            left = []
            with lock:
                for w in waiting:
                    p = self._peers.get(w[0]) or self._peer(w[0])
                    if not (p.rx_cur is None and self._take(p, w[1], tag, w[2])):
                        left.append(w)
            if not left or time.monotonic() > end:
                return left
            waiting = left
            if self._spin_yields:
                os.sched_yield()

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
        pos = tail % p.rx_size
        h = p.rx_data + pos
        comm, seq, _, call, count, total, off, c = _HDR.unpack_from(p.rx_mm, h)
        if c == _WRAP_REC:            # the record is at the ring's start (c < 0 would
            # also match the single-copy descriptors, which are records of their own)
            tail += p.rx_size - pos
            p.rx_tail = tail
            p.rx_q[_TAIL] = tail
            if tail == p.rx_head:
                p.rx_head = p.rx_q[_HEAD]
                if tail == p.rx_head:
                    return False
            h = p.rx_data
            comm, seq, _, call, count, total, off, c = _HDR.unpack_from(p.rx_mm, h)
        n = buf.nbytes
        if not (c == total == n and comm == tag[0] and seq == tag[1] and call == tag[3]
                and count == tag[4]) or not buf.flags.c_contiguous:
            return False              # a wrap marker, a chunk, another call: the usual path
        if n:
            flat = buf if buf.ndim == 1 else buf.reshape(-1)
            dt = flat.dtype
            ring = p.rx_typed.get(dt)
            if ring is None:
                # the whole segment as this dtype, made once: a record's payload is then one
                # slice (records start on 64-byte boundaries, so every itemsize divides them)
                ring = p.rx_typed[dt] = np.frombuffer(p.rx_mm, dtype=dt)
            i = (h + HDR) // dt.itemsize
            if reduce is None:
                if n > EAGER:         # a record of the small path's upper sizes (small_bytes)
                    bytecopy.copy(flat, ring[i:i + flat.shape[0]])
                else:
                    flat[...] = ring[i:i + flat.shape[0]]
            else:
                reduce(flat, ring[i:i + flat.shape[0]])
        tail += HDR + ((n + 63) & ~63)
        p.rx_tail = tail
        p.rx_q[_TAIL] = tail          # hand the space back
        _fence_acquire()              # fence(), inline
        _fence_release()
        if p.flag_q[_SLEEPING]:
            self._ring_if_sleeping(p)
        else:
            p.owed = False
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
            p.tx_tail = tail = p.tx_q[_TAIL]          # the cached tail may be stale
            if need > size - pos and size - head + tail >= size - pos + need:
                # no room before the ring's end, room at its start: a wrap marker first
                _HDR.pack_into(p.tx_mm, p.tx_data + pos, 0, 0, 0, 0, 0, 0, 0, _WRAP_REC)
                head += size - pos
                p.tx_head = head
                p.tx_q[_HEAD] = head
                pos = 0
            if need > size - pos or need > size - head + tail:
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
