"""The simulated network device under the rdma and ub transports: memory, access checks, paths.

One ``Device`` per process plays its NIC (rdma) or UB controller (ub). rdma.py and ub.py give it
their vocabulary (queue pairs and completion queues; Jettys and segments); the mechanics are here:

Memory and protection. Every remotely accessible region is carved out of the process's ``Arena``
(segment.py: a /dev/shm file every peer on the same host maps) and described by an entry of the
arena's region table: key (rkey / token id), access flags, token, virtual address, length. The
table is the NIC's protection table: *every* remote operation is checked against it by whoever
executes the operation -- bad key, bounds, access or token give an error status and touch no
byte of memory. Atomics run under the region's ``SharedMutex`` (its atomic unit).

Two paths to a target, chosen per peer:
  inside a node (same node and same host): the initiator maps the target's arena and executes the
    operation itself -- a WRITE is a real one-sided store into the target's memory, a READ a load;
    the target process is not involved at all. A WRITE_WITH_IMM / SEND also appends a record to
    the target's inbound ``EventRing`` for this initiator (the shared half of its completion
    queue) and rings its doorbell (an authenticated AF_UNIX socket) only if it sleeps.
  between nodes: the operation is a request frame to the target's NIC agent thread (nicagent.py),
    which executes it there with no call from the target application and answers; the answer
    completes the operation here. The sockets are authenticated with the job token.
Operations to this rank itself take the first path over its own arena (loopback).

What is simulated vs real: the memory sharing, the stores, loads, atomicity and the socket
transport are real; the "NIC" that checks keys and executes operations is Python code run by the
initiator (inside a node) or by the agent thread (between nodes); there is no DMA engine, no
wire protocol of InfiniBand or UB, and local memory is not protected (no lkey checks).

Completions. ``post`` executes a same-node operation at once and returns its (status, result);
a cross-node one returns None and calls ``done(status, result)`` later from the agent thread.
Inbound events (imm / receive) are collected by ``pump`` from the rings and the agent's queue.

Link emulation (``MINICOMM_EMULATE_LINK=1``): each operation first waits alpha + n/beta of the
transport's illustrative ``LinkParams`` (rdma.LINK, ub.LINK) -- a sleep above ``_SLEEP_ABOVE_S``,
a short spin below (sleep cannot wait a microsecond) -- so code can feel a modelled link's latency.
"""
from __future__ import annotations

import os
import secrets
import socket
import time
from collections import deque
from typing import Callable, Dict, List, NamedTuple, Optional

import numpy as np

from minicomm.errors import CommError, CommTimeout
from minicomm.rendezvous import accept_peers, dial_peer
from minicomm.settings import byte_setting, env_flag
from . import nicagent
from .bytecopy import copy
from .progress import fence
from .segment import (
    PAGE,
    Arena,
    EventRing,
    SharedMutex,
    hung_up,
    ring_bytes,
    round_up,
)

# access flags (rdma.py and ub.py export them under their own names)
LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC = 1, 2, 4, 8

# operations
(OP_WRITE, OP_WRITE_IMM, OP_READ, OP_FADD, OP_CAS, OP_SWAP, OP_FAND, OP_FOR, OP_FXOR, OP_SEND,
 OP_IMPORT) = range(1, 12)
ATOMICS = frozenset({OP_FADD, OP_CAS, OP_SWAP, OP_FAND, OP_FOR, OP_FXOR})
_NEED = {OP_WRITE: REMOTE_WRITE, OP_WRITE_IMM: REMOTE_WRITE, OP_READ: REMOTE_READ,
         OP_SEND: 0, OP_IMPORT: 0, **{op: REMOTE_ATOMIC for op in ATOMICS}}

# statuses of an operation
(OK, BAD_KEY, BAD_TOKEN, NO_PERMISSION, BAD_BOUNDS, BAD_ALIGN, RNR, LEN_ERR, PEER_DEAD, FLUSHED,
 OVERRUN, BAD_OP) = range(12)
STATUS_TEXT = {
    OK: "success", BAD_KEY: "the key names no region registered at the target",
    BAD_TOKEN: "the token does not match the target's", NO_PERMISSION:
    "the region does not grant this access", BAD_BOUNDS: "the access falls outside the region",
    BAD_ALIGN: "atomics need an 8-byte aligned address", RNR: "no receive was posted at the target",
    LEN_ERR: "the message is longer than the posted receive buffer",
    PEER_DEAD: "the target is gone (its process exited or its link failed)",
    FLUSHED: "flushed: an earlier error put the queue in the error state",
    OVERRUN: "the target's completion queue is full",
    BAD_OP: "the target does not know this operation"}

# inbound events
EV_IMM, EV_RECV = 1, 2

VA_BASE = 0x7E00_0000_0000            # virtual address of arena offset 0 (every process alike)
MAGIC = 0x4D434E4943                  # "MCNIC"
MAX_REGIONS = 1024
ENTRY = 192                           # region table entry: 16 int64 fields, then the mutex
MUTEX_AT = 128
_KEY, _VALID, _ACCESS, _TOKEN, _OFF, _LEN, _VA, _KIND = range(8)
_DEPTH, _POSTED, _CONSUMED, _SLOT = 12, 13, 14, 15   # receive queues (UB JFR)
TABLE_OFF = PAGE
RING_ENTRIES = 1024
_SLEEPING = 8                         # int64 index in the header: the owner may be asleep
_RANKS_AT = 64                        # int64 index: ranks of the producers of our rings
_WAKE, _ABORT, _BYE = b"\x01", b"\x00", b"\x02"
_NOWAIT = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_ARENA_BYTES = byte_setting("MINICOMM_NIC_ARENA_BYTES", 1 << 30, minimum=1 << 20)
_SLEEP_ABOVE_S = 200e-6               # an emulated link delay longer than this sleeps, else spins


class LinkParams(NamedTuple):
    """Illustrative per-operation cost of a modelled link: alpha seconds + n / bytes_per_s."""
    alpha_s: float
    bytes_per_s: float
    source: str

    def cost(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s


def _emulate_enabled() -> bool:
    return env_flag("MINICOMM_EMULATE_LINK", False)


def _wrap(x: int) -> int:
    return ((x + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


class Region:
    """A registered region of this process (the owner's handle)."""
    __slots__ = ("device", "index", "key", "access", "token", "offset", "length", "va", "buf",
                 "kind", "slot_bytes")

    def __init__(self, device, index, key, access, token, offset, length, va, kind=0,
                 slot_bytes=0):
        self.device, self.index, self.key, self.access, self.token = device, index, key, access, token
        self.offset, self.length, self.va, self.kind = offset, length, va, kind
        self.slot_bytes = slot_bytes
        self.buf = device.arena.u8[offset:offset + length]

    def __repr__(self):
        return (f"<Region key=0x{self.key:x} va=0x{self.va:x} length={self.length} "
                f"access={self.access:#x}>")


class ArenaView:
    """Executes operations on one arena (this process's or a mapped peer's): the target side of
    the simulated NIC, with the protection checks of module doc."""

    def __init__(self, arena: Arena, rank: int):
        self.arena, self.rank = arena, rank
        self.q, self.u8 = arena.q, arena.u8
        self._mutexes: Dict[int, SharedMutex] = {}

    def check(self, key: int, va: int, n: int, need: int, token):
        """(status, arena offset, entry index) of an access of n bytes at va."""
        idx = key & (MAX_REGIONS - 1)
        qi = (TABLE_OFF + idx * ENTRY) >> 3
        q = self.q
        if q[qi + _KEY] != key or not q[qi + _VALID] or key < 0:
            return BAD_KEY, 0, idx
        if token is not None and q[qi + _TOKEN] != token:
            return BAD_TOKEN, 0, idx
        if need & ~q[qi + _ACCESS]:
            return NO_PERMISSION, 0, idx
        rva = q[qi + _VA]
        if n < 0 or va < rva or va + n > rva + q[qi + _LEN]:
            return BAD_BOUNDS, 0, idx
        return OK, q[qi + _OFF] + (va - rva), idx

    def mutex(self, idx: int) -> SharedMutex:
        m = self._mutexes.get(idx)
        if m is None:
            m = self._mutexes[idx] = SharedMutex(self.arena, TABLE_OFF + idx * ENTRY + MUTEX_AT,
                                                 f"region {idx} of rank {self.rank}")
        return m

    def write(self, key, va, bufs, n, token, need=REMOTE_WRITE) -> int:
        status, off, _ = self.check(key, va, n, need, token)
        if status == OK:
            mm = self.arena.mm
            for b in bufs:
                k = b.nbytes
                if k:
                    mm[off:off + k] = b       # buffer protocol: one memcpy, no numpy views
                    off += k
        return status

    def read(self, key, va, dst, token) -> int:
        n = dst.nbytes
        status, off, _ = self.check(key, va, n, REMOTE_READ, token)
        if status == OK and n:
            copy(dst, self.u8[off:off + n])
        return status

    def atomic(self, op, key, va, a, b, token):
        status, off, idx = self.check(key, va, 8, REMOTE_ATOMIC, token)
        if status != OK:
            return status, 0
        if off & 7:
            return BAD_ALIGN, 0
        m = self.mutex(idx)
        q = self.q
        i = off >> 3
        m.acquire()
        try:
            old = q[i]
            if op == OP_FADD:
                q[i] = _wrap(old + a)
            elif op == OP_CAS:
                if old == a:
                    q[i] = _wrap(b)
            elif op == OP_SWAP:
                q[i] = _wrap(a)
            elif op == OP_FAND:
                q[i] = old & _wrap(a)
            elif op == OP_FOR:
                q[i] = old | _wrap(a)
            elif op == OP_FXOR:
                q[i] = old ^ _wrap(a)
        finally:
            m.release()
        return OK, old

    def claim_receive(self, key, n, token):
        """SEND: take the next posted buffer of the receive queue ``key`` (status, offset, slot)."""
        idx = key & (MAX_REGIONS - 1)
        qi = (TABLE_OFF + idx * ENTRY) >> 3
        q = self.q
        if q[qi + _KEY] != key or not q[qi + _VALID] or q[qi + _KIND] != 1:
            return BAD_KEY, 0, 0
        if token is not None and q[qi + _TOKEN] != token:
            return BAD_TOKEN, 0, 0
        if n > q[qi + _SLOT]:
            return LEN_ERR, 0, 0
        m = self.mutex(idx)
        m.acquire()
        try:
            consumed = q[qi + _CONSUMED]
            if consumed >= q[qi + _POSTED]:
                return RNR, 0, 0
            q[qi + _CONSUMED] = consumed + 1
        finally:
            m.release()
        slot = consumed % q[qi + _DEPTH]
        return OK, q[qi + _OFF] + slot * q[qi + _SLOT], slot

    def lookup(self, key, va, n, token):
        """IMPORT: may ``token`` reach [va, va+n)? (status, access, length)."""
        status, _, idx = self.check(key, va, n, 0, token)
        qi = (TABLE_OFF + idx * ENTRY) >> 3
        return status, (self.q[qi + _ACCESS] if status == OK else 0), \
            (self.q[qi + _LEN] if status == OK else 0)


class RegionRegistry:
    """Registering memory, a part of ``Device``: regions carved out of this process's arena and
    described in its region table, the protection table every access is checked against
    (module doc, "Memory and protection")."""
    kind: str
    rank: int
    arena: Optional[Arena]
    _regions: Dict[int, Region]      # table entry index -> this process's handle
    _gen: int                        # the generation part of the next key
    _free: List[List[int]]           # the arena's free byte ranges, [offset, length]
    _views: Dict[int, ArenaView]

    def register(self, nbytes: int, access: int, token: int = 0, kind: int = 0,
                 slot_bytes: int = 0, depth: int = 0) -> Region:
        """Carve ``nbytes`` out of the arena and describe it in the region table."""
        if nbytes < 0:
            raise ValueError(f"region length must be >= 0, got {nbytes}")
        idx = next((i for i in range(MAX_REGIONS) if i not in self._regions), None)
        if idx is None:
            raise CommError(f"{self.kind}: all {MAX_REGIONS} region table entries are in use")
        length = max(nbytes, 1)
        alloc = round_up(length)
        for i, (off, n) in enumerate(self._free):
            if n >= alloc:
                break
        else:
            raise CommError(f"{self.kind}: no {alloc} bytes left in the {self.arena.size >> 20} "
                            f"MiB arena (MINICOMM_NIC_ARENA_BYTES)")
        self.arena.reserve(off, alloc)
        if n == alloc:
            del self._free[i]
        else:
            self._free[i] = [off + alloc, n - alloc]
        self._gen = (self._gen + 1) & 0x3FFFFF
        key = (self._gen << 10) | idx
        va = VA_BASE + off
        qi = (TABLE_OFF + idx * ENTRY) >> 3
        q = self.arena.q
        q[qi + _KEY], q[qi + _ACCESS], q[qi + _TOKEN] = key, access, _wrap(token)
        q[qi + _OFF], q[qi + _LEN], q[qi + _VA], q[qi + _KIND] = off, nbytes, va, kind
        q[qi + _POSTED] = q[qi + _CONSUMED] = 0
        q[qi + _SLOT], q[qi + _DEPTH] = slot_bytes, depth
        q[qi + _VALID] = 1            # last: the entry is complete before anyone can match it
        r = Region(self, idx, key, access, _wrap(token), off, nbytes, va, kind, slot_bytes)
        self._regions[idx] = r
        return r

    def deregister(self, region: Region) -> None:
        if self._regions.get(region.index) is not region or self.arena is None:
            return
        qi = (TABLE_OFF + region.index * ENTRY) >> 3
        self.arena.q[qi + _VALID] = 0
        self.arena.q[qi + _KEY] = -1
        del self._regions[region.index]
        alloc = round_up(max(region.length, 1))
        self.arena.release(region.offset, alloc)
        self._free.append([region.offset, alloc])
        self._free.sort()
        merged: List[List[int]] = []
        for off, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1][1] += n
            else:
                merged.append([off, n])
        self._free = merged

    def post_receive(self, region: Region, count: int = 1) -> None:
        """A receive queue (kind 1) gets ``count`` more posted buffers."""
        qi = (TABLE_OFF + region.index * ENTRY) >> 3
        m = self._views[self.rank].mutex(region.index)
        m.acquire()
        try:
            self.arena.q[qi + _POSTED] += count
        finally:
            m.release()


class AgentProtocol:
    """What the NIC agent thread (nicagent.py) calls, a part of ``Device``: requests of peers on
    other nodes, executed against our memory and answered; answers, which complete our own
    operations; and a peer's abort or goodbye."""
    rank: int
    arena: Optional[Arena]
    agent: Optional[nicagent.NicAgent]
    _views: Dict[int, ArenaView]
    _pending: Dict[int, tuple]       # op id -> (peer, done, dst)
    _events: deque                   # inbound events from the agent and loopback

    def _notify(self) -> None:
        """Wake this process's waiter (``Device``)."""
        raise NotImplementedError

    def on_closed(self, peer: int, reason: str) -> None:
        """A peer's link ended (``Device``)."""
        raise NotImplementedError

    def on_header(self, conn, f):
        if f.kind == nicagent.REQ:
            own = self._views[self.rank]
            token = None if f.token == -1 else f.token
            if f.op in (OP_WRITE, OP_WRITE_IMM):
                status, off, _ = own.check(f.key, f.addr, f.payload, REMOTE_WRITE, token)
                slot = 0
                if status == OK and f.op == OP_WRITE_IMM and f.b:
                    status, _, slot = own.claim_receive(f.b, 0, None if f.a == -1 else f.a)
                conn.state = (status, slot)
                return self.arena.u8[off:off + f.payload] if status == OK else None
            if f.op == OP_SEND:
                status, off, slot = own.claim_receive(f.key, f.payload, token)
                conn.state = (status, slot)
                return self.arena.u8[off:off + f.payload] if status == OK else None
            return None
        if f.kind == nicagent.RESP:
            pend = self._pending.get(f.op_id)
            if pend is not None and pend[2] is not None and f.status == OK:
                return pend[2].reshape(-1).view(np.uint8)
            return None
        # ABORT / BYE: the reason text (bounded: a longer one is dropped, not allocated)
        conn.state = np.empty(min(f.payload, 1 << 16), dtype=np.uint8)
        return conn.state if f.payload <= 1 << 16 else None

    def on_frame(self, conn, f) -> None:
        if f.kind == nicagent.REQ:
            self._serve(conn.peer, conn, f)
        elif f.kind == nicagent.RESP:
            pend = self._pending.pop(f.op_id, None)
            if pend is not None and pend[1] is not None:
                result = (f.a, f.b) if f.op == OP_IMPORT else f.a
                pend[1](f.status, result)
                self._notify()
        else:
            reason = bytes(conn.state).decode(errors="replace") if f.payload else ""
            self.on_closed(conn.peer, f"it aborted: {reason}" if f.kind == nicagent.ABORT
                           else "it closed its transport (it finished)")

    def _serve(self, peer: int, conn, f) -> None:
        """Execute a request of a peer on another node against our memory, and answer it."""
        own = self._views[self.rank]
        token = None if f.token == -1 else f.token
        op, status, a, b, payload, event = f.op, OK, 0, 0, None, None
        if op in (OP_WRITE, OP_WRITE_IMM):
            if f.payload:
                status, slot = conn.state
            else:
                status, slot = own.check(f.key, f.addr, 0, REMOTE_WRITE, token)[0], 0
                if status == OK and op == OP_WRITE_IMM and f.b:
                    status, _, slot = own.claim_receive(f.b, 0, None if f.a == -1 else f.a)
            if status == OK and op == OP_WRITE_IMM:
                event = (peer, EV_IMM, f.channel, f.imm, f.nbytes, slot)
        elif op == OP_SEND:
            status, slot = conn.state if f.payload else own.claim_receive(f.key, 0, token)[::2]
            if status == OK:
                event = (peer, EV_RECV, f.channel, f.imm, f.nbytes, slot)
            a = slot
        elif op == OP_READ:
            status, off, _ = own.check(f.key, f.addr, f.nbytes, REMOTE_READ, token)
            if status == OK and f.nbytes:
                payload = [self.arena.u8[off:off + f.nbytes]]
        elif op in ATOMICS:
            status, a = own.atomic(op, f.key, f.addr, f.a, f.b, token)
        elif op == OP_IMPORT:
            status, a, b = own.lookup(f.key, f.addr, f.nbytes, token)
        else:
            status = BAD_OP               # never a silent success for an unknown operation
        frame = nicagent.pack(nicagent.RESP, op, f.channel, f.op_id, f.key, f.addr, f.nbytes,
                              0, a, b, 0, status, f.nbytes if payload else 0)
        self.agent.send(peer, frame, payload)
        if event is not None:
            # after the answer is queued: once our application sees the event it may finish
            # and say goodbye, which must not overtake the answer
            self._events.append(event)
            self._notify()


class Device(RegionRegistry, AgentProtocol):
    """This process's simulated NIC (module doc). ``kind`` is "rdma" or "ub": its setup, paths
    and lifetime here; registering memory in ``RegionRegistry``, the agent's requests and
    answers in ``AgentProtocol``."""

    def __init__(self, kind: str, rank: int, store, job_id: str, token: bytes, peers,
                 local_peers, deadline: float, bind_host: str, progress, link: LinkParams):
        self.kind, self.rank, self.job_id = kind, rank, str(job_id)
        self.peers = sorted(int(p) for p in peers if p != rank)
        self.local_peers = sorted(int(p) for p in local_peers if p != rank and p in self.peers)
        self.remote_peers = [p for p in self.peers if p not in self.local_peers]
        self.progress = progress
        self.link = link
        self.emulate = _emulate_enabled()
        self.closed_peers: Dict[int, str] = {}
        self.on_peer_closed: Optional[Callable[[int, str], None]] = None
        self._events: deque = deque()           # inbound events from the agent and loopback
        self._pending: Dict[int, tuple] = {}    # op id -> (peer, done, dst)
        self._next_op = 1
        self._sleeping = False
        self._regions: Dict[int, Region] = {}
        self._gen = int.from_bytes(os.urandom(3), "little")
        self._free: List[List[int]] = []
        self._socks: Dict[int, socket.socket] = {}
        self._fds: List[int] = []
        self._views: Dict[int, ArenaView] = {}
        self._rings_out: Dict[int, EventRing] = {}   # peer -> our producer ring in its arena
        self._rings_in: List[tuple] = []             # (peer, our consumer ring)
        self._flag_q: Dict[int, memoryview] = {}
        self._peer_arenas: List[Arena] = []
        self.arena: Optional[Arena] = None
        self.agent = None
        self._event_fd = -1
        self._closed = False
        self._aborted: Optional[str] = None
        listener = None
        try:
            self._make_arena()
            store.set(f"{kind}/arena/{rank}", self.arena.path.encode())
            for p in self.local_peers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"rank {rank}: {kind} setup timed out waiting for rank {p}")
                self._attach(p, store.get(f"{kind}/arena/{p}", timeout=left).decode())
            if self.local_peers:
                # random part in the name (nobody binds it first); a queue strays cannot fill
                nonce = secrets.token_hex(8)
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(self._sock_name(rank, nonce))
                listener.listen(socket.SOMAXCONN)
                store.set(f"{kind}/bell/{rank}", nonce.encode())
                for p in self.local_peers:
                    if p < rank:
                        theirs = store.get(f"{kind}/bell/{p}",
                                           timeout=max(0.0, deadline - time.monotonic()))
                        name = self._sock_name(p, theirs.decode(errors="replace"))
                        self._socks[p] = dial_peer(socket.AF_UNIX, name, token, rank, p,
                                                   deadline, refused_is_final=True)
                self._socks.update(accept_peers(listener, token, rank,
                                                [p for p in self.local_peers if p > rank],
                                                deadline))
            # every local peer mapped our arena before its handshake with us: the name can go
            self.arena.unlink()
            if self.remote_peers:
                self.agent = nicagent.NicAgent(kind, rank, self.remote_peers, store, token,
                                               bind_host, deadline, self)
        except BaseException:
            if listener is not None:
                listener.close()
            self.close()
            raise
        if listener is not None:
            listener.close()
        self._views[rank] = ArenaView(self.arena, rank)
        self._event_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        progress.register(self._event_fd, self._drain_eventfd)
        for p, s in self._socks.items():
            s.setblocking(False)
            self._fds.append(s.fileno())
            progress.register(s.fileno(), lambda ev, p=p: self._on_doorbell(p))
        if self.agent is not None:
            self.agent.start()

    # ------------------------------------------------------------------------- setup
    def _sock_name(self, rank: int, nonce: str) -> str:
        return f"\0minicomm-{self.job_id}-{self.kind}-{rank}-{nonce}"

    def _make_arena(self) -> None:
        n_rings = len(self.local_peers)
        ring = round_up(ring_bytes(RING_ENTRIES))
        self._rings_off = TABLE_OFF + MAX_REGIONS * ENTRY
        data_off = self._rings_off + n_rings * ring
        size = max(_ARENA_BYTES, data_off + (16 << 20))
        path = os.path.join("/dev/shm", f"minicomm-{self.job_id}-{self.kind}{self.rank}")
        self.arena = a = Arena.create(path, size)
        a.reserve(0, data_off)
        q = a.q
        q[0], q[1], q[2], q[3], q[4] = MAGIC, self.rank, MAX_REGIONS, RING_ENTRIES, n_rings
        for i, p in enumerate(self.local_peers):
            q[_RANKS_AT + i] = p
            self._rings_in.append((p, EventRing(a, self._rings_off + i * ring, RING_ENTRIES)))
        for idx in range(MAX_REGIONS):
            SharedMutex.initialize(a, TABLE_OFF + idx * ENTRY + MUTEX_AT)
        self._free = [[data_off, size - data_off]]

    def _attach(self, p: int, path: str) -> None:
        arena = Arena.attach(path)
        self._peer_arenas.append(arena)
        q = arena.q
        n = q[4]
        if q[0] != MAGIC or q[1] != p:
            raise CommError(f"{self.kind}: {path} is not rank {p}'s arena of this job")
        ranks = [q[_RANKS_AT + i] for i in range(n)]
        if self.rank not in ranks:
            raise CommError(f"{self.kind}: rank {p} has no event ring for rank {self.rank} "
                            f"(ranks disagree on the node layout)")
        ring = round_up(ring_bytes(RING_ENTRIES))
        rings_off = TABLE_OFF + MAX_REGIONS * ENTRY
        self._rings_out[p] = EventRing(arena, rings_off + ranks.index(self.rank) * ring,
                                       RING_ENTRIES)
        self._views[p] = ArenaView(arena, p)
        self._flag_q[p] = arena.q

    def is_local(self, peer: int) -> bool:
        return peer == self.rank or peer in self._views

    # ------------------------------------------------------------------------ operations
    def post(self, peer: int, op: int, key: int, va: int, nbytes: int, token=None, src=(),
             dst=None, a: int = 0, b: int = 0, channel: int = 0, imm: int = 0,
             done: Optional[Callable] = None):
        """Execute one operation on ``peer``'s memory (module doc). Same node: returns
        (status, result). Other node: returns None; ``done(status, result)`` follows."""
        if self.emulate:
            self._delay(nbytes)
        view = self._views.get(peer)
        if view is not None:
            return self._local(peer, view, op, key, va, nbytes, token, src, dst, a, b, channel,
                               imm)
        reason = self.closed_peers.get(peer)
        if reason is not None or self.agent is None or peer not in self.agent.conns:
            return (PEER_DEAD, reason) if reason is not None else (BAD_KEY, "no route")
        op_id = self._next_op
        self._next_op += 1
        self._pending[op_id] = (peer, done, dst)
        payload = sum(s.nbytes for s in src) if op in (OP_WRITE, OP_WRITE_IMM, OP_SEND) else 0
        frame = nicagent.pack(nicagent.REQ, op, channel, op_id, key, va, nbytes, imm, a, b,
                              -1 if token is None else _wrap(token), 0, payload)
        if not self.agent.send(peer, frame, [s.reshape(-1).view(np.uint8) for s in src]
                               if payload else None):
            self._pending.pop(op_id, None)
            return PEER_DEAD, self.link_reason(peer) or "link closed"
        return None

    def _local(self, peer, view, op, key, va, nbytes, token, src, dst, a, b, channel, imm):
        if op == OP_WRITE:
            return view.write(key, va, src, nbytes, token), None
        if op == OP_WRITE_IMM:
            # b: a receive queue the immediate consumes an entry of (UB's JFR; rdma: 0, its
            # receive queue is matched when the target polls), a: that queue's token
            status, slot = view.check(key, va, nbytes, REMOTE_WRITE, token)[0], 0
            if status == OK and b:
                status, _, slot = view.claim_receive(b, 0, None if a == -1 else a)
            if status == OK:
                status = view.write(key, va, src, nbytes, token)
            if status == OK:
                status = self._event(peer, EV_IMM, channel, imm, nbytes, slot)
            return status, slot
        if op == OP_READ:
            return view.read(key, va, dst, token), None
        if op in ATOMICS:
            return view.atomic(op, key, va, a, b, token)
        if op == OP_SEND:
            status, off, slot = view.claim_receive(key, nbytes, token)
            if status == OK:
                u8 = view.u8
                for s in src:
                    k = s.nbytes
                    u8[off:off + k] = s.reshape(-1).view(np.uint8)
                    off += k
                status = self._event(peer, EV_RECV, channel, imm, nbytes, slot)
            return status, slot
        if op == OP_IMPORT:
            status, access, length = view.lookup(key, va, nbytes, token)
            return status, (access, length)
        raise ValueError(f"unknown operation {op}")

    def _event(self, peer: int, kind: int, channel: int, imm: int, nbytes: int, a: int) -> int:
        """Tell ``peer`` (same node or self) that an event arrived for its ``channel``."""
        if peer == self.rank:
            self._events.append((peer, kind, channel, imm, nbytes, a))
            return OK
        if peer in self.closed_peers:
            return PEER_DEAD
        if not self._rings_out[peer].push(kind, channel, imm, nbytes, a, self.rank):
            return OVERRUN
        fence()                       # the record before the peer's sleeping flag is read
        if self._flag_q[peer][_SLEEPING]:
            s = self._socks.get(peer)
            if s is not None:
                try:
                    s.send(_WAKE, _NOWAIT)
                except BlockingIOError:
                    pass              # unread doorbells are pending: it wakes anyway
                except OSError:
                    pass
        return OK

    def pump(self) -> list:
        """Inbound events, oldest first per source: (peer, kind, channel, imm, nbytes, a)."""
        out = []
        for peer, ring in self._rings_in:
            for kind, channel, imm, nbytes, a, _src, _, _ in ring.pop_all():
                out.append((peer, kind, channel, imm, nbytes, a))
        ev = self._events
        while ev:
            out.append(ev.popleft())
        return out

    def sleep(self, flag: bool) -> None:
        self._sleeping = flag
        if self.arena is not None:
            self.arena.q[_SLEEPING] = int(flag)

    def _notify(self) -> None:
        """Wake this process's waiter (called from the agent thread)."""
        if self._sleeping and self._event_fd >= 0:
            try:
                os.eventfd_write(self._event_fd, 1)
            except OSError:
                pass

    def _drain_eventfd(self, events: int) -> None:
        try:
            os.eventfd_read(self._event_fd)
        except (BlockingIOError, OSError):
            pass

    def _delay(self, nbytes: int) -> None:
        wait = self.link.cost(nbytes)
        until = time.perf_counter() + wait
        if wait > _SLEEP_ABOVE_S:
            time.sleep(wait)
        while time.perf_counter() < until:
            pass

    # ------------------------------------------------------------------- peers ending
    def link_reason(self, peer: int) -> Optional[str]:
        """Why the link to ``peer`` ended, as soon as its agent connection recorded it (before
        ``on_closed`` has run), or None while it is up."""
        why = self.closed_peers.get(peer)
        if why is None and self.agent is not None:
            c = self.agent.conns.get(peer)
            why = c.closed if c is not None else None
        return why

    def peer_gone(self, peer: int) -> Optional[str]:
        """Why ``peer`` is known gone (exited, crashed, aborted or closed its transport), or None
        while it is up; never blocks; call it under the transport's lock. A peer on another
        node: what its agent connection recorded. One on this node: its doorbell socket,
        checked for a hang-up without reading it (``hung_up``); once it hung up, the rest is
        read here as the progress engine's handler would (the goodbye or abort reason)."""
        why = self.link_reason(peer)
        if why is not None or peer == self.rank:
            return why
        s = self._socks.get(peer)
        if s is not None and hung_up(s.fileno()):
            self._on_doorbell(peer)
            why = self.closed_peers.get(peer)
        return why

    def on_closed(self, peer: int, reason: str) -> None:
        """A peer's link ended: fail what waits on it, wake the waiter."""
        if peer not in self.closed_peers:
            self.closed_peers[peer] = reason
        for op_id, (p, done, _dst) in list(self._pending.items()):
            if p == peer:
                self._pending.pop(op_id, None)
                if done is not None:
                    done(PEER_DEAD, reason)
        if self.on_peer_closed is not None:
            self.on_peer_closed(peer, reason)
        self._notify()

    def _on_doorbell(self, peer: int) -> None:
        """Drain a same-node peer's doorbell socket (edge-triggered); EOF: the peer is gone."""
        s = self._socks.get(peer)
        while s is not None:
            try:
                data = s.recv(65536)
            except BlockingIOError:
                return
            except OSError as e:
                data = b""
                self.closed_peers.setdefault(peer, f"its {self.kind} link failed ({e})")
            if not data:
                self.on_closed(peer, f"it closed its {self.kind} link (exited or crashed)")
                if s.fileno() in self._fds:
                    self.progress.unregister(s.fileno())
                return
            cur = self.closed_peers.get(peer)
            if cur is not None and cur.startswith("it aborted: "):
                self.closed_peers[peer] = cur + data.decode(errors="replace")
            elif _ABORT in data:
                self.on_closed(peer, "it aborted: " +
                               data[data.index(_ABORT) + 1:].decode(errors="replace"))
            elif _BYE in data:
                self.on_closed(peer, "it closed its transport (it finished)")

    def exclude(self, peer: int, reason: str, local_reason: str) -> None:
        """End the link to ``peer`` alone, as ``abort`` ends all: ``reason`` to it (the doorbell
        on this node, the NIC agent's connection across), the link shut; here it reads
        ``local_reason`` and what waits on it fails."""
        msg = reason.encode()[:2000]
        s = self._socks.get(peer)
        if s is not None:
            try:
                s.send(_ABORT + msg, _NOWAIT)
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if s.fileno() in self._fds:
                self.progress.unregister(s.fileno())
        elif self.agent is not None:
            self.agent.goodbye_to(peer, nicagent.ABORT, msg)
        self.on_closed(peer, local_reason)

    # ------------------------------------------------------------------------- lifetime
    def abort(self, reason: str) -> None:
        if self._aborted is not None or self._closed:
            return
        self._aborted = reason
        msg = reason.encode()[:2000]
        for s in self._socks.values():
            try:
                s.send(_ABORT + msg, _NOWAIT)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if self.agent is not None:
            self.agent.goodbye(nicagent.ABORT, msg)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in self._fds:
            self.progress.unregister(fd)
        if self._event_fd >= 0:
            self.progress.unregister(self._event_fd)
        if self.agent is not None:
            if self._aborted is None:
                self.agent.goodbye(nicagent.BYE)
            self.agent.close()
        for s in self._socks.values():
            if self._aborted is None:
                try:
                    s.send(_BYE, _NOWAIT)
                except OSError:
                    pass
            s.close()
        self._socks.clear()
        if self._event_fd >= 0:
            os.close(self._event_fd)
            self._event_fd = -1
        self._views.clear()
        self._rings_out.clear()
        self._rings_in.clear()
        self._flag_q.clear()
        self._regions.clear()
        for a in self._peer_arenas:
            a.close()
        self._peer_arenas.clear()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

