"""Bootstrap: job-token authentication, a small TCP key-value store, and peer-link setup.

Authentication. Every connection minicomm opens (store, tcp data links, shm doorbell links) starts
with a mutual HMAC-SHA256 challenge-response over the per-job random token (``MINICOMM_JOB_TOKEN``,
hex). Each side sends a fresh 32-byte nonce and proves knowledge of the token with
``HMAC(token, role || nonce_server || nonce_client)``; binding both nonces and the role into each
MAC rules out replay and reflection. Messages have fixed sizes, so an unauthenticated peer can make
the server read at most 64 bytes (72 on a peer link: its rank) and allocate nothing; the store
never unpickles anything (its protocol is plain length-prefixed bytes) and the transports read no
payload before the handshake succeeds.

Bounded pre-authentication work. Listeners (the store's, the ranks' peer-link listeners) run
every incoming handshake non-blocking in one select loop: no thread per connection, at most
``MAX_PENDING_HANDSHAKES`` unauthenticated connections at once (a newcomer beyond that evicts the
oldest: a member answers within milliseconds, so the oldest is a stray), each cut at
``HANDSHAKE_TIMEOUT``. On AF_UNIX listeners a connection from another user (``SO_PEERCRED``) is
closed before a byte is sent. Refusals are logged (logger ``minicomm.rendezvous``, INFO) with
the named error, e.g. ``AuthError: ... wrong job token``; nothing is raised in a background
thread. A dialer that meets a full queue, a refused connection or a listener that dropped it
before the handshake finished (EAGAIN, ECONNREFUSED, EOF) backs off and retries until the setup
deadline.

Store. ``StoreServer`` serves set / blocking get / atomic add. Authenticated members get a thread
each (a blocking get must not delay the others); if that thread cannot be started (a thread
limit) the member's connection is closed and logged, and the accept loop lives on. Values are
read as they arrive (memory follows bytes actually sent, up to ``_MAX_VALUE``). A key is written
once: a second writer (another connection) with a different value poisons the store (see
"Membership"), so a stranger who knows a derived token cannot silently redirect a rank. Once a
rank has joined, a connection that has not joined may not read or write keys at all (refused,
``RendezvousError``); a store used without joins (tests, tools) keeps the open key-value mode.
``StoreClient`` is thread-safe (one request at a time on its socket).

Membership. A rank ``join``s the store before it uses it: (job identity, world size, rank, a
random member id, host, pid). The store belongs to the first job that joins it (or the one it was
built for) and refuses a member of any other job (another identity or size) with a
``RendezvousError`` naming both jobs. Two processes claiming one rank of the same job mean two
jobs that carry the same identity share this port (generic ``RANK`` / ``WORLD_SIZE`` /
``MASTER_PORT`` with nothing job-unique in them): before the world is complete that stops every
member (the store is poisoned: every call, waiting ones included, raises the conflict; the host
closing it with ``linger`` first waits until every connected member has been sent that verdict);
after it is complete only the newcomer is refused. ``wait_world`` blocks until every rank has
joined, or reports how many did (``CommTimeout``). One more member may join a job: its emulated
in-network switch (``role`` ``AUX_SWITCH``, rank = the world size), which is not a rank of the
world; ``PrefixedStore`` gives it and the ranks' links to it their own key space.

Peer links. ``dial_peer`` and ``accept_peers`` build the authenticated full mesh that shm and tcp
use: the higher rank dials the lower one, authenticates, and both sides exchange ranks. Incoming
handshakes run in ``accept_peers``' select loop (above), so a stray connection that never speaks
cannot stall the job's setup.
"""
from __future__ import annotations

import errno
import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from hashlib import sha256
from typing import Dict, Iterable, Optional, Tuple

from .errors import CommError, CommTimeout, PeerFailure

_MAGIC = b"minicomm-auth-v1"          # 16 bytes: also rejects clients speaking another protocol
_NONCE = 32
_MAC = 32
HANDSHAKE_TIMEOUT = 10.0              # per connection; a silent stray is dropped after this
MAX_PENDING_HANDSHAKES = 64           # unauthenticated connections one listener keeps at once
_ACCEPT_BURST = 64                    # connections accepted per wake-up (others stay queued)
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
log = logging.getLogger("minicomm.rendezvous")


class AuthError(CommError):
    """The other side of a connection does not hold this job's token."""


class RendezvousError(CommError):
    """The rendezvous store refused this process: it belongs to another job, or two processes of
    jobs that look alike claimed one rank (two jobs share a port)."""


def new_token() -> bytes:
    return secrets.token_bytes(32)


def token_from_env() -> Optional[bytes]:
    value = os.environ.get("MINICOMM_JOB_TOKEN")
    return bytes.fromhex(value) if value else None


def _mac(token: bytes, role: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(token, role + ns + nc, sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"{what}: timed out")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            raise CommTimeout(f"{what}: timed out") from None
        if k == 0:
            raise PeerFailure(f"{what}: connection closed by the other side")
        got += k
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float, what: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise CommTimeout(f"{what}: timed out")
    sock.settimeout(left)
    try:
        sock.sendall(data)
    except socket.timeout:
        raise CommTimeout(f"{what}: timed out") from None


def authenticate_server(sock: socket.socket, token: bytes, timeout: float) -> None:
    """Server side of the handshake; raises AuthError (caller closes the socket) unless the client
    proves it holds ``token``. Leaves the socket in blocking mode with no timeout."""
    deadline = time.monotonic() + timeout
    ns = secrets.token_bytes(_NONCE)
    try:
        _send_all(sock, _MAGIC + ns, deadline, "authentication")
        reply = _recv_exact(sock, _NONCE + _MAC, deadline, "authentication")
    except (PeerFailure, CommTimeout, OSError) as e:
        raise AuthError(f"client did not complete authentication: {e}") from None
    nc, mac = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(mac, _mac(token, b"client", ns, nc)):
        raise AuthError("client failed authentication (wrong job token)")
    _send_all(sock, _mac(token, b"server", ns, nc), deadline, "authentication")
    sock.settimeout(None)


def authenticate_client(sock: socket.socket, token: bytes, timeout: float) -> None:
    """Client side of the handshake: proves we hold ``token`` and checks the server does too."""
    deadline = time.monotonic() + timeout
    hello = _recv_exact(sock, len(_MAGIC) + _NONCE, deadline, "authentication")
    if hello[:len(_MAGIC)] != _MAGIC:
        raise AuthError("the server does not speak the minicomm protocol")
    ns = hello[len(_MAGIC):]
    nc = secrets.token_bytes(_NONCE)
    _send_all(sock, nc + _mac(token, b"client", ns, nc), deadline, "authentication")
    try:
        mac = _recv_exact(sock, _MAC, deadline, "authentication")
    except (PeerFailure, ConnectionResetError):   # a refusing server closes the connection
        err = AuthError("the server closed the connection during authentication (it refused "
                        "our job token, or dropped us as a stray under a flood)")
        err.closed = True
        raise err from None
    if not hmac.compare_digest(mac, _mac(token, b"server", ns, nc)):
        raise AuthError("the server failed authentication (it does not hold the job token)")
    sock.settimeout(None)


def peer_uid(sock: socket.socket) -> Optional[int]:
    """The uid of the process at the other end of an AF_UNIX socket (SO_PEERCRED), else None."""
    if sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class _ServerHandshake:
    """The server side of the handshake on a non-blocking socket, driven by readiness: reads
    exactly the bytes the protocol allows (64, then 8 for the rank on a peer link) and keeps no
    thread. ``step()`` returns True when done; raises AuthError on any deviation."""
    __slots__ = ("sock", "token", "ns", "buf", "need", "stage", "deadline", "my_rank", "rank",
                 "peer")

    def __init__(self, sock: socket.socket, token: bytes, deadline: float,
                 my_rank: Optional[int], peer: str):
        self.sock, self.token, self.deadline, self.my_rank, self.peer = (sock, token, deadline,
                                                                         my_rank, peer)
        self.ns = secrets.token_bytes(_NONCE)
        self.buf = bytearray()
        self.need, self.stage, self.rank = _NONCE + _MAC, 0, None
        sock.setblocking(False)
        self._send(_MAGIC + self.ns)

    def _send(self, data: bytes) -> None:
        # a few dozen bytes into a fresh socket's buffer: anything short of all of it means the
        # other side is not a well-behaved client
        try:
            sent = self.sock.send(data, socket.MSG_NOSIGNAL)
        except OSError as e:
            raise AuthError(f"connection lost during authentication ({e})") from None
        if sent != len(data):
            raise AuthError("client does not read its handshake")

    def step(self) -> bool:
        while True:
            while len(self.buf) < self.need:
                try:
                    chunk = self.sock.recv(self.need - len(self.buf))
                except (BlockingIOError, InterruptedError):
                    return False
                except OSError as e:
                    raise AuthError(f"connection lost during authentication ({e})") from None
                if not chunk:
                    raise AuthError(f"client closed the connection after {len(self.buf)} of "
                                    f"{self.need} handshake bytes")
                self.buf += chunk
            data, self.buf = bytes(self.buf), bytearray()
            if self.stage == 0:
                nc, mac = data[:_NONCE], data[_NONCE:]
                if not hmac.compare_digest(mac, _mac(self.token, b"client", self.ns, nc)):
                    raise AuthError("client failed authentication (wrong job token, or not a "
                                    "minicomm client)")
                self._send(_mac(self.token, b"server", self.ns, nc))
                if self.my_rank is None:
                    return True
                self.stage, self.need = 1, _RANK.size
            else:
                (self.rank,) = _RANK.unpack(data)
                self._send(_RANK.pack(self.my_rank))
                return True


class _Gate:
    """Authenticates the incoming connections of one listener inside the owner's select loop:
    no thread per connection, at most MAX_PENDING_HANDSHAKES pending (the oldest is evicted),
    each cut at its deadline; AF_UNIX peers of another uid are closed before a byte is sent.
    ``my_rank`` None: store handshakes; an int: peer-link handshakes (ranks are swapped too)."""

    def __init__(self, listener: socket.socket, token: bytes, sel: selectors.BaseSelector,
                 what: str, my_rank: Optional[int] = None,
                 deadline: Optional[float] = None):
        self.listener, self.token, self.sel, self.what = listener, token, sel, what
        self.my_rank, self.deadline = my_rank, deadline
        self.pending: Dict[socket.socket, _ServerHandshake] = {}   # insertion order = age
        self.starved = 0.0            # accept failed for lack of descriptors: until when to wait
        listener.setblocking(False)
        sel.register(listener, selectors.EVENT_READ, self)

    def _refuse(self, sock: socket.socket, peer: str, err: BaseException) -> None:
        log.info("%s: refused connection from %s: %s: %s", self.what, peer, type(err).__name__,
                 err)
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        if self.pending.pop(sock, None) is not None:
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
        sock.close()

    def on_listener(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _RESOURCE_ERRNOS:
                    # out of descriptors: shed the oldest stray, and let the queue wait a moment
                    log.warning("%s: cannot accept (%s); shedding unauthenticated connections",
                                self.what, e)
                    if self.pending:
                        old = next(iter(self.pending))
                        self._refuse(old, self.pending[old].peer,
                                     AuthError("evicted: out of file descriptors"))
                    else:         # nothing to shed: stop polling the listener for 50 ms
                        self.starved = time.monotonic() + 0.05
                        self.sel.unregister(self.listener)
                    return
                continue              # ECONNABORTED and the like: that connection only
            peer = str(addr) if addr else "a local process"
            try:
                uid = peer_uid(sock)
                if uid is not None:
                    peer = f"a local process of uid {uid}"
                    if uid != os.geteuid():
                        raise AuthError(f"uid {uid} is not this job's user ({os.geteuid()})")
                if len(self.pending) >= MAX_PENDING_HANDSHAKES:
                    old = next(iter(self.pending))
                    self._refuse(old, self.pending[old].peer,
                                 AuthError(f"evicted: more than {MAX_PENDING_HANDSHAKES} "
                                           f"unauthenticated connections at once"))
                deadline = time.monotonic() + HANDSHAKE_TIMEOUT
                if self.deadline is not None:
                    deadline = min(deadline, max(self.deadline, time.monotonic() + 0.1))
                hs = _ServerHandshake(sock, self.token, deadline, self.my_rank, peer)
            except (AuthError, OSError) as e:
                self._refuse(sock, peer, e if isinstance(e, AuthError) else AuthError(str(e)))
                continue
            self.pending[sock] = hs
            self.sel.register(sock, selectors.EVENT_READ, hs)

    def on_ready(self, hs: _ServerHandshake) -> Optional[_ServerHandshake]:
        """Drive one handshake; the finished handshake (its socket no longer registered, still
        non-blocking) or None."""
        try:
            done = hs.step()
        except AuthError as e:
            self._refuse(hs.sock, hs.peer, e)
            return None
        if not done:
            return None
        self.pending.pop(hs.sock, None)
        self.sel.unregister(hs.sock)
        return hs

    def expire(self) -> Optional[float]:
        """Close handshakes past their deadline; seconds until the next one (None: none)."""
        now = time.monotonic()
        nxt = None
        for sock, hs in list(self.pending.items()):
            if hs.deadline <= now:
                self._refuse(sock, hs.peer, AuthError("handshake timed out"))
            elif nxt is None or hs.deadline - now < nxt:
                nxt = hs.deadline - now
        if self.starved:
            if self.starved > now:
                nxt = min(nxt, self.starved - now) if nxt is not None else self.starved - now
            else:
                self.starved = 0.0
                self.sel.register(self.listener, selectors.EVENT_READ, self)
        return nxt

    def close(self) -> None:
        for sock in list(self.pending):
            self._drop(sock)


# ------------------------------------------------------------------------------------ store
_OP_SET, _OP_GET, _OP_ADD, _OP_JOIN, _OP_WAIT_WORLD = 1, 2, 3, 4, 5
_ST_OK, _ST_TIMEOUT, _ST_ERROR, _ST_REFUSED, _ST_POISONED = 0, 1, 2, 3, 4
_MAX_JOIN = 1 << 16                   # a join record is a small JSON object
AUX_SWITCH = "switch"                 # the role of the job's switch in its join record
_REQ = struct.Struct("!BIQ")          # op, key length, value length
_RESP = struct.Struct("!BQ")          # status, payload length
_MAX_KEY = 4096
_MAX_VALUE = 1 << 28                  # 256 MiB; read as it arrives, never allocated up front
_READ_CHUNK = 1 << 20


class StoreProtocolError(CommError):
    """An authenticated store client sent a request that breaks the protocol (its connection is
    closed; the store and the other clients go on)."""


class StoreServer:
    """Key-value store of one job, served from daemon threads of this process.

    ``job``: (identity, world size) of the job it serves; None: the first member to join sets it.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: bytes = b"",
                 job: Optional[Tuple[str, int]] = None):
        if not token:
            raise ValueError("StoreServer needs the job token (bytes)")
        self._token = token
        self._job = None if job is None else (str(job[0]), int(job[1]))
        self._members: Dict[int, dict] = {}      # rank -> its join record
        self._complete = False
        self._aux: Optional[dict] = None         # the job's switch (AUX_SWITCH), if it joined
        self._poisoned: Optional[str] = None     # why every call now fails
        self._data: Dict[str, bytes] = {}
        self._writer: Dict[str, int] = {}        # key -> the connection that wrote it first
        self._conn_member: Dict[int, dict] = {}  # connection -> its join record
        self._cond = threading.Condition()
        self._closed = False
        self._conns = set()
        self._told = set()            # connections already sent the poisoned verdict
        self._threads = set()
        self._listener = socket.create_server((host, port), family=_family(host), backlog=128)
        self.host = host
        self.port = self._listener.getsockname()[1]
        # close() wakes the accept loop through this pair instead of a polling timeout.
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"minicomm-store:{self.port}")
        self._thread.start()

    def _accept_loop(self) -> None:
        """Accept and authenticate in one select loop (bounded: see the module header); only an
        authenticated member gets a thread. Never dies before close(): an unexpected error costs
        at most the connection it concerned."""
        sel = selectors.DefaultSelector()
        gate = _Gate(self._listener, self._token, sel, f"rendezvous store :{self.port}")
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closed:
                try:
                    for key, _ in sel.select(gate.expire()):
                        if key.data is None or self._closed:
                            return
                        if key.data is gate:
                            gate.on_listener()
                        else:
                            hs = gate.on_ready(key.data)
                            if hs is not None:
                                self._start_member(hs.sock, hs.peer)
                except Exception as e:        # a bug must not end the store for everyone
                    log.warning("rendezvous store :%s: accept loop error %s: %s (continuing)",
                                self.port, type(e).__name__, e)
        finally:
            gate.close()
            sel.close()

    def _start_member(self, conn: socket.socket, peer: str) -> None:
        conn.setblocking(True)
        t = threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name=f"minicomm-store:{self.port}-conn")
        with self._cond:
            self._conns.add(conn)
            self._threads.add(t)
        try:
            t.start()
        except RuntimeError as e:             # can't start new thread: that member only
            log.warning("rendezvous store :%s: closing an authenticated connection from %s: "
                        "%s: %s", self.port, peer, type(e).__name__, e)
            with self._cond:
                self._conns.discard(conn)
                self._threads.discard(t)
            conn.close()

    def _serve(self, conn: socket.socket, peer: str = "?") -> None:
        cid = id(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        try:
            while not self._closed:
                head = _recv_or_eof(conn, _REQ.size)
                if head is None:
                    return
                op, klen, vlen = _REQ.unpack(head)
                if klen > _MAX_KEY or vlen > _MAX_VALUE:
                    raise StoreProtocolError(f"request of key length {klen}, value length {vlen}"
                                             f" (limits {_MAX_KEY}, {_MAX_VALUE})")
                key = _recv_or_eof(conn, klen)
                value = _recv_or_eof(conn, vlen) if vlen else b""
                if key is None or value is None:
                    return
                try:
                    status, payload = self._handle(op, key.decode(), value, cid)
                except (UnicodeDecodeError, struct.error, ValueError, OverflowError) as e:
                    raise StoreProtocolError(f"malformed request (op {op}): {e}") from None
                conn.sendall(_RESP.pack(status, len(payload)) + payload)
                if status == _ST_POISONED:
                    with self._cond:          # the verdict is in this member's hands: close()
                        self._told.add(conn)  # need not wait for it (see close's linger)
                        self._cond.notify_all()
        except StoreProtocolError as e:       # a member broke the protocol: its connection ends
            log.warning("rendezvous store :%s: closing the connection of %s: "
                        "StoreProtocolError: %s", self.port, peer, e)
        except OSError:
            pass                      # gone: the other clients are unaffected
        finally:
            with self._cond:
                self._conns.discard(conn)
                self._told.discard(conn)
                self._threads.discard(threading.current_thread())
                self._conn_member.pop(cid, None)
                self._cond.notify_all()       # a lingering close() waits for no one gone
            conn.close()

    def _handle(self, op: int, key: str, value: bytes, cid: int = 0) -> Tuple[int, bytes]:
        with self._cond:
            if self._poisoned is not None:
                return _ST_POISONED, self._poisoned.encode()
            if op == _OP_JOIN:
                status, payload = self._join(value)
                if status == _ST_OK:
                    self._conn_member[cid] = json.loads(value.decode())
                return status, payload
            if (op in (_OP_SET, _OP_ADD, _OP_GET) and self._members
                    and cid not in self._conn_member):
                # once ranks have joined, the store is theirs: a connection that did not join
                # (a stranger who computed a derived token) may neither read nor write it
                return _ST_REFUSED, (f"this rendezvous store serves the members of "
                                     f"{_describe_job(*self._job)}; a connection that has not "
                                     f"joined it may not read or write keys").encode()
            if op == _OP_WAIT_WORLD:
                timeout = _wait_seconds(value)
                self._cond.wait_for(lambda: self._complete or self._closed
                                    or self._poisoned is not None, timeout)
                if self._poisoned is not None:
                    return _ST_POISONED, self._poisoned.encode()
                if self._closed:
                    return _ST_ERROR, b"store is shutting down"
                members = {str(r): m for r, m in sorted(self._members.items())}
                return (_ST_OK if self._complete else _ST_TIMEOUT), json.dumps(members).encode()
            if op == _OP_SET:
                first = self._writer.setdefault(key, cid)
                if first != cid and self._data.get(key, value) != value:
                    return self._conflict(key, first, cid)
                self._data[key] = value
                self._cond.notify_all()
                return _ST_OK, b""
            if op == _OP_ADD:
                total = int.from_bytes(self._data.get(key, b"\0" * 8), "big", signed=True)
                total += struct.unpack("!q", value)[0]
                self._data[key] = total.to_bytes(8, "big", signed=True)
                self._cond.notify_all()
                return _ST_OK, self._data[key]
            if op == _OP_GET:
                timeout = _wait_seconds(value)
                found = self._cond.wait_for(lambda: key in self._data or self._closed
                                            or self._poisoned is not None, timeout)
                if self._poisoned is not None:
                    return _ST_POISONED, self._poisoned.encode()
                if self._closed:
                    return _ST_ERROR, b"store is shutting down"
                return (_ST_OK, self._data[key]) if found else (_ST_TIMEOUT, b"")
        return _ST_ERROR, f"unknown store op {op}".encode()

    def _conflict(self, key: str, first: int, second: int) -> Tuple[int, bytes]:
        """Two connections wrote different values to one key (called with the lock held): one of
        them is not who it claims, or two look-alike jobs share the store. Stop every member now
        rather than let one of them use the wrong value (and hang or misroute)."""
        def who(cid):
            rec = self._conn_member.get(cid)
            return (f"rank {rec.get('rank')} ({_describe_member(rec)})" if rec else
                    "a connection that never joined")
        self._poisoned = (f"conflicting writes to rendezvous key {key!r}: first by {who(first)}, "
                          f"then a different value by {who(second)}. A process outside this job "
                          f"knows its token (a derived token under a foreign launcher can be "
                          f"computed by anyone who knows the job's environment), or two jobs "
                          f"share this store's port; every member of this rendezvous is stopped")
        log.warning("rendezvous store :%s: %s", self.port, self._poisoned)
        self._cond.notify_all()
        return _ST_POISONED, self._poisoned.encode()

    def _join(self, value: bytes) -> Tuple[int, bytes]:
        """A rank joins (called with the lock held). See the module header for the rules."""
        try:
            if len(value) > _MAX_JOIN:
                raise ValueError("join record too long")
            rec = json.loads(value.decode())
            if not isinstance(rec, dict):
                raise TypeError("join record is not an object")
            job, size, rank = str(rec["job"]), int(rec["size"]), int(rec["rank"])
            member = str(rec["member"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
            return _ST_REFUSED, b"malformed join record"
        if self._job is None:
            self._job = (job, size)
        mine, theirs = _describe_job(*self._job), _describe_job(job, size)
        if (job, size) != self._job:
            return _ST_REFUSED, (f"this rendezvous store serves {mine}; the joining process "
                                 f"belongs to {theirs}").encode()
        if rec.get("role") == AUX_SWITCH and rank == size:
            # the job's emulated in-network switch: a member that is not a rank of the world
            if self._aux is not None and self._aux["member"] != member:
                return _ST_REFUSED, (f"{mine} already has a switch "
                                     f"({_describe_member(self._aux)})").encode()
            self._aux = rec
            return _ST_OK, b""
        if not 0 <= rank < size:
            return _ST_REFUSED, f"rank {rank} is outside {mine}".encode()
        prev = self._members.get(rank)
        if prev is None:
            self._members[rank] = rec
            self._complete = len(self._members) == size
            self._cond.notify_all()
            return _ST_OK, b""
        if prev["member"] == member:
            return _ST_OK, b""        # the same process again
        clash = (f"two processes claim rank {rank} of {mine}: {_describe_member(prev)} and "
                 f"{_describe_member(rec)}. Two jobs with nothing job-unique in their environment "
                 f"share this store's port")
        if self._complete:
            return _ST_REFUSED, (clash + "; the world was already complete, so only the "
                                 "newcomer is refused").encode()
        self._poisoned = clash + "; every member of this rendezvous is stopped"
        self._cond.notify_all()
        return _ST_POISONED, self._poisoned.encode()

    def close(self, linger: float = 0.0) -> None:
        """Stop serving. ``linger`` (seconds): if the store is poisoned, first wait until every
        connected member has been sent the verdict (or has gone), at most that long. The host of
        a poisoned rendezvous leaves right after reading the verdict itself; without this, a
        member whose handler had not yet answered (woken in ``wait_world``, or between ``join``
        and its next call) would see only a lost store, not the conflict. The wait returns as
        soon as the last member is answered (each answer notifies), so it costs nothing when
        every member is already waiting in the store."""
        with self._cond:
            if self._closed:
                return
            if self._poisoned is not None and linger > 0:
                if not self._cond.wait_for(lambda: self._closed or self._conns <= self._told,
                                           linger):
                    log.info("rendezvous store :%s: closing with %d member(s) not yet told "
                             "the verdict after %gs", self.port, len(self._conns - self._told),
                             linger)
                if self._closed:              # another close() finished meanwhile
                    return
            self._closed = True
            self._cond.notify_all()
            conns, threads = list(self._conns), list(self._threads)
        self._wake_w.send(b"x")
        self._thread.join(5.0)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)      # wakes a handler blocked in recv
            except OSError:
                pass
        for t in threads:
            t.join(5.0)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _wait_seconds(value: bytes) -> float:
    """A get / wait_world timeout from the wire: 8 bytes, a finite number of seconds >= 0
    (StoreProtocolError otherwise; at most a day)."""
    if len(value) != 8:
        raise StoreProtocolError(f"a wait needs an 8-byte timeout, got {len(value)} bytes")
    t = struct.unpack("!d", value)[0]
    if not (t >= 0.0 and t < float("inf")):
        raise StoreProtocolError(f"wait timeout {t!r} is not a finite number of seconds >= 0")
    return min(t, 86400.0)


def _describe_job(identity: str, size: int) -> str:
    return f"job {identity!r} of {size} ranks" if identity else f"a job of {size} ranks"


def _describe_member(rec: dict) -> str:
    return f"pid {rec.get('pid', '?')} on {rec.get('host', '?')}"


def _recv_or_eof(conn: socket.socket, n: int) -> Optional[bytes]:
    """Exactly ``n`` bytes, or None at EOF. Memory grows with the bytes that actually arrive
    (a header claiming a huge value costs nothing until the value is sent)."""
    parts, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, _READ_CHUNK))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class StoreClient:
    """Client of a ``StoreServer``; ``timeout`` bounds connecting and is the default for ``get``."""

    def __init__(self, host: str, port: int, token: bytes, timeout: float = 300.0):
        self.host, self.port, self.timeout = host, port, float(timeout)
        self.token = token
        self._member = secrets.token_hex(8)       # this client's identity as a member
        self._lock = threading.Lock()
        deadline = time.monotonic() + self.timeout
        self._sock = _connect_with_retry((host, port), deadline, f"rendezvous store {host}:{port}")
        try:
            authenticate_client(self._sock, token, max(0.0, deadline - time.monotonic()))
        except OSError as e:
            self._sock.close()
            raise PeerFailure(f"rendezvous store {host}:{port}: connection lost during "
                              f"authentication: {e}") from None
        except BaseException:
            self._sock.close()
            raise
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def local_address(self) -> str:
        """The address this host uses to reach the store: a peer-reachable address to advertise."""
        return self._sock.getsockname()[0]

    def _call(self, op: int, key: str, value: bytes, wait: float) -> Tuple[int, bytes]:
        k = key.encode()
        if len(k) > _MAX_KEY:
            raise ValueError(f"store key longer than {_MAX_KEY} bytes: {key[:40]!r}...")
        with self._lock:
            if self._sock is None:
                raise CommError("store client is closed")
            deadline = time.monotonic() + wait
            what = f"rendezvous store {self.host}:{self.port} ({key!r})"
            try:
                _send_all(self._sock, _REQ.pack(op, len(k), len(value)) + k + value, deadline, what)
                status, n = _RESP.unpack(_recv_exact(self._sock, _RESP.size, deadline, what))
                if n > _MAX_VALUE + _MAX_JOIN * 64:
                    raise StoreProtocolError(f"{what}: the store announced a {n}-byte reply")
                payload = _recv_exact(self._sock, n, deadline, what) if n else b""
            except (OSError, CommError) as e:
                # The stream may be mid-reply: never reuse it (a late answer would be taken for
                # the next request's).
                self._sock.close()
                self._sock = None
                if isinstance(e, CommError):
                    raise
                raise PeerFailure(f"{what}: connection lost: {e}") from None
        if status == _ST_POISONED:
            raise RendezvousError(f"{what}: {payload.decode(errors='replace')}")
        if status == _ST_ERROR:
            text = payload.decode(errors="replace")
            if op == _OP_JOIN or text.startswith("two processes claim"):
                raise RendezvousError(f"{what}: {text}")
            raise CommError(f"{what}: {text}")
        if status == _ST_REFUSED:
            raise RendezvousError(f"{what}: {payload.decode(errors='replace')}")
        return status, payload

    def join(self, job: str, size: int, rank: int, **info) -> None:
        """Become ``rank`` of the job (identity ``job``, ``size`` ranks); ``info`` (JSON values:
        host, node, ...) is returned to every member by ``wait_world``. RendezvousError if the
        store belongs to another job or the rank is taken (see the module header)."""
        rec = dict(info, job=str(job), size=int(size), rank=int(rank), member=self._member,
                   pid=os.getpid())
        rec.setdefault("host", socket.gethostname())
        data = json.dumps(rec).encode()
        if len(data) > _MAX_JOIN:
            raise ValueError(f"join record longer than {_MAX_JOIN} bytes")
        self._call(_OP_JOIN, "join", data, self.timeout)

    def wait_world(self, timeout: Optional[float] = None) -> Dict[int, dict]:
        """Wait until every rank has joined; returns rank -> join record. CommTimeout (with
        ``arrived`` and ``missing`` attributes) if they have not within ``timeout``."""
        wait = self.timeout if timeout is None else float(timeout)
        status, payload = self._call(_OP_WAIT_WORLD, "world", struct.pack("!d", wait), wait + 10.0)
        members = {int(r): m for r, m in json.loads(payload.decode()).items()}
        if status == _ST_TIMEOUT:
            size = next(iter(members.values()))["size"] if members else 0
            missing = sorted(set(range(size)) - set(members))
            err = CommTimeout(f"rendezvous store {self.host}:{self.port}: {len(members)} of "
                              f"{size} ranks arrived within {wait:g}s (missing ranks "
                              f"{rank_ranges(missing)})")
            err.arrived, err.missing = sorted(members), missing
            raise err
        return members

    def set(self, key: str, value: bytes) -> None:
        self._call(_OP_SET, key, bytes(value), self.timeout)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """The value of ``key``, waiting until a client sets it; CommTimeout after ``timeout``."""
        wait = self.timeout if timeout is None else float(timeout)
        # The server answers "timeout" itself; the socket deadline only guards a dead server.
        status, payload = self._call(_OP_GET, key, struct.pack("!d", wait), wait + 10.0)
        if status == _ST_TIMEOUT:
            raise CommTimeout(f"rendezvous store: key {key!r} was not set within {wait:g}s "
                              f"(has every rank started?)")
        return payload

    def add(self, key: str, delta: int = 1) -> int:
        """Atomically add ``delta`` to the counter ``key`` (0 when new); returns the new value."""
        _, payload = self._call(_OP_ADD, key, struct.pack("!q", delta), self.timeout)
        return int.from_bytes(payload, "big", signed=True)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def rank_ranges(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (missing-rank lists stay short at any world size)."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out) or "none"


def _connect_with_retry(addr, deadline: float, what: str) -> socket.socket:
    """Connect, retrying while nothing listens yet: under ``mc.init`` rank 0 hosts the store and
    may start after the others. There is no kernel object to wait on for "a remote port starts
    listening", so this backs off exponentially (10 ms .. 0.5 s) until the deadline."""
    delay = 0.01
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"{what}: could not connect before the deadline")
        try:
            sock = socket.create_connection(addr, timeout=left)
            if sock.getsockname() == sock.getpeername():
                # TCP simultaneous open: with nothing listening on a port of the ephemeral range,
                # the kernel can give the connecting socket that very port, and it connects to
                # itself (and would hold the port the store is about to bind). Drop it and retry.
                sock.close()
                raise ConnectionRefusedError("connected to itself")
            return sock
        except (ConnectionRefusedError, ConnectionResetError):
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
        except socket.timeout:
            raise CommTimeout(f"{what}: connect timed out") from None


# -------------------------------------------------------------------------------- peer links
_RANK = struct.Struct("!q")


_RETRY_ERRORS = (BlockingIOError, ConnectionRefusedError, FileNotFoundError, InterruptedError)


def dial_peer(family: int, address, token: bytes, my_rank: int, peer: int,
              deadline: float, refused_is_final: bool = False) -> socket.socket:
    """Connect to ``peer``'s listener, authenticate, exchange ranks; returns a blocking socket.

    A full listen queue (EAGAIN on AF_UNIX), a refused connection, or a listener that dropped
    us before the handshake completed (a stray flood evicts pending handshakes) is retried with
    exponential backoff (5 ms .. 200 ms: there is no kernel object to wait on for "the peer's
    queue has room") until ``deadline``; then CommTimeout naming the last reason. On AF_UNIX
    the listener must belong to this user (SO_PEERCRED).

    ``refused_is_final``: the address was published only after the peer listened on it (the
    local doorbell listeners: an abstract AF_UNIX name, which nobody else can hold), so a
    refused connection means the listener is gone -- the peer died or gave up its setup --
    and is a PeerFailure naming it at once instead of a retry until the deadline."""
    what = f"rank {my_rank}: connecting to rank {peer}"
    delay, last = 0.005, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"{what}: timed out" + (f" (last attempt: {last})" if last else ""))
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            retry = _dial_once(sock, family, address, token, my_rank, peer, deadline, what,
                               refused_is_final)
        except ConnectionRefusedError:        # only with refused_is_final (_dial_once)
            sock.close()
            err = PeerFailure(f"{what}: rank {peer} no longer listens at the address it "
                              f"published (it exited, was killed or gave up its setup)")
            err.peer = peer
            raise err from None
        except BaseException:
            sock.close()
            raise
        if not isinstance(retry, str):
            return sock
        sock.close()
        last = retry
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.2)


def _dial_once(sock, family, address, token, my_rank, peer, deadline, what,
               refused_is_final=False):
    """One attempt: None when connected and authenticated, else the reason to retry (str); a
    refused connection is raised instead with ``refused_is_final`` (``dial_peer``)."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        sock.connect(address)
    except socket.timeout:
        raise CommTimeout(f"{what}: connect timed out") from None
    except ConnectionRefusedError as e:
        if refused_is_final:
            raise
        return f"{type(e).__name__}: {e}"
    except _RETRY_ERRORS as e:
        return f"{type(e).__name__}: {e}"
    except OSError as e:
        raise PeerFailure(f"{what} at {address!r}: {e}") from None
    uid = peer_uid(sock)
    if uid is not None and uid != os.geteuid():
        raise AuthError(f"{what}: the local socket {address!r} belongs to uid {uid}, not to "
                        f"this job's user ({os.geteuid()})")
    try:
        authenticate_client(sock, token, max(0.0, min(HANDSHAKE_TIMEOUT,
                                                       deadline - time.monotonic())))
    except AuthError as e:
        if getattr(e, "closed", False):
            return f"AuthError: {e}"
        raise
    except (PeerFailure, ConnectionResetError, BrokenPipeError) as e:
        return f"{type(e).__name__}: {e}"     # dropped before the handshake completed
    try:
        _send_all(sock, _RANK.pack(my_rank), deadline, what)
        (theirs,) = _RANK.unpack(_recv_exact(sock, _RANK.size, deadline, what))
    except (PeerFailure, ConnectionResetError, BrokenPipeError) as e:
        return f"{type(e).__name__}: {e}"
    if theirs != peer:
        raise CommError(f"{what}: the listener at {address!r} is rank {theirs}")
    sock.settimeout(None)
    return None


def accept_peers(listener: socket.socket, token: bytes, my_rank: int, expected: Iterable[int],
                 deadline: float) -> Dict[int, socket.socket]:
    """Accept one authenticated connection from each rank in ``expected``; refuse everything else.

    Handshakes run non-blocking in this call's select loop (``_Gate``: bounded, no threads), so
    a slow, silent or flooding stray cannot hold up the real peers; refused connections are
    closed without reading anything more. Returns blocking sockets."""
    expected = set(expected)
    got: Dict[int, socket.socket] = {}
    if not expected:
        return got
    sel = selectors.DefaultSelector()
    gate = _Gate(listener, token, sel, f"rank {my_rank}'s peer listener", my_rank=my_rank,
                 deadline=deadline)
    try:
        while len(got) < len(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(expected - set(got))
                raise CommTimeout(f"rank {my_rank}: ranks {missing} did not connect before the "
                                  f"deadline (setup)")
            nxt = gate.expire()
            for key, _ in sel.select(left if nxt is None else min(left, nxt)):
                if key.data is gate:
                    gate.on_listener()
                    continue
                hs = gate.on_ready(key.data)
                if hs is None:
                    continue
                if hs.rank in expected and hs.rank not in got:
                    hs.sock.setblocking(True)
                    got[hs.rank] = hs.sock
                else:                 # authenticated but unexpected (duplicate): not ours to use
                    log.info("rank %s: closing an authenticated link claiming rank %s (not "
                             "expected here)", my_rank, hs.rank)
                    hs.sock.close()
    except BaseException:
        for s in got.values():
            s.close()
        raise
    finally:
        gate.close()
        sel.close()
    return got


class PrefixedStore:
    """A store's keys under ``prefix``: a second set of links (the switch's) set up through the
    same store without meeting the world's keys."""

    def __init__(self, store, prefix: str):
        self._store, self._prefix = store, prefix

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self._store.get(self._prefix + key, timeout)

    def add(self, key: str, delta: int = 1) -> int:
        return self._store.add(self._prefix + key, delta)

    def local_address(self) -> str:
        return self._store.local_address()
