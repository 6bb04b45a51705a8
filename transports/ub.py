"""ub: a simulated Unified Bus (UB, 灵衢) endpoint per process, in URMA's vocabulary.

What it does. UB gives every endpoint an EID; memory is addressed as (EID, virtual address).
A process *registers* a segment with access flags and a token; a peer *imports* it with that token
(the owner checks it) and then reaches it two ways:

    ep = comm.transport.ub
    seg = ep.register_segment(nbytes, ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC, token=0x1234)
    tseg = ep.import_segment(seg_info_from_peer, token=0x1234)   # RMAError if the token is wrong
    # memory semantics, synchronous: the call returns when the access is done
    data = tseg.load(tseg.va + 64, 16); tseg.store(tseg.va, array)
    old = tseg.cas(va, expect, new); tseg.swap / fadd / fand / for_ / fxor(va, operand)
    # queued DMA on Jettys: JFS (send queue), JFR (receive queue), JFC (completion queue)
    jfc = ep.create_jfc(); jfs = ep.create_jfs(jfc)
    jfs.post([JfsWr(OPC_WRITE, tseg, local=a, va=...), JfsWr(OPC_READ, tseg2, local=out, ...)])
    crs = jfc.wait()                  # CompletionRecord(user_ctx, status, opcode, ...)

One JFS reaches many targets (every work request names its own target segment or JFR).
Each request carries an ordering and fence flags (urma_jfs_wr_flag_t: place_order, fence):

  ORDER_NONE    no order with any other request: the simulator places every run of consecutive
                unordered requests of one ``post`` in *reverse*, the most adversarial legal
                order, so code that relies on an order it did not ask for breaks here first;
  ORDER_RELAX   ordered after earlier requests to the same target (they share an in-order path);
  ORDER_STRONG  ordered after every earlier request of this JFS, whatever its target: it waits for
                earlier requests to other targets to complete before it is issued;
  fence=True    waits for earlier READs to complete (their data back) before it is issued.

SEND takes the next posted buffer of the target JFR (RNR error if none); WRITE_IMM writes and
then consumes a posted entry of the JFR it names, raising a receive record there.

Errors. A bad token, a missing permission or an access outside the segment gives an error
completion record (``CR_REM_ACCESS_ABORT_ERR``) and touches no target memory -- on the memory-
semantic path the call raises ``RMAError`` with that status instead. A failed request moves the
JFS to the ERROR state, as the URMA model does: the rest of its batch is flushed
(``CR_WR_FLUSH_ERR``), ``post`` refuses new requests, until ``jfs.flush()`` returns the flushed
records and makes it READY again. A vanished peer: ``CR_ACK_TIMEOUT_ERR``.

Simulated vs real (nic.py): same node -- shared mappings, the initiator's "UB controller" does the
load / store / atomic itself (real one-sided memory semantics); other nodes -- the target's NIC
agent thread serves requests over authenticated sockets (passive target). Names and statuses
follow openEuler UMDK's URMA headers (openeuler-mirror/umdk, src/urma/lib/urma/core/include/
urma_types.h: urma_jfs_wr_flag_t, urma_cr_status_t); there is no UB wire protocol, UMMU or
hardware ordering engine here.

Link parameters (``LINK``, illustrative, used by the simulator and MINICOMM_EMULATE_LINK=1): a UB
memory-semantic load of ~0.5 us (an assumed figure, the same order as published CXL.mem load
latencies of a few hundred ns; no UB hardware was timed) against rdma.LINK's ~2 us RoCE READ,
and 50 GB/s (a round illustrative number).

Cost (alpha-beta): same node, a load / store of n bytes is one memcpy; an atomic one mutex round
trip; other nodes, one request/answer round trip plus n bytes over the socket.
"""
from __future__ import annotations

import ipaddress
import os
import struct
import threading
import time
import zlib
from collections import deque
from typing import Dict, List, NamedTuple, Optional, Sequence, Union

import numpy as np

from minicomm.errors import CommError, RMAError
from . import nic as _nic
from .base import Capabilities, ChannelBase
from .landing import CREDIT, DATA, RECORDS, RING, LandingEngine, _Link
from .nic import LinkParams

ACCESS_READ = _nic.REMOTE_READ
ACCESS_WRITE = _nic.REMOTE_WRITE | _nic.LOCAL_WRITE
ACCESS_ATOMIC = _nic.REMOTE_ATOMIC | _nic.LOCAL_WRITE

ORDER_NONE, ORDER_RELAX, ORDER_STRONG = 0, 1, 2

OPC_WRITE, OPC_WRITE_IMM, OPC_READ, OPC_SEND = "WRITE", "WRITE_IMM", "READ", "SEND"
_OPS = {OPC_WRITE: _nic.OP_WRITE, OPC_WRITE_IMM: _nic.OP_WRITE_IMM, OPC_READ: _nic.OP_READ,
        OPC_SEND: _nic.OP_SEND}
CR_OPC_RECV_WRITE_IMM, CR_OPC_RECV_SEND = "RECV_WRITE_IMM", "RECV_SEND"

CR_SUCCESS = "SUCCESS"
CR_REM_ACCESS_ABORT_ERR = "REM_ACCESS_ABORT_ERR"
CR_REM_OPERATION_ERR = "REM_OPERATION_ERR"
CR_RNR_RETRY_CNT_EXC_ERR = "RNR_RETRY_CNT_EXC_ERR"
CR_ACK_TIMEOUT_ERR = "ACK_TIMEOUT_ERR"
CR_WR_FLUSH_ERR = "WR_FLUSH_ERR"
_STATUS = {_nic.OK: CR_SUCCESS, _nic.BAD_KEY: CR_REM_ACCESS_ABORT_ERR,
           _nic.BAD_TOKEN: CR_REM_ACCESS_ABORT_ERR, _nic.NO_PERMISSION: CR_REM_ACCESS_ABORT_ERR,
           _nic.BAD_BOUNDS: CR_REM_ACCESS_ABORT_ERR, _nic.BAD_ALIGN: CR_REM_OPERATION_ERR,
           _nic.RNR: CR_RNR_RETRY_CNT_EXC_ERR, _nic.LEN_ERR: CR_REM_OPERATION_ERR,
           _nic.PEER_DEAD: CR_ACK_TIMEOUT_ERR, _nic.FLUSHED: CR_WR_FLUSH_ERR,
           _nic.OVERRUN: CR_REM_OPERATION_ERR}

LINK = LinkParams(0.5e-6, 50e9, "UB memory-semantic load ~0.5 us (an assumed figure: the order "
                  "of published CXL.mem load latencies; no UB hardware timed), 50 GB/s")
_INFO = struct.Struct("<QQqqqq")


class SegmentInfo(NamedTuple):
    """What a peer needs to import a segment (urma_seg_t): exchanged out of band."""
    eid: int
    va: int
    length: int
    token_id: int
    access: int

    def pack(self) -> bytes:
        return _INFO.pack(self.eid >> 64, self.eid & ((1 << 64) - 1), self.va, self.length,
                          self.token_id, self.access)

    @classmethod
    def unpack(cls, data: bytes) -> "SegmentInfo":
        hi, lo, va, length, token_id, access = _INFO.unpack(data)
        return cls((hi << 64) | lo, va, length, token_id, access)


class CompletionRecord(NamedTuple):
    """urma_cr_t: ``slot`` is the JFR buffer a SEND landed in; ``value`` a READ's length or
    nothing; ``detail`` says why an error happened."""
    user_ctx: int
    status: str
    opcode: str
    completion_len: int
    imm_data: int
    remote: int                       # the peer's world rank
    local_id: int
    slot: int = 0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == CR_SUCCESS


def format_eid(eid: int) -> str:
    return str(ipaddress.IPv6Address(eid))


class Segment:
    """A registered segment of this endpoint: ``info`` (give it to peers), ``buf`` (the memory)."""

    def __init__(self, ep: "UbEndpoint", region: _nic.Region):
        self.ep, self.region = ep, region
        self.info = SegmentInfo(ep.eid, region.va, region.length, region.key, region.access)
        self.token = region.token
        self.buf = region.buf
        self.va, self.length = region.va, region.length


def _flat_u8(a: np.ndarray) -> np.ndarray:
    if a.__class__ is np.ndarray and a.ndim == 1 and a.dtype == np.uint8 and a.flags.c_contiguous:
        return a
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8)


class TargetSegment:
    """An imported segment (urma_target_seg_t): synchronous memory-semantic access."""

    def __init__(self, ep: "UbEndpoint", info: SegmentInfo, peer: int, token: int):
        self.ep, self.info, self.peer, self.token = ep, info, peer, token
        self.va, self.length, self.access = info.va, info.length, info.access

    def _sync(self, what, op, va, nbytes, src=(), dst=None, a=0, b=0):
        status, result = self.ep._sync(self.peer, op, self.info.token_id, va, nbytes, self.token,
                                       src, dst, a, b)
        if status != _nic.OK:
            raise _error(f"{what} at (eid {format_eid(self.info.eid)}, va 0x{va:x})", status,
                         result, self.peer)
        return result

    def load(self, va: int, nbytes: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Read ``nbytes`` at ``va`` (into ``out``, a contiguous array of that size)."""
        dst = np.empty(nbytes, dtype=np.uint8) if out is None else out
        if dst.nbytes != nbytes or not dst.flags.c_contiguous:
            raise ValueError(f"load: out= must be a contiguous array of {nbytes} bytes")
        self._sync("load", _nic.OP_READ, va, nbytes, dst=dst)
        return dst

    def store(self, va: int, data) -> None:
        u8 = _flat_u8(np.asarray(data))
        self._sync("store", _nic.OP_WRITE, va, u8.nbytes, src=(u8,))

    def cas(self, va: int, compare: int, swap: int) -> int:
        return int(self._sync("cas", _nic.OP_CAS, va, 8, a=int(compare), b=int(swap)))

    def swap(self, va: int, value: int) -> int:
        return int(self._sync("swap", _nic.OP_SWAP, va, 8, a=int(value)))

    def fadd(self, va: int, value: int) -> int:
        return int(self._sync("fetch-and-add", _nic.OP_FADD, va, 8, a=int(value)))

    def fand(self, va: int, value: int) -> int:
        return int(self._sync("fetch-and-and", _nic.OP_FAND, va, 8, a=int(value)))

    def for_(self, va: int, value: int) -> int:
        return int(self._sync("fetch-and-or", _nic.OP_FOR, va, 8, a=int(value)))

    def fxor(self, va: int, value: int) -> int:
        return int(self._sync("fetch-and-xor", _nic.OP_FXOR, va, 8, a=int(value)))


class Jfc:
    """Jetty For Completion: completion records of the JFSs and JFRs bound to it."""

    def __init__(self, ep: "UbEndpoint"):
        self.ep = ep
        self._crs: deque = deque()

    def _push(self, cr: CompletionRecord) -> None:
        self._crs.append(cr)

    def poll(self, max_entries: int = 16) -> List[CompletionRecord]:
        with self.ep.transport._lock:
            return self._poll(max_entries)

    def _poll(self, max_entries: int) -> List[CompletionRecord]:
        self.ep._pump()
        out = []
        while self._crs and len(out) < max_entries:
            out.append(self._crs.popleft())
        return out

    def wait(self, timeout: float = 60.0, max_entries: int = 16,
             peer: Optional[int] = None) -> List[CompletionRecord]:
        self.ep.transport.wait_for(lambda: bool(self._crs), self.ep.rank if peer is None else peer,
                                   "ub JFC", "a completion record", timeout)
        return self.poll(max_entries)


class Jfr:
    """Jetty For Receive: ``depth`` entries of ``buf_bytes`` each, posted in order. ``info``
    lets peers import it (SEND and WRITE_IMM name it)."""

    def __init__(self, ep: "UbEndpoint", jfc: Jfc, depth: int, buf_bytes: int, token: int):
        self.ep, self.jfc, self.depth, self.buf_bytes = ep, jfc, depth, buf_bytes
        self.region = ep.device.register(depth * buf_bytes, _nic.LOCAL_WRITE, token=token, kind=1,
                                         slot_bytes=buf_bytes, depth=depth)
        self.id = self.region.key
        self.token = self.region.token
        self.info = SegmentInfo(ep.eid, self.region.va, self.region.length, self.id, 0)
        self._ctx: List[int] = [0] * depth
        self._posted = self._done = 0

    def post_recv(self, user_ctx: int = 0) -> None:
        with self.ep.transport._lock:
            self._post_recv(user_ctx)

    def _post_recv(self, user_ctx: int) -> None:
        if self._posted - self._done >= self.depth:
            raise CommError(f"JFR {self.id:#x}: all {self.depth} entries are posted already")
        self._ctx[self._posted % self.depth] = user_ctx
        self._posted += 1
        self.ep.device.post_receive(self.region)

    def buffer(self, slot: int) -> np.ndarray:
        """The memory of entry ``slot`` (what a SEND wrote there)."""
        return self.region.buf[slot * self.buf_bytes:(slot + 1) * self.buf_bytes]

    def _arrive(self, peer: int, kind: int, imm: int, nbytes: int, slot: int) -> None:
        self._done += 1
        opcode = CR_OPC_RECV_SEND if kind == _nic.EV_RECV else CR_OPC_RECV_WRITE_IMM
        self.jfc._push(CompletionRecord(self._ctx[slot], CR_SUCCESS, opcode, nbytes, imm, peer,
                                        self.id, slot))


class TargetJfr(NamedTuple):
    peer: int
    id: int
    token: int


class JfsWr(NamedTuple):
    """One work request (urma_jfs_wr_t): ``target`` a TargetSegment (WRITE, WRITE_IMM, READ) or
    a TargetJfr (SEND); ``va`` the target address (default: the segment's start); ``local``
    the source (WRITE, WRITE_IMM, SEND) or destination (READ); ``notify`` the TargetJfr a
    WRITE_IMM raises its record at."""
    opcode: str
    target: Union[TargetSegment, TargetJfr]
    local: Optional[np.ndarray] = None
    va: Optional[int] = None
    imm: int = 0
    order: int = ORDER_NONE
    fence: bool = False
    complete: bool = True
    user_ctx: int = 0
    notify: Optional[TargetJfr] = None


class Jfs:
    """Jetty For Send: queued DMA requests to any number of targets (module doc)."""

    def __init__(self, ep: "UbEndpoint", jfc: Jfc, depth: int):
        self.ep, self.jfc, self.depth = ep, jfc, depth
        self.id = ep._new_id()
        self.state = "READY"
        self.error: Optional[CompletionRecord] = None
        self._lock = threading.Lock()
        self._outstanding: Dict[int, tuple] = {}     # seq -> (peer, opcode)
        self._seq = 0
        self._flushed: List[CompletionRecord] = []

    def post(self, wrs: Union[JfsWr, Sequence[JfsWr]]) -> None:
        with self.ep.transport._lock:
            self._post(wrs)

    def _post(self, wrs) -> None:
        if wrs.__class__ is JfsWr:
            wrs = (wrs,)
        if self.state != "READY":
            raise RMAError(f"ub JFS {self.id} is in the ERROR state after a failed request "
                           f"({self.error.status}: {self.error.detail}); flush() it first")
        if len(self._outstanding) + len(wrs) > self.depth:
            raise CommError(f"ub JFS {self.id}: queue full ({self.depth} requests outstanding)")
        for wr in _placement(wrs):
            if self.state == "READY":
                peer = wr.target.peer
                if wr.fence:
                    self._wait_outstanding(lambda p, opc: opc == OPC_READ, "a fenced request")
                if wr.order == ORDER_STRONG:
                    self._wait_outstanding(lambda p, opc, peer=peer: p != peer,
                                           "a strongly ordered request")
            if self.state != "READY":         # an earlier request failed (maybe just now)
                self._flush_wr(wr)
                continue
            self._issue(wr)

    def _wait_outstanding(self, which, what: str) -> None:
        def clear():
            return not any(which(p, opc) for p, opc in list(self._outstanding.values()))
        if not clear():
            self.ep.transport._lock.release()         # wait_for takes the progress lock itself
            try:
                self.ep.transport.wait_for(clear, self.ep.rank, "ub JFS", what, 60.0)
            finally:
                self.ep.transport._lock.acquire()

    def _issue(self, wr: JfsWr) -> None:
        op = _OPS.get(wr.opcode)
        if op is None:
            raise ValueError(f"unknown opcode {wr.opcode!r}: choose one of {', '.join(_OPS)}")
        t = wr.target
        src, dst, a, b = (), None, 0, 0
        if op == _nic.OP_READ:
            if wr.local is None or not wr.local.flags.c_contiguous:
                raise ValueError("READ needs a contiguous local array to read into")
            dst, nbytes = wr.local, wr.local.nbytes
        else:
            src = () if wr.local is None else (_flat_u8(wr.local),)
            nbytes = sum(s.nbytes for s in src)
        if op == _nic.OP_SEND:
            key, va, token = t.id, 0, t.token
        else:
            key, va, token = t.info.token_id, t.va if wr.va is None else wr.va, t.token
        channel = 0                   # the target JFR whose JFC gets the receive record
        if op == _nic.OP_SEND:
            channel = t.id
        elif op == _nic.OP_WRITE_IMM:
            if wr.notify is None:
                raise ValueError("WRITE_IMM needs notify=, the TargetJfr of the receive record")
            a, b, channel = wr.notify.token, wr.notify.id, wr.notify.id
        dev = self.ep.device
        view = dev._views.get(t.peer)
        if view is not None:          # same node: executed now, nothing stays outstanding
            if dev.emulate:
                dev._delay(nbytes)
            status, result = dev._local(t.peer, view, op, key, va, nbytes, token, src, dst, a, b,
                                        channel, wr.imm)
            if status != _nic.OK or wr.complete:
                self._record(wr, nbytes, status, result)
            return
        self._seq += 1
        seq = self._seq
        self._outstanding[seq] = (t.peer, wr.opcode)

        def done(status, result):
            self._complete(seq, wr, nbytes, status, result)
        res = dev.post(t.peer, op, key, va, nbytes, token, src, dst, a, b, channel, wr.imm, done)
        if res is not None:
            done(*res)

    def _complete(self, seq, wr, nbytes, status, result) -> None:
        with self._lock:
            self._outstanding.pop(seq, None)
            self._record(wr, nbytes, status, result)

    def _record(self, wr, nbytes, status, result) -> None:
        """The completion record of a finished request (always one for an error)."""
        peer = wr.target.peer
        if status == _nic.OK:
            if wr.complete:
                self.jfc._push(CompletionRecord(wr.user_ctx, CR_SUCCESS, wr.opcode, nbytes, 0,
                                                peer, self.id))
            return
        detail = _nic.STATUS_TEXT[status]
        if isinstance(result, str):
            detail += f" ({result})"
        cr = CompletionRecord(wr.user_ctx, _STATUS[status], wr.opcode, 0, 0, peer, self.id, 0,
                              detail)
        if self.state == "READY":
            self.state, self.error = "ERROR", cr
        self.jfc._push(cr)

    def _flush_wr(self, wr: JfsWr) -> None:
        self._flushed.append(CompletionRecord(wr.user_ctx, CR_WR_FLUSH_ERR, wr.opcode, 0, 0,
                                              wr.target.peer, self.id, 0,
                                              "flushed: the JFS is in the ERROR state"))

    def flush(self) -> List[CompletionRecord]:
        """Leave the ERROR state: the records of the requests flushed since the error (also
        pushed to the JFC, ``urma_flush_jfs``); the JFS is READY again."""
        with self.ep.transport._lock:
            out, self._flushed = self._flushed, []
            for cr in out:
                self.jfc._push(cr)
            self.state, self.error = "READY", None
            return out


def _placement(wrs: Sequence[JfsWr]) -> Sequence[JfsWr]:
    """The order the simulator places a batch in: each run of unordered, unfenced requests
    reversed (module doc); every ordered or fenced request stays after what came before it."""
    if len(wrs) == 1:
        return wrs
    out: List[JfsWr] = []
    run: List[JfsWr] = []
    for wr in wrs:
        if wr.order == ORDER_NONE and not wr.fence:
            run.append(wr)
        else:
            out.extend(reversed(run))
            run = []
            out.append(wr)
    out.extend(reversed(run))
    return out


class UbEndpoint:
    """This process's UB endpoint (``comm.transport.ub``): its EID, segments and Jettys."""

    def __init__(self, transport: "UbTransport", eids: Dict[int, int]):
        self.transport, self.device, self.rank = transport, transport.device, transport.rank
        self.eid = eids[self.rank]
        self._eids = eids
        self._rank_of = {e: r for r, e in eids.items()}
        self._jfrs: Dict[int, Jfr] = {}
        self._ids = 0

    def _new_id(self) -> int:
        self._ids += 1
        return self._ids

    def eid_of(self, rank: int) -> int:
        return self._eids[rank]

    def register_segment(self, nbytes: int, access: int = ACCESS_READ | ACCESS_WRITE,
                         token: int = 0) -> Segment:
        if access & ~(ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC):
            raise ValueError(f"register_segment: unknown access flags {access:#x}")
        if not 0 <= token < 1 << 32:
            raise ValueError("a UB token is a 32-bit value")
        with self.transport._lock:
            return Segment(self, self.device.register(int(nbytes), access, token=token))

    def unregister_segment(self, seg: Segment) -> None:
        with self.transport._lock:
            self.device.deregister(seg.region)

    def import_segment(self, info: SegmentInfo, token: int) -> TargetSegment:
        """Import a peer's segment; its owner checks ``token`` (RMAError if refused)."""
        peer = self._rank_of.get(info.eid)
        if peer is None:
            raise RMAError(f"import: no endpoint has eid {format_eid(info.eid)}")
        status, result = self._sync(peer, _nic.OP_IMPORT, info.token_id, info.va, info.length,
                                    token)
        if status != _nic.OK:
            raise _error(f"import of segment at (eid {format_eid(info.eid)}, va 0x{info.va:x})",
                         status, result, peer)
        return TargetSegment(self, info, peer, token)

    def create_jfc(self) -> Jfc:
        return Jfc(self)

    def create_jfs(self, jfc: Jfc, depth: int = 4096) -> Jfs:
        return Jfs(self, jfc, depth)

    def create_jfr(self, jfc: Jfc, depth: int = 64, buf_bytes: int = 4096, token: int = 0) -> Jfr:
        with self.transport._lock:
            jfr = Jfr(self, jfc, depth, buf_bytes, token)
            self._jfrs[jfr.id] = jfr
            return jfr

    def import_jfr(self, info: SegmentInfo, token: int) -> TargetJfr:
        peer = self._rank_of.get(info.eid)
        if peer is None:
            raise RMAError(f"import: no endpoint has eid {format_eid(info.eid)}")
        return TargetJfr(peer, info.token_id, token)

    def _pump(self) -> None:
        for peer, kind, channel, imm, nbytes, slot in self.device.pump():
            jfr = self._jfrs.get(channel)
            if jfr is not None:
                jfr._arrive(peer, kind, imm, nbytes, slot)

    def _sync(self, peer, op, key, va, nbytes, token, src=(), dst=None, a=0, b=0):
        """One synchronous access: done at once inside a node, else wait for the answer."""
        box = []
        with self.transport._lock:
            res = self.device.post(peer, op, key, va, nbytes, token, src, dst, a, b,
                                   done=lambda status, result: box.append((status, result)))
        if res is not None:
            return res
        self.transport.wait_for(lambda: bool(box), peer, "ub memory access", "an answer", 60.0)
        return box[0]


def _error(what: str, status: int, result, peer: int) -> RMAError:
    name = _STATUS[status]
    detail = _nic.STATUS_TEXT[status]
    if isinstance(result, str):
        detail += f" ({result})"
    e = RMAError(f"ub {what} of rank {peer}: URMA_CR_{name} -- {detail}")
    e.status = name
    return e


# --------------------------------------------------------------------------- the transport
class UbTransport(LandingEngine):
    """Two-sided messages for the collectives (landing.py) over the UB endpoint: per peer one
    JFS; the data WRITE is unordered, the header's WRITE_IMM strongly ordered after it and
    consuming an entry of the peer's JFR."""
    name = "ub"
    kind = "ub"
    link = LINK

    def _landing_token(self) -> int:
        if not hasattr(self, "_token_value"):
            self._token_value = int.from_bytes(os.urandom(4), "little")
        return self._token_value

    def _setup_verbs(self) -> None:
        # the EID: fd00::/8-style, job hash and rank (every rank derives every EID alike)
        h = zlib.crc32(self.device.job_id.encode())
        eids = {r: (0xFD00 << 112) | (h << 32) | r for r in range(self.size)}
        self.ub = UbEndpoint(self, eids)
        self._jfc = self.ub.create_jfc()
        depth = 4 * RECORDS * max(1, len(self.peer_ranks))
        self._jfr = self.ub.create_jfr(self._jfc, depth=depth, buf_bytes=0,
                                       token=self._landing_token())
        for _ in range(depth):
            self._jfr._post_recv(0)

    def _setup_landing(self, store, deadline: float) -> None:
        store.set(f"ub/jfr/{self.rank}", self._jfr.info.pack() +
                  struct.pack("<q", self._jfr.token))
        super()._setup_landing(store, deadline)

    def _connect_peer(self, link: _Link, store, deadline: float) -> None:
        ep = self.ub
        raw = store.get(f"ub/jfr/{link.peer}", timeout=max(0.0, deadline - time.monotonic()))
        info = SegmentInfo.unpack(raw[:_INFO.size])
        link.qp = ep.import_jfr(info, struct.unpack("<q", raw[_INFO.size:])[0])
        eid = ep.eid_of(link.peer)
        # importing checks our copy of the token with the owner (one round trip across nodes)
        link.tseg = ep.import_segment(SegmentInfo(eid, link.r_va, RING, link.r_key,
                                                  ACCESS_WRITE), link.r_token)
        link.cseg = ep.import_segment(SegmentInfo(eid, link.c_va, 16, link.c_key, ACCESS_WRITE),
                                      link.c_token)
        link.local_node = self.device.is_local(link.peer)
        link.jfs = ep.create_jfs(self._jfc)

    def _write_record(self, link, pos, header, data, wr_id):
        va = link.r_va + pos
        remote = not link.local_node
        wrs = []
        if data is not None and data.nbytes:
            wrs.append(JfsWr(OPC_WRITE, link.tseg, data, va + 64, complete=False))
        wrs.append(JfsWr(OPC_WRITE_IMM, link.tseg, header, va, imm=DATA << 32,
                         order=ORDER_STRONG, complete=remote and wr_id != 0, user_ctx=wr_id,
                         notify=link.qp))
        jfs = link.jfs
        jfs._post(wrs)
        if remote:
            return None
        return _nic.OK if jfs.state == "READY" else _nic.PEER_DEAD

    def _write_credit(self, link, value):
        link.jfs._post(JfsWr(OPC_WRITE_IMM, link.cseg, value, link.c_va, imm=CREDIT << 32,
                             complete=False, notify=link.qp))

    def _poll(self) -> bool:
        crs = self._jfc._poll(1 << 30)
        for cr in crs:
            if cr.opcode == CR_OPC_RECV_WRITE_IMM:
                self._jfr._post_recv(0)
                self._on_arrival(cr.remote, cr.imm_data)
            elif cr.ok:
                self._on_sent(cr.user_ctx, _nic.OK)
            else:
                link = self._by_peer.get(cr.remote)
                if link is not None and link.closed is None:
                    self._link_failed(link, f"its ub write failed: {cr.status} ({cr.detail})")
        return bool(crs)

    def capabilities(self) -> Capabilities:
        """One-sided access (windows) is its own; no eager channel, no registered memory."""
        return Capabilities(one_sided=self, describe=self.describe,
                            device_job_id=self.device.job_id)

    # ----------------------------------------------------------- one-sided RMA for windows
    def rma_expose(self, nbytes: int, name: str):
        return _UbExposure(self, nbytes)

    def rma_attach(self, peer: int, descriptor: bytes, channel: int):
        return _UbChannel(self, peer, descriptor)


class _UbExposure:
    """A window's local memory: one segment with read, write and atomic access and a fresh
    token, which the descriptor carries to the window's members."""

    def __init__(self, t: UbTransport, nbytes: int):
        self.t = t
        token = int.from_bytes(os.urandom(4), "little")
        self.seg = t.ub.register_segment(nbytes, ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
                                         token=token)
        self.u8 = self.seg.buf
        self.descriptor = self.seg.info.pack() + struct.pack("<q", token)

    def seal(self) -> None:
        """Nothing to unlink: the arena's name went at setup."""

    def close(self) -> None:
        if self.seg is not None:
            self.u8 = None
            self.t.ub.unregister_segment(self.seg)
            self.seg = None


class _UbChannel(ChannelBase):
    """A window's access to one target: the imported segment, used with memory semantics
    (synchronous store / load / atomics; nothing is left to flush)."""
    mapped = False
    native_atomics = True     # the segment's fadd / cas
    native_swap = True

    def __init__(self, t: UbTransport, peer: int, descriptor: bytes):
        self.t, self.peer = t, peer
        info = SegmentInfo.unpack(descriptor[:_INFO.size])
        token = struct.unpack("<q", descriptor[_INFO.size:])[0]
        self.tseg = t.ub.import_segment(info, token)
        self.base = info.va

    def put(self, off: int, src: np.ndarray) -> None:
        self.tseg.store(self.base + off, src)

    def get(self, off: int, dst: np.ndarray) -> None:
        self.tseg.load(self.base + off, dst.nbytes, out=dst)

    def fadd(self, off: int, value: int) -> int:
        return self.tseg.fadd(self.base + off, value)

    def cas(self, off: int, compare: int, swap: int) -> int:
        return self.tseg.cas(self.base + off, compare, swap)

    def swap(self, off: int, value: int) -> int:
        return self.tseg.swap(self.base + off, value)

    def flush(self) -> None:
        pass

    def peer_gone(self) -> Optional[str]:
        """Why this channel's peer is known gone, or None while it is up (nic.Device.peer_gone)."""
        with self.t._lock:
            return self.t.device.peer_gone(self.peer)

    def close(self) -> None:
        pass
