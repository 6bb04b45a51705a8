"""torch.distributed backend ``"minicomm"``: ``import minicomm.torch``, then
``dist.init_process_group("minicomm", ...)`` (torchrun, ``torch.multiprocessing`` spawn, ``env://``,
``tcp://``, ``file://`` or an explicit ``store=``). CPU tensors only; stock
``DistributedDataParallel`` trains over it unchanged.

Bootstrap. torch hands the backend creator its c10d store (a ``PrefixStore`` of the group). The
minicomm world is built on that store (``connect_world(cfg, store=adapter)``): every rank counts
itself in (a generation number, so a later ``init_process_group`` on the same store never reads a
stale key), rank 0 publishes a fresh random job token and job id, and the transports exchange
their addresses through it — no second port. The token authenticates minicomm's own links; it is
as private as torch's store is (that store is not authenticated). ``MINICOMM_TRANSPORT``,
``MINICOMM_BIND``, ``MINICOMM_NODE``/``MINICOMM_HOST`` work as under ``mc.init``.
``dist.new_group(ranks)`` builds its communicators on the world's transports (no new
connections): the group's lowest rank allocates their ids and publishes them in the group's store.

Execution. Each process group owns a world (or group) ``Communicator`` for collectives and a second
one for send/recv. Collectives run in issue order on one worker thread per group (the
communicator's one-thread rule holds by construction); ``async_op=True`` returns at once and the
work's future completes on that thread (``then`` callbacks run there, and a collective they
issue runs at once, in the same place of the order on every rank). A synchronous ``dist.*`` call
with nothing queued runs on the caller's thread instead, saving the hand-off.
Send/recv are posted at once on the caller's thread and move when waited on (like MPI; torch's
gloo likewise gives p2p works no future).

Tensors. Contiguous CPU tensors of a numpy dtype are passed as zero-copy numpy views: results land
in the caller's tensors in place. Non-contiguous tensors (and conjugate/negative views) are staged
through a contiguous copy, float16 and bfloat16 through float32 (reduced in float32, rounded once
when written back). Other dtypes raise ``TypeError``; non-CPU or sparse tensors ``ValueError`` /
``TypeError``, from the call.

Ops. ``ReduceOp`` SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG and PREMUL_SUM (the factor, a number
or a one-element tensor, scales a copy of the input before a sum).

Errors. A minicomm ``CommError`` (``MismatchError``, ``CommTimeout``, ``PeerFailure``) raised by a
collective fails its work: ``wait()`` raises it; ``get_future()`` ends in error (torch reports a
``RuntimeError`` naming it), and so do chained futures, and the DDP reducer raises it from
``backward()``. The first such error breaks the group for good (minicomm's
rule): later calls on it raise ``CommError("communicator is broken: ...")``. Argument errors
(wrong device, dtype, sizes, a root outside the group) raise from the call itself.

Who reaches what. Python ``dist.*`` functions call the Python methods of the group object, so they
reach every method here. C++ callers (the DDP ``Reducer``, ``_broadcast_coalesced``, parameter
verification, c10d functional collectives) hold the group as a C++ ``ProcessGroup`` and reach
Python only through torch's trampoline (``PyProcessGroup``), which forwards exactly:
``allreduce``, ``allreduce_coalesced``, ``allgather``, ``all_gather_single_coalesced``,
``all_to_all_single``, ``barrier``, ``broadcast``, ``reduce_scatter``,
``reduce_scatter_single_coalesced``, ``send``, ``recv``, and ``getBackendName``, ``getRank``,
``getSize``, ``abort``, ``getGroupName``/``setGroupName``, ``getGroupDesc``/``setGroupDesc``
(plus ``wait`` and ``get_future`` on works). ``reduce``, ``gather``, ``scatter``, ``alltoall``,
``all_gather_single``, ``reduce_scatter_single``, ``allgather_coalesced``, ``recv_anysource`` and
``shutdown`` are Python-only: a C++ caller of those gets torch's "not supported" error.

Pitfalls solved here (each has a test in tests/test_torch_backend.py): the group name (torch sets
it with ``_set_group_name`` after the creator returns; a Python group has no C++ backend to hold
it, so ``group_name``, ``_set_group_name`` and the trampoline's ``getGroupName`` /
``setGroupName`` are all answered from Python); the return type of works (every method returns a
``dist._Work`` subclass that torch's C++ side can hold — never None or a future); errors through
futures (``Future.set_exception`` completes a future *successfully* as far as C++ knows — the DDP
reducer then takes the exception object for its bucket and crashes; here the future fails with
a real C++ error, see ``MinicommWork``).

Cost: per collective, one queue hand-off (~tens of us) unless it runs inline; staging costs one copy
in and one out; everything else is minicomm's own cost.
"""
from __future__ import annotations

import collections
import datetime
import itertools
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import ops as _ops
from .communicator import Communicator
from .errors import CommError, CommTimeout, MismatchError, PeerFailure
from .launch.world import connect_world
from .p2p import ANY_SOURCE
from .rendezvous import RendezvousError, new_token, rank_ranges

if not dist.is_available():                          # pragma: no cover - torch built without it
    raise ImportError("minicomm.torch needs torch.distributed (this torch build has none)")

BACKEND = "minicomm"
__all__ = ["BACKEND", "MinicommProcessGroup", "MinicommWork", "register"]

# ---------------------------------------------------------------------------------- dtypes
_DIRECT = {torch.float32: np.float32, torch.float64: np.float64, torch.int8: np.int8,
           torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
           torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64,
           torch.complex128: np.complex128}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        _DIRECT[getattr(torch, _name)] = _np
_STAGED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

_RED = dist.ReduceOp
_OPS = {_RED.SUM: _ops.SUM, _RED.PRODUCT: _ops.PROD, _RED.MIN: _ops.MIN, _RED.MAX: _ops.MAX,
        _RED.BAND: _ops.BAND, _RED.BOR: _ops.BOR, _RED.BXOR: _ops.BXOR, _RED.AVG: _ops.AVG,
        _RED.PREMUL_SUM: _ops.SUM}


def _np_dtype(t: torch.Tensor) -> np.dtype:
    """The numpy dtype minicomm moves ``t`` as (float32 for the half types)."""
    return np.dtype(_DIRECT[_STAGED.get(t.dtype, t.dtype)])


def _check_tensor(t, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what}: the minicomm backend moves CPU tensors, got one on {t.device}")
    if t.layout != torch.strided:
        raise TypeError(f"{what}: the minicomm backend moves dense (strided) tensors, got {t.layout}")
    if t.dtype not in _DIRECT and t.dtype not in _STAGED:
        raise TypeError(f"{what}: dtype {t.dtype} is not supported by the minicomm backend")
    return t


def _check_list(ts, what: str, n: Optional[int] = None) -> List[torch.Tensor]:
    ts = list(ts)
    if n is not None and len(ts) != n:
        raise ValueError(f"{what}: expected {n} tensors, got {len(ts)}")
    for t in ts:
        _check_tensor(t, what)
    return ts


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with its conjugate and negative bits applied (a copy only where one is
    set). A converting ``copy_`` from a float16 tensor with the negative bit set (what
    torch.distributed makes of a complex32 negative view, through view_as_real) drops the sign
    in torch 2.13, so staging resolves the bits before it converts."""
    return t.detach().resolve_conj().resolve_neg()


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, converting first where ``dst`` has the negative or conjugate bit set:
    a converting copy into a float16 negative view stores the values unnegated (torch 2.13)."""
    if src.dtype != dst.dtype and (dst.is_neg() or dst.is_conj()):
        src = src.to(dst.dtype)
    with torch.no_grad():
        dst.copy_(src)


def _zero_copy(t: torch.Tensor) -> bool:
    return t.dtype in _DIRECT and t.is_contiguous() and not t.is_conj() and not t.is_neg()


class _Buf:
    """A flat numpy view of a tensor: the tensor's own memory when it can be (contiguous, numpy
    dtype), else a contiguous staging tensor (float32 for the half types) that ``store()`` copies
    back. ``load=False``: an output whose old contents do not matter (nothing is copied in)."""
    __slots__ = ("tensor", "stage", "array")

    def __init__(self, t: torch.Tensor, load: bool = True):
        self.tensor = t
        if _zero_copy(t):
            self.stage = None
            self.array = t.detach().numpy().reshape(-1)
        else:
            self.stage = torch.empty(t.shape, dtype=_STAGED.get(t.dtype, t.dtype))
            if load:
                self.stage.copy_(_resolved(t))
            self.array = self.stage.numpy().reshape(-1)

    def store(self) -> None:
        if self.stage is not None:
            _copy_into(self.tensor, self.stage)


def _put(t: torch.Tensor, row: np.ndarray) -> None:
    """Copy a flat numpy block into tensor ``t`` (any layout or dtype: torch converts)."""
    _copy_into(t, torch.from_numpy(row).view(t.shape))


def _stack(ts: Sequence[torch.Tensor], dtype: np.dtype) -> np.ndarray:
    """Tensors of one element count as the rows of a fresh (len, n) array."""
    n = ts[0].numel() if ts else 0
    out = np.empty((len(ts), n), dtype=dtype)
    for j, t in enumerate(ts):
        torch.from_numpy(out[j]).view(t.shape).copy_(_resolved(t))
    return out


def _seconds(timeout) -> Optional[float]:
    """A wait timeout from Python (timedelta, seconds or None) or from C++ (a timedelta; 0 means
    none, torch's kNoTimeout) -> seconds or None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout)
    return s if s > 0 else None


# ---------------------------------------------------------------------------------- works
class _Failed:
    """What a failed collective's source future carries to ``_unwrap``."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _unwrap(source: torch.futures.Future):
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class MinicommWork(dist._Work):
    """A collective's handle. ``wait()`` returns True or raises the collective's error (its own
    type: ``MismatchError``, ``CommTimeout``, ``PeerFailure``...); ``get_future()`` is a
    ``torch.futures.Future`` completed on the group's worker thread, with the output tensors or
    in error; ``result()`` the output tensors.

    The future's error is a real C++ error, not ``Future.set_exception`` (that one completes the
    future *successfully* with the exception as its value and only Python's ``wait()`` raises
    it; the DDP reducer would read the exception as its bucket's tensors and crash). It is made
    by a ``then`` callback that raises, so torch reports it as a ``RuntimeError`` naming the
    minicomm error (``work.wait()`` raises the original)."""

    def __init__(self, description: str, outputs: List[torch.Tensor], engine: "_Engine"):
        super().__init__()
        self.description = description
        self._outputs = outputs
        self._engine = engine
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._source = torch.futures.Future()
        self._future = self._source.then(_unwrap)

    def _finish(self, error: Optional[BaseException]) -> None:
        self._error = error
        self._done.set()
        try:
            self._source.set_result(self._outputs if error is None else _Failed(error))
        except Exception as e:        # a callback misbehaved inside markCompleted: say so
            print(f"minicomm.torch: completing the future of {self.description} raised "
                  f"{type(e).__name__}: {e}", file=sys.stderr)

    def wait(self, timeout=None) -> bool:
        secs = _seconds(timeout)
        if secs is not None:
            if not self._done.wait(secs):
                raise CommTimeout(f"{self.description} did not complete within {secs:g} s")
        else:
            self._engine.wait_done(self._done, self.description)
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:      # CPU: nothing to synchronize with
        pass

    def __repr__(self):
        state = ("failed" if self._error is not None else "done") if self._done.is_set() else "pending"
        return f"<MinicommWork {self.description} {state}>"


class _P2PWork(dist._Work):
    """A send's or receive's handle: the transfer moves when ``wait()`` is called (MPI progress
    rules). Like gloo's send/recv works it has no future (``get_future`` raises)."""

    def __init__(self, description: str, pg: "MinicommProcessGroup", mc_work, on_done=None,
                 keep=None):
        super().__init__()
        self.description = description
        self._pg, self._mc, self._on_done, self._keep = pg, mc_work, on_done, keep
        self._done = False
        self._error: Optional[BaseException] = None
        self._source = -1

    def wait(self, timeout=None) -> bool:
        if not self._done:
            secs = _seconds(timeout)
            self._pg._p2p_wait(self, secs)
        if self._error is not None:
            raise self._error
        return True

    def _complete(self, secs: Optional[float]) -> None:
        """Drive the minicomm work (the caller holds the group's p2p lock)."""
        if self._done:
            return
        try:
            self._mc.wait(secs)
        except CommTimeout:
            if secs is not None and not self._mc.is_completed():
                raise                 # wait(timeout) may be retried: the transfer stays posted
            self._fail()
            return
        except BaseException:
            self._fail()
            return
        status = getattr(self._mc, "status", None)
        if status is not None:
            self._source = int(status.source)
        if self._on_done is not None:
            self._on_done()
        self._done, self._keep = True, None

    def _fail(self) -> None:
        self._error = sys.exc_info()[1]
        self._done, self._keep = True, None

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        raise RuntimeError(f"minicomm: {self.description} has no future (send/recv works "
                           f"complete in wait(), as gloo's do)")

    def _source_rank(self) -> int:
        if self._source < 0:
            raise RuntimeError(f"{self.description}: the source rank is known once a receive "
                               f"has completed")
        return self._source

    source_rank = _source_rank

    def result(self):
        self.wait()
        return []

    def synchronize(self) -> None:
        pass


class _DoneWork(dist._Work):
    """An already completed work (a group of one rank on a no-op path)."""

    def __init__(self, outputs):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(outputs)
        self._outputs = outputs

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return self._outputs


# ---------------------------------------------------------------------------------- engine
class _Engine:
    """Runs a group's collectives in issue order: queued calls on one worker thread; a
    synchronous call with nothing queued on the caller's thread. ``_exec`` makes sure only one
    thread at a time is inside the collective communicator.

    A call made by a future's callback (which runs on the worker, right after the call it
    follows: DDP comm hooks such as PowerSGD chain collectives this way) runs at once, sync or
    async: its place in the order is then the same on every rank — after the call whose
    completion triggered it, before whatever the main thread queued meanwhile (queuing it
    would put it behind a varying number of those, and mismatch or mix up calls)."""

    def __init__(self, name: str, timeout: float):
        self.name, self.timeout = name, timeout
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._exec = threading.Lock()
        self._queue: "collections.deque" = collections.deque()
        self._pending = 0                       # queued + running on the worker
        self._completed = 0                     # progress counter (bounded waits)
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, work: MinicommWork, fn: Callable[[], None], inline: bool) -> None:
        with self._lock:
            if self._closed:
                raise CommError(f"{work.description}: the process group was shut down")
            on_worker = self._thread is not None and threading.current_thread() is self._thread
            if not (on_worker or (inline and self._pending == 0)):
                self._pending += 1
                self._queue.append((work, fn))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True,
                                                    name=f"minicomm-torch-{self.name}")
                    self._thread.start()
                self._cv.notify()
                return
        self._run(work, fn)

    def _run(self, work: MinicommWork, fn) -> None:
        # bounded: whoever holds _exec is inside one call, which has its own deadline
        if not self._exec.acquire(timeout=self.timeout + 60.0):
            work._finish(CommTimeout(f"{work.description}: another call of this group did not "
                                     f"finish within {self.timeout + 60.0:g} s"))
            return
        try:
            try:
                fn()
                error = None
            except BaseException as e:   # delivered through wait() and the future
                error = e
        finally:
            self._exec.release()
        work._finish(error)             # callbacks run here, outside _exec
        with self._lock:
            self._completed += 1

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._cv.wait()     # idle: woken by submit() or close()
                if not self._queue:
                    return
                work, fn = self._queue.popleft()
            try:
                self._run(work, fn)
            finally:
                with self._lock:
                    self._pending -= 1

    def wait_done(self, done: threading.Event, what: str) -> None:
        """Wait for ``done`` while the engine makes progress: every call it runs is bounded by
        the communicator's timeout, so a full timeout with no call finishing is a hang."""
        window = self.timeout + 30.0
        while True:
            seen = self._completed
            if done.wait(window):
                return
            if self._completed == seen:
                raise CommTimeout(f"{what}: no collective of this group finished within "
                                  f"{window:g} s")

    def close(self, timeout: float) -> bool:
        """Stop taking calls, let the queued ones run (each bounded), stop the thread; False if
        the worker is still inside a call after ``timeout``."""
        with self._lock:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True


# ---------------------------------------------------------------------------------- store
class _TorchStore:
    """minicomm's rendezvous-store interface over a c10d store: ``set``, ``get(key, timeout)``,
    ``add``, ``join`` / ``wait_world`` (membership), ``local_address``. Keys live under ``minicomm/<generation>/``; torch owns the store
    (``close`` drops the reference, leaving it open)."""

    def __init__(self, store, timeout: float):
        self._store = store
        self.timeout = timeout
        self.prefix = "minicomm/"
        self.host = _store_host(store)
        self._job = ("", 0)

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self.prefix + key, bytes(value))

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        wait = self.timeout if timeout is None else float(timeout)
        k = self.prefix + key
        try:
            # never 0: a zero timedelta means "no timeout" to some c10d stores
            self._store.wait([k], datetime.timedelta(seconds=max(wait, 1e-3)))
            return self._store.get(k)
        except dist.DistStoreError as e:
            raise CommTimeout(f"torch store: key {k!r} was not set within {wait:g}s (has every "
                              f"rank started?): {e}") from None
        except dist.DistError as e:
            raise PeerFailure(f"torch store: {k!r}: {e}") from None

    def add(self, key: str, delta: int = 1) -> int:
        return int(self._store.add(self.prefix + key, int(delta)))

    def join(self, job: str, size: int, rank: int, **info) -> None:
        """``StoreClient.join``: become ``rank`` of the job (a rank joins once per generation)."""
        rec = dict(info, job=str(job), size=int(size), rank=int(rank), pid=os.getpid())
        rec.setdefault("host", socket.gethostname())
        if self.add(f"claims/{int(rank)}", 1) != 1:
            raise RendezvousError(f"torch store: rank {rank} joined this job twice")
        self.set(f"member/{int(rank)}", json.dumps(rec).encode())
        self._job = (str(job), int(size))

    def wait_world(self, timeout: Optional[float] = None) -> Dict[int, dict]:
        """``StoreClient.wait_world``: rank -> join record once every rank has joined;
        CommTimeout with ``arrived`` / ``missing`` if they have not within ``timeout``."""
        job, size = self._job
        wait = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + wait
        members: Dict[int, dict] = {}
        for r in range(size):
            try:
                raw = self.get(f"member/{r}", timeout=max(1e-3, deadline - time.monotonic()))
            except CommTimeout:
                arrived = [q for q in range(size)
                           if self._store.check([f"{self.prefix}member/{q}"])]
                missing = sorted(set(range(size)) - set(arrived))
                err = CommTimeout(f"torch store: {len(arrived)} of {size} ranks arrived within "
                                  f"{wait:g}s (missing ranks {rank_ranges(missing)})")
                err.arrived, err.missing = arrived, missing
                raise err from None
            members[r] = json.loads(raw.decode())
            if (members[r].get("job"), members[r].get("size")) != (job, size):
                raise RendezvousError(f"torch store: rank {r} belongs to another job "
                                      f"({members[r].get('job')}, size {members[r].get('size')})")
        return members

    def local_address(self) -> str:
        """The address of this host on the route to the store's host: what peers can reach."""
        host = self.host
        if host is None:
            try:
                return socket.gethostbyname(socket.gethostname())
            except OSError:
                return "127.0.0.1"
        try:
            info = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(info[0], socket.SOCK_DGRAM) as s:
                s.connect(info[4])        # UDP: picks the route, sends nothing
                return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"

    def close(self) -> None:
        # torch owns the store; only let go of it (a TCPStore server in this process must be
        # free to end when torch drops it, so a later init can bind its port again)
        self._store = None


def _store_host(store) -> Optional[str]:
    """The host of the TCPStore under a chain of PrefixStores (None for file / hash stores)."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:
        store, seen = store.underlying_store, seen + 1
    return getattr(store, "host", None) if isinstance(store, dist.TCPStore) else None


def _is_loopback(host: Optional[str]) -> bool:
    if host is None:
        return False
    if host in ("localhost", "127.0.0.1", "::1"):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def _store_generation(store, size: int, timeout: float) -> _TorchStore:
    """The adapter of a c10d store, keyed by generation: every rank of one init counts itself
    in, so a re-init on the same store (after destroy_process_group) uses fresh keys."""
    ts = _TorchStore(store, timeout)
    generation = (ts.add("arrivals", 1) - 1) // size
    ts.prefix = f"minicomm/{generation}/"
    return ts


def _connect_new_world(ts: _TorchStore, rank: int, size: int, timeout: float) -> Communicator:
    """A minicomm world over ``size`` processes, bootstrapped through a c10d store: rank 0
    publishes a fresh job token and job id; the transports exchange addresses through it."""
    if rank == 0:
        ts.set("boot", json.dumps({"token": new_token().hex(),
                                   "job": f"torch{secrets.token_hex(6)}"}).encode())
    boot = json.loads(ts.get("boot").decode())
    node = os.environ.get("MINICOMM_NODE") or socket.gethostname()
    cfg = dict(rank=rank, size=size, node=node, host=os.environ.get("MINICOMM_HOST") or node,
               topology=None, master_addr="127.0.0.1" if _is_loopback(ts.host) else "0.0.0.0",
               master_port=0, token=boot["token"], host_store=False, job_id=boot["job"],
               transport=os.environ.get("MINICOMM_TRANSPORT", "auto"), timeout=timeout)
    return connect_world(cfg, store=ts)


# Ids of the communicators this module builds on an existing transport: above every id
# Communicator.split allocates ((world rank + 1) << 24 | counter < 2**48), unique per leader.
_TORCH_IDS = 1 << 50
_id_counter = itertools.count(1)


def _on_transport(world: Communicator, ranks: Sequence[int], rank: int, ts: _TorchStore,
                  timeout: float, count: int) -> List[Communicator]:
    """``count`` communicators over the world ranks ``ranks`` (this process is ``ranks[rank]``),
    built on the world's transport by the members alone: the lowest member allocates the ids
    and publishes them in the group's own store."""
    if rank == 0:
        base = _TORCH_IDS + ((world.group[world.rank] + 1) << 24)
        ids = [base + next(_id_counter) % (1 << 24) for _ in range(count)]
        ts.set("ids", json.dumps(ids).encode())
    ids = json.loads(ts.get("ids").decode())
    group = [world.group[r] for r in ranks]
    return [Communicator(world.transport, rank, len(ranks), group=group,
                         topology=[world.topology[r] for r in ranks], comm_id=int(cid),
                         timeout=timeout, check=world.check, link_model=world.link_model,
                         _owner=False) for cid in ids]


# ---------------------------------------------------------------------------------- group
class MinicommProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on minicomm communicators.
    Created by ``dist.init_process_group("minicomm")`` / ``dist.new_group(backend="minicomm")``;
    see the module docstring for what reaches which method."""

    def __init__(self, coll: Communicator, p2p: Communicator, timeout: float,
                 owned: Sequence[Communicator]):
        super().__init__(coll.rank, coll.size)
        self._coll, self._p2p_comm = coll, p2p
        self._owned = list(owned)              # closed by shutdown(), in this order
        self._timeout = timeout
        self._engine = _Engine(f"r{coll.group[coll.rank]}-c{coll.comm_id}", timeout)
        self._p2p_lock = threading.Lock()
        self._group_name = ""
        self._group_desc = "undefined"
        self._shut = False

    # ---- identity (the group-name pitfall: answered from Python, for Python and C++ callers)
    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._group_name = str(name)

    def setGroupName(self, name: str) -> None:
        self._group_name = str(name)

    @property
    def group_name(self) -> str:
        return self._group_name

    def getGroupName(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = str(desc)

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = str(desc)

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def communicator(self) -> Communicator:
        """The minicomm communicator the collectives run on (its rank and size are the group's)."""
        return self._coll

    def __repr__(self):
        return (f"<MinicommProcessGroup {self._group_name or '?'} rank {self.rank()}/"
                f"{self.size()} on {self._coll!r}>")

    # ---- plumbing
    def _launch(self, what: str, outputs: List[torch.Tensor], fn: Callable[[], None],
                opts=None) -> MinicommWork:
        if self._shut:
            raise CommError(f"{what}: the process group was shut down")
        work = MinicommWork(what, outputs, self._engine)
        inline = opts is not None and not getattr(opts, "asyncOp", True)
        self._engine.submit(work, fn, inline)
        return work

    def _op(self, opts, dtype: np.dtype, what: str):
        red = opts.reduceOp
        kind = getattr(red, "op", red)
        if kind not in _OPS:
            raise ValueError(f"{what}: reduce op {red} is not supported by the minicomm backend")
        op = _OPS[kind]
        factor = None
        if kind == _RED.PREMUL_SUM:
            factor = red.factor
            if isinstance(factor, torch.Tensor):
                if factor.numel() != 1:
                    raise ValueError(f"{what}: a PREMUL_SUM factor must have one element")
                factor = factor.item()
            if dtype.kind not in "fc":
                raise TypeError(f"{what}: PREMUL_SUM needs a floating or complex dtype, "
                                f"got {dtype}")
        _ops.check_dtype(op, dtype)
        return op, factor

    def _root(self, root: int, what: str) -> int:
        if not 0 <= int(root) < self.size():
            raise ValueError(f"{what}: root {root} is not a rank of this group "
                             f"(size {self.size()})")
        return int(root)

    @staticmethod
    def _same(ts: Sequence[torch.Tensor], ref: torch.Tensor, what: str) -> None:
        for t in ts:
            if t.numel() != ref.numel() or t.dtype != ref.dtype:
                raise ValueError(f"{what}: every tensor must have {ref.numel()} elements of "
                                 f"{ref.dtype} (the input's), got {t.numel()} of {t.dtype}")

    # ---- allreduce
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = _check_list(tensors, "allreduce")
        ops = [self._op(opts, _np_dtype(t), "allreduce") for t in tensors]
        comm = self._coll

        def run():
            for t, (op, factor) in zip(tensors, ops):
                b = _Buf(t)
                if factor is not None:
                    b.array *= factor
                comm.allreduce(b.array, op=op, out=b.array)
                b.store()
        return self._launch("allreduce", tensors, run, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        """One allreduce per dtype over the tensors packed end to end."""
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        tensors = _check_list(tensors, "allreduce_coalesced")
        groups: "collections.OrderedDict" = collections.OrderedDict()
        for t in tensors:
            groups.setdefault(_np_dtype(t), []).append(t)
        ops = {dt: self._op(opts, dt, "allreduce_coalesced") for dt in groups}
        comm = self._coll

        def run():
            for dt, ts in groups.items():
                op, factor = ops[dt]
                flat = np.empty(sum(t.numel() for t in ts), dtype=dt)
                pos = 0
                for t in ts:
                    torch.from_numpy(flat[pos:pos + t.numel()]).view(t.shape).copy_(_resolved(t))
                    pos += t.numel()
                if factor is not None:
                    flat *= factor
                comm.allreduce(flat, op=op, out=flat)
                pos = 0
                for t in ts:
                    _put(t, flat[pos:pos + t.numel()])
                    pos += t.numel()
        return self._launch("allreduce_coalesced", tensors, run, opts)

    # ---- broadcast / reduce
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = _check_list(tensors, "broadcast")
        root = self._root(opts.rootRank, "broadcast")
        comm, me = self._coll, self.rank()

        def run():
            for t in tensors:
                b = _Buf(t, load=me == root)
                comm.broadcast(b.array, root=root, out=b.array)
                if me != root:
                    b.store()
        return self._launch("broadcast", tensors, run, opts)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = _check_list(tensors, "reduce")
        root = self._root(opts.rootRank, "reduce")
        ops = [self._op(opts, _np_dtype(t), "reduce") for t in tensors]
        comm, me = self._coll, self.rank()

        def run():
            for t, (op, factor) in zip(tensors, ops):
                b = _Buf(t)
                src = b.array * factor if factor is not None else b.array
                comm.reduce(src, root=root, op=op, out=b.array if me == root else None)
                if me == root:
                    b.store()
        return self._launch("reduce", tensors, run, opts)

    # ---- allgather
    def allgather(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i]``: ``size`` tensors receiving every rank's ``input_tensors[i]``."""
        inputs = _check_list(input_tensors, "allgather")
        outputs = [_check_list(o, "allgather", self.size()) for o in output_tensors]
        if len(outputs) != len(inputs):
            raise ValueError(f"allgather: {len(outputs)} output lists for {len(inputs)} inputs")
        for o, i in zip(outputs, inputs):
            self._same(o, i, "allgather")
        comm = self._coll

        def run():
            for o, i in zip(outputs, inputs):
                rows = comm.allgather(_Buf(i).array)
                for t, row in zip(o, rows):
                    _put(t, row)
        return self._launch("allgather", [t for o in outputs for t in o], run, opts)

    def all_gather_single(self, output, input, opts=None):
        """``all_gather_into_tensor``: ``output`` holds the ``size`` inputs end to end."""
        _check_tensor(output, "all_gather_into_tensor")
        _check_tensor(input, "all_gather_into_tensor")
        if output.numel() != self.size() * input.numel() or output.dtype != input.dtype:
            raise ValueError(f"all_gather_into_tensor: output needs {self.size()} x "
                             f"{input.numel()} elements of {input.dtype}, got {output.numel()} "
                             f"of {output.dtype}")
        comm, size = self._coll, self.size()

        def run():
            bo = _Buf(output, load=False)
            bi = _Buf(input)
            comm.allgather(bi.array, out=bo.array.reshape(size, -1))
            bo.store()
        return self._launch("all_gather_into_tensor", [output], run, opts)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        works = [self.allgather([o], [i], opts) for o, i in zip(output_lists, input_list)]
        return works[-1] if works else _DoneWork([])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else _DoneWork([])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce_scatter
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i]`` gets the reduction of every rank's ``input_tensors[i][rank]``."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        outputs = _check_list(output_tensors, "reduce_scatter")
        inputs = [_check_list(i, "reduce_scatter", self.size()) for i in input_tensors]
        if len(outputs) != len(inputs):
            raise ValueError(f"reduce_scatter: {len(inputs)} input lists for {len(outputs)} outputs")
        for o, i in zip(outputs, inputs):
            self._same(i, o, "reduce_scatter")
        ops = [self._op(opts, _np_dtype(o), "reduce_scatter") for o in outputs]
        comm = self._coll

        def run():
            for o, i, (op, factor) in zip(outputs, inputs, ops):
                block = _stack(i, _np_dtype(o))
                if factor is not None:
                    block *= factor
                bo = _Buf(o, load=False)
                comm.reduce_scatter(block, op=op, out=bo.array)
                bo.store()
        return self._launch("reduce_scatter", outputs, run, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        """``reduce_scatter_tensor``: ``input`` holds ``size`` blocks end to end."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        _check_tensor(output, "reduce_scatter_tensor")
        _check_tensor(input, "reduce_scatter_tensor")
        if input.numel() != self.size() * output.numel() or output.dtype != input.dtype:
            raise ValueError(f"reduce_scatter_tensor: input needs {self.size()} x "
                             f"{output.numel()} elements of {output.dtype}, got {input.numel()} "
                             f"of {input.dtype}")
        op, factor = self._op(opts, _np_dtype(output), "reduce_scatter_tensor")
        comm, size = self._coll, self.size()

        def run():
            bi = _Buf(input)
            src = bi.array * factor if factor is not None else bi.array
            bo = _Buf(output, load=False)
            comm.reduce_scatter(src.reshape(size, -1), op=op, out=bo.array)
            bo.store()
        return self._launch("reduce_scatter_tensor", [output], run, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else _DoneWork([])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- alltoall
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``all_to_all_single``: splits count rows of dimension 0 (empty: equal splits)."""
        _check_tensor(output, "all_to_all_single")
        _check_tensor(input, "all_to_all_single")
        if output.dtype != input.dtype:
            raise ValueError(f"all_to_all_single: output dtype {output.dtype} is not the "
                             f"input's {input.dtype}")
        size, comm = self.size(), self._coll
        out_splits, out_row = self._splits(output, output_split_sizes, "output")
        in_splits, in_row = self._splits(input, input_split_sizes, "input")
        if out_row != in_row and output.numel() and input.numel():
            raise ValueError(f"all_to_all_single: input rows have {in_row} elements, output "
                             f"rows {out_row}")
        even = (not output_split_sizes and not input_split_sizes)

        def run():
            bi = _Buf(input)
            bo = _Buf(output, load=False)
            if even:
                comm.alltoall(bi.array.reshape(size, -1), out=bo.array.reshape(size, -1))
            else:
                send = _pieces(bi.array, in_splits, in_row)
                recv = _pieces(bo.array, out_splits, out_row)
                _exchange(comm, send, recv, "all_to_all_single")
            bo.store()
        return self._launch("all_to_all_single", [output], run, opts)

    alltoall_base = all_to_all_single

    def _splits(self, t: torch.Tensor, splits, which: str):
        size = self.size()
        rows = t.shape[0] if t.dim() > 0 else 1
        row = t.numel() // rows if rows else 0
        splits = [int(s) for s in splits] if splits else None
        if splits is None:
            if rows % size:
                raise ValueError(f"all_to_all_single: {which} has {rows} rows, not divisible by "
                                 f"the group size {size} (pass {which}_split_sizes)")
            splits = [rows // size] * size
        if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"all_to_all_single: {which}_split_sizes {splits} must be {size} "
                             f"non-negative row counts summing to {rows}")
        return splits, row

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """List all-to-all: ``output_tensors[j]`` receives rank j's ``input_tensors[rank]``."""
        size, comm = self.size(), self._coll
        outputs = _check_list(output_tensors, "alltoall", size)
        inputs = _check_list(input_tensors, "alltoall", size)
        dts = {t.dtype for t in outputs + inputs}
        if len(dts) > 1:
            raise ValueError(f"alltoall: tensors of several dtypes {sorted(map(str, dts))}")
        dt = _np_dtype(inputs[0])
        uniform = len({t.numel() for t in outputs + inputs}) == 1

        def run():
            if uniform:
                rows = comm.alltoall(_stack(inputs, dt))
                for t, row in zip(outputs, rows):
                    _put(t, row)
            else:
                send = [_Buf(t).array for t in inputs]
                bufs = [_Buf(t, load=False) for t in outputs]
                _exchange(comm, send, [b.array for b in bufs], "alltoall")
                for b in bufs:
                    b.store()
        return self._launch("alltoall", outputs, run, opts)

    # ---- gather / scatter
    def gather(self, output_tensors, input_tensors, opts=None):
        """Root: ``output_tensors[0]`` is ``size`` tensors; other ranks pass ``[]``."""
        opts = opts if opts is not None else dist.GatherOptions()
        inputs = _check_list(input_tensors, "gather", 1)
        root = self._root(opts.rootRank, "gather")
        me, comm = self.rank(), self._coll
        if me == root:
            if len(output_tensors) != 1:
                raise ValueError("gather: the root passes one list of output tensors")
            outs = _check_list(output_tensors[0], "gather", self.size())
            self._same(outs, inputs[0], "gather")
        else:
            if any(len(o) for o in output_tensors):
                raise ValueError("gather: only the root passes output tensors")
            outs = []

        def run():
            rows = comm.gather(_Buf(inputs[0]).array, root=root)
            if me == root:
                for t, row in zip(outs, rows):
                    _put(t, row)
        return self._launch("gather", outs, run, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Root: ``input_tensors[0]`` is ``size`` tensors; other ranks pass ``[]``."""
        opts = opts if opts is not None else dist.ScatterOptions()
        outputs = _check_list(output_tensors, "scatter", 1)
        root = self._root(opts.rootRank, "scatter")
        me, comm = self.rank(), self._coll
        if me == root:
            if len(input_tensors) != 1:
                raise ValueError("scatter: the root passes one list of input tensors")
            ins = _check_list(input_tensors[0], "scatter", self.size())
            self._same(ins, outputs[0], "scatter")
        else:
            if any(len(i) for i in input_tensors):
                raise ValueError("scatter: only the root passes input tensors")
            ins = []

        def run():
            bo = _Buf(outputs[0], load=False)
            block = _stack(ins, _np_dtype(outputs[0])) if me == root else None
            comm.scatter(block, root=root, out=bo.array)
            bo.store()
        return self._launch("scatter", outputs, run, opts)

    # ---- barrier
    def barrier(self, opts=None):
        comm = self._coll
        return self._launch("barrier", [], comm.barrier, opts)

    # ---- dist._coalescing_manager(device=...): torch records the ops and calls the coalesced
    # methods above itself; these two only bracket them (the C++ ones need a C++ backend)
    def _start_coalescing(self, device=None) -> None:
        pass

    def _end_coalescing(self, device=None):
        """A work that completes once everything issued before it has (the queue is FIFO)."""
        return self._launch("end of coalescing", [], lambda: None)

    # ---- point to point (caller's thread, second communicator)
    def _p2p_tag(self, tag: int, what: str) -> int:
        if not 0 <= int(tag) < 2 ** 31:
            raise ValueError(f"{what}: tag {tag} must be in 0..2**31-1 for the minicomm backend")
        return int(tag)

    def _p2p_acquire(self, what: str) -> None:
        if not self._p2p_lock.acquire(timeout=self._timeout + 60.0):
            raise CommTimeout(f"{what}: another thread held this group's send/recv for "
                              f"{self._timeout + 60.0:g} s")

    def send(self, tensors, dst: int, tag: int = 0):
        t = _check_list(tensors, "send", 1)[0]
        tag = self._p2p_tag(tag, "send")
        b = _Buf(t)                             # staged now: the caller may reuse t at once
        self._p2p_acquire("send")
        try:
            mc = self._p2p_comm.isend(b.array, int(dst), tag)
        finally:
            self._p2p_lock.release()
        return _P2PWork(f"send to rank {dst} (tag {tag})", self, mc, keep=b)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._recv(tensors, int(src), tag, "recv")

    def recv_anysource(self, tensors, tag: int = 0):
        return self._recv(tensors, ANY_SOURCE, tag, "recv_anysource")

    def _recv(self, tensors, src: int, tag: int, what: str):
        t = _check_list(tensors, what, 1)[0]
        tag = self._p2p_tag(tag, what)
        b = _Buf(t, load=False)
        self._p2p_acquire(what)
        try:
            mc = self._p2p_comm.irecv(src, tag, out=b.array)
        finally:
            self._p2p_lock.release()
        source = "any source" if src == ANY_SOURCE else f"rank {src}"
        return _P2PWork(f"recv from {source} (tag {tag})", self, mc, on_done=b.store, keep=b)

    def _p2p_wait(self, work: _P2PWork, secs: Optional[float]) -> None:
        self._p2p_acquire(work.description)
        try:
            work._complete(secs)
        finally:
            self._p2p_lock.release()

    # ---- lifetime
    def shutdown(self) -> None:
        """``destroy_process_group``: run what is queued, then close the communicators."""
        if self._shut:
            return
        self._shut = True
        finished = self._engine.close(self._timeout + 30.0)
        for comm in self._owned:
            try:
                if not finished:
                    comm.abort("process group destroyed while a collective was running")
                comm.close()
            except CommError:
                pass

    def abort(self) -> None:
        """Fail what runs and what is queued now; later calls raise."""
        for comm in self._owned:
            try:
                comm.abort("torch.distributed process group aborted")
            except CommError:
                pass
        self.shutdown()


def _pieces(flat: np.ndarray, splits: Sequence[int], row: int) -> List[np.ndarray]:
    out, pos = [], 0
    for s in splits:
        out.append(flat[pos:pos + s * row])
        pos += s * row
    return out


def _exchange(comm: Communicator, send: Sequence[np.ndarray], recv: Sequence[np.ndarray],
              what: str) -> None:
    """Uneven all-to-all on ``comm``'s point-to-point context (worker thread only): every pair
    exchanges one message, zero-length ones included, so a rank that expects a different size
    than its peer sends is a MismatchError. Any failure breaks the communicator (this is a
    collective: its messages must never be matched by a later one)."""
    me, size = comm.rank, comm.size
    try:
        recvs = [comm.irecv(j, 0, out=recv[j]) for j in range(size)]
        sends = [comm.isend(send[(me + k) % size], (me + k) % size, 0) for k in range(size)]
        for w in sends:
            w.wait()
        for j, w in enumerate(recvs):
            try:
                w.wait()
            except (ValueError, TypeError) as e:
                raise MismatchError(f"{what}: rank {j} sent a block this rank did not expect "
                                    f"(its split sizes disagree with ours): {e}") from None
    except BaseException as e:
        comm.abort(f"{what} failed: {type(e).__name__}: {e}")
        raise


# ---------------------------------------------------------------------------------- creator
def _default_group() -> Optional[MinicommProcessGroup]:
    if not dist.is_initialized():
        return None
    pg = dist.distributed_c10d._get_default_group()
    return pg if isinstance(pg, MinicommProcessGroup) and not pg._shut else None


def _create(dist_opts, backend_options=None) -> MinicommProcessGroup:
    """torch's backend creator (extended API): the default group builds a minicomm world through
    torch's store; a sub-group of a minicomm world builds its communicators on that world."""
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    timeout = dist_opts.timeout.total_seconds() if dist_opts.timeout is not None else 1800.0
    ranks = list(dist_opts.global_ranks_in_group)
    parent = _default_group()
    ts = _store_generation(dist_opts.store, size, timeout)
    if ranks and parent is not None:
        coll, p2p = _on_transport(parent._coll, ranks, rank, ts, timeout, 2)
        return MinicommProcessGroup(coll, p2p, timeout, owned=[p2p, coll])
    world = _connect_new_world(ts, rank, size, timeout)
    try:
        (p2p,) = _on_transport(world, list(range(size)), rank, ts, timeout, 1)
    except BaseException:
        world.close()
        raise
    return MinicommProcessGroup(world, p2p, timeout, owned=[p2p, world])


def register() -> None:
    """Register the backend ``"minicomm"`` with torch.distributed (idempotent; done on import)."""
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


register()
