"""Waiting and waking in the shm transport: the sleeping flag, the futex word, doorbell sockets.

A waiting rank polls its rings (hot for a few microseconds, then yielding its core between
polls: at once when the node's ranks outnumber its cores, ``MINICOMM_SPIN=yield|hot``
overrides), then raises the ``sleeping`` word of its segment, fences, re-checks its rings once,
and sleeps: on the *futex word* of its segment (``sleeping`` = 2; futex.py, ctypes) when shm is
the only engine of its progress loop, else in epoll on its doorbell sockets (``sleeping`` = 1).
Spin, then sleep: docs/decisions/shm-spin-then-sleep.md.

After publishing records or freeing ring space for a peer, a rank fences and reads that peer's
``sleeping`` word: 0 costs nothing (an awake peer), 2 a store of a fresh value into the peer's
futex word and one ``futex(FUTEX_WAKE)``, 1 one byte on the doorbell socket. The two fences make
the handshake sound (Dekker): either the sleeper's re-check sees the new head/tail, or the
publisher sees the flag and wakes it; the futex sleeper reads its word *before* the re-check,
and the kernel sleeps only while the word still holds that value, so a wake between the two is
never lost (every wake writes a value no waker wrote before: its own counter and rank). A full
doorbell socket means unread doorbells are already pending, so a failed (EAGAIN) ring loses
nothing. A futex sleeper wakes at least every ``progress.FUTEX_SLICE_S`` to read its doorbell
sockets. A dead peer's kernel closes its end: EOF -> PeerFailure, with no heartbeat. ``abort``
and ``close`` send a reason (or goodbye) on the socket and then wake the peer's futex word.
``MINICOMM_FUTEX=0`` (or a platform without futexes) keeps the socket doorbells only.
"""
from __future__ import annotations

import os
import socket

from .. import futex
from ..progress import CLEAN_CLOSE
from .layout import _FUTEX_WORD, _SLEEP_FUTEX, _SLEEPING
from .peer import _Peer

_NOWAIT = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
_WAKE = b"\x01"
_ABORT = b"\x00"                      # then the reason, then EOF
_ABORTED = "it aborted: "
_BYE = b"\x02"                        # an orderly close: then EOF


def _oversubscribed(local_ranks: int) -> bool:
    """True if this node's ranks outnumber the cores this process may run on (then a spinning
    rank must hand its core over between polls). ``MINICOMM_SPIN=yield|hot`` overrides."""
    forced = os.environ.get("MINICOMM_SPIN", "").strip().lower()
    if forced in ("yield", "hot"):
        return forced == "yield"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return local_ranks > cores


class DoorbellMixin:
    """ShmTransport's flag, futex word and doorbells (the module doc). Its state: ``_flag_q`` /
    ``_futex_i`` (our segment's first page as int64 / int32 words), ``_futex_addr``,
    ``futex_ok`` (the progress engine may sleep on our word), ``_wake_seq``, and each peer's
    ``sock``, ``flag_q``, ``futex_i`` / ``futex_addr``."""

    def sleep(self, flag) -> None:
        """Raise (``True``: asleep on the doorbell sockets; ``_SLEEP_FUTEX``: on the futex word)
        or lower our sleeping flag, which peers read before deciding to wake us."""
        if self._flag_q is not None:
            self._flag_q[_SLEEPING] = int(flag)

    def futex_value(self) -> int:
        """Our futex word, read after the flag is raised and before the last pass (Progress)."""
        return self._futex_i[_FUTEX_WORD]

    def futex_block(self, value: int, timeout: float) -> None:
        """Sleep on our futex word while it still holds ``value``, at most ``timeout`` s."""
        addr = self._futex_addr
        if addr:
            self.futex_sleeps += 1
            try:
                futex.wait(addr, value, timeout)
            except OSError:
                pass                  # unmapped under us by close(): the next pass raises

    def kick(self) -> None:
        """Wake our own futex sleeper (another thread cancelled or closed something)."""
        if self._futex_i is not None and self._futex_addr:
            self._futex_i[_FUTEX_WORD] = self._next_wake_value()
            futex.wake(self._futex_addr, 1 << 30)

    def _next_wake_value(self) -> int:
        # unique per (waker, wake): a waker can never write back the value a sleeper read
        self._wake_seq = (self._wake_seq + 1) & 0xFFFFFF
        return self._wake_seq << 7 | (self.rank & 0x7F)

    def _futex_wake(self, p: _Peer) -> None:
        if p.futex_i is not None and p.futex_addr:
            p.futex_i[_FUTEX_WORD] = self._next_wake_value()
            try:
                futex.wake(p.futex_addr, 1 << 30)
            except OSError:
                pass                  # cannot happen while mapped; never fail a send for it

    def _ring_if_sleeping(self, p: _Peer) -> None:
        """Ring ``p``'s doorbell if it may be asleep; the caller fenced after its last store."""
        p.owed = False
        asleep = p.flag_q[_SLEEPING]
        if not asleep or p.sock is None:
            return
        if asleep == _SLEEP_FUTEX and p.futex_addr:
            self._futex_wake(p)
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
