"""One server's shard and its consistency state machine: clocks, queues, aggregation, updates.

``Shard`` holds the pieces a server owns (params, optimizer state, receive buffers), a clock per
worker (pushes received from it) and a FIFO of requests per worker. It does no I/O of its own: the
server loop hands it decoded frames (``submit``) and deaths (``worker_failed``), and it talks back
through an ``io`` object, so tests drive it with fake requests and no communicator:

    h = io.post_payload(worker, seq, bufs)     # post receives of request seq's data into bufs
    io.payload_done(h) -> bool                 # all arrived (or failed)? never blocks
    io.finish_payload(h)                       # raise Refuse / PeerFailure if it failed
    io.respond(worker, seq, frame, arrays=())  # a response frame, then raw arrays (not copied:
                                               # the shard leaves them untouched until settle())
    io.settle() -> [dead ranks]                # wait for every response sent so far

Receives are posted as soon as a request may proceed and completed later (``receiving`` lists
them oldest first; the server loop waits on the oldest), so the gradients of several workers
stream in at once. Each lands in a buffer of its own from a per-piece pool.

Consistency (``staleness``), enforced per worker clock c_w = pushes received from w:

  * ``0`` (BSP): a push at clock t is accumulated (the first worker's buffer simply becomes the
    accumulator, no copy; the others' are added to it); when every active worker has pushed t,
    the sum divided by the number of contributors goes through the optimizer once, and every push
    of clock t is answered. A push for t+1 waits in its worker's queue (its data
    still unread) until t is applied. A pull at clock c waits until clock c-1 is applied.
  * ``None`` (async): each push is one optimizer step on that gradient, on arrival, no 1/W.
  * ``k`` (SSP): pushes as in async; a pull by a worker at clock c waits until the slowest active
    worker has c_w >= c - k. A worker thus never runs more than k+1 pushes ahead of the slowest.

A worker's requests are served in order (a blocked one blocks those behind it), so a reply's
clock is exactly the requester's. A push's pieces are all received before any is applied, so a
refused or interrupted push changes nothing. Failures: a dead worker in async/SSP mode is dropped
(its clock no longer holds anyone back). In BSP mode ``on_worker_failure`` decides: "fail" (the
default): the clock can never complete, so every waiting and later request is answered with a
PEER_FAILED error naming it ("broken"); "drop": the worker is dropped as in async mode, the clock
it held back is applied with the gradients that arrived (a push it completed before it died
counts), divided by the number of those contributors, and the survivors go on. Closing workers are
answered even then. A worker whose initial values never arrived breaks the shard in every mode.

Cost per push of M bytes held here: M received, one add of M (BSP, from the second worker on),
one optimizer pass; per pull M sent straight from the params (zero copy). Memory: params,
optimizer state, the accumulator and up to one receive buffer per worker in flight.
"""
from __future__ import annotations

import copy
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import PeerFailure
from . import wire
from .checkpoint import CheckpointError
from .optimizers import Optimizer
from .sharding import KeySpec, Piece, Plan

NEW, INITED, CLOSED, DEAD = "new", "inited", "closed", "dead"
ON_WORKER_FAILURE = ("fail", "drop")      # what BSP does with a dead worker (module docstring)
MAX_SHARD_BYTES = 1 << 40


class Refuse(Exception):
    """A request that is answered with an error frame (code, message, peer)."""

    def __init__(self, code: int, message: str, peer: int = -1):
        super().__init__(message)
        self.code, self.message, self.peer = code, message, peer


class _Request:
    __slots__ = ("worker", "frame", "pieces", "pulling", "receiving", "bufs")

    def __init__(self, worker: int, frame: wire.Frame):
        self.worker, self.frame = worker, frame
        self.pieces: Optional[List[Piece]] = None     # validated against the plan, once
        self.pulling = frame.opcode == wire.PULL      # a pushpull turns into a pull
        self.receiving = None                         # io handle of its data, while in flight
        self.bufs: List[np.ndarray] = []


class Shard:
    """The state of one server (see the module docstring)."""

    def __init__(self, server: int, num_servers: int, workers: Sequence[int],
                 staleness: Optional[int], optimizer: Optimizer, chunk_bytes: int, io,
                 after_update: Optional[Callable[["Shard"], None]] = None,
                 on_worker_failure: str = "fail"):
        if not workers:
            raise ValueError("a parameter server needs at least one worker")
        if on_worker_failure not in ON_WORKER_FAILURE:
            raise ValueError(f"on_worker_failure={on_worker_failure!r}: choose one of "
                             f"{', '.join(ON_WORKER_FAILURE)}")
        self.drop_dead = on_worker_failure == "drop"
        self.server, self.num_servers, self.chunk_bytes = server, num_servers, chunk_bytes
        self.workers = tuple(sorted(workers))
        self.lowest = self.workers[0]
        self.staleness = staleness
        self.sync = staleness == 0
        self.optimizer = optimizer
        self.io = io
        self.after_update = after_update
        self.status: Dict[int, str] = {w: NEW for w in self.workers}
        self.queues: Dict[int, Deque[_Request]] = {w: deque() for w in self.workers}
        self.clocks: Dict[int, int] = {w: 0 for w in self.workers}
        self.applied = 0             # BSP: clocks fully applied
        self.updates = 0             # optimizer applications (BSP: one per clock; else per push)
        self.plan: Optional[Plan] = None
        self.held: Dict[Tuple[str, int], Piece] = {}
        self.params: Dict[Tuple[str, int], np.ndarray] = {}
        self.opt_state: Dict[Tuple[str, int], Dict[str, np.ndarray]] = {}
        self.acc: Dict[Tuple[str, int], np.ndarray] = {}
        self.pool: Dict[Tuple[str, int], List[np.ndarray]] = {}     # free receive buffers
        self.receiving: List[_Request] = []         # requests whose data is in flight, oldest first
        self.touched: set = set()
        self.contributors = 0
        self.waiting: List[Tuple[int, int, int, List[Piece]]] = []   # BSP pushes awaiting apply
        self.init_waiting: List[Tuple[int, int]] = []
        self.init_done = False
        self.have_values = False
        self.resumed = False
        self.broken: Optional[Tuple[int, str, int]] = None
        self.max_lead = 0            # max over time of (fastest - slowest) active clock
        self._deaths: List[int] = []

    # ------------------------------------------------------------------ views
    def active(self) -> List[int]:
        return [w for w in self.workers if self.status[w] in (NEW, INITED)]

    @property
    def done(self) -> bool:
        return all(self.status[w] in (CLOSED, DEAD) for w in self.workers)

    def lead(self) -> int:
        cs = [self.clocks[w] for w in self.active()]
        return max(cs) - min(cs) if cs else 0

    # ------------------------------------------------------------------ input
    def submit(self, worker: int, message) -> None:
        """A frame arrived from ``worker``: queue it, or refuse it at once if it is malformed."""
        try:
            frame = wire.decode(message)
        except wire.ProtocolError as e:
            self._refuse(worker, _seq_guess(message), wire.PROTOCOL, f"malformed request: {e}")
            return
        if worker not in self.status:
            self._refuse(worker, frame.seq, wire.PROTOCOL,
                         f"rank {worker} is not a worker of this parameter server")
            return
        if self.status[worker] in (CLOSED, DEAD):
            self._refuse(worker, frame.seq, wire.STATE, f"worker {worker} has already closed")
            return
        self.queues[worker].append(_Request(worker, frame))

    def worker_failed(self, worker: int) -> None:
        """The transport reported ``worker`` dead."""
        if worker in self.status:
            self._deaths.append(worker)
            self.progress()

    # ------------------------------------------------------------------ the engine
    def progress(self) -> None:
        """Serve every queued request that can be served now, until nothing moves."""
        moved = True
        while moved:
            moved = self._handle_deaths()
            for w in self.workers:
                q = self.queues[w]
                while q:
                    req = q[0]
                    try:
                        finished = self._step(w, req)
                    except Refuse as e:
                        q.popleft()
                        if req in self.receiving:     # refused while its data was arriving
                            self.receiving.remove(req)
                        self._refuse(w, req.frame.seq, e.code, e.message, e.peer)
                        moved = True
                        continue
                    except PeerFailure as e:       # w died while we received its data
                        peer = getattr(e, "peer", None)
                        self._deaths.append(peer if peer in self.status else w)
                        moved = True
                        break
                    if not finished:
                        break
                    q.popleft()
                    moved = True
            moved = self._handle_deaths() or moved

    def _step(self, w: int, req: _Request) -> bool:
        """Try to serve ``req`` (head of ``w``'s queue); False = it must wait."""
        f = req.frame
        if f.opcode == wire.CLOSE:
            self._close(w, f.seq)
            return True
        if self.broken is not None:
            raise Refuse(*self.broken)
        if f.opcode == wire.INIT:
            return self._init(w, req)
        if not self.init_done:
            raise Refuse(wire.STATE, f"{f.name} before init completed")
        if req.pieces is None:
            req.pieces = self._check_pieces(f)
            if f.clock != self.clocks[w]:
                raise Refuse(wire.PROTOCOL, f"{f.name} at clock {f.clock}: this server has "
                             f"worker {w} at clock {self.clocks[w]}")
        if req.pulling:
            return self._pull(w, f.seq, req.pieces)
        if self.sync and self.clocks[w] > self.applied:
            return False                   # its clock t+1: wait until t is applied
        if not self._received(req):
            return False
        if self.sync:
            self._push_sync(w, f, req)
            return True
        self._push_async(w, f, req)
        if f.opcode == wire.PUSH:
            self.io.respond(w, f.seq, wire.encode(wire.OK, f.seq, clock=self.clocks[w]))
            return True
        req.pulling = True
        return self._pull(w, f.seq, req.pieces)

    # ------------------------------------------------------------------ requests
    def _check_pieces(self, f: wire.Frame) -> List[Piece]:
        out = []
        for ref in f.pieces:
            p = self.held.get((ref.name, ref.piece))
            if p is None:
                if self.plan is not None and ref.name not in self.plan.specs:
                    raise Refuse(wire.PROTOCOL, f"{f.name}: unknown key {ref.name!r}")
                raise Refuse(wire.PROTOCOL, f"{f.name}: server {self.server} holds no piece "
                             f"{ref.piece} of key {ref.name!r}")
            if ref.count != p.count or ref.dtype != p.dtype:
                raise Refuse(wire.PROTOCOL, f"{f.name}: piece {ref.piece} of {ref.name!r} is "
                             f"{p.count} x {p.dtype}, request says {ref.count} x {ref.dtype}")
            out.append(p)
        return out

    def _pull_ready(self, clock: int) -> bool:
        if self.staleness is None:
            return True
        if self.sync:
            return self.applied >= clock
        cs = [self.clocks[w] for w in self.active()]
        return not cs or min(cs) >= clock - self.staleness

    def _pull(self, w: int, seq: int, pieces: List[Piece]) -> bool:
        if not self._pull_ready(self.clocks[w]):
            return False
        self._send_values(w, seq, pieces)
        return True

    def _send_values(self, w: int, seq: int, pieces: List[Piece]) -> None:
        refs = [wire.PieceRef(p.name, p.index, p.count, p.dtype) for p in pieces]
        self.io.respond(w, seq, wire.encode(wire.OK, seq, clock=self.clocks[w], pieces=refs),
                        [self.params[(p.name, p.index)] for p in pieces])

    def _received(self, req: _Request, into: Optional[List[np.ndarray]] = None) -> bool:
        """Post the receives of ``req``'s data (once), then: has all of it arrived? Raises
        Refuse / PeerFailure if it failed; its buffers are then dropped, not reused (a receive
        of theirs may still be posted)."""
        if req.receiving is None:
            if into is None:
                into = [self._buffer((p.name, p.index)) for p in req.pieces]
            req.bufs = into
            req.receiving = self.io.post_payload(req.worker, req.frame.seq, into)
            self.receiving.append(req)
        if not self.io.payload_done(req.receiving):
            return False
        self.receiving.remove(req)
        handle, req.receiving = req.receiving, None
        try:
            self.io.finish_payload(handle)
        except BaseException:
            req.bufs = []
            raise
        return True

    def _buffer(self, key: Tuple[str, int]) -> np.ndarray:
        free = self.pool[key]
        if free:
            return free.pop()
        p = self.held[key]
        return np.empty(p.count, p.dtype)

    def _push_sync(self, w: int, f: wire.Frame, req: _Request) -> None:
        # Everything arrived before anything changes: a push that failed half way changed nothing.
        for p, buf in zip(req.pieces, req.bufs):
            key = (p.name, p.index)
            if key in self.touched:
                self.acc[key] += buf
                self.pool[key].append(buf)
            else:                          # the first gradient of this clock: it is the sum
                old = self.acc.get(key)
                self.acc[key] = buf
                self.touched.add(key)
                if old is not None:
                    self.pool[key].append(old)
        req.bufs = []
        self.clocks[w] += 1
        self.contributors += 1
        self.waiting.append((w, f.seq, f.opcode, req.pieces))
        self.max_lead = max(self.max_lead, self.lead())
        self._maybe_apply()

    def _maybe_apply(self) -> None:
        if not self.sync or self.contributors == 0:
            return
        if any(self.clocks[w] <= self.applied for w in self.active()):
            return
        self._deaths.extend(self.io.settle())
        scale = 1.0 / self.contributors
        for key in sorted(self.touched):
            self.optimizer.step(self.params[key], self.acc[key], self.opt_state[key], scale)
        self.touched.clear()
        self.contributors = 0
        self.applied += 1
        self.updates += 1
        self._updated()
        waiting, self.waiting = self.waiting, []
        for w, seq, opcode, pieces in waiting:
            if self.status[w] == DEAD:
                continue
            if opcode == wire.PUSH:
                self.io.respond(w, seq, wire.encode(wire.OK, seq, clock=self.clocks[w]))
            else:
                self._send_values(w, seq, pieces)

    def _push_async(self, w: int, f: wire.Frame, req: _Request) -> None:
        self._deaths.extend(self.io.settle())
        for p, buf in zip(req.pieces, req.bufs):
            key = (p.name, p.index)
            self.optimizer.step(self.params[key], buf, self.opt_state[key], 1.0)
            self.pool[key].append(buf)
        req.bufs = []
        self.clocks[w] += 1
        self.updates += 1
        self.max_lead = max(self.max_lead, self.lead())
        self._updated()

    def _updated(self) -> None:
        if self.after_update is not None:
            self.after_update(self)

    # ------------------------------------------------------------------ init / close
    def _init(self, w: int, req: _Request) -> bool:
        f = req.frame
        if req.receiving is not None:          # its values are arriving
            return self._received(req) and self._init_values_arrived(w, req)
        if self.init_done or self.status[w] == INITED:
            raise Refuse(wire.STATE, "init was already called")
        table = tuple(sorted(f.keys, key=lambda s: s.name.encode("utf-8")))
        if self.plan is None:
            self._install(table)
        elif table != self.plan.table:
            why = _table_difference(self.plan.table, table)
            self._break(wire.MISMATCH, f"worker {w} called init with other keys than "
                        f"{'the checkpoint' if self.resumed else 'another worker'}: {why}")
            raise Refuse(*self.broken)
        if f.flags & wire.HAS_VALUES:
            if w != self.lowest:
                raise Refuse(wire.PROTOCOL, f"only the lowest-ranked worker ({self.lowest}) "
                             f"sends initial values, not {w}")
            mine = self.plan.on_server(self.server)
            req.pieces = mine
            # straight into the params (after a resume: into scratch, the checkpoint wins)
            into = [self._buffer((p.name, p.index)) if self.resumed
                    else self.params[(p.name, p.index)] for p in mine]
            return self._received(req, into) and self._init_values_arrived(w, req)
        if w == self.lowest and not self.resumed:
            raise Refuse(wire.PROTOCOL, "the lowest-ranked worker's init must carry the values")
        return self._inited(w, f.seq)

    def _init_values_arrived(self, w: int, req: _Request) -> bool:
        if self.resumed:
            for p, buf in zip(req.pieces, req.bufs):
                self.pool[(p.name, p.index)].append(buf)
        req.bufs = []
        self.have_values = True
        return self._inited(w, req.frame.seq)

    def _inited(self, w: int, seq: int) -> bool:
        self.status[w] = INITED
        self.init_waiting.append((w, seq))
        self._maybe_finish_init()
        return True

    def _install(self, table: Tuple[KeySpec, ...]) -> None:
        try:
            plan = Plan(table, self.num_servers, self.chunk_bytes)
        except (ValueError, TypeError) as e:
            raise Refuse(wire.PROTOCOL, f"init: {e}") from None
        mine = plan.on_server(self.server)
        if sum(p.nbytes for p in mine) > MAX_SHARD_BYTES:
            raise Refuse(wire.PROTOCOL, "init: the shard would exceed 1 TiB")
        try:
            for p in mine:
                key = (p.name, p.index)
                self.params[key] = np.zeros(p.count, p.dtype)
                self.opt_state[key] = self.optimizer.new_state(p.count, p.dtype)
                self.pool[key] = []
        except MemoryError:
            self.params.clear(), self.opt_state.clear(), self.pool.clear()
            raise Refuse(wire.PROTOCOL, "init: not enough memory for the shard") from None
        self.plan = plan
        self.held = {(p.name, p.index): p for p in mine}

    def _maybe_finish_init(self) -> None:
        if self.init_done or self.plan is None:
            return
        if any(self.status[w] == NEW for w in self.workers):
            return
        if not (self.resumed or self.have_values):
            if self.status[self.lowest] in (CLOSED, DEAD):
                self._break(wire.PEER_FAILED, f"worker {self.lowest} (whose values init uses) "
                            f"is gone before sending them", self.lowest)
            return
        self.init_done = True
        waiting, self.init_waiting = self.init_waiting, []
        for w, seq in waiting:
            if self.status[w] == INITED:
                self.io.respond(w, seq, wire.encode(wire.OK, seq, clock=self.clocks[w],
                                                    flags=wire.RESUMED if self.resumed else 0))

    def _close(self, w: int, seq: int) -> None:
        self.status[w] = CLOSED
        self.io.respond(w, seq, wire.encode(wire.OK, seq, clock=self.clocks[w]))
        if self.broken is None:
            self._maybe_finish_init()
            self._maybe_apply()

    # ------------------------------------------------------------------ failures
    def _handle_deaths(self) -> bool:
        moved = False
        while self._deaths:
            w = self._deaths.pop()
            if self.status.get(w) in (None, CLOSED, DEAD):
                continue
            moved = True
            self.status[w] = DEAD
            self.queues[w].clear()
            self.receiving = [r for r in self.receiving if r.worker != w]
            self.waiting = [x for x in self.waiting if x[0] != w]
            self.init_waiting = [x for x in self.init_waiting if x[0] != w]
            lost_init_values = (not self.init_done and w == self.lowest
                                and not (self.have_values or self.resumed))
            if lost_init_values or (self.sync and not self.drop_dead):
                self._break(wire.PEER_FAILED, f"worker rank {w} failed", w)
            if self.broken is None:
                self._maybe_finish_init()
                # drop: the clock w held back completes with the contributions that arrived
                self._maybe_apply()
        return moved

    def _break(self, code: int, message: str, peer: int = -1) -> None:
        """The job cannot go on (BSP lost a worker; init mismatch): refuse everything waiting."""
        if self.broken is None:
            self.broken = (code, message, peer)
        for w, seq, _, _ in self.waiting:
            self._refuse(w, seq, *self.broken)
        for w, seq in self.init_waiting:
            self._refuse(w, seq, *self.broken)
        self.waiting, self.init_waiting = [], []

    def _refuse(self, w: int, seq: int, code: int, message: str, peer: int = -1) -> None:
        self.io.respond(w, seq, wire.error_frame(seq, code, message, peer))

    # ------------------------------------------------------------------ checkpoints
    def config(self) -> dict:
        return {"num_servers": self.num_servers, "workers": list(self.workers),
                "chunk_bytes": self.chunk_bytes, "staleness": self.staleness,
                "optimizer": _optimizer_config(self.optimizer)}

    def snapshot(self) -> Tuple[dict, Dict[str, np.ndarray]]:
        """(metadata, arrays) of the shard as of now: what a checkpoint stores."""
        if self.plan is None:
            raise ValueError("nothing to snapshot before init")
        pieces = self.plan.on_server(self.server)
        meta = dict(self.config(), applied=self.applied,
                    clocks=[[w, self.clocks[w]] for w in self.workers],
                    table=[[s.name, s.dtype.str, list(s.shape)] for s in self.plan.table],
                    pieces=[[p.name, p.index] for p in pieces])
        arrays = {}
        for i, p in enumerate(pieces):
            key = (p.name, p.index)
            arrays[f"p{i}"] = self.params[key]
            for name, a in self.opt_state[key].items():
                arrays[f"s{i}.{name}"] = a
        return meta, arrays

    def restore(self, meta: dict, arrays: Dict[str, np.ndarray], source: str = "") -> None:
        """Load a snapshot (from ``checkpoint.read``); ``CheckpointError`` if it does not fit."""
        where = source or "checkpoint"
        mine = self.config()
        for k, v in mine.items():
            if meta.get(k) != v:
                raise CheckpointError(f"{where} was written with {k}={meta.get(k)!r}, this job "
                                      f"has {k}={v!r}")
        if meta.get("server") not in (None, self.server):
            raise CheckpointError(f"{where} belongs to server {meta.get('server')}")
        try:
            table = tuple(KeySpec(str(n), np.dtype(d), tuple(int(x) for x in shp))
                          for n, d, shp in meta["table"])
            clocks = {int(w): int(c) for w, c in meta["clocks"]}
            applied, updates = int(meta["applied"]), int(meta["updates"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: bad metadata ({e})") from None
        try:
            self._install(table)
        except Refuse as e:
            raise CheckpointError(f"{where}: {e.message}") from None
        pieces = self.plan.on_server(self.server)
        if meta.get("pieces") != [[p.name, p.index] for p in pieces]:
            raise CheckpointError(f"{where}: its pieces are not this server's")
        for i, p in enumerate(pieces):
            key = (p.name, p.index)
            _load_into(self.params[key], arrays, f"p{i}", where)
            for name, a in self.opt_state[key].items():
                _load_into(a, arrays, f"s{i}.{name}", where)
        if set(clocks) != set(self.workers):
            raise CheckpointError(f"{where}: clocks of other workers")
        self.clocks, self.applied, self.updates = clocks, applied, updates
        self.resumed = True


def _optimizer_config(opt) -> dict:
    try:
        return opt.config()
    except NotImplementedError:
        return {"name": type(opt).__name__}


def _load_into(dst: np.ndarray, arrays: Dict[str, np.ndarray], name: str, where: str) -> None:
    a = arrays.get(name)
    if a is None or a.shape != dst.shape or a.dtype != dst.dtype:
        got = "missing" if a is None else f"{a.dtype} {a.shape}"
        raise CheckpointError(f"{where}: array {name} is {got}, expected {dst.dtype} {dst.shape}")
    dst[...] = a


def _seq_guess(message) -> int:
    """The seq field of a frame too broken to decode (so its sender can match the refusal)."""
    try:
        raw = np.asarray(message).view(np.uint8).reshape(-1)
        return int.from_bytes(raw[8:12].tobytes(), "little") if raw.size >= 12 else 0
    except (ValueError, TypeError):
        return 0


def _table_difference(a: Sequence[KeySpec], b: Sequence[KeySpec]) -> str:
    da, db = {s.name: s for s in a}, {s.name: s for s in b}
    missing, extra = sorted(set(da) - set(db)), sorted(set(db) - set(da))
    if missing or extra:
        return f"missing {missing}, extra {extra}"
    for n in sorted(da):
        if da[n] != db[n]:
            return (f"key {n!r} is {da[n].dtype} {da[n].shape} there, "
                    f"{db[n].dtype} {db[n].shape} here")
    return "same keys"


def clone_optimizer(opt: Optimizer) -> Optimizer:
    """Each server gets its own optimizer (their scratch buffers must not be shared)."""
    return copy.deepcopy(opt)
