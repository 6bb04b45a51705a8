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

import functools
import itertools
import math
import numbers
import queue
import sys
import threading
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import cloudpickle
import numpy as np

from . import ops as _ops
from . import settings
from .algorithms import FAMILIES, build_schedule
from .cost import LinkModel, choose, parse_algo_env
from .errors import (
    CommError,
    CommTimeout,
    MismatchError,
    PeerFailure,
    describe_call,
    fingerprint_call,
    pack_call,
)
from .executor import LazyCheck, Plan, run_plan
from .p2p import ANY_SOURCE, ANY_TAG, MAX_TAG, P2PEngine, Status
from .schedule import ROOTED
from .settings import env_debug, env_flag, env_timeout, timeout_arg
from .smallpath import SMALL_SPIN_S, Guard, compile_small, eligible, straight_line
from .transports.base import ABORT_CALL, ABORT_KINDS, Tag
from .window import Window

DEFAULT_TIMEOUT = settings.DEFAULT_TIMEOUT
_SCATTER_META = "scatter:meta"     # scatter's header exchange (errors.COLLECTIVE_CODES)
# MINICOMM_SMALL_PATH=0: every call runs through the executor (minicomm.smallpath's A/B switch)
_SMALL_OFF = not env_flag("MINICOMM_SMALL_PATH", True)
_new_tag = tuple.__new__               # Tag(...) without the namedtuple's Python-level __new__
_U8 = np.dtype(np.uint8)
_EMPTY = np.empty(0, dtype=np.uint8)   # barrier's buffers (never written: zero elements)
_get_ident = threading.get_ident
_monotonic = time.monotonic
_HOT_TMP_BYTES = 64 << 10              # a hot call keeps its own scratch up to this size
_MISS = object()                      # Communicator._quick: not the hot case
_SAME, _STACKED, _BLOCKS, _ALL_BLOCKS = 0, 1, 2, 3   # ... and its layouts of x and out

# Context ids (Tag.comm). A communicator has a number, ``comm_id``, unique among the
# communicators that share a transport; its collectives travel on context ``comm_id << 2`` and its
# point-to-point messages on ``comm_id << 2 | 1``. Numbers: the world is 1; numbers below
# ``_SPLIT_BASE`` are reserved for internal pairs (link measurement); split() numbers are
# allocated by the lowest rank of each new group from its own counter, as
# ``(world rank + 1) << 24 | counter``, and broadcast to the group: unique without a hash.
WORLD_ID = 1
_SPLIT_BASE = 1 << 24
_COLL, _P2P = 0, 1
_id_counter = itertools.count(1)


def context(comm_id: int, kind: int) -> int:
    return comm_id << 2 | kind


def _serialized(name: str):
    """Run a public method inside the communicator's one-thread-at-a-time guard."""
    def deco(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            self._enter(name)
            try:
                return method(self, *args, **kwargs)
            finally:
                self._exit()
        return wrapper
    return deco


class Work:
    """Handle of an ``async_op=True`` collective, an ``isend`` or an ``irecv``:
    ``wait(timeout=None)`` returns its result (or raises its error); ``is_completed()``.
    An ``irecv``'s ``status`` tells the source and tag it matched."""

    def __init__(self, description: str, drive=None):
        self.description = description
        self._event = threading.Event()
        self._result = None
        self._error: Optional[BaseException] = None
        self._drive = drive           # p2p: moves the messages, in the waiting thread
        self.status: Optional[Status] = None

    def _finish(self, result=None, error: Optional[BaseException] = None):
        self._result, self._error = result, error
        self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None):
        if self._drive is not None and not self._event.is_set():
            self._drive(timeout)
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
    __slots__ = ("coll", "algo", "call", "plan", "kernel", "rooted", "label", "requested",
                 "small", "hot", "tmp", "alias0", "count", "run", "run_guarded")

    def __init__(self, coll, algo, call, plan, kernel, rooted, label, requested, small=None,
                 hot=False, dtype=None, count=0, exchange=False):
        self.coll, self.algo, self.call, self.plan, self.kernel = coll, algo, call, plan, kernel
        self.rooted, self.label, self.requested = rooted, label, requested
        self.small = small            # the plan compiled for the small-message path, or None
        # a call on the small path runs it unrolled (smallpath.straight_line); a rooted one with
        # its fingerprint exchange (``run_guarded``), or without where that is done otherwise
        self.run = straight_line(small, exchange) if small is not None else None
        self.run_guarded = (straight_line(small, exchange, guarded=True)
                            if small is not None and rooted else None)
        # ``hot``: an unrooted such call that ``Communicator._hot`` may run, with its own
        # scratch ``tmp`` and whether its input may alias its output (``alias0``)
        self.hot, self.count = hot and self.run is not None and not rooted, count
        self.tmp = np.empty(plan.tmp_count, dtype=dtype) if self.hot else None
        self.alias0 = plan.alias_safe(0) if self.hot else False


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
        self.timeout = timeout_arg("timeout", timeout) or env_timeout()
        debug = env_debug()
        self.debug_info = debug in ("info", "detail")
        # "header": tags checked on every message, plus a fingerprint exchange before rooted
        # collectives; "full" (MINICOMM_DEBUG=detail): a fingerprint exchange before every call.
        self.check = check or ("full" if debug == "detail" else "header")
        self._calls: Dict[Tuple, _Call] = {}
        self._fingerprints: Dict[Tuple, np.ndarray] = {}
        self._scatter_headers: Dict[Tuple, Tuple] = {}      # _scatter_header_plan's, memoised
        self._scatter_metas: Dict[bytes, Tuple] = {}        # decoded scatter headers, memoised
        # False: every call runs through the executor (what the link probe times against the
        # small-message path; MINICOMM_SMALL_PATH=0 does it for the whole process)
        self.small_path = True
        self.link_model = link_model or LinkModel.for_transports("shm", "tcp")
        self._algo_env = parse_algo_env()
        self._owner = _owner
        self._ctx = context(comm_id, _COLL)
        self._seq = 0
        self._plans: Dict[Tuple, Plan] = {}
        self._scratch: Dict[np.dtype, np.ndarray] = {}
        # async work: a queue with its own lock (submitting never waits for running work) and
        # one worker thread that runs the queued calls in program order
        self._qlock = threading.Lock()
        self._queue: "queue.Queue" = queue.Queue()
        self._pending = 0
        self._worker: Optional[threading.Thread] = None
        # one user thread at a time (MPI_THREAD_SERIALIZED), checked by _enter/_exit
        self._guard = threading.Lock()
        self._busy_thread: Optional[int] = None
        self._depth = 0
        self.busy_with: Optional[str] = None     # the call that holds the guard now
        self._broken: Optional[BaseException] = None
        self._closed = False
        self._closing_error: Optional[BaseException] = None
        self._p2p = P2PEngine(transport, rank, self.group, context(comm_id, _P2P))
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
        self._forget_calls()          # cached algorithm choices followed the old model

    def _forget_calls(self) -> None:
        """Drop every call derived from a signature (``_prepare``'s, and the scatter header
        plans that hold them): the next call of each chooses and compiles again."""
        self._calls.clear()
        self._scatter_headers.clear()

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

    def _small(self, plan: Plan, dtype: np.dtype):
        """The plan compiled for the small-message path (minicomm.smallpath) if the transport
        offers it and every message of the call fits, else None."""
        limit = getattr(self.transport, "small_bytes", 0)
        if not limit or _SMALL_OFF or not eligible(plan.schedule, dtype.itemsize, limit):
            return None
        return compile_small(plan.schedule, self.group)

    def _tmp(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype=dtype)
            self._scratch[dtype] = buf
        return buf[:count]

    # ------------------------------------------------------------------ guard, errors, async
    def _enter(self, what: str) -> None:
        if self._guard.acquire(False):
            self._busy_thread = _get_ident()
            self._depth, self.busy_with = 1, what
            return
        if self._busy_thread == _get_ident():
            self._depth += 1          # a call made by a call (object collectives, split)
            return
        busy = next((t.name for t in threading.enumerate() if t.ident == self._busy_thread),
                    str(self._busy_thread))          # named only on this error path
        raise CommError(
            f"{what} called on thread {threading.current_thread().name!r} while this "
            f"communicator is in {self.busy_with} on thread {busy!r}: a communicator "
            f"is used by one thread at a time (like MPI_THREAD_SERIALIZED); give each thread its "
            f"own communicator with split(), or overlap with async_op=True")

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.busy_with, self._busy_thread = None, None
            self._guard.release()

    def _usable(self, what: str) -> None:
        if self._broken is not None:
            e = self._broken
            raise CommError(f"{what}: communicator is broken: {type(e).__name__}: {e}")
        if self._closed:
            raise CommError(f"{what}: communicator is closed")

    def _break(self, error: BaseException) -> None:
        """The first error of a collective is final (as in Gloo and NCCL): tell the peers, drop
        this communicator's posted and queued messages, and fail whatever is queued."""
        if self._broken is not None:
            return
        self._broken = error
        kind = type(error).__name__
        step = ABORT_KINDS.index(kind) if kind in ABORT_KINDS else ABORT_KINDS.index("CommError")
        notice = np.empty(0, dtype=np.uint8)
        skip = getattr(error, "peer", None)
        for r, peer in enumerate(self.group):
            if r == self.rank or peer == skip:
                continue
            try:
                self.transport.isend(peer, notice, Tag(self._ctx, -1, step, ABORT_CALL, self._seq))
            except (CommError, OSError, ValueError):
                pass                  # that link is gone: its peer learns of it anyway
        broken = CommError(f"communicator is broken: {kind}: {error}")
        self.transport.cancel_context(self._ctx, broken)
        self.transport.cancel_context(self._p2p.ctx, broken)

    def _submit(self, description: str, fn, async_op: bool):
        """Run ``fn`` now (sync) or on this communicator's worker thread (async), keeping the
        program order of calls: a sync call issued after async ones waits for them."""
        self._usable(description)
        if not async_op:
            if self._pending == 0:
                return fn()
            return self._enqueue(description, fn).wait()
        return self._enqueue(description, fn)

    def _enqueue(self, description: str, fn) -> Work:
        work = Work(description)
        with self._qlock:
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
                if self._broken is not None:
                    work._finish(error=_same_error(self._broken))
                elif self._closed and self._closing_error is not None:
                    work._finish(error=_same_error(self._closing_error))
                else:
                    work._finish(fn())
            except BaseException as e:   # delivered to whoever waits on the handle
                work._finish(error=e)
            finally:
                with self._qlock:
                    self._pending -= 1

    def _fingerprint_check(self, call: int, count: int, shape: Tuple[int, ...]) -> None:
        """check='full': every rank learns whether all ranks make the same call, before any data
        moves — a fixed-size allgather, so it cannot itself mismatch."""
        mine = np.array([call, count, zlib.crc32(repr(tuple(shape)).encode())], dtype=np.int64)
        seq = self._next_seq()
        everyone = np.empty(3 * self.size, dtype=np.int64)
        plan = self._plan("allgather", "rhd", 3, 0)
        # the tag names the checked call: a rank in another call finds out from the header
        tag = Tag(self._ctx, seq, 0, fingerprint_call(call), 3)
        bufs = (mine, everyone, self._tmp(np.dtype(np.int64), plan.tmp_count))
        run_plan(plan, self.transport, bufs, _ops.get_kernel("sum"), tag, self._deadline(),
                 f"fingerprint check of call #{seq + 1}")
        self._compare_fingerprints(everyone.reshape(self.size, 3), mine, call, count, seq)

    def _fingerprint(self, call: int, count: int, shape: Tuple[int, ...]) -> np.ndarray:
        """This rank's fingerprint of a call: (packed signature, count, crc32 of the shape),
        memoised (calls repeat; read-only, it is only ever sent and compared)."""
        key = (call, count, shape)
        mine = self._fingerprints.get(key)
        if mine is None:
            mine = np.array([call, count, zlib.crc32(repr(tuple(shape)).encode())],
                            dtype=np.int64)
            mine.flags.writeable = False
            if len(self._fingerprints) > 1024:
                self._fingerprints.clear()
            self._fingerprints[key] = mine
        return mine

    def _small_guard(self, call: int, count: int, shape: Tuple[int, ...]) -> Guard:
        """``_post_fingerprints`` for a call on the small-message path: the same messages (same
        sequence number and tag), sent and received by the compiled plan (smallpath, "Guarded
        calls")."""
        return Guard(*self._fingerprint_exchange(call, count, shape))

    def _post_fingerprints(self, call: int, count: int, shape: Tuple[int, ...],
                           plan: Plan) -> LazyCheck:
        """The fingerprint check of a rooted call without its round trip: every rank sends its
        fingerprint to every other (small eager sends) and the call's data moves at once; the
        steps' waits compare the fingerprints as they arrive and every rank compares all of them
        before the call returns, so a disagreement (on the root above all: such ranks may never
        exchange data) is still a MismatchError on every rank, where otherwise a wait would
        time out. Same sequence number and tag as ``_fingerprint_check``'s allgather.

        The sends go first: a peer may be waiting on ours. Receives from the peers ``plan``
        receives data from are posted now (their fingerprint is checked before their data is
        waited for); the others' when the call ends (``LazyCheck.later``)."""
        tag, mine, rows, check = self._fingerprint_exchange(call, count, shape)
        t, group = self.transport, self.group
        others = [r for r in range(self.size) if r != self.rank]
        sends = [t.isend(group[r], mine, tag) for r in others]   # 24 bytes: eager
        heard = plan.recv_peers
        recvs = [t.irecv(group[r], rows[r], tag) for r in others if group[r] in heard]
        later = [(group[r], rows[r], tag) for r in others if group[r] not in heard]
        return LazyCheck(recvs, check, sends, later)

    def _fingerprint_exchange(self, call: int, count: int, shape: Tuple[int, ...]):
        """What both forms of the lazy fingerprint check share: the tag (the next sequence
        number; it names the checked call), this rank's fingerprint, the rows the peers' land
        in (each holding ours until theirs arrives) and ``check()``, which compares them."""
        mine = self._fingerprint(call, count, shape)
        seq = self._next_seq()
        rows = np.empty((self.size, 3), dtype=np.int64)
        rows[:] = mine

        def check():
            self._compare_fingerprints(rows, mine, call, count, seq)
        return Tag(self._ctx, seq, 0, fingerprint_call(call), 3), mine, rows, check

    def _compare_fingerprints(self, rows: np.ndarray, mine: np.ndarray, call: int, count: int,
                              seq: int) -> None:
        if rows.tobytes() == mine.tobytes() * self.size:
            return
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
            plan = self._plan(coll, algo, count, root)
            small = self._small(plan, dtype)
            c = _Call(
                coll=coll, algo=algo,
                call=pack_call(coll, op, algo, dtype, root if coll in ROOTED else -1),
                plan=plan,
                kernel=_ops.get_kernel(op) if op != "none" else None,
                rooted=coll in ROOTED,
                # what wait_all names in errors (they add the step and the call's number)
                label=f"{coll} ({algo})", requested=algorithm not in (None, "auto"),
                small=small, dtype=dtype, count=count,
                exchange=hasattr(self.transport, "sendrecv_now"),
                hot=self.size > 1 and self.check != "full" and not self.debug_info
                and plan.tmp_count * dtype.itemsize <= _HOT_TMP_BYTES)
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
        try:
            self._run_call_unchecked(c, inb, outb, count, shape, fingerprint)
        except CommError as e:
            self._fail(e)

    def _fail(self, e: CommError):
        """A call's error is final: break the communicator and raise it (see ``_break``)."""
        if self._closing_error is not None and not isinstance(e, (MismatchError, PeerFailure)):
            e = _same_error(self._closing_error)     # woken by close() from another thread
        self._break(e)
        raise e from None

    def _hot(self, name: str, c: "_Call", inb: np.ndarray, outb: np.ndarray) -> bool:
        """``_run_call`` of a ``hot`` call (unguarded, on the small path) made synchronously by
        the thread that finds the communicator idle: the same steps with nothing recomputed.
        False (nothing done): the general path must run it."""
        if not self.small_path or inb.__class__ is _InPlace or not self._guard.acquire(False):
            return False
        self._busy_thread, self._depth, self.busy_with = _get_ident(), 1, name
        try:
            self._seq = seq = self._seq + 1
            if inb is outb and not c.alias0:
                inb = inb.copy()
            try:
                c.run((inb, outb, c.tmp), self.transport, c.kernel, self._ctx, seq, c.call,
                      c.count, _monotonic() + self.timeout, c.label, SMALL_SPIN_S)
            except CommError as e:
                self._fail(e)
        finally:
            self._depth, self.busy_with, self._busy_thread = 0, None, None
            self._guard.release()
        return True

    def _run_call_unchecked(self, c: "_Call", inb: np.ndarray, outb: np.ndarray, count: int,
                            shape: Tuple[int, ...], fingerprint: bool) -> None:
        # Headers catch a disagreement whenever the disagreeing ranks exchange a message. Ranks
        # that disagree on the *root* may never do so (each "root" only sends): rooted calls
        # therefore always exchange fingerprints first; check="full" does it for every call.
        guard = small_guard = None
        if fingerprint and self.size > 1 and (c.rooted or self.check == "full"):
            if self.check == "full":
                self._fingerprint_check(c.call, count, shape)
            elif c.small is not None and self.small_path:
                small_guard = self._small_guard(c.call, count, shape)
            else:
                guard = self._post_fingerprints(c.call, count, shape, c.plan)
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
        if c.run is not None and guard is None and self.small_path:
            # latency-bound: the compiled plan (smallpath), unrolled; a rooted call's
            # fingerprints travel with it (small_guard)
            if small_guard is None:
                c.run((inb, outb, tmp[:n]), self.transport, c.kernel, self._ctx, seq, c.call,
                      count, time.monotonic() + self.timeout, c.label, SMALL_SPIN_S)
            else:
                c.run_guarded((inb, outb, tmp[:n]), self.transport, c.kernel, self._ctx, seq,
                              c.call, count, time.monotonic() + self.timeout, c.label,
                              SMALL_SPIN_S, small_guard)
        else:
            # a guarded (rooted, lazily fingerprinted) call checks fingerprints while it waits
            run_plan(plan, self.transport, (inb, outb, tmp[:n]), c.kernel,
                     _new_tag(Tag, (self._ctx, seq, 0, c.call, count)),
                     time.monotonic() + self.timeout, c.label, guard)

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
        ib, ob = inflat.base, outflat.base
        if ib is None and ob is None:
            return inflat             # two arrays that own their memory: never the same bytes
        # views of two different arrays that own their memory (numpy points a view's base at the
        # owner): never the same bytes either, decided without np.may_share_memory (0.4 us, a
        # tenth of an 8 B allreduce at n=2)
        # (inline, not a helper: this runs on every 8 B call)
        if ib is None:
            ib = inflat
        elif ib.__class__ is not np.ndarray or ib.base is not None:
            ib = None                 # memory numpy does not own: only the full check can tell
        if ob is None:
            ob = outflat
        elif ob.__class__ is not np.ndarray or ob.base is not None:
            ob = None
        if ib is not None and ob is not None and ib is not ob:
            return inflat
        # both are contiguous and 1-D here, so overlapping bounds mean shared memory
        if not np.may_share_memory(inflat, outflat):
            return inflat
        if inflat.dtype == outflat.dtype and inflat.size == outflat.size and \
                np.may_share_memory(inflat.view(_U8)[:1], outflat.view(_U8)[:1]):
            return outflat            # the same first byte: the same array (a view of it)
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
        # minus the generic argument handling and the closure. _quick for the other collectives;
        # inlined here, where the 8 B call is a latency target (see _entry).
        if not async_op and type(x) is np.ndarray and not self._pending and x.ndim == 1 \
                and x.flags.c_contiguous and not self._closed and self._broken is None:
            c = self._calls.get(("allreduce", op, algorithm, x.dtype, x.size, 0))
            if c is not None:
                if out is None:
                    res, inb = np.empty(x.size, x.dtype), x
                elif type(out) is np.ndarray and out.shape == x.shape and out.dtype == x.dtype \
                        and out.flags.c_contiguous:
                    res, inb = out, self._separate(x, out, out)
                else:
                    res = None                # let the general path explain what is wrong
                if res is not None and c.hot and self._hot("allreduce", c, inb, res):
                    if op == _ops.AVG:
                        res /= self.size
                    return res
                if res is not None:
                    self._enter("allreduce")
                    try:
                        self._run_call(c, inb, res, x.size, x.shape)
                    finally:
                        self._exit()
                    if op == _ops.AVG:
                        res /= self.size
                    return res
        self._enter("allreduce")
        try:
            return self._allreduce(x, op, algorithm, out, async_op)
        finally:
            self._exit()

    def _entry(self, name: str, quick, quick_args: tuple, general, general_args: tuple,
               async_op: bool):
        """A public collective: its hot case, ``quick(*quick_args)`` (``_quick``,
        ``_scatter_quick``), or else ``general(*general_args)``, the general path, inside the
        one-thread-at-a-time guard. (allreduce inlines the same: this call and the unpacking
        measured 19.3 against 18.3 us for its 8 B call at n=2, the latency row of issue 15.)"""
        if not async_op:
            res = quick(*quick_args)
            if res is not _MISS:
                return res
        self._enter(name)
        try:
            return general(*general_args)
        finally:
            self._exit()

    def _quick(self, name: str, op: str, algorithm, root: int, x, out, layout: int,
               root_only: bool = False):
        """allreduce's hot case for the other collectives: a synchronous call on a C-contiguous
        array whose call signature ran before (so its op, dtype, root and shapes were validated
        then), with nothing queued. The same steps as the general path, minus its argument
        handling and closure; ``_MISS`` (nothing done) whenever anything differs from that case,
        and the general path runs the call (and explains what is wrong).

        ``layout``: ``_SAME`` (out has x's shape: broadcast, reduce), ``_STACKED`` (out is
        ``(size,) + x.shape``: allgather, gather), ``_BLOCKS`` (x is ``(size, ...)`` blocks, out
        one block: reduce_scatter) or ``_ALL_BLOCKS`` (x and out are such blocks: alltoall).
        ``root_only``: the call's result is the root's (reduce, gather); the other ranks get
        None and a scratch output, and ignore ``out`` as the general path does."""
        if type(x) is not np.ndarray or self._pending or not x.flags.c_contiguous \
                or self._closed or self._broken is not None or type(root) is not int:
            return _MISS
        if layout >= _BLOCKS:
            if x.ndim == 0 or x.shape[0] != self.size:
                return _MISS
            count, shape = x.size // self.size, x.shape[1:] if layout == _BLOCKS else x.shape
        else:
            count = x.size
            shape = (self.size,) + x.shape if layout == _STACKED else x.shape
        c = self._calls.get((name, op, algorithm, x.dtype, count, root))
        if c is None:
            return _MISS
        inb = x if x.ndim == 1 else x.reshape(-1)
        if root_only and self.rank != root:
            res, outb = None, np.empty(count * self.size if layout == _STACKED else count, x.dtype)
        else:
            if out is None:
                res = np.empty(shape, x.dtype)
            elif type(out) is np.ndarray and out.shape == shape and out.dtype == x.dtype \
                    and out.flags.c_contiguous:
                res = out
            else:
                return _MISS
            outb = res if res.ndim == 1 else res.reshape(-1)
            if out is not None and not (name == "broadcast" and self.rank != root):
                inb = self._separate(inb, outb, out)
        if not (c.hot and self._hot(name, c, inb, outb)):
            self._enter(name)
            try:
                self._run_call(c, inb, outb, count, x.shape)
            finally:
                self._exit()
        if op == _ops.AVG and res is not None:
            outb /= self.size
        return res

    def _allreduce(self, x, op, algorithm, out, async_op):
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
        return self._entry("reduce", self._quick,
                           ("reduce", op, algorithm, root, x, out, _SAME, True),
                           self._reduce, (x, root, op, algorithm, out, async_op), async_op)

    def _reduce(self, x, root, op, algorithm, out, async_op):
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
        return self._entry("broadcast", self._quick,
                           ("broadcast", "none", algorithm, root, x, out, _SAME),
                           self._broadcast, (x, root, algorithm, out, async_op), async_op)

    def _broadcast(self, x, root, algorithm, out, async_op):
        root = self._check_root(root, "broadcast")
        arr, inflat = self._flat_in(x)
        res, outflat = self._make_out(out, arr.shape, arr.dtype, "broadcast")
        inflat = self._separate(inflat, outflat, out) if self.rank == root else inflat

        def run():
            self._execute("broadcast", inflat, outflat, inflat.size, "none", root, algorithm, arr.shape)
            return res
        return self._submit("broadcast", run, async_op)

    def allgather(self, x, algorithm="auto", out=None, async_op=False):
        return self._entry("allgather", self._quick,
                           ("allgather", "none", algorithm, 0, x, out, _STACKED),
                           self._allgather, (x, algorithm, out, async_op), async_op)

    def _allgather(self, x, algorithm, out, async_op):
        arr, inflat = self._flat_in(x)
        res, outflat = self._make_out(out, (self.size,) + arr.shape, arr.dtype, "allgather")
        inflat = self._separate(inflat, outflat, out)

        def run():
            self._execute("allgather", inflat, outflat, inflat.size, "none", 0, algorithm, arr.shape)
            return res
        return self._submit("allgather", run, async_op)

    def gather(self, x, root=0, algorithm="auto", out=None, async_op=False):
        return self._entry("gather", self._quick,
                           ("gather", "none", algorithm, root, x, out, _STACKED, True),
                           self._gather, (x, root, algorithm, out, async_op), async_op)

    def _gather(self, x, root, algorithm, out, async_op):
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
        return self._entry("reduce_scatter", self._quick,
                           ("reduce_scatter", op, algorithm, 0, x, out, _BLOCKS),
                           self._reduce_scatter, (x, op, algorithm, out, async_op), async_op)

    def _reduce_scatter(self, x, op, algorithm, out, async_op):
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
        return self._entry("alltoall", self._quick,
                           ("alltoall", "none", algorithm, 0, x, out, _ALL_BLOCKS),
                           self._alltoall, (x, algorithm, out, async_op), async_op)

    def _alltoall(self, x, algorithm, out, async_op):
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
        Other ranks' x is ignored (None is fine): they learn shape and dtype from the root,
        or from their out= (which must then match the root's block)."""
        return self._entry("scatter", self._scatter_quick, (x, root, algorithm, out),
                           self._scatter, (x, root, algorithm, out, async_op), async_op)

    def _scatter_quick(self, x, root, algorithm, out):
        """scatter's hot case (as ``_quick``): a synchronous call with nothing queued whose
        arguments need no conversion -- the root's x C-contiguous blocks, a block's header plan
        made before (so dtype and shape were validated then), out= absent or of the block's
        shape and dtype -- runs ``_scatter_run`` without the general path's argument handling
        and closure. ``_MISS`` otherwise. The header exchange is the call's check either way."""
        if type(root) is not int or not 0 <= root < self.size or self._pending \
                or self._closed or self._broken is not None:
            return _MISS
        inflat = None
        if self.rank == root:
            if type(x) is not np.ndarray or not x.flags.c_contiguous or x.ndim == 0 \
                    or x.shape[0] != self.size:
                return _MISS
            dtype, block = x.dtype, x.shape[1:]
            inflat = x.reshape(-1)
        elif type(out) is np.ndarray:
            dtype, block = out.dtype, out.shape
        elif out is None:
            dtype = block = None          # the root's header row says
        else:
            return _MISS
        if dtype is not None and (root, algorithm, dtype, block) not in self._scatter_headers:
            return _MISS
        res = None
        if out is not None:
            if not (type(out) is np.ndarray and out.shape == block and out.dtype == dtype
                    and out.flags.c_contiguous):
                return _MISS
            res = out
        elif dtype is not None:
            res = np.empty(block, dtype)
        self._enter("scatter")
        try:
            return self._scatter_run(root, algorithm, dtype, block, inflat, res, out)
        finally:
            self._exit()

    def _scatter(self, x, root, algorithm, out, async_op):
        root = self._check_root(root, "scatter")
        inflat = res = None
        if self.rank == root:
            arr, inflat = self._flat_in(x)
            block, dtype = self._blocked(arr, "scatter"), arr.dtype
        elif out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("scatter: out= must be a numpy array")
            block, dtype = out.shape, out.dtype
        else:
            block = dtype = None          # the root's header row says
        if block is not None:
            if len(block) > _META_WORDS - 3:      # what _encode_meta refuses, before any message
                _encode_meta(dtype, block)
            res = self._make_out(out, block, dtype, "scatter")[0]
        return self._submit("scatter", lambda: self._scatter_run(
            root, algorithm, dtype, block, inflat, res, out), async_op)

    def _scatter_run(self, root: int, algorithm, dtype, block, inflat, res, out):
        """A scatter whose arguments are checked: the header exchange, then the data. ``res``
        is the result (None: a non-root without out=, which learns the block from the root)."""
        try:
            c, dt, count, shape, finish = self._scatter_header(root, algorithm, dtype, block)
        except CommError as e:
            self._fail(e)
        if res is None:
            res = self._make_out(out, shape[1:], dt, "scatter")[0]
        outflat = res if res.ndim == 1 else res.reshape(-1)
        src = (self._separate(inflat, outflat, out) if self.rank == root
               else np.empty(0, dtype=outflat.dtype))
        # the header exchange is this call's argument check (its fingerprints)
        self._run_call(c, src, outflat, count, shape, fingerprint=False)
        try:
            finish()
        except CommError as e:
            self._fail(e)
        return res

    def _scatter_header(self, root: int, algorithm: Optional[str], dtype, block):
        """Scatter's header exchange, which is also its argument check: every rank sends every
        other one row, its fingerprint of the call (``_fingerprint``: the packed signature, the
        count, the shape's crc32) followed by the block's shape and dtype (``_encode_meta``).
        A rank that does not know them (a non-root without out=; ``dtype`` None) sends a row
        of zeros, which claims nothing (the tag has already said scatter and the root), then
        takes the root's row. Every rank takes the rows of the peers it receives data from before
        the data (each is that peer's first message of the call, so FIFO order puts it there)
        and compares them on arrival; ``finish()``, after the data, takes and compares the
        others' (check='full': all of them before the data). The tag names scatter and its
        root but no dtype, which the rank may not know yet; the rows compare the rest.

        Returns the call (``_Call``), its dtype, count and shape, and ``finish``."""
        size, me, group, t = self.size, self.rank, self.group, self.transport
        seq = self._next_seq()
        tag = _new_tag(Tag, (self._ctx, seq, 0, _scatter_header_call(root), _HEADER_WORDS))
        deadline, what = self._deadline(), f"scatter #{seq} (its header)"
        fast = self.small_path and hasattr(t, "recv_now")

        def take(ranks, rows):
            reqs = [t.irecv(group[r], rows[r], tag) for r in ranks
                    if not (fast and t.recv_now(group[r], rows[r], tag, None, SMALL_SPIN_S))]
            if reqs:
                t.wait_all(reqs, deadline, what)

        def send(row):
            return [t.isend(group[r], row, tag) for r in range(size) if r != me
                    and not (fast and t.send_now(group[r], row, tag))]
        rows = np.empty((size, _HEADER_WORDS), dtype=np.int64)
        took_root = dtype is None
        if took_root:
            sends = send(_NO_CLAIM)       # at once: the peers need not wait for the root's row
            take((root,), rows)
            meta = rows[root, 3:].tobytes()
            decoded = self._scatter_metas.get(meta)
            if decoded is None:
                if len(self._scatter_metas) > 256:
                    self._scatter_metas.clear()
                decoded = self._scatter_metas[meta] = _decode_meta(rows[root, 3:])
            dtype, block = decoded
        h = self._scatter_headers.get((root, algorithm, dtype, block))
        if h is None:
            h = self._scatter_headers[(root, algorithm, dtype, block)] = \
                self._scatter_header_plan(root, algorithm, dtype, block)
        c, count, shape, mine, key, first, rest, first_after_root, rest_after_root = h
        if took_root:
            root_row = rows[root].copy()
            rows[:] = mine                # every row holds ours until theirs arrives
            rows[root] = root_row
            first, rest = first_after_root, rest_after_root
        else:
            rows[:] = mine
            sends = send(mine)

        def check(ranks):
            if any(rows[r, :3].tobytes() != key and rows[r, 0] != 0 for r in ranks):
                claims = np.ascontiguousarray(rows[:, :3])
                claims[claims[:, 0] == 0] = mine[:3]
                self._compare_fingerprints(claims, mine[:3].copy(), c.call, count, seq)
        take(first, rows)
        check(first + (root,) if took_root else first)

        def finish():
            take(rest, rows)
            if sends:
                t.wait_all(sends, deadline, what)
            check(rest)
        return c, dtype, count, shape, finish

    def _scatter_header_plan(self, root: int, algorithm: Optional[str], dtype, block):
        """What ``_scatter_header`` derives from a call's signature: the call, its count and
        shape, this rank's row (read-only) and its fingerprint part's bytes (what the arriving
        rows are compared with), the ranks whose rows come before the data (the
        root's first) and those taken at the end, and both without the root (for a rank that
        took the root's row first)."""
        if len(self._scatter_headers) > 256:
            self._scatter_headers.clear()
        shape = (self.size,) + tuple(block)
        count = math.prod(block)
        c = self._calls.get(("scatter", "none", algorithm, dtype, count, root)) \
            or self._prepare("scatter", "none", algorithm, dtype, count, root)
        mine = np.empty(_HEADER_WORDS, dtype=np.int64)
        mine[:3] = self._fingerprint(c.call, count, shape)
        mine[3:] = _encode_meta(dtype, block)
        mine.flags.writeable = False
        heard, me = c.plan.recv_peers, self.rank
        first = tuple(r for r in sorted(range(self.size), key=lambda r: r != root)
                      if r != me and (self.check == "full" or self.group[r] in heard))
        rest = tuple(r for r in range(self.size) if r != me and r not in first)
        return (c, count, shape, mine, mine[:3].tobytes(), first, rest,
                tuple(r for r in first if r != root), tuple(r for r in rest if r != root))

    def barrier(self, algorithm="auto", async_op=False):
        # the hot case, as in allreduce: a synchronous barrier whose signature ran before
        if not async_op and not self._pending and not self._closed and self._broken is None:
            c = self._calls.get(("barrier", "none", algorithm, _U8, 0, 0))
            if c is not None and c.hot and self._hot("barrier", c, _EMPTY, _EMPTY):
                return None
            if c is not None:
                self._enter("barrier")
                try:
                    self._run_call(c, _EMPTY, _EMPTY, 0, ())
                finally:
                    self._exit()
                return None
        self._enter("barrier")
        try:
            def run():
                self._execute("barrier", _EMPTY, _EMPTY, 0, "none", 0, algorithm, ())
            return self._submit("barrier", run, async_op)
        finally:
            self._exit()

    # ------------------------------------------------------------------ registered buffers
    def empty(self, shape, dtype=np.float64) -> np.ndarray:
        """An uninitialised array in *registered* memory, which the peers on this node can map
        (as NCCL's user-buffer registration, MPI_Win_allocate_shared): over shm, a large message
        from it is copied once, straight from this rank's memory into the receiver's
        destination, with no staging ring and no system call. Use it like any array (in, out,
        in place); where no peer can map it (tcp, inproc) it is a plain array. ``free`` ends
        the registration. Cost: one /dev/shm segment per call (its name lives while it is
        registered)."""
        dtype = np.dtype(dtype)
        if dtype.kind not in "biufc":
            raise TypeError(f"minicomm moves numeric and bool arrays, got dtype {dtype}")
        shape = tuple(int(d) for d in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
        if any(d < 0 for d in shape):
            raise ValueError(f"empty: negative dimension in {shape}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        from .transports import registered_memory
        reg = registered_memory(self.transport)
        if reg is None:
            return np.empty(shape, dtype)
        return reg.register_memory(nbytes).view(dtype).reshape(shape)

    def register(self, array) -> np.ndarray:
        """``array`` itself if it lies in registered memory already, else a registered copy of
        it (same shape, dtype and values): pass the returned array to the collectives."""
        arr = np.asarray(array)
        if self.is_registered(arr) and arr.flags.c_contiguous:
            return arr
        reg = self.empty(arr.shape, arr.dtype)
        reg[...] = arr
        return reg

    def is_registered(self, array) -> bool:
        from .transports import registered_memory
        reg = registered_memory(self.transport)
        return (reg is not None and isinstance(array, np.ndarray)
                and reg.is_registered(array))

    def free(self, array) -> None:
        """End the registration of memory from ``empty`` / ``register``: peers stop mapping it
        and its name goes; the array itself stays valid as a plain (private) array. Do not
        free a buffer an unfinished async_op call uses. A plain array is a ValueError."""
        from .transports import registered_memory
        reg = registered_memory(self.transport)
        if reg is None:
            return                    # it was a plain array all along (tcp, inproc)
        if not isinstance(array, np.ndarray) or not reg.free_memory(array):
            raise ValueError("free: the array is not registered memory of this communicator")

    # ------------------------------------------------------------------ point to point
    def _check_peer(self, rank: int, what: str, any_ok: bool) -> int:
        if isinstance(rank, numbers.Integral):
            rank = int(rank)
            if any_ok and rank == ANY_SOURCE:
                return rank
            if 0 <= rank < self.size:
                return rank
        raise ValueError(f"{what}: rank {rank!r} is not in 0..{self.size - 1}"
                         + (" or ANY_SOURCE" if any_ok else ""))

    @staticmethod
    def _check_tag(tag, what: str, any_ok: bool) -> int:
        if isinstance(tag, numbers.Integral):
            tag = int(tag)
            if (any_ok and tag == ANY_TAG) or 0 <= tag <= MAX_TAG:
                return tag
        raise ValueError(f"{what}: tag {tag!r} must be an int in 0..{MAX_TAG}"
                         + (" or ANY_TAG" if any_ok else ""))

    def _p2p_deadline(self, timeout: Optional[float]) -> float:
        return time.monotonic() + (self.timeout if timeout is None else float(timeout))

    def _isend(self, x, dst, tag) -> Work:
        arr, flat = self._flat_in(x)
        dst = self._check_peer(dst, "send", False)
        tag = self._check_tag(tag, "send", False)
        self._usable("send")
        reqs = self._p2p.isend(arr, flat, dst, tag)
        what = f"send to rank {dst} (tag {tag})"
        work = Work(what)
        if not reqs:
            work._finish(None)
            return work
        transport = self.transport

        def drive(timeout):
            self._enter("wait on " + what)
            try:
                if not work.is_completed():
                    try:
                        transport.wait_all(reqs, self._p2p_deadline(timeout), what)
                        work._finish(None)
                    except CommTimeout:
                        if timeout is None:
                            raise
                    except CommError as e:
                        work._finish(error=_translate_peer(e, self.group))
            finally:
                self._exit()
        work._drive = drive
        work._keep = flat             # the buffer must live until the send completes
        return work

    def _irecv(self, src, tag, out) -> Tuple[Work, object]:
        src = self._check_peer(src, "recv", True)
        tag = self._check_tag(tag, "recv", True)
        if out is not None and not isinstance(out, np.ndarray):
            raise TypeError("recv: out= must be a numpy array")
        self._usable("recv")
        work = Work(f"recv from {'any source' if src == ANY_SOURCE else f'rank {src}'} "
                    f"({'any tag' if tag == ANY_TAG else f'tag {tag}'})")
        work.status = Status()
        r = self._p2p.post(src, tag, out, work)
        engine = self._p2p

        def drive(timeout):
            self._enter("wait on " + work.description)
            try:
                if work.is_completed():
                    return
                try:
                    engine.progress(r.done, self._p2p_deadline(timeout), work.description)
                except CommTimeout as e:
                    if timeout is not None:   # wait(timeout) may be retried: keep the receive
                        raise
                    engine.cancel(r)
                    work._finish(error=e)
                    return
                except CommError as e:
                    engine.cancel(r)
                    work._finish(error=e)
                    return
                if r.error is not None:
                    work._finish(error=r.error)
                else:
                    work._finish(r.result)
            finally:
                self._exit()
        work._drive = drive
        if r.done():
            drive(None)
        return work, r

    @_serialized("isend")
    def isend(self, x, dst: int, tag: int = 0) -> Work:
        """Post one message to ``dst``; ``wait()`` returns once ``x`` may be reused."""
        return self._isend(x, dst, tag)

    @_serialized("send")
    def send(self, x, dst: int, tag: int = 0) -> None:
        """One message to ``dst``, matched on (source, tag) by the receiver."""
        self._isend(x, dst, tag).wait()

    @_serialized("irecv")
    def irecv(self, src: int, tag: int = 0, out=None) -> Work:
        """Post a receive; ``wait()`` returns the array, ``status`` tells what it matched."""
        return self._irecv(src, tag, out)[0]

    @_serialized("recv")
    def recv(self, src: int, tag: int = 0, out=None, status: Optional[Status] = None,
             timeout: Optional[float] = None):
        """Receive one message from ``src`` (or ``ANY_SOURCE``) with ``tag`` (or ``ANY_TAG``);
        shape and dtype come from the message. ``out=`` is checked before anything is consumed.
        ``timeout`` (seconds, default the communicator's) cancels only this receive."""
        timeout = timeout_arg("recv: timeout", timeout)     # checked before anything is consumed
        work, r = self._irecv(src, tag, out)
        if not work.is_completed():
            try:
                self._p2p.progress(r.done, self._p2p_deadline(timeout), work.description)
            except CommError:
                self._p2p.cancel(r)
                raise
            work._finish(r.result, r.error)
        y = work.wait(0)
        if status is not None:
            st = work.status
            status.source, status.tag, status.nbytes = st.source, st.tag, st.nbytes
            status.dtype, status.shape = st.dtype, st.shape
        return y

    # ------------------------------------------------------------------ objects (cloudpickle)
    @_serialized("broadcast_object")
    def broadcast_object(self, obj=None, root=0):
        root = self._check_root(root, "broadcast_object")
        data = _pickle(obj) if self.rank == root else np.empty(0, dtype=np.uint8)
        n = self.broadcast(np.array([data.size], dtype=np.int64), root=root, algorithm="tree")
        buf = data if self.rank == root else np.empty(int(n[0]), dtype=np.uint8)
        return _unpickle(self.broadcast(buf, root=root))

    @_serialized("allgather_object")
    def allgather_object(self, obj) -> List[Any]:
        data = _pickle(obj)
        sizes = self.allgather(np.array([data.size], dtype=np.int64))[:, 0]
        padded = np.zeros(int(sizes.max()), dtype=np.uint8)
        padded[:data.size] = data
        rows = self.allgather(padded)
        return [_unpickle(rows[r, :sizes[r]]) for r in range(self.size)]

    @_serialized("gather_object")
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

    @_serialized("scatter_object")
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

    def recv_object(self, src: int, tag: int = 0, status: Optional[Status] = None,
                    timeout: Optional[float] = None):
        return _unpickle(self.recv(src, tag, status=status, timeout=timeout))

    # ------------------------------------------------------------------ groups
    @_serialized("split")
    def split(self, color, key=None) -> Optional["Communicator"]:
        """MPI_Comm_split: ranks with the same color form a communicator, ordered by (key, rank).
        color None or negative (MPI_UNDEFINED) -> this rank gets None. The new communicator's
        number is allocated by the group's lowest rank and sent to the others (see WORLD_ID)."""
        if color is not None and (not isinstance(color, numbers.Integral)
                                  or isinstance(color, bool)):
            raise TypeError(f"split: color must be an int (or None / negative for no group), "
                            f"got {type(color).__name__} {color!r}")
        if key is not None and not isinstance(key, numbers.Integral):
            raise TypeError(f"split: key must be an int, got {type(key).__name__} {key!r}")
        color = -1 if color is None or int(color) < 0 else int(color)
        k = self.rank if key is None else int(key)
        table = self.allgather(np.array([color, k], dtype=np.int64))
        members = sorted((int(table[r, 1]), r) for r in range(self.size)
                         if color >= 0 and table[r, 0] == color)
        ranks = [r for _, r in members]
        mine = -1
        if ranks and self.rank == min(ranks):
            mine = (self.group[self.rank] + 1) * _SPLIT_BASE + next(_id_counter) % _SPLIT_BASE
        ids = self.allgather(np.array([mine], dtype=np.int64))
        if color < 0:
            return None
        return Communicator(self.transport, ranks.index(self.rank), len(ranks),
                            group=[self.group[r] for r in ranks],
                            topology=[self.topology[r] for r in ranks],
                            comm_id=int(ids[min(ranks), 0]), timeout=self.timeout,
                            check=self.check, link_model=self.link_model, _owner=False)

    # ------------------------------------------------------------------ one-sided
    def window(self, array) -> Window:
        """One-sided RMA window exposing ``array`` to every rank (collective): minicomm.window."""
        return Window(self, array)

    def abort(self, reason: str = "aborted by the user") -> None:
        """Fail this communicator now: a call blocked in another thread raises at once, queued
        work fails, later calls raise; peers blocked on this rank learn of it."""
        err = CommError(f"communicator aborted: {reason}")
        self._closing_error = err
        self._break(err)

    def close(self) -> None:
        """Finish queued async work (each call bounded by its own deadline), then release the
        communicator. Called from another thread while a call runs, it fails that call (and
        the queued ones) with a CommError at once instead, and waits for it to leave before it
        frees anything."""
        if self._closed:
            return
        me = threading.get_ident()
        busy = self._busy_thread
        if busy is not None and busy != me:
            err = CommError(f"{self.busy_with}: communicator closed by close() on thread "
                            f"{threading.current_thread().name!r} while this call ran")
            self._closing_error = err
            self._closed = True
            self.transport.cancel_context(self._ctx, err)
            self.transport.cancel_context(self._p2p.ctx, err)
            # the woken call leaves promptly; never tear down under it
            if self._guard.acquire(timeout=max(10.0, min(self.timeout, 60.0))):
                self._guard.release()
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(self.timeout)
            if self._worker.is_alive():
                # a queued call outlived its own deadline: fail it before memory goes away
                err = self._closing_error or CommError("communicator closed while async work "
                                                       "was still running")
                self._closing_error = err
                self.transport.cancel_context(self._ctx, err)
                self._worker.join(10.0)
        self._closed = True
        if self._closing_error is None:
            self._closing_error = CommError("communicator is closed")
        if not self._owner:
            closed = CommError("communicator is closed")
            self.transport.cancel_context(self._ctx, closed)     # drop what peers still send
            self.transport.cancel_context(self._p2p.ctx, closed)
        else:
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
_HEADER_WORDS = 3 + _META_WORDS     # a scatter header row: fingerprint, then shape and dtype
_NO_CLAIM = np.zeros(_HEADER_WORDS, dtype=np.int64)   # ... of a rank that takes the root's word
_NO_CLAIM.flags.writeable = False


@functools.lru_cache(maxsize=None)
def _scatter_header_call(root: int) -> int:
    """The packed call in a scatter header's tag: scatter and its root, no dtype (see there)."""
    return pack_call(_SCATTER_META, "none", "none", None, root)


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


def _same_error(e: BaseException) -> BaseException:
    """A fresh exception of ``e``'s class and message (one instance per raise)."""
    try:
        c = type(e)(str(e))
    except Exception:
        return CommError(str(e))
    c.peer = getattr(e, "peer", None)
    return c


def _translate_peer(e: BaseException, group: Sequence[int]) -> BaseException:
    """A transport's PeerFailure names a world rank: give this communicator's rank instead."""
    world = getattr(e, "peer", None)
    if isinstance(e, PeerFailure) and world in group:
        e.peer = list(group).index(world)
    return e


def _pickle(obj) -> np.ndarray:
    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)


def _unpickle(arr: np.ndarray):
    return cloudpickle.loads(arr.tobytes())
