"""tcp: two-sided transport over one TCP connection per peer pair.

Setup. Each rank listens on an ephemeral port of ``bind_host`` and publishes ``addr/<rank>`` in the
store; the higher rank of a pair dials the lower one. Every connection is authenticated with the
job token (rendezvous.py) before a single frame is read, then both sides swap ranks; strays are
refused by the listener's bounded select loop while setup goes on (no thread each; the listen
queue is the kernel's maximum). The listener binds the interface this rank reaches the store
through (launch/world.py) and closes once every peer is connected, so later strays are refused
by the kernel.

Wire. A message is a 48-byte little-endian frame (the Tag's five int64 and the payload length)
followed by the payload. Dtype and shape are not sent: the receiver posted the buffer, and the
Tag (call signature and count) plus the length detect any disagreement (``check_tag``).

Full duplex. Sockets are non-blocking and edge-triggered in the shared epoll (progress.py); a
progress pass writes every queued send and reads every receivable message of every peer, so a
ring step sends and receives at once and never deadlocks on full socket buffers. Sends gather
the frame and payloads of queued messages into one ``sendmsg`` straight from numpy memory. The
receiver reads into a 256 KiB staging buffer, which batches small messages into one ``recv`` and
is the bounce buffer that receive-with-reduce reduces from (whole elements at a time); a large
plain receive goes ``recv_into`` the destination directly.

Matching. Frames of one connection arrive in send order; receives match FIFO per (peer, tag.comm).
A frame whose receive is not posted stays unread (in staging or the kernel: rendezvous semantics
for the sender, no copy), unless a receive for another communicator is posted on that peer: then
the frame is read out of the way into an ``Unexpected`` buffer, so communicators cannot block
each other.

Failures. A peer's stream is read in order: its data, then its goodbye, then its end. ``close``
writes a goodbye frame (comm = -2) behind everything sent (waiting, at most ``BYE_WAIT_S``, for
room behind data the peer has not read yet), then FIN: the peer *finished*, a clean PeerFailure
for whoever waits on it (``ANY_SOURCE`` skips it). ``abort`` sends a frame with the reason (comm
= -1) when the stream is at a frame boundary, then shuts the connection. The end of the stream
(EOF, a reset) or a failed write is judged by what the stream held before it: a goodbye or abort
frame staged ahead of the end is the verdict, even when the end was read first (staging reads
ahead while the rank is busy in another call); only an end without one is a crash -- a
PeerFailure for whoever waits on that peer, at once. Staged messages are delivered whatever the
verdict. Keepalive probes bound the wait on a host that vanished without a reset.
"""
from __future__ import annotations

import select
import socket
import struct
import time
from collections import deque
from typing import Dict, Optional

import numpy as np

from minicomm.rendezvous import accept_peers, dial_peer
from .base import Capabilities, ReduceFn, Request, Tag
from .progress import CLEAN_CLOSE, Inbox, LinkEngine, Progress, Req, deliver

_FRAME = struct.Struct("<6q")
FRAME = _FRAME.size
RX_BYTES = 256 << 10                  # staging / bounce buffer per connection (fits in L2)
DIRECT = 64 << 10                     # plain receives at least this large bypass staging
ABORT_COMM = -1
_FINISHED = CLEAN_CLOSE + " (it finished)"
MAX_PAYLOAD = 1 << 48                 # a frame announcing more is malformed (PeerFailure)
BYE_COMM = -2                         # an orderly close (then FIN)
BYE_WAIT_S = 10.0                     # close waits this long at most for room for its goodbye
PEEK_FRAMES = 1024                    # staged frames _peek_all reads before a rank blocks
_MAX_IOV = 128
_SEND_FLAGS = socket.MSG_NOSIGNAL
_READ_EV = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_WRITE_EV = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR


class _Conn:
    __slots__ = ("rank", "sock", "fd", "txq", "readable", "writable", "rx", "rx_np", "rx_mv",
                 "lo", "hi", "rx_cur", "rx_total", "inbox", "closed", "broken")

    def __init__(self, rank: int, sock: socket.socket):
        self.rank, self.sock, self.fd = rank, sock, sock.fileno()
        self.txq: deque = deque()
        self.readable = self.writable = True     # edge-triggered hints: cleared on EAGAIN
        self.rx = bytearray(RX_BYTES)
        self.rx_np = np.frombuffer(self.rx, dtype=np.uint8)
        self.rx_mv = memoryview(self.rx)
        self.lo = self.hi = 0                    # unconsumed staging bytes are rx[lo:hi]
        self.rx_cur = None                       # the target whose payload is arriving
        self.rx_total = 0
        self.inbox = Inbox(rank)
        self.closed: Optional[str] = None        # the verdict, in stream order
        self.broken: Optional[str] = None        # why a write failed (no more sends)


def _split_addr(value: str):
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class TcpTransport(LinkEngine):
    name = "tcp"

    def __init__(self, rank: int, size: int, store, token: bytes, peers, bind_host: str,
                 timeout: float, progress: Optional[Progress] = None):
        self.rank, self.size = rank, size
        self.peer_ranks = sorted(int(p) for p in peers if p != rank)
        self._progress = progress or Progress()
        self._lock = self._progress.lock
        self._conns: Dict[int, _Conn] = {}
        self._active: Dict[_Conn, None] = {}
        self._aborted: Optional[str] = None
        self._cancelled: Dict[int, BaseException] = {}
        self._closed = False
        if self.peer_ranks:
            socks = self._connect_all(store, token, bind_host, time.monotonic() + timeout)
            for pr, s in socks.items():
                self._conns[pr] = self._configure(pr, s)
        self._progress.attach(self, False)   # a tcp pass costs syscalls: block, don't spin

    def _connect_all(self, store, token: bytes, bind_host: str, deadline: float):
        me = self.rank
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        socks: Dict[int, socket.socket] = {}
        with socket.create_server((bind_host, 0), family=family,
                                  backlog=socket.SOMAXCONN) as listener:   # strays may queue
            port = listener.getsockname()[1]
            host = bind_host if bind_host not in ("", "0.0.0.0", "::") else store.local_address()
            store.set(f"addr/{me}", (f"[{host}]:{port}" if ":" in host else
                                     f"{host}:{port}").encode())
            try:
                for pr in self.peer_ranks:
                    if pr < me:
                        left = deadline - time.monotonic()
                        h, p = _split_addr(store.get(f"addr/{pr}", timeout=max(0.0, left)).decode())
                        fam = socket.AF_INET6 if ":" in h else socket.AF_INET
                        socks[pr] = dial_peer(fam, (h, p), token, me, pr, deadline)
                socks.update(accept_peers(listener, token, me,
                                          [p for p in self.peer_ranks if p > me], deadline))
            except BaseException:
                for s in socks.values():
                    s.close()
                raise
        return socks

    def _configure(self, peer: int, s: socket.socket) -> _Conn:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A peer host that vanishes without a reset is noticed in ~25 s even with no deadline.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
        s.setblocking(False)
        c = _Conn(peer, s)
        self._progress.register(c.fd, lambda ev, c=c: self._on_event(c, ev))
        return c

    # ------------------------------------------------------------------------- data path
    def _conn(self, peer: int) -> _Conn:
        try:
            return self._conns[peer]
        except KeyError:
            raise ValueError(f"rank {self.rank}: no tcp route to rank {peer} "
                             f"(tcp peers: {self.peer_ranks})") from None

    def isend(self, peer: int, buf: np.ndarray, tag: Tag) -> Request:
        c = self._conn(peer)
        req = Req(self, peer, buf, tag, None, True)
        req.hdr = _FRAME.pack(tag[0], tag[1], tag[2], tag[3], tag[4], req.nbytes)
        with self._lock:
            c.txq.append(req)
            self._active[c] = None
            if len(c.txq) == 1 and c.closed is None and c.broken is None:
                self._push(c)         # eager: frame and payload leave in this very call
        return req

    def irecv(self, peer: int, buf: np.ndarray, tag: Tag,
              reduce: Optional[ReduceFn] = None) -> Request:
        c = self._conn(peer)
        req = Req(self, peer, buf, tag, reduce, False)
        with self._lock:
            c.inbox.post(req)
            self._active[c] = None
        return req

    def progress(self) -> bool:
        moved = False
        for c in list(self._active):
            if c.txq and c.closed is None and c.broken is None and self._push(c):
                moved = True
            if (c.inbox.n_posted or c.rx_cur is not None) and self._pull(c):
                moved = True
            if not (c.txq or c.inbox.n_posted or c.rx_cur is not None):
                del self._active[c]
        return moved

    def _push(self, c: _Conn) -> bool:
        """Write queued frames and payloads until the socket buffer is full."""
        q = c.txq
        moved = False
        while q and c.writable:
            iov = []
            for req in q:
                off = req.off
                if off < FRAME:
                    iov.append(memoryview(req.hdr)[off:])
                    if req.nbytes:
                        iov.append(req.u8)
                else:
                    iov.append(req.u8[off - FRAME:])
                if len(iov) >= _MAX_IOV:
                    break
            try:
                n = c.sock.sendmsg(iov, (), _SEND_FLAGS)
            except BlockingIOError:
                c.writable = False    # the next EPOLLOUT edge sets it again
                break
            except OSError as e:
                self._send_failed(c, f"its connection failed ({e.strerror or e})")
                break
            moved = True
            while n:
                req = q[0]
                left = FRAME + req.nbytes - req.off
                if n < left:
                    req.off += n
                    break
                n -= left
                req.off += left
                req.done = True
                q.popleft()
        return moved

    def _pull(self, c: _Conn) -> bool:
        """Parse frames and land payloads until nothing more can be matched or read."""
        ib = c.inbox
        rx = c.rx_np
        moved = False
        while True:
            target = c.rx_cur
            if target is None:
                if c.hi - c.lo < FRAME:
                    if not self._fill(c):
                        break
                    continue
                comm, seq, step, call, count, total = _FRAME.unpack_from(c.rx, c.lo)
                if not 0 <= total <= MAX_PAYLOAD:
                    # an authenticated peer that breaks the framing: its link is unusable
                    c.closed = c.closed or f"it sent a malformed frame (payload length {total})"
                    break
                if comm == ABORT_COMM:
                    reason = bytes(c.rx[c.lo + FRAME:min(c.hi, c.lo + FRAME + total)])
                    c.closed = "it aborted: " + reason.decode(errors="replace")
                    break
                if comm == BYE_COMM:
                    if c.closed is None or c.closed == c.broken:
                        c.closed = _FINISHED    # a write after its goodbye failed: no crash
                    break
                target = ib.match(Tag(comm, seq, step, call, count), total)
                if target is None:
                    break             # not posted yet: leave it unread
                c.lo += FRAME
                c.rx_cur, c.rx_total = target, total
                target.off = 0
                moved = True
                if total == 0:
                    c.rx_cur = None
                    ib.complete(target)
                    continue
            have = c.hi - c.lo
            if have:
                k = min(have, c.rx_total - target.off)
                if target.reduce is not None:
                    k -= k % target.buf.itemsize          # reduce whole elements only
                if k:
                    deliver(target, target.off, rx[c.lo:c.lo + k])
                    c.lo += k
                    target.off += k
                    moved = True
                    if target.off == c.rx_total:
                        c.rx_cur = None
                        ib.complete(target)
                        continue
            if not c.readable:
                break
            need = c.rx_total - target.off
            if (target.reduce is None and c.lo == c.hi and need >= DIRECT
                    and target.u8.flags.c_contiguous):    # not a dropped message's scratch
                n = self._recv(c, target.u8[target.off:])   # straight into the destination
                if n <= 0:
                    break
                target.off += n
                moved = True
                if target.off == c.rx_total:
                    c.rx_cur = None
                    ib.complete(target)
            elif not self._fill(c):
                break
        return moved

    def _fill(self, c: _Conn) -> bool:
        """Read more into staging (after moving the few unconsumed bytes to its front)."""
        if not c.readable:
            return False
        if c.lo:
            n = c.hi - c.lo
            c.rx[:n] = c.rx[c.lo:c.hi]
            c.lo, c.hi = 0, n
        if c.hi - c.lo == len(c.rx):
            return False              # full: an empty read would look like the stream's end
        k = self._recv(c, c.rx_mv[c.hi:])
        if k <= 0:
            return False
        c.hi += k
        return True

    def _recv(self, c: _Conn, view) -> int:
        try:
            n = c.sock.recv_into(view)
        except BlockingIOError:
            c.readable = False        # the next EPOLLIN edge sets it again
            return 0
        except OSError as e:
            self._stream_ended(c, f"its connection failed ({e.strerror or e})")
            return -1
        if n == 0:
            self._stream_ended(c, "it closed the connection (exited or crashed)")
            return -1
        return n

    def _stream_ended(self, c: _Conn, reason: str) -> None:
        """``c``'s inbound stream ended (EOF or a reset): staging holds all that is left of it,
        and a goodbye or abort frame there, ahead of the end, is the verdict (read ahead of its
        parsing by ``_peek_all``); ``reason``, a crash, only without one."""
        c.readable = False
        if c.closed is None or c.closed == c.broken:
            c.closed = self._staged_verdict(c) or (c.closed or reason)

    def _send_failed(self, c: _Conn, reason: str) -> None:
        """A write to ``c`` failed. A peer that said goodbye and closed makes writes fail too,
        so what its stream holds decides: stage what has arrived (its end, if reached, judges
        it: ``_stream_ended``), then ``reason`` only if no goodbye or abort frame is staged."""
        c.broken = reason
        c.writable = False
        c.readable = True             # a read that finds nothing costs one EAGAIN
        while c.closed is None and self._fill(c):
            pass
        if c.closed is None:
            c.closed = self._staged_verdict(c) or reason

    def _staged_verdict(self, c: _Conn) -> Optional[str]:
        """The verdict of the first goodbye or abort frame staged in ``c`` (past the payload
        still arriving), or None: every staged frame is data, or a frame is cut by the end."""
        pos = c.lo + (c.rx_total - c.rx_cur.off if c.rx_cur is not None else 0)
        while pos + FRAME <= c.hi:
            comm, _, _, _, _, total = _FRAME.unpack_from(c.rx, pos)
            if comm == BYE_COMM:
                return _FINISHED
            if comm == ABORT_COMM:
                reason = bytes(c.rx[pos + FRAME:min(c.hi, pos + FRAME + total)])
                return "it aborted: " + reason.decode(errors="replace")
            if not 0 <= total <= MAX_PAYLOAD:
                return None
            pos += FRAME + total
        return None

    def sleep(self, flag: bool) -> None:
        """Nothing to announce: the kernel wakes a sleeping receiver on tcp."""

    def capabilities(self) -> Capabilities:
        """The two-sided core only (a tcp peer cannot be reached one-sided); its routes."""
        return Capabilities(describe=self.describe)

    def _on_event(self, c: _Conn, ev: int) -> None:
        if ev & _READ_EV:
            c.readable = True
        if ev & _WRITE_EV:
            c.writable = True

    def _link(self, peer: int):
        return self._conns[peer]

    def _peek(self, c: _Conn):
        # a closed connection's staged frames too: they arrived whole before its end (a notice
        # of a rank that broke the communicator and then finished comes just before its EOF)
        if c.hi - c.lo < FRAME:
            self._fill(c)                       # reads only into the staging buffer
            if c.hi - c.lo < FRAME:
                return None
        comm, seq, step, call, count, total = _FRAME.unpack_from(c.rx, c.lo)
        if comm in (ABORT_COMM, BYE_COMM) or not 0 <= total <= MAX_PAYLOAD:
            return None
        return comm, seq, step, call, count

    def _peek_all(self, c: _Conn):
        """The headers of the whole frames in ``c``'s staging buffer, oldest first (at most
        ``PEEK_FRAMES``), none consumed: as shm's ``_peek_all``, an abort notice behind a frame
        nobody has received yet is seen before this rank blocks (bytes still in the kernel's
        socket buffer are not: those are found once they are staged)."""
        if c.closed is None and c.readable and c.hi < len(c.rx):
            self._fill(c)                       # stage what the socket holds (edge-triggered:
            # the bytes behind an unreceived frame would raise no new event before we block)
        head = self._peek(c)                    # stages at least a header when one is there
        if head is None:
            return
        yield head
        pos, seen = c.lo + FRAME + _FRAME.unpack_from(c.rx, c.lo)[5], 1
        while pos + FRAME <= c.hi and seen < PEEK_FRAMES:
            comm, seq, step, call, count, total = _FRAME.unpack_from(c.rx, pos)
            if comm in (ABORT_COMM, BYE_COMM) or not 0 <= total <= MAX_PAYLOAD:
                return
            seen += 1
            yield comm, seq, step, call, count
            pos += FRAME + total

    def _links(self):
        return self._conns.values()

    # --------------------------------------------------------------------------- lifetime
    def abort(self, reason: str) -> None:
        with self._lock:
            if self._aborted is not None or self._closed:
                return
            self._aborted = reason
            msg = reason.encode()[:2000]
            for c in self._conns.values():
                try:
                    if not c.txq or c.txq[0].off == 0:    # at a frame boundary
                        c.sock.send(_FRAME.pack(ABORT_COMM, 0, 0, 0, 0, len(msg)) + msg,
                                    _SEND_FLAGS | socket.MSG_DONTWAIT)
                    c.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def _exclude(self, c: _Conn, reason: str) -> None:
        """Under the lock: ``c`` alone ends as ``abort`` ends all (an abort frame with the
        reason at a frame boundary, then both directions shut and no more events)."""
        msg = reason.encode()[:2000]
        try:
            if not c.txq or c.txq[0].off == 0:
                c.sock.send(_FRAME.pack(ABORT_COMM, 0, 0, 0, 0, len(msg)) + msg,
                            _SEND_FLAGS | socket.MSG_DONTWAIT)
            c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._progress.unregister(c.fd)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bye = _FRAME.pack(BYE_COMM, 0, 0, 0, 0, 0)
            deadline = time.monotonic() + BYE_WAIT_S
            for c in self._conns.values():
                self._progress.unregister(c.fd)
                try:
                    # a goodbye only at a frame boundary, to a peer still there
                    if (self._aborted is None and c.closed is None and c.broken is None
                            and (not c.txq or c.txq[0].off == 0)):
                        self._say_goodbye(c, bye, deadline)
                    c.sock.shutdown(socket.SHUT_WR)      # FIN after the data still queued
                except OSError:
                    pass
                c.sock.close()
                c.txq.clear()
                c.rx_cur = None
        self._progress.detach(self)

    @staticmethod
    def _say_goodbye(c: _Conn, frame: bytes, deadline: float) -> bool:
        """Write the goodbye frame behind everything sent. The socket's buffer may be full of
        data the peer has not read yet (a send completes once the kernel holds it): wait for
        room until ``deadline``, reading and dropping what the peer sends meanwhile (nothing is
        received any more, and two ranks closing at once must not wait on each other's full
        buffers). Returns whether the goodbye went: past the deadline the peer sees an end
        without one. Raises OSError if the connection fails."""
        view = memoryview(frame)
        poller = None
        want = select.POLLOUT | select.POLLIN
        while view:
            try:
                view = view[c.sock.send(view, _SEND_FLAGS | socket.MSG_DONTWAIT):]
                continue
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if poller is None:
                poller = select.poll()
                poller.register(c.fd, want)
            for _, ev in poller.poll(max(1, int(left * 1000))):
                if not want & select.POLLIN and ev & (select.POLLHUP | select.POLLERR):
                    return False                        # it is gone: nobody to tell
                if want & select.POLLIN and ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    try:
                        if c.sock.recv_into(c.rx_mv) == 0:
                            want = select.POLLOUT    # its end: nothing more to drop
                            poller.modify(c.fd, want)
                    except BlockingIOError:
                        pass
        return True
