"""The NIC agent: a per-process thread that plays the network card for peers on other nodes.

What is simulated. A real RDMA NIC or UB controller executes incoming WRITE / READ / atomic
requests against registered memory by DMA, without the host CPU. Here one daemon thread per
process ("minicomm-<kind>-agent-r<rank>") does that: it holds one authenticated TCP connection per
peer on another node (the job token, ``rendezvous.accept_peers`` / ``dial_peer``; a connection
without the token is refused before a byte of payload is read), reads request frames and applies
them to this process's registered regions through ``handler.on_frame`` -- with no call from the
application, which may be busy in a numpy loop (passive-target progress; the interpreter hands
the GIL over at least every ``sys.getswitchinterval()``, 5 ms) -- and sends the responses. It also
reads the responses to this process's own requests and completes them. An incoming WRITE's
payload is received straight into the target region (``recv_into`` a view of it: the "DMA"), a
READ's reply straight into the initiator's buffer.

Wire: a 112-byte frame of 14 little-endian int64 (kind, op, channel, op_id, key, addr, nbytes,
imm, a, b, token, status, payload, spare) followed by ``payload`` bytes. Frames of one connection
are applied in order (the socket is the in-order reliable connection of an RC QP / a UB
transaction path).

Never blocking. Every socket is non-blocking; a send that does not fit is queued on its connection
and flushed when the socket becomes writable (edge-triggered epoll), so two agents replying to
each other's large READs never deadlock. Any thread may send (``send``): it writes directly when
the connection's queue is empty, else queues and wakes the agent.

Failures: EOF or a reset -> ``handler.on_closed(peer, reason)`` at once (pending requests to that
peer fail, waiters raise PeerFailure).
"""
from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Dict, List, Optional

import numpy as np

from minicomm.rendezvous import accept_peers, dial_peer

FRAME = struct.Struct("<14q")
FRAME_BYTES = FRAME.size
REQ, RESP, ABORT, BYE = 1, 2, 3, 4
KINDS = frozenset({REQ, RESP, ABORT, BYE})
MAX_DROPPED = 64 << 20                # a payload nobody takes is dropped only up to this size
STAGING = 256 << 10
DIRECT = 64 << 10                     # payloads at least this large skip the staging copy
_MAX_IOV = 64
_FLAGS = socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT
_EV = select.EPOLLIN | select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLET


class Frame:
    """A parsed frame header (attribute access for readability)."""
    __slots__ = ("kind", "op", "channel", "op_id", "key", "addr", "nbytes", "imm", "a", "b",
                 "token", "status", "payload", "spare")

    def __init__(self, fields):
        (self.kind, self.op, self.channel, self.op_id, self.key, self.addr, self.nbytes, self.imm,
         self.a, self.b, self.token, self.status, self.payload, self.spare) = fields


def pack(kind, op=0, channel=0, op_id=0, key=0, addr=0, nbytes=0, imm=0, a=0, b=0, token=0,
         status=0, payload=0) -> bytes:
    return FRAME.pack(kind, op, channel, op_id, key, addr, nbytes, imm, a, b, token, status,
                      payload, 0)


class Conn:
    __slots__ = ("peer", "sock", "fd", "lock", "outq", "rx", "rx_mv", "lo", "hi", "cur", "dst",
                 "got", "closed", "state")

    def __init__(self, peer: int, sock: socket.socket):
        self.peer, self.sock, self.fd = peer, sock, sock.fileno()
        # guards ``outq`` (re-entrant: a failed write in _flush ends the link, with it held)
        self.lock = threading.RLock()
        self.outq: deque = deque()            # [memoryview, keepalive] not yet written
        self.rx = bytearray(STAGING)
        self.rx_mv = memoryview(self.rx)
        self.lo = self.hi = 0
        self.cur: Optional[Frame] = None      # frame whose payload is arriving
        self.dst = None                       # where it goes (uint8 view)
        self.got = 0
        self.closed: Optional[str] = None
        self.state = None                     # the handler's note about ``cur``


class NicAgent:
    """Connections to the peers of other nodes and the thread that serves them (module doc).

    ``handler`` provides ``on_header(conn, frame) -> uint8 view or None`` (where a frame's
    payload goes; None: read and drop), ``on_frame(conn, frame)`` (the frame and its payload have
    arrived) and ``on_closed(peer, reason)``."""

    def __init__(self, kind: str, rank: int, peers: List[int], store, token: bytes,
                 bind_host: str, deadline: float, handler):
        self.kind, self.rank, self.handler = kind, rank, handler
        self.conns: Dict[int, Conn] = {}
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._ep = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep.register(self._wake_r, select.EPOLLIN)
        try:
            for peer, s in self._connect(peers, store, token, bind_host, deadline).items():
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setblocking(False)
                c = self.conns[peer] = Conn(peer, s)
                self._ep.register(c.fd, _EV)
        except BaseException:
            self._release()
            raise
        self._by_fd = {c.fd: c for c in self.conns.values()}

    def _connect(self, peers, store, token, bind_host, deadline):
        me = self.rank
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        socks: Dict[int, socket.socket] = {}
        with socket.create_server((bind_host, 0), family=family,
                                  backlog=socket.SOMAXCONN) as listener:   # strays may queue
            port = listener.getsockname()[1]
            host = bind_host if bind_host not in ("", "0.0.0.0", "::") else store.local_address()
            store.set(f"{self.kind}/agent/{me}", f"{host}|{port}".encode())
            try:
                for pr in sorted(peers):
                    if pr < me:
                        left = max(0.0, deadline - time.monotonic())
                        h, p = store.get(f"{self.kind}/agent/{pr}", timeout=left).decode().split("|")
                        fam = socket.AF_INET6 if ":" in h else socket.AF_INET
                        socks[pr] = dial_peer(fam, (h, int(p)), token, me, pr, deadline)
                socks.update(accept_peers(listener, token, me, [p for p in peers if p > me],
                                          deadline))
            except BaseException:
                for s in socks.values():
                    s.close()
                raise
        return socks

    def start(self) -> None:
        if self.conns:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"minicomm-{self.kind}-agent-r{self.rank}")
            self._thread.start()

    # ------------------------------------------------------------------------ sending
    def send(self, peer: int, frame: bytes, payload=None) -> bool:
        """Queue one frame and its payload (a list of uint8 views, kept alive until written);
        False if the connection is closed. Safe from any thread."""
        c = self.conns[peer]
        with c.lock:
            if c.closed is not None:
                return False
            was_empty = not c.outq
            c.outq.append([memoryview(frame), frame])
            for part in payload or ():
                if len(part):
                    c.outq.append([memoryview(part).cast("B"), part])
            if was_empty:
                self._flush(c)
            pending = bool(c.outq)
        if pending and threading.current_thread() is not self._thread:
            self._wake()
        return True

    def _flush(self, c: Conn) -> None:
        """Write as much of the queue as the socket takes now (caller holds c.lock)."""
        q = c.outq
        while q:
            iov = [item[0] for item in list(q)[:_MAX_IOV]]
            try:
                n = c.sock.sendmsg(iov, (), _FLAGS)
            except BlockingIOError:
                return                # the next EPOLLOUT edge resumes
            except OSError as e:
                self._lost(c, f"its {self.kind} agent link failed ({e.strerror or e})")
                return
            while n:
                item = q[0]
                k = len(item[0])
                if n < k:
                    item[0] = item[0][n:]
                    break
                n -= k
                q.popleft()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\x01")
        except (BlockingIOError, OSError):
            pass

    # ------------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        try:
            while not self._closed:
                try:
                    events = self._ep.poll(1.0)
                except (OSError, ValueError):
                    return
                for fd, ev in events:
                    if fd == self._wake_r:
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                        for c in self.conns.values():
                            if c.outq:
                                with c.lock:
                                    self._flush(c)
                        continue
                    c = self._by_fd.get(fd)
                    if c is None or c.closed is not None:
                        continue
                    if ev & select.EPOLLOUT and c.outq:
                        with c.lock:
                            self._flush(c)
                    if ev & (select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR):
                        self._read(c)
        except BaseException as e:    # a handler bug must not hang the job silently
            for c in self.conns.values():
                self._lost(c, f"its {self.kind} agent thread failed: {type(e).__name__}: {e}")

    def _read(self, c: Conn) -> None:
        """Parse frames and land payloads until the socket has nothing more (edge-triggered)."""
        handler = self.handler
        while c.closed is None:
            f = c.cur
            if f is None:
                if c.hi - c.lo < FRAME_BYTES:
                    if not self._fill(c):
                        return
                    continue
                f = Frame(FRAME.unpack_from(c.rx, c.lo))
                c.lo += FRAME_BYTES
                if f.kind not in KINDS:
                    self._refuse(c, f"sent a frame of unknown kind {f.kind} (op {f.op})")
                    return
                if f.payload <= 0:
                    handler.on_frame(c, f)
                    continue
                dst = handler.on_header(c, f)
                if dst is None or len(dst) != f.payload:
                    # nothing takes this payload: read and drop it, but never allocate what a
                    # broken or hostile peer announces
                    if f.payload > MAX_DROPPED:
                        self._refuse(c, f"sent a frame announcing {f.payload} payload bytes that "
                                        f"no region accepts (kind {f.kind}, op {f.op}; the limit "
                                        f"is {MAX_DROPPED})")
                        return
                    dst = np.empty(f.payload, dtype=np.uint8)
                c.cur, c.dst, c.got = f, dst, 0
            need = f.payload - c.got
            have = c.hi - c.lo
            if have:
                k = min(have, need)
                c.dst[c.got:c.got + k] = np.frombuffer(c.rx, np.uint8, k, c.lo)
                c.lo += k
                c.got += k
            elif need >= DIRECT:
                try:
                    k = c.sock.recv_into(c.dst[c.got:])
                except BlockingIOError:
                    return
                except OSError as e:
                    self._lost(c, f"its {self.kind} agent link failed ({e.strerror or e})")
                    return
                if k == 0:
                    self._lost(c, f"it closed its {self.kind} link (exited or crashed)")
                    return
                c.got += k
            elif not self._fill(c):
                return
            if c.got == f.payload:
                c.cur = c.dst = None
                handler.on_frame(c, f)

    def _fill(self, c: Conn) -> bool:
        if c.lo:
            n = c.hi - c.lo
            c.rx[:n] = c.rx[c.lo:c.hi]
            c.lo, c.hi = 0, n
        try:
            k = c.sock.recv_into(c.rx_mv[c.hi:])
        except BlockingIOError:
            return False
        except OSError as e:
            self._lost(c, f"its {self.kind} agent link failed ({e.strerror or e})")
            return False
        if k == 0:
            self._lost(c, f"it closed its {self.kind} link (exited or crashed)")
            return False
        c.hi += k
        return True

    def _refuse(self, c: Conn, reason: str) -> None:
        """The peer broke the protocol: end its link (it sees EOF, so it learns too). The
        reason is recorded before the socket is shut: a write by another thread in between
        would otherwise fail with EPIPE and be taken for the cause."""
        self._lost(c, f"its {self.kind} agent {reason}: the link is closed")
        try:
            c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _lost(self, c: Conn, reason: str) -> None:
        if c.closed is None:
            c.closed = reason
            with c.lock:              # the agent thread's reads end links too: never clear the
                c.outq.clear()        # queue under another thread's _flush
            try:
                self._ep.unregister(c.fd)
            except (OSError, ValueError):
                pass
            self.handler.on_closed(c.peer, reason)

    # ------------------------------------------------------------------------ lifetime
    def goodbye(self, kind: int, reason: bytes = b"") -> None:
        """Best effort: tell every peer why this link ends (ABORT with a reason, or BYE)."""
        for c in self.conns.values():
            self._goodbye(c, kind, reason)

    def goodbye_to(self, peer: int, kind: int, reason: bytes = b"") -> None:
        """``goodbye`` to one peer: its link alone ends (an agreement excluded it)."""
        c = self.conns.get(peer)
        if c is not None:
            self._goodbye(c, kind, reason)

    def _goodbye(self, c: Conn, kind: int, reason: bytes) -> None:
        with c.lock:
            if c.closed is not None:
                return
            data = pack(kind, payload=len(reason)) + reason
            c.outq.append([memoryview(data), data])
            self._flush(c)
            if kind == ABORT and not c.outq:
                try:
                    c.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for c in self.conns.values():          # what is still queued (answers, the goodbye)
            if c.closed is None and c.outq:
                try:
                    c.sock.settimeout(2.0)
                    for item in c.outq:
                        c.sock.sendall(item[0])
                except OSError:
                    pass
                c.outq.clear()
        self._release()

    def _release(self) -> None:
        for c in self.conns.values():
            c.closed = c.closed or "closed"
            try:
                c.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            c.sock.close()
        try:
            self._ep.close()
        except OSError:
            pass
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

