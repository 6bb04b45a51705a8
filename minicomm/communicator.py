"""The public communicator: validation, algorithm choice, sequence tags, async work, split.

Every collective goes the same way:
  validate the arguments locally (TypeError / ValueError before anything is sent)
  -> choose the family (per-call ``algorithm=``, else ``MINICOMM_ALGO``, else the α-β model)
  -> take the next sequence number (every rank of the communicator takes the same one)
  -> optionally exchange call fingerprints (``check="full"``: every rank learns of a mismatch)
  -> fetch the cached plan for (collective, family, count, root) and run it through the transport
Every message of the call carries (communicator id, sequence number, step, packed signature,
count), so a rank that disagrees on the call is detected from the first header it receives.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import cloudpickle
import numpy as np

from . import ops as _ops
from .algorithms import FAMILIES, build_schedule
from .cost import LinkModel, choose, parse_algo_env
from .errors import CommError, CommTimeout, MismatchError, PeerFailure, describe_call, pack_call
from .executor import Plan, run_plan
from .schedule import ROOTED
from .transports.base import Tag

DEFAULT_TIMEOUT = 300.0
_new_tag = tuple.__new__               # Tag(...) without the namedtuple's Python-level __new__
_P2P_CONTEXT = 1 << 40        # p2p traffic of communicator c uses context c | _P2P_CONTEXT
_P2P_HEADER = 256             # bytes of the header message that precedes every send()


class Work:
    """Handle of an ``async_op=True`` call: ``wait(timeout=None)`` returns its result."""

    def __init__(self, description: str):
        self.description = description
        self._event = threading.Event()
        self._result = None
        self._error: Optional[BaseException] = None

    def _finish(self, result=None, error: Optional[BaseException] = None):
        self._result, self._error = result, error
        self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None):
        if not self._event.wait(timeout):
            raise CommTimeout(f"{self.description} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    result = wait


class _InPlace(np.ndarray):
    """An input that lies inside the output's memory, ``shift`` elements from its start
    (``in[i]`` is ``out[i + shift]``): see ``Communicator._separate``."""
    shift = 0


class _Call:
    """What ``_prepare`` derives from a call's signature (see there)."""
    __slots__ = ("coll", "algo", "call", "plan", "kernel", "rooted", "label", "requested")

    def __init__(self, coll, algo, call, plan, kernel, rooted, label, requested):
        self.coll, self.algo, self.call, self.plan, self.kernel = coll, algo, call, plan, kernel
        self.rooted, self.label, self.requested = rooted, label, requested


class Communicator:
    """A group of ranks that run collectives together. Create with ``mc.spawn`` or ``mc.init``."""

    def __init__(self, transport, rank: int, size: int, *, group: Optional[Sequence[int]] = None,
                 topology: Optional[Sequence[int]] = None, comm_id: int = 1,
                 timeout: Optional[float] = None, check: Optional[str] = None,
                 link_model: Optional[LinkModel] = None, _owner: bool = True):
        self.transport = transport
        self.rank, self.size = rank, size
        self.group = tuple(group) if group is not None else tuple(range(size))
        topo = tuple(topology) if topology is not None else (0,) * size
        # Node ids renumbered 0..k-1 in order of first appearance, so every rank agrees.
        remap: Dict[int, int] = {}
        self.topology = tuple(remap.setdefault(t, len(remap)) for t in topo)
        self.comm_id = comm_id
        env_timeout = os.environ.get("MINICOMM_TIMEOUT")
        self.timeout = float(timeout if timeout is not None else env_timeout or DEFAULT_TIMEOUT)
        debug = os.environ.get("MINICOMM_DEBUG", "").lower()
        self.debug_info = debug in ("info", "detail")
        # "header": tags checked on every message, plus a fingerprint exchange before rooted
        # collectives; "full" (MINICOMM_DEBUG=detail): a fingerprint exchange before every call.
        self.check = check or ("full" if debug == "detail" else "header")
        self._calls: Dict[Tuple, _Call] = {}
        self.link_model = link_model or LinkModel.for_transports("shm", "tcp")
        self._algo_env = parse_algo_env()
        self._owner = _owner
        self._seq = 0
        self._split_count = 0
        self._p2p_sent: Dict[int, int] = {}
        self._p2p_recvd: Dict[int, int] = {}
        self._plans: Dict[Tuple, Plan] = {}
        self._scratch: Dict[np.dtype, np.ndarray] = {}
        self._lock = threading.RLock()
        self._queue: "queue.Queue" = queue.Queue()
        self._pending = 0
        self._worker: Optional[threading.Thread] = None
        self._closed = False
        self.node = self.topology[rank]
        self.num_nodes = len(set(self.topology))
        same = [r for r in range(size) if self.topology[r] == self.node]
        self.local_rank, self.local_size = same.index(rank), len(same)

    def __repr__(self):
        return (f"<Communicator rank {self.rank}/{self.size} node {self.node}/{self.num_nodes} "
                f"transport={getattr(self.transport, 'name', '?')} id={self.comm_id}>")

    @property
    def link_model(self) -> LinkModel:
        return self._link_model

    @link_model.setter
    def link_model(self, model: LinkModel) -> None:
        self._link_model = model
        self._calls.clear()           # cached algorithm choices followed the old model

    # ------------------------------------------------------------------ infrastructure
    def _log(self, msg: str) -> None:
        if self.debug_info:
            print(f"[minicomm rank {self.group[self.rank]}] {msg}", file=sys.stderr, flush=True)

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _resolve_algorithm(self, coll: str, algorithm: Optional[str], nbytes: int) -> str:
        if algorithm is None or algorithm == "auto":
            fam = self._algo_env.get(coll)
            if fam is None:
                return choose(coll, self.size, nbytes, self.topology, self.link_model)
            algorithm = fam
        if algorithm not in FAMILIES:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of "
                             f"{', '.join(FAMILIES)} or 'auto'")
        return algorithm

    def _plan(self, coll: str, algo: str, count: int, root: int) -> Plan:
        key = (coll, algo, count, root)
        plan = self._plans.get(key)
        if plan is None:
            topo = self.topology if algo == "hier" else None
            sched = build_schedule(coll, algo, self.rank, self.size, count, root, topo)
            plan = Plan(sched, self.group)
            if len(self._plans) > 1024:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _tmp(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype=dtype)
            self._scratch[dtype] = buf
        return buf[:count]

    def _submit(self, description: str, fn, async_op: bool):
        """Run ``fn`` now (sync) or on this communicator's worker thread (async), keeping the
        program order of calls: a sync call issued after async ones waits for them."""
        if self._closed:
            raise CommError(f"{description}: communicator is closed")
        if not async_op:
            if self._pending == 0:
                with self._lock:
                    return fn()
            work = self._enqueue(description, fn)
            return work.wait()
        return self._enqueue(description, fn)

    def _enqueue(self, description: str, fn) -> Work:
        work = Work(description)
        with self._lock:
            self._pending += 1
        if self._worker is None:
            self._worker = threading.Thread(target=self._work_loop, daemon=True,
                                            name=f"minicomm-comm{self.comm_id}-r{self.rank}")
            self._worker.start()
        self._queue.put((work, fn))
        return work

    def _work_loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, fn = item
            try:
                with self._lock:
                    result = fn()
                work._finish(result)
            except BaseException as e:   # delivered to whoever waits on the handle
                work._finish(error=e)
            finally:
                with self._lock:
                    self._pending -= 1

    def _fingerprint_check(self, call: int, count: int, shape: Tuple[int, ...]) -> None:
        """check='full': every rank learns whether all ranks make the same call, before any data
        moves — a fixed-size allgather, so it cannot itself mismatch."""
        mine = np.array([call, count, zlib.crc32(repr(tuple(shape)).encode())], dtype=np.int64)
        seq = self._next_seq()
        everyone = np.empty(3 * self.size, dtype=np.int64)
        plan = self._plan("allgather", "rhd", 3, 0)
        tag = Tag(self.comm_id, seq, 0, pack_call("fingerprint", "none", "none", np.int64, -1), 3)
        bufs = (mine, everyone, self._tmp(np.dtype(np.int64), plan.tmp_count))
        run_plan(plan, self.transport, bufs, _ops.get_kernel("sum"), tag, self._deadline(),
                 f"fingerprint check of call #{seq + 1}")
        rows = everyone.reshape(self.size, 3)
        bad = [r for r in range(self.size) if not np.array_equal(rows[r], mine)]
        if bad:
            theirs = Tag(0, 0, 0, int(rows[bad[0]][0]), int(rows[bad[0]][1]))
            me = Tag(0, 0, 0, call, count)
            extra = "" if rows[bad[0]][:2].tolist() != mine[:2].tolist() else " (different shapes)"
            raise MismatchError(f"ranks disagree on call #{seq + 1}: rank {bad[0]} called "
                                f"{describe_call(theirs)}{extra}, rank {self.rank} called "
                                f"{describe_call(me)}; mismatched ranks: {bad}")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _prepare(self, coll: str, op: str, algorithm: Optional[str], dtype: np.dtype,
                 count: int, root: int) -> "_Call":
        """Everything about a call that its arguments determine, computed once per signature:
        calls repeat, and choosing, packing and plan lookup cost more than a small message."""
        key = (coll, op, algorithm, dtype, count, root)
        c = self._calls.get(key)
        if c is None:
            algo = self._resolve_algorithm(coll, algorithm, count * dtype.itemsize)
            c = _Call(
                coll=coll, algo=algo,
                call=pack_call(coll, op, algo, dtype, root if coll in ROOTED else -1),
                plan=self._plan(coll, algo, count, root),
                kernel=_ops.get_kernel(op) if op != "none" else None,
                rooted=coll in ROOTED,
                # what wait_all names in errors (they add the step and the call's number)
                label=f"{coll} ({algo})", requested=algorithm not in (None, "auto"))
            if len(self._calls) > 1024:
                self._calls.clear()
            self._calls[key] = c
        return c

    def _execute(self, coll: str, inb: np.ndarray, outb: np.ndarray, count: int, op: str,
                 root: int, algorithm: Optional[str], shape: Tuple[int, ...],
                 fingerprint: bool = True) -> None:
        dtype = outb.dtype if outb is not None else inb.dtype
        c = self._calls.get((coll, op, algorithm, dtype, count, root)) \
            or self._prepare(coll, op, algorithm, dtype, count, root)
        self._run_call(c, inb, outb, count, shape, fingerprint)

    def _run_call(self, c: "_Call", inb: np.ndarray, outb: np.ndarray, count: int,
                  shape: Tuple[int, ...], fingerprint: bool = True) -> None:
        # Headers catch a disagreement whenever the disagreeing ranks exchange a message. Ranks
        # that disagree on the *root* may never do so (each "root" only sends): rooted calls
        # therefore always exchange fingerprints first; check="full" does it for every call.
        if fingerprint and self.size > 1 and (c.rooted or self.check == "full"):
            self._fingerprint_check(c.call, count, shape)
        self._seq += 1
        seq = self._seq
        if self.debug_info:
            self._log(f"{c.coll} #{seq} count={count} dtype={outb.dtype} -> {c.algo} "
                      f"({'requested' if c.requested else 'auto'})")
        plan = c.plan
        if inb is outb:
            if not plan.alias_safe(0):
                inb = inb.copy()
        elif inb.__class__ is _InPlace:
            inb = inb.view(np.ndarray) if plan.alias_safe(inb.shift) else np.array(inb)
        n = plan.tmp_count
        tmp = self._scratch.get(outb.dtype)
        if tmp is None or tmp.size < n:
            tmp = self._tmp(outb.dtype, n)
        try:
            run_plan(plan, self.transport, (inb, outb, tmp[:n]), c.kernel,
                     _new_tag(Tag, (self.comm_id, seq, 0, c.call, count)),
                     time.monotonic() + self.timeout, c.label)
        except MismatchError as e:
            # Peers may be blocked on us: make them fail now with the same verdict.
            self.transport.abort(f"MismatchError: {e}")
            raise
        except PeerFailure as e:
            if "MismatchError:" in str(e):     # a peer detected the mismatch and aborted
                raise MismatchError(str(e)) from e
            raise

    # ------------------------------------------------------------------ argument helpers
    @staticmethod
    def _flat_in(x) -> Tuple[np.ndarray, np.ndarray]:
        if type(x) is np.ndarray and x.ndim == 1 and x.flags.c_contiguous \
                and x.dtype.kind in "biufc":
            return x, x                       # the common case: nothing to convert
        arr = np.asarray(x)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"minicomm moves numeric and bool arrays, got dtype {arr.dtype}")
        return arr, np.ascontiguousarray(arr).reshape(-1)

    @staticmethod
    def _make_out(out, shape, dtype, name: str) -> Tuple[np.ndarray, np.ndarray]:
        if out is None:
            res = np.empty(shape, dtype=dtype)
            return res, (res if len(shape) == 1 else res.reshape(-1))
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{name}: out= must be a numpy array")
        if out.shape != tuple(shape) or out.dtype != dtype:
            raise ValueError(f"{name}: out= has shape {out.shape} dtype {out.dtype}, needs "
                             f"{tuple(shape)} {dtype}")
        if not out.flags.c_contiguous:
            raise ValueError(f"{name}: out= must be C-contiguous")
        return out, (out if out.ndim == 1 else out.reshape(-1))

    def _check_root(self, root: int, name: str) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"{name}: root {root!r} is not a rank of this communicator "
                             f"(size {self.size})")
        return int(root)

    def _blocked(self, arr: np.ndarray, name: str) -> Tuple[int, ...]:
        if arr.ndim == 0 or arr.shape[0] != self.size:
            raise ValueError(f"{name}: input must have shape (size={self.size}, ...), got {arr.shape}")
        return arr.shape[1:]

    @staticmethod
    def _separate(inflat: np.ndarray, outflat: np.ndarray, out) -> np.ndarray:
        """``inflat``, or a copy of it if it overlaps ``outflat``: schedules never write 'in' but
        may read it after writing 'out'. ``out`` is the caller's out= (None: ``outflat`` is a
        fresh array, which cannot overlap). An in-place call (``in`` is ``out``, or lies at a
        whole-element offset in the same memory) returns ``outflat`` itself or an ``_InPlace``
        view: ``_run_call`` copies it only if the plan is not ``alias_safe`` at that offset."""
        if out is None or inflat is outflat:
            return inflat
        # both are contiguous and 1-D here, so overlapping bounds mean shared memory
        if not np.may_share_memory(inflat, outflat):
            return inflat
        diff = inflat.__array_interface__["data"][0] - outflat.__array_interface__["data"][0]
        if inflat.dtype == outflat.dtype and diff % inflat.itemsize == 0:
            if diff == 0 and inflat.size == outflat.size:
                return outflat
            view = inflat.view(_InPlace)
            view.shift = diff // inflat.itemsize
            return view
        return inflat.copy()

    def _finish_avg(self, op: str, outflat: np.ndarray) -> None:
        if op == _ops.AVG:
            outflat /= self.size

    # ------------------------------------------------------------------ collectives
    def allreduce(self, x, op="sum", algorithm="auto", out=None, async_op=False):
        # The hot case: a 1-D contiguous array whose call signature ran before (so op and dtype
        # were validated then), a synchronous call with nothing queued. Same steps as below,
        # minus the generic argument handling and the closure.
        if not async_op and type(x) is np.ndarray and not self._pending and x.ndim == 1 \
                and x.flags.c_contiguous and not self._closed:
            c = self._calls.get(("allreduce", op, algorithm, x.dtype, x.size, 0))
            if c is not None:
                if out is None:
                    res, inb = np.empty(x.size, x.dtype), x
                elif type(out) is np.ndarray and out.shape == x.shape and out.dtype == x.dtype \
                        and out.flags.c_contiguous:
                    res, inb = out, self._separate(x, out, out)
                else:
                    res = None                # let the general path explain what is wrong
                if res is not None:
                    with self._lock:
                        self._run_call(c, inb, res, x.size, x.shape)
                    if op == _ops.AVG:
                        res /= self.size
                    return res
        op = _ops.normalize(op)
        arr, inflat = self._flat_in(x)
        _ops.check_dtype(op, arr.dtype)
        res, outflat = self._make_out(out, arr.shape, arr.dtype, "allreduce")
        inflat = self._separate(inflat, outflat, out)

        def run():
            self._execute("allreduce", inflat, outflat, inflat.size, op, 0, algorithm, arr.shape)
            self._finish_avg(op, outflat)
            return res
        return self._submit("allreduce", run, async_op)

    def reduce(self, x, root=0, op="sum", algorithm="auto", out=None, async_op=False):
        op = _ops.normalize(op)
        root = self._check_root(root, "reduce")
        arr, inflat = self._flat_in(x)
        _ops.check_dtype(op, arr.dtype)
        if self.rank == root:
            res, outflat = self._make_out(out, arr.shape, arr.dtype, "reduce")
        else:
            res, outflat = None, np.empty(inflat.size, dtype=arr.dtype)
        inflat = self._separate(inflat, outflat, out)

        def run():
            self._execute("reduce", inflat, outflat, inflat.size, op, root, algorithm, arr.shape)
            if res is not None:
                self._finish_avg(op, outflat)
            return res
        return self._submit("reduce", run, async_op)

    def broadcast(self, x, root=0, algorithm="auto", out=None, async_op=False):
        root = self._check_root(root, "broadcast")
        arr, inflat = self._flat_in(x)
        res, outflat = self._make_out(out, arr.shape, arr.dtype, "broadcast")
        inflat = self._separate(inflat, outflat, out) if self.rank == root else inflat

        def run():
            self._execute("broadcast", inflat, outflat, inflat.size, "none", root, algorithm, arr.shape)
            return res
        return self._submit("broadcast", run, async_op)

    def allgather(self, x, algorithm="auto", out=None, async_op=False):
        arr, inflat = self._flat_in(x)
        res, outflat = self._make_out(out, (self.size,) + arr.shape, arr.dtype, "allgather")
        inflat = self._separate(inflat, outflat, out)

        def run():
            self._execute("allgather", inflat, outflat, inflat.size, "none", 0, algorithm, arr.shape)
            return res
        return self._submit("allgather", run, async_op)

    def gather(self, x, root=0, algorithm="auto", out=None, async_op=False):
        root = self._check_root(root, "gather")
        arr, inflat = self._flat_in(x)
        if self.rank == root:
            res, outflat = self._make_out(out, (self.size,) + arr.shape, arr.dtype, "gather")
        else:
            res, outflat = None, np.empty(self.size * inflat.size, dtype=arr.dtype)
        inflat = self._separate(inflat, outflat, out)

        def run():
            self._execute("gather", inflat, outflat, inflat.size, "none", root, algorithm, arr.shape)
            return res
        return self._submit("gather", run, async_op)

    def reduce_scatter(self, x, op="sum", algorithm="auto", out=None, async_op=False):
        op = _ops.normalize(op)
        arr, inflat = self._flat_in(x)
        _ops.check_dtype(op, arr.dtype)
        block = self._blocked(arr, "reduce_scatter")
        res, outflat = self._make_out(out, block, arr.dtype, "reduce_scatter")
        inflat = self._separate(inflat, outflat, out)
        count = inflat.size // self.size

        def run():
            self._execute("reduce_scatter", inflat, outflat, count, op, 0, algorithm, arr.shape)
            self._finish_avg(op, outflat)
            return res
        return self._submit("reduce_scatter", run, async_op)

    def alltoall(self, x, algorithm="auto", out=None, async_op=False):
        arr, inflat = self._flat_in(x)
        self._blocked(arr, "alltoall")
        res, outflat = self._make_out(out, arr.shape, arr.dtype, "alltoall")
        inflat = self._separate(inflat, outflat, out)
        count = inflat.size // self.size

        def run():
            self._execute("alltoall", inflat, outflat, count, "none", 0, algorithm, arr.shape)
            return res
        return self._submit("alltoall", run, async_op)

    def scatter(self, x, root=0, algorithm="auto", out=None, async_op=False):
        """Root's x has shape (size, *s); every rank returns its block x[rank] of shape s.
        Other ranks' x is ignored (None is fine): they learn shape and dtype from the root."""
        root = self._check_root(root, "scatter")
        if self.rank == root:
            arr, inflat = self._flat_in(x)
            self._blocked(arr, "scatter")
            meta = _encode_meta(arr.dtype, arr.shape[1:])
        else:
            meta = np.zeros(_META_WORDS, dtype=np.int64)

        def run():
            m = np.empty(_META_WORDS, dtype=np.int64)
            self._execute("broadcast", meta, m, _META_WORDS, "none", root, "tree", (_META_WORDS,))
            dtype, block = _decode_meta(m)
            res, outflat = self._make_out(out, block, dtype, "scatter")
            count = outflat.size
            if self.rank == root:
                src = self._separate(inflat, outflat, out)
            else:
                src = np.empty(0, dtype=dtype)
            shape = (self.size,) + tuple(block)
            # the metadata broadcast above already proved every rank agrees on the root
            self._execute("scatter", src, outflat, count, "none", root, algorithm, shape,
                          fingerprint=False)
            return res
        return self._submit("scatter", run, async_op)

    def barrier(self, algorithm="auto", async_op=False):
        empty = np.empty(0, dtype=np.uint8)

        def run():
            self._execute("barrier", empty, empty, 0, "none", 0, algorithm, ())
        return self._submit("barrier", run, async_op)

    # ------------------------------------------------------------------ point to point
    def _p2p_tag(self, seq: int, tag: int, nbytes: int) -> Tag:
        return Tag(self.comm_id | _P2P_CONTEXT, seq, tag, pack_call("p2p", "none", "none", None, tag),
                   nbytes)

    def send(self, x, dst: int, tag: int = 0) -> None:
        arr, flat = self._flat_in(x)
        dst = self._check_root(dst, "send")
        header = np.zeros(_P2P_HEADER, dtype=np.uint8)
        desc = f"{arr.dtype.str};{','.join(map(str, arr.shape))}".encode()
        if len(desc) > _P2P_HEADER:
            raise ValueError(f"send: array of {arr.ndim} dimensions is too many")
        header[:len(desc)] = np.frombuffer(desc, dtype=np.uint8)

        def run():
            seq = self._p2p_sent.get(dst, 0) + 1
            self._p2p_sent[dst] = seq
            peer = self.group[dst]
            what = f"send to rank {dst} (tag {tag})"
            reqs = [self.transport.isend(peer, header, self._p2p_tag(seq, tag, _P2P_HEADER))]
            reqs.append(self.transport.isend(peer, flat.view(np.uint8),
                                             self._p2p_tag(seq, tag, flat.nbytes)))
            self.transport.wait_all(reqs, self._deadline(), what)
        return self._submit("send", run, False)

    def recv(self, src: int, tag: int = 0, out=None):
        src = self._check_root(src, "recv")

        def run():
            seq = self._p2p_recvd.get(src, 0) + 1
            self._p2p_recvd[src] = seq
            peer = self.group[src]
            what = f"recv from rank {src} (tag {tag})"
            header = np.empty(_P2P_HEADER, dtype=np.uint8)
            self.transport.wait_all(
                [self.transport.irecv(peer, header, self._p2p_tag(seq, tag, _P2P_HEADER))],
                self._deadline(), what)
            dstr, _, shp = header.tobytes().rstrip(b"\0").decode().partition(";")
            shape = tuple(int(s) for s in shp.split(",") if s)
            res, flat = self._make_out(out, shape, np.dtype(dstr), "recv")
            self.transport.wait_all(
                [self.transport.irecv(peer, flat.view(np.uint8), self._p2p_tag(seq, tag, flat.nbytes))],
                self._deadline(), what)
            return res
        return self._submit("recv", run, False)

    # ------------------------------------------------------------------ objects (cloudpickle)
    def broadcast_object(self, obj=None, root=0):
        root = self._check_root(root, "broadcast_object")
        data = _pickle(obj) if self.rank == root else np.empty(0, dtype=np.uint8)
        n = self.broadcast(np.array([data.size], dtype=np.int64), root=root, algorithm="tree")
        buf = data if self.rank == root else np.empty(int(n[0]), dtype=np.uint8)
        return _unpickle(self.broadcast(buf, root=root))

    def allgather_object(self, obj) -> List[Any]:
        data = _pickle(obj)
        sizes = self.allgather(np.array([data.size], dtype=np.int64))[:, 0]
        padded = np.zeros(int(sizes.max()), dtype=np.uint8)
        padded[:data.size] = data
        rows = self.allgather(padded)
        return [_unpickle(rows[r, :sizes[r]]) for r in range(self.size)]

    def gather_object(self, obj, root=0):
        root = self._check_root(root, "gather_object")
        data = _pickle(obj)
        sizes = self.allgather(np.array([data.size], dtype=np.int64))[:, 0]
        padded = np.zeros(int(sizes.max()), dtype=np.uint8)
        padded[:data.size] = data
        rows = self.gather(padded, root=root)
        if rows is None:
            return None
        return [_unpickle(rows[r, :sizes[r]]) for r in range(self.size)]

    def scatter_object(self, objs=None, root=0):
        root = self._check_root(root, "scatter_object")
        if self.rank == root:
            if objs is None or len(objs) != self.size:
                raise ValueError(f"scatter_object: root needs a sequence of {self.size} objects")
            blobs = [_pickle(o) for o in objs]
            width = max(b.size for b in blobs)
            table = np.zeros((self.size, width + 8), dtype=np.uint8)
            for r, b in enumerate(blobs):
                table[r, :8] = np.frombuffer(np.int64(b.size).tobytes(), dtype=np.uint8)
                table[r, 8:8 + b.size] = b
        else:
            table = None
        row = self.scatter(table, root=root)
        n = int(np.frombuffer(row[:8].tobytes(), dtype=np.int64)[0])
        return _unpickle(row[8:8 + n])

    def send_object(self, obj, dst: int, tag: int = 0) -> None:
        self.send(_pickle(obj), dst, tag)

    def recv_object(self, src: int, tag: int = 0):
        return _unpickle(self.recv(src, tag))

    # ------------------------------------------------------------------ groups
    def split(self, color, key=None) -> Optional["Communicator"]:
        """MPI_Comm_split: ranks with the same color form a communicator, ordered by (key, rank).
        color None or negative (MPI_UNDEFINED) -> this rank gets None."""
        self._split_count += 1
        k = self.rank if key is None else key
        entries = self.allgather_object((color, k, self.rank))
        if color is None or (isinstance(color, int) and color < 0):
            return None
        members = sorted((kk, r) for c, kk, r in entries if c == color)
        ranks = [r for _, r in members]
        sub_id = zlib.crc32(repr((self.comm_id, self._split_count, color)).encode()) & 0xFFFFFFFF
        sub_id = (sub_id << 8 | 2) & (_P2P_CONTEXT - 1)
        return Communicator(self.transport, ranks.index(self.rank), len(ranks),
                            group=[self.group[r] for r in ranks],
                            topology=[self.topology[r] for r in ranks], comm_id=sub_id,
                            timeout=self.timeout, check=self.check, link_model=self.link_model,
                            _owner=False)

    def close(self) -> None:
        if self._closed:
            return
        if self._worker is not None:
            # let queued async work finish first (bounded by each call's own deadline)
            self._queue.put(None)
            self._worker.join(self.timeout)
        self._closed = True
        if self._owner:
            self.transport.close()
            # the world communicator of a launched process also owns its rendezvous connection
            for res in (getattr(self, "_store", None), getattr(self, "_store_server", None)):
                if res is not None:
                    res.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_META_WORDS = 16


def _encode_meta(dtype: np.dtype, shape: Tuple[int, ...]) -> np.ndarray:
    if len(shape) > _META_WORDS - 3:
        raise ValueError(f"arrays of more than {_META_WORDS - 2} dimensions are not supported")
    m = np.zeros(_META_WORDS, dtype=np.int64)
    code = np.dtype(dtype).str.encode().ljust(8, b"\0")
    m[0] = np.frombuffer(code, dtype=np.int64)[0]
    m[1] = len(shape)
    m[2:2 + len(shape)] = shape
    return m


def _decode_meta(m: np.ndarray) -> Tuple[np.dtype, Tuple[int, ...]]:
    dtype = np.dtype(m[:1].tobytes().rstrip(b"\0").decode())
    nd = int(m[1])
    return dtype, tuple(int(v) for v in m[2:2 + nd])


def _pickle(obj) -> np.ndarray:
    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)


def _unpickle(arr: np.ndarray):
    return cloudpickle.loads(arr.tobytes())
