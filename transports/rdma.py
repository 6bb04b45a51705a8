"""rdma: a simulated RDMA NIC (InfiniBand / RoCEv2 verbs, reliable connection) per process.

What it does. The verbs an RDMA program uses, in numpy shape:

    nic = comm.transport.nic
    mr = nic.reg_mr(nbytes, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE)   # -> addr, rkey, buf
    cq = nic.create_cq()
    qp = nic.create_qp(peer, qp_num=7, send_cq=cq)        # RC, "connected" to the peer's QP 7
    qp.post_send(WR_RDMA_WRITE, wr_id=1, local=array, remote_addr=addr, rkey=rkey)
    qp.post_send(WR_RDMA_WRITE_WITH_IMM, ..., imm=42)      # + a receive completion at the peer
    qp.post_send(WR_RDMA_READ, local=out, remote_addr=..., rkey=...)
    qp.post_send(WR_ATOMIC_FETCH_AND_ADD, local=old8, remote_addr=..., rkey=..., compare_add=1)
    qp.post_send(WR_ATOMIC_CMP_AND_SWP, local=old8, ..., compare_add=expect, swap=new)
    qp.post_recv(wr_id)                                     # consumed by a WRITE_WITH_IMM
    wcs = cq.poll(16); wcs = cq.wait(timeout=1.0)           # WorkCompletion(wr_id, status, ...)

Access rules as in verbs: remote write or remote atomic access needs local write (``reg_mr``
raises ValueError, ibv_reg_mr's EINVAL); a WRITE needs REMOTE_WRITE, a READ REMOTE_READ, an atomic
REMOTE_ATOMIC and an 8-byte aligned address. A bad rkey, an access outside the region or without
the right comes back as an error completion (``WC_REM_ACCESS_ERR``, ``WC_REM_INV_REQ_ERR`` for a
misaligned atomic) -- never as a silent write: the target's memory is untouched -- and moves the
QP to the error state: later work requests complete with ``WC_WR_FLUSH_ERR`` until
``qp.reset()`` (RESET -> INIT -> RTR -> RTS). A dead peer: ``WC_RETRY_EXC_ERR``. A
WRITE_WITH_IMM that finds no posted receive waits for one (receiver-not-ready retried forever,
rnr_retry = 7).

Simulated vs real (see nic.py): inside a node the target region is a shared mapping and the
initiator's "NIC" performs the store / load / atomic itself -- a real one-sided access, the target
process takes no part; between nodes the per-process NIC agent thread of the target applies it
(passive-target progress) over authenticated sockets. Local keys (lkey) are not checked; there is
no wire protocol, PSN or retransmission; atomics are atomic with respect to other atomics on the
same region (the NIC's atomic unit), as IBV_ATOMIC_HCA.

Two-sided for the collectives: landing.py (NCCL IB style: a landing ring with credits, WRITE then
WRITE_WITH_IMM) on QP ``LANDING_QP`` of every peer pair.

Link parameters (``LINK``, illustrative, used by the simulator and by MINICOMM_EMULATE_LINK=1):
a RoCEv2 READ of ~2 us and 100 Gbit/s. Kalia, Kaminsky, Andersen, "Design Guidelines for High
Performance RDMA Systems" (USENIX ATC 2016) and the NIC vendors' perftest (ib_read_lat) report
RDMA READ latencies of about 1.5-2.5 us on ConnectX-class NICs (published figures, not this
project's).

Cost (alpha-beta): a same-node WRITE of n bytes is one memcpy (n / memory bandwidth); a
cross-node one is a request frame plus n bytes over a loopback or real TCP socket, completed by
the agent's reply (one round trip); a READ or atomic always waits one round trip.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Dict, List, NamedTuple, Optional

import numpy as np

from minicomm.errors import CommError, RMAError
from . import nic as _nic
from .base import Capabilities, ChannelBase
from .landing import CREDIT, DATA, LANDING_QP, RECORDS, LandingEngine, _Link
from .nic import LinkParams

ACCESS_LOCAL_WRITE = _nic.LOCAL_WRITE
ACCESS_REMOTE_WRITE = _nic.REMOTE_WRITE
ACCESS_REMOTE_READ = _nic.REMOTE_READ
ACCESS_REMOTE_ATOMIC = _nic.REMOTE_ATOMIC

WR_RDMA_WRITE = "RDMA_WRITE"
WR_RDMA_WRITE_WITH_IMM = "RDMA_WRITE_WITH_IMM"
WR_RDMA_READ = "RDMA_READ"
WR_ATOMIC_FETCH_AND_ADD = "ATOMIC_FETCH_AND_ADD"
WR_ATOMIC_CMP_AND_SWP = "ATOMIC_CMP_AND_SWP"
_OPS = {WR_RDMA_WRITE: _nic.OP_WRITE, WR_RDMA_WRITE_WITH_IMM: _nic.OP_WRITE_IMM,
        WR_RDMA_READ: _nic.OP_READ, WR_ATOMIC_FETCH_AND_ADD: _nic.OP_FADD,
        WR_ATOMIC_CMP_AND_SWP: _nic.OP_CAS}
WC_RECV_RDMA_WITH_IMM = "RECV_RDMA_WITH_IMM"

WC_SUCCESS = "SUCCESS"
WC_REM_ACCESS_ERR = "REM_ACCESS_ERR"
WC_REM_INV_REQ_ERR = "REM_INV_REQ_ERR"
WC_REM_OP_ERR = "REM_OP_ERR"
WC_RETRY_EXC_ERR = "RETRY_EXC_ERR"
WC_WR_FLUSH_ERR = "WR_FLUSH_ERR"
_STATUS = {_nic.OK: WC_SUCCESS, _nic.BAD_KEY: WC_REM_ACCESS_ERR,
           _nic.NO_PERMISSION: WC_REM_ACCESS_ERR, _nic.BAD_BOUNDS: WC_REM_ACCESS_ERR,
           _nic.BAD_TOKEN: WC_REM_ACCESS_ERR, _nic.BAD_ALIGN: WC_REM_INV_REQ_ERR,
           _nic.OVERRUN: WC_REM_OP_ERR, _nic.PEER_DEAD: WC_RETRY_EXC_ERR,
           _nic.FLUSHED: WC_WR_FLUSH_ERR, _nic.RNR: WC_REM_OP_ERR, _nic.LEN_ERR: WC_REM_OP_ERR}

LINK = LinkParams(2.0e-6, 12.5e9, "RoCEv2 READ ~2 us (Kalia et al., USENIX ATC 2016; perftest "
                  "ib_read_lat on ConnectX-class NICs), 100 Gbit/s; illustrative")


class WorkCompletion(NamedTuple):
    """ibv_wc: ``value`` is a convenience (an atomic's original value; verbs only writes it to
    the local buffer, which this does too); ``detail`` says why an error happened."""
    wr_id: int
    status: str
    opcode: str
    byte_len: int
    imm_data: int
    src: int                          # the peer (world rank)
    qp_num: int
    value: Optional[int] = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == WC_SUCCESS


class MemoryRegion:
    """ibv_mr: ``addr`` (virtual address), ``length``, ``rkey`` (= ``lkey``), ``access`` and
    ``buf``, the registered memory as a uint8 array (a shared mapping of the arena)."""

    def __init__(self, region: _nic.Region):
        self.region = region
        self.addr, self.length, self.access = region.va, region.length, region.access
        self.rkey = self.lkey = region.key
        self.buf = region.buf

    def __repr__(self):
        return f"<MemoryRegion addr=0x{self.addr:x} length={self.length} rkey=0x{self.rkey:x}>"


class CompletionQueue:
    """ibv_cq: completions of the QPs bound to it, polled or waited for."""

    def __init__(self, nic: "RdmaNic", depth: int):
        self.nic, self.depth = nic, depth
        self._wcs: deque = deque()

    def _push(self, wc: WorkCompletion) -> None:
        self._wcs.append(wc)

    def poll(self, max_entries: int = 16) -> List[WorkCompletion]:
        with self.nic.transport._lock:
            return self._poll(max_entries)

    def _poll(self, max_entries: int) -> List[WorkCompletion]:
        self.nic._pump()
        out = []
        wcs = self._wcs
        while wcs and len(out) < max_entries:
            out.append(wcs.popleft())
        return out

    def wait(self, timeout: float = 60.0, max_entries: int = 16,
             peer: Optional[int] = None) -> List[WorkCompletion]:
        """At least one completion (CommTimeout after ``timeout``; PeerFailure if ``peer``,
        whose completion this waits for, is gone)."""
        t = self.nic.transport
        t.wait_for(lambda: bool(self._wcs), self.nic.rank if peer is None else peer,
                   "rdma completion queue", "a completion", timeout)
        return self.poll(max_entries)


class QueuePair:
    """ibv_qp, reliable connection to QP ``qp_num`` of ``peer`` (both sides create it)."""

    def __init__(self, nic: "RdmaNic", peer: int, qp_num: int, send_cq: CompletionQueue,
                 recv_cq: Optional[CompletionQueue], max_send_wr: int):
        self.nic, self.peer, self.qp_num = nic, peer, qp_num
        self.send_cq, self.recv_cq = send_cq, recv_cq or send_cq
        self.max_send_wr = max_send_wr
        self.state = "RTS"
        self.error: Optional[WorkCompletion] = None
        self.outstanding = 0
        self._lock = threading.Lock()
        self._rq: deque = deque()               # posted receive wr ids
        self._arrived: deque = deque()          # WRITE_WITH_IMMs waiting for a receive (RNR)
        self._epoch = 0                         # bumped by reset: late completions are flushed
        self.same_node = nic.device.is_local(peer)

    def post_recv(self, wr_id: int = 0) -> None:
        with self.nic.transport._lock:
            self._post_recv(wr_id)

    def _post_recv(self, wr_id: int) -> None:
        if self._arrived:
            imm, nbytes = self._arrived.popleft()
            self.recv_cq._push(WorkCompletion(wr_id, WC_SUCCESS, WC_RECV_RDMA_WITH_IMM, nbytes,
                                              imm, self.peer, self.qp_num))
        else:
            self._rq.append(wr_id)

    def _arrive(self, imm: int, nbytes: int) -> None:
        if self._rq:
            self.recv_cq._push(WorkCompletion(self._rq.popleft(), WC_SUCCESS,
                                              WC_RECV_RDMA_WITH_IMM, nbytes, imm, self.peer,
                                              self.qp_num))
        else:
            self._arrived.append((imm, nbytes))

    def post_send(self, opcode: str, wr_id: int = 0, local: Optional[np.ndarray] = None,
                  remote_addr: int = 0, rkey: int = 0, imm: int = 0, compare_add: int = 0,
                  swap: int = 0, signaled: bool = True) -> None:
        """Post one work request. ``local``: the source of a WRITE (an array, or a list of
        arrays gathered in order), the destination of a READ, the 8-byte buffer that receives an
        atomic's original value (optional here)."""
        with self.nic.transport._lock:
            self._post(opcode, wr_id, local, remote_addr, rkey, imm, compare_add, swap, signaled)

    def _post(self, opcode, wr_id=0, local=None, remote_addr=0, rkey=0, imm=0, compare_add=0,
              swap=0, signaled=True) -> Optional[int]:
        """post_send under the caller's lock; a same-node request's status, else None."""
        op = _OPS.get(opcode)
        if op is None:
            raise ValueError(f"unknown opcode {opcode!r}: choose one of {', '.join(_OPS)}")
        if self.state != "RTS":
            self.send_cq._push(WorkCompletion(wr_id, WC_WR_FLUSH_ERR, opcode, 0, 0, self.peer,
                                              self.qp_num, detail="the QP is in the error state "
                                              "after an earlier error; reset() it"))
            return _nic.FLUSHED
        src, dst, nbytes = (), None, 0
        if op == _nic.OP_WRITE or op == _nic.OP_WRITE_IMM:
            if local is None:
                pass
            elif local.__class__ is np.ndarray:
                src = (local if local.flags.c_contiguous else np.ascontiguousarray(local),)
                nbytes = local.nbytes
            else:
                src = tuple(np.ascontiguousarray(s) for s in local)
                nbytes = sum(s.nbytes for s in src)
        elif op == _nic.OP_READ:
            if local is None or not local.flags.c_contiguous:
                raise ValueError("RDMA_READ needs a contiguous local array to read into")
            dst, nbytes = local, local.nbytes
        else:
            dst, nbytes = local, 8
            if local is not None and local.nbytes < 8:
                raise ValueError("an atomic's local buffer needs 8 bytes")
        dev = self.nic.device
        if self.same_node:
            # executed now by this process's simulated NIC: no completion to wait for
            view = dev._views.get(self.peer)
            if view is None:
                status, result = _nic.PEER_DEAD, dev.closed_peers.get(self.peer, "closed")
            else:
                if dev.emulate:
                    dev._delay(nbytes)
                status, result = dev._local(self.peer, view, op, rkey, remote_addr, nbytes, None,
                                            src, dst if op == _nic.OP_READ else None,
                                            compare_add, swap, self.qp_num, imm)
            if status != _nic.OK or signaled or op in (_nic.OP_FADD, _nic.OP_CAS):
                self._finish(wr_id, opcode, op, nbytes, status, result, dst, signaled)
            return status
        with self._lock:
            if self.outstanding >= self.max_send_wr:
                raise CommError(f"rdma QP {self.qp_num} to rank {self.peer}: send queue full "
                                f"({self.max_send_wr} outstanding work requests)")
            self.outstanding += 1
        epoch = self._epoch

        def done(status, result, epoch=epoch):
            self._complete(wr_id, opcode, op, nbytes, status, result, dst, signaled, epoch)
        res = dev.post(self.peer, op, rkey, remote_addr, nbytes, None, src, dst if op ==
                       _nic.OP_READ else None, compare_add, swap, self.qp_num, imm, done)
        if res is None:
            return None
        done(res[0], res[1])
        return res[0]

    def _complete(self, wr_id, opcode, op, nbytes, status, result, dst, signaled, epoch):
        with self._lock:
            self.outstanding -= 1
            if epoch != self._epoch:
                status = _nic.FLUSHED
            self._finish(wr_id, opcode, op, nbytes, status, result, dst, signaled)

    def _finish(self, wr_id, opcode, op, nbytes, status, result, dst, signaled):
        """The work completion of a finished request (an error one always)."""
        value = None
        if status == _nic.OK and op in (_nic.OP_FADD, _nic.OP_CAS):
            value = int(result)
            if dst is not None:
                dst.reshape(-1).view(np.int64)[0] = value
        name = _STATUS[status]
        if status != _nic.OK:
            detail = _nic.STATUS_TEXT[status]
            if status == _nic.PEER_DEAD and isinstance(result, str):
                detail += f" ({result})"
            wc = WorkCompletion(wr_id, name, opcode, 0, 0, self.peer, self.qp_num,
                                None, detail)
            if self.state == "RTS":
                self.state, self.error = "ERR", wc
            self.send_cq._push(wc)
        elif signaled:
            self.send_cq._push(WorkCompletion(wr_id, name, opcode, nbytes, 0, self.peer,
                                              self.qp_num, value))

    def reset(self) -> None:
        """ERR -> RESET -> INIT -> RTR -> RTS: usable again; completions of work requests still
        in flight are reported as flushed."""
        with self._lock:
            self._epoch += 1
            self.state, self.error = "RTS", None

    def __repr__(self):
        return f"<QueuePair {self.qp_num} to rank {self.peer} {self.state}>"


class RdmaNic:
    """The verbs context and protection domain of this process (``comm.transport.nic``)."""

    def __init__(self, transport: "RdmaTransport"):
        self.transport, self.device, self.rank = transport, transport.device, transport.rank
        self._qps: Dict[tuple, QueuePair] = {}
        self._orphans: Dict[tuple, deque] = {}      # imms for a QP not created yet

    def reg_mr(self, nbytes: int, access: int = ACCESS_LOCAL_WRITE) -> MemoryRegion:
        """Register ``nbytes`` of fresh (zeroed) memory. Remote write or remote atomic access
        needs local write, as ibv_reg_mr requires (ValueError, its EINVAL)."""
        if access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) and not access & ACCESS_LOCAL_WRITE:
            raise ValueError("reg_mr: remote write or remote atomic access requires "
                             "ACCESS_LOCAL_WRITE (ibv_reg_mr: EINVAL)")
        if access & ~(ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ |
                      ACCESS_REMOTE_ATOMIC):
            raise ValueError(f"reg_mr: unknown access flags {access:#x}")
        with self.transport._lock:
            return MemoryRegion(self.device.register(int(nbytes), access))

    def dereg_mr(self, mr: MemoryRegion) -> None:
        with self.transport._lock:
            self.device.deregister(mr.region)

    def create_cq(self, depth: int = 4096) -> CompletionQueue:
        return CompletionQueue(self, depth)

    def create_qp(self, peer: int, qp_num: int, send_cq: CompletionQueue,
                  recv_cq: Optional[CompletionQueue] = None, max_send_wr: int = 4096) -> QueuePair:
        if peer != self.rank and peer not in self.transport.peer_ranks:
            raise ValueError(f"rank {self.rank}: no rdma route to rank {peer}")
        key = (peer, qp_num)
        if key in self._qps:
            raise ValueError(f"QP {qp_num} to rank {peer} exists already")
        qp = self._qps[key] = QueuePair(self, peer, qp_num, send_cq, recv_cq, max_send_wr)
        for imm, nbytes in self._orphans.pop(key, ()):
            qp._arrive(imm, nbytes)
        return qp

    def destroy_qp(self, qp: QueuePair) -> None:
        self._qps.pop((qp.peer, qp.qp_num), None)

    def _pump(self) -> None:
        """Hand inbound WRITE_WITH_IMM events to their QPs' receive queues."""
        for peer, kind, channel, imm, nbytes, _a in self.device.pump():
            qp = self._qps.get((peer, channel))
            if qp is not None:
                qp._arrive(imm, nbytes)
            else:
                self._orphans.setdefault((peer, channel), deque()).append((imm, nbytes))


# --------------------------------------------------------------------------- the transport
class RdmaTransport(LandingEngine):
    """Two-sided messages for the collectives (landing.py) over the simulated NIC."""
    name = "rdma"
    kind = "rdma"
    link = LINK

    def _setup_verbs(self) -> None:
        self.nic = RdmaNic(self)
        self._cq = self.nic.create_cq()

    def _connect_peer(self, link: _Link, store, deadline: float) -> None:
        link.qp = self.nic.create_qp(link.peer, LANDING_QP, self._cq)
        link.local_node = self.device.is_local(link.peer)
        for _ in range(4 * RECORDS):
            link.qp._post_recv(0)

    def _write_record(self, link, pos, header, data, wr_id):
        qp = link.qp
        va = link.r_va + pos
        remote = not link.local_node
        if data is not None and data.nbytes:
            status = qp._post(WR_RDMA_WRITE, local=data, remote_addr=va + 64, rkey=link.r_key,
                              signaled=False)
            if status not in (None, _nic.OK):
                return status
        return qp._post(WR_RDMA_WRITE_WITH_IMM, wr_id=wr_id, local=header, remote_addr=va,
                        rkey=link.r_key, imm=DATA << 32, signaled=remote and wr_id != 0)

    def _write_credit(self, link, value):
        link.qp._post(WR_RDMA_WRITE_WITH_IMM, local=value, remote_addr=link.c_va,
                          rkey=link.c_key, imm=CREDIT << 32, signaled=False)

    def _poll(self) -> bool:
        wcs = self._cq._poll(1 << 30)
        for wc in wcs:
            if wc.opcode == WC_RECV_RDMA_WITH_IMM:
                self._by_peer[wc.src].qp._post_recv(0)
                self._on_arrival(wc.src, wc.imm_data)
            elif wc.ok:
                self._on_sent(wc.wr_id, _nic.OK)
            else:
                link = self._by_peer.get(wc.src)
                if link is not None and link.closed is None:
                    self._link_failed(link, f"its rdma write failed: {wc.status} ({wc.detail})")
        return bool(wcs)

    def capabilities(self) -> Capabilities:
        """One-sided access (windows) is its own; no eager channel, no registered memory."""
        return Capabilities(one_sided=self, describe=self.describe,
                            device_job_id=self.device.job_id)

    # ----------------------------------------------------------- one-sided RMA for windows
    def rma_expose(self, nbytes: int, name: str):
        return _RdmaExposure(self, nbytes)

    def rma_attach(self, peer: int, descriptor: bytes, channel: int):
        return _RdmaChannel(self, peer, descriptor, channel)


class _RdmaExposure:
    """A window's local memory: one region with remote read, write and atomic access."""

    def __init__(self, t: RdmaTransport, nbytes: int):
        self.t = t
        self.mr = t.nic.reg_mr(nbytes, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE |
                               ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC)
        self.u8 = self.mr.buf
        self.descriptor = np.array([self.mr.addr, self.mr.rkey], dtype=np.int64).tobytes()

    def seal(self) -> None:
        """Nothing to unlink: the arena's name went at setup."""

    def close(self) -> None:
        if self.mr is not None:
            self.u8 = None
            self.t.nic.dereg_mr(self.mr)
            self.mr = None


class _RdmaChannel(ChannelBase):
    """A window's access to one target: one QP and CQ; WRITE is posted (completed by
    ``flush``), READ and atomics wait for their completion. An error completion raises
    ``RMAError`` naming the verbs status, and resets the QP."""
    mapped = False
    native_atomics = True     # FETCH_AND_ADD and CMP_AND_SWP verbs
    native_swap = False       # verbs have no swap: the window loops on CAS

    def __init__(self, t: RdmaTransport, peer: int, descriptor: bytes, channel: int):
        self.t, self.peer = t, peer
        self.base, self.rkey = (int(v) for v in np.frombuffer(descriptor, dtype=np.int64))
        self.cq = t.nic.create_cq()
        self.qp = t.nic.create_qp(peer, channel, self.cq)
        self._posted = []             # arrays of puts in flight (kept alive until flushed)
        self.timeout = 60.0

    def _wait(self, what: str):
        wcs = self.cq.poll(1)
        if not wcs:
            wcs = self.cq.wait(self.timeout, 1, peer=self.peer)
        wc = wcs[0]
        if not wc.ok:
            # reset the QP, let what is still in flight finish (reported flushed) and drop
            # those completions, so the next operation starts from an empty CQ
            self.qp.reset()
            self._posted.clear()
            qp = self.qp
            self.t.wait_for(lambda: qp.outstanding == 0, self.peer, "rdma window",
                            "in-flight requests", self.timeout)
            self.cq.poll(1 << 30)
            raise _error(what, wc, self.peer)
        return wc

    def put(self, off: int, src: np.ndarray) -> None:
        self.qp.post_send(WR_RDMA_WRITE, wr_id=1, local=src, remote_addr=self.base + off,
                          rkey=self.rkey)
        self._posted.append(src)
        if len(self._posted) >= 256:
            self.flush()

    def get(self, off: int, dst: np.ndarray) -> None:
        self.flush()                  # a READ after our own WRITEs sees them (same QP order)
        self.qp.post_send(WR_RDMA_READ, wr_id=2, local=dst, remote_addr=self.base + off,
                          rkey=self.rkey)
        self._wait("get")

    def fadd(self, off: int, value: int) -> int:
        self.flush()
        self.qp.post_send(WR_ATOMIC_FETCH_AND_ADD, wr_id=3, remote_addr=self.base + off,
                          rkey=self.rkey, compare_add=int(value))
        return self._wait("fetch-and-add").value

    def cas(self, off: int, compare: int, swap: int) -> int:
        self.flush()
        self.qp.post_send(WR_ATOMIC_CMP_AND_SWP, wr_id=4, remote_addr=self.base + off,
                          rkey=self.rkey, compare_add=int(compare), swap=int(swap))
        return self._wait("compare-and-swap").value

    def flush(self) -> None:
        while self._posted:
            self._wait("put")
            self._posted.pop(0)

    def peer_gone(self) -> Optional[str]:
        """Why this channel's peer is known gone, or None while it is up (nic.Device.peer_gone)."""
        with self.t._lock:
            return self.t.device.peer_gone(self.peer)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.t.nic.destroy_qp(self.qp)


def _error(what: str, wc: WorkCompletion, peer: int) -> RMAError:
    e = RMAError(f"rdma {what} at rank {peer}: IBV_WC_{wc.status} -- {wc.detail}")
    e.status = wc.status
    return e
