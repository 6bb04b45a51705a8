"""The worker side: ``init``, ``pull``, ``push``, ``pushpull``, ``wait``, ``close``.

Every call computes, from the sharding plan, which pieces of which keys each server holds, posts
the receives for the answers first (response frames, and for pulls the data straight into slices
of the result arrays), then sends one frame per server and the gradient pieces as raw numpy
messages (views of the caller's arrays, not copies, when they are contiguous and of the key's
dtype). A push goes to *every* server, with an empty piece list where a server holds none of the
pushed keys, so every server sees every clock of every worker.

Clocks: the worker counts its pushes per server (equal across servers except after an
asynchronous job resumed from checkpoints taken at different times); ``clock`` is their maximum.

Restrictions: one thread per Worker (its communicator is MPI_THREAD_SERIALIZED). After
``push(g, wait=False)`` the arrays in ``g`` must stay unchanged until ``wait(ts)`` returns. Keys
and their shapes and dtypes are fixed by ``init``; gradients are cast to the key's dtype. At most
12288 keys (names of 1..1024 utf-8 bytes, up to 32 dimensions), and no server may hold more
pieces than one frame names (``wire.check_fits``, checked by ``init`` before anything is sent).

Cost per step (model of M bytes, W workers, k servers): push + pull move 2M per worker; each
server link carries 2M·W/k; one frame of 28 + ~(16 + name) bytes per piece per server each way.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import MismatchError, PeerFailure
from . import wire
from .sharding import KeySpec, Piece, Plan, key_table


class _Outstanding:
    """What one request is waiting for: per server, the response frame and the data."""
    __slots__ = ("what", "seq", "parts", "sends", "result", "pull", "refused")

    def __init__(self, what: str, seq: int, pull: bool):
        self.what, self.seq, self.pull = what, seq, pull
        self.refused: List[int] = []          # servers that answered with an error frame
        self.parts: List[Tuple[int, object, List[object], List[Piece]]] = []
        self.sends: List[Tuple[int, object]] = []
        self.result: Optional[Dict[str, np.ndarray]] = None


class Worker:
    """A worker's handle on the parameter servers (``ps.start`` returns it on worker ranks).

    One thread per worker. Keys, their shapes and dtypes are fixed by ``init``; gradients are
    cast to the key's dtype. A worker is a context manager that closes on exit.

    Attributes:
        rank (int): This worker's rank in the job's communicator.
        num_servers (int): How many servers hold the keys.
        staleness (int | None): The consistency model (see ``ps.start``).
        resumed (bool): Whether the servers restarted from a checkpoint.

    Examples:
        >>> kv = ps.start(comm, num_servers=1)  # doctest: +SKIP
        >>> if kv is not None:  # doctest: +SKIP
        ...     with kv:
        ...         kv.init({"w": np.zeros(2)})
        ...         new = kv.pushpull({"w": np.ones(2)})
    """

    def __init__(self, comm, num_servers: int, workers: Sequence[int], staleness,
                 chunk_bytes: int):
        self._comm = comm
        self.rank = comm.rank
        self.num_servers = num_servers
        self.workers = tuple(workers)
        self.staleness = staleness
        self.chunk_bytes = chunk_bytes
        self.timeout = comm.timeout
        self.plan: Optional[Plan] = None
        self.resumed = False
        self._clocks = [0] * num_servers
        self._seq = 0
        self._outstanding: Dict[int, _Outstanding] = {}
        self._closed = False

    def __repr__(self):
        return (f"<ps.Worker rank {self.rank}, {self.num_servers} servers, "
                f"staleness={self.staleness}, clock={self.clock}>")

    # ------------------------------------------------------------------ properties
    @property
    def clock(self) -> int:
        """Pushes this worker has made (after a resume: counted from the checkpoint).

        Returns:
            (int): The clock; under staleness k a pull waits for the slowest worker to be within k.
        """
        return max(self._clocks)

    @property
    def keys(self) -> List[str]:
        """The names of the keys ``init`` gave, in the plan's order (by utf-8 name).

        Returns:
            (list): The key names; empty before ``init``.
        """
        return [s.name for s in self.plan.table] if self.plan else []

    # ------------------------------------------------------------------ plumbing
    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & wire.SEQ_MASK
        return self._seq

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"ps.Worker.{what}: the worker is closed")

    def _check_ready(self, what: str) -> None:
        self._check_open(what)
        if self.plan is None:
            raise RuntimeError(f"ps.Worker.{what}: call init() first")

    def _post(self, req: _Outstanding, server: int, frame: np.ndarray, payload: Sequence,
              pieces: Sequence[Piece] = (), results: Optional[Dict[str, np.ndarray]] = None):
        """Receives first (the answer, then its data into the result arrays), then the sends."""
        comm = self._comm
        head = comm.irecv(server, tag=wire.tag(wire.RESPONSE, req.seq))
        data = []
        if results is not None:
            t = wire.tag(wire.RESPONSE_DATA, req.seq)
            for p in pieces:
                flat = results[p.name].reshape(-1)
                data.append(comm.irecv(server, tag=t, out=flat[p.offset:p.offset + p.count]))
        req.parts.append((server, head, data, list(pieces)))
        req.sends.append((server, comm.isend(frame, server, tag=wire.REQUEST_TAG)))
        t = wire.tag(wire.PUSH_DATA, req.seq)
        for a in payload:
            req.sends.append((server, comm.isend(a, server, tag=t)))

    def _complete(self, req: _Outstanding, expect_pieces: bool) -> List[wire.Frame]:
        """Wait for every part of ``req``; raise the first server's error after all are in."""
        errors: List[BaseException] = []
        frames = []
        for server, work in req.sends:
            try:
                work.wait(timeout=self.timeout)
            except PeerFailure as e:
                errors.append(e)
        for server, head, data, pieces in req.parts:
            try:
                frame = wire.decode(head.wait(timeout=self.timeout), expect_response=True)
                if frame.seq != req.seq:
                    raise wire.ProtocolError(f"server {server} answered request {frame.seq} "
                                             f"for {req.seq}")
                if frame.opcode == wire.ERROR:
                    req.refused.append(server)
                    raise _error_of(frame, server, req.what)
                if expect_pieces:
                    got = [(r.name, r.piece, r.count) for r in frame.pieces]
                    if got != [(p.name, p.index, p.count) for p in pieces]:
                        raise wire.ProtocolError(f"server {server} answered {req.what} with "
                                                 f"other pieces than asked for")
                for w in data:
                    w.wait(timeout=self.timeout)
                frames.append(frame)
            except Exception as e:   # every server's answer is collected before raising
                errors.append(e)
        if errors:
            raise errors[0]
        return frames

    def _gradients(self, grads: Mapping[str, object], what: str) -> Dict[str, np.ndarray]:
        if not isinstance(grads, Mapping):
            raise TypeError(f"ps.Worker.{what}: expected a dict of {{name: array}}")
        if not grads:
            raise ValueError(f"ps.Worker.{what}: no gradients given")
        out = {}
        for name, g in grads.items():
            spec = self._spec(name, what)
            arr = np.asarray(g)
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"ps.Worker.{what}: gradient of {name!r} has dtype {arr.dtype}")
            if arr.shape != spec.shape:
                raise ValueError(f"ps.Worker.{what}: gradient of {name!r} has shape {arr.shape}, "
                                 f"the key has {spec.shape}")
            out[name] = np.ascontiguousarray(arr, dtype=spec.dtype).reshape(-1)
        return out

    def _spec(self, name, what: str) -> KeySpec:
        spec = self.plan.specs.get(name) if isinstance(name, str) else None
        if spec is None:
            if not isinstance(name, str):
                raise TypeError(f"ps.Worker.{what}: keys are str, got {type(name).__name__}")
            raise ValueError(f"ps.Worker.{what}: unknown key {name!r} (init has {self.keys})")
        return spec

    def _refs(self, pieces: Sequence[Piece]) -> List[wire.PieceRef]:
        return [wire.PieceRef(p.name, p.index, p.count, p.dtype) for p in pieces]

    # ------------------------------------------------------------------ the API
    def init(self, arrays: Mapping[str, object]) -> None:
        """Give the keys and their initial values; the lowest-ranked worker's values win.

        Every worker must call it with the same keys, shapes and dtypes; it returns when all have.
        After a resume the servers keep their checkpointed values and ``clock`` says where
        training stands.

        Args:
            arrays (Mapping): ``{name: array}``: str names, floating-point arrays.

        Returns:
            (None): Once every worker has called it.

        Raises:
            RuntimeError: Called twice.
            TypeError: A name that is not a str, or an array that is not floating-point.
            ValueError: No keys, a bad name, too many dimensions, more than
                ``wire.MAX_KEYS`` (12288) keys, or a server holding more pieces than one frame
                can name (all before anything is sent).
            MismatchError: Workers gave different keys, shapes or dtypes.

        Examples:
            >>> kv.init({"w1": np.zeros((4, 4)), "b1": np.zeros(4)})  # doctest: +SKIP
        """
        self._check_open("init")
        if self.plan is not None:
            raise RuntimeError("ps.Worker.init: already initialized")
        table = key_table(arrays)
        plan = Plan(table, self.num_servers, self.chunk_bytes)
        wire.check_fits(table, plan)          # a request too big for one frame: refused here
        lowest = self.rank == min(self.workers)
        flat = {s.name: np.ascontiguousarray(np.asarray(arrays[s.name]), dtype=s.dtype).reshape(-1)
                for s in table} if lowest else {}
        req = _Outstanding("init", self._next_seq(), pull=False)
        for s in range(self.num_servers):
            frame = wire.encode(wire.INIT, req.seq, flags=wire.HAS_VALUES if lowest else 0,
                                keys=table)
            payload = [flat[p.name][p.offset:p.offset + p.count]
                       for p in plan.on_server(s)] if lowest else []
            self._post(req, s, frame, payload)
        frames = self._complete(req, expect_pieces=False)
        self.plan = plan
        self._clocks = [f.clock for f in frames]
        self.resumed = any(f.flags & wire.RESUMED for f in frames)

    def _results(self, names: Sequence[str], out, what: str) -> Dict[str, np.ndarray]:
        """New arrays for ``names``, or the caller's ``out`` arrays once checked."""
        if out is None:
            return {n: np.empty(self.plan.specs[n].shape, self.plan.specs[n].dtype)
                    for n in names}
        if not isinstance(out, Mapping):
            raise TypeError(f"ps.Worker.{what}: out= must be a dict of {{name: array}}")
        res = {}
        for n in names:
            spec, a = self.plan.specs[n], out.get(n)
            if not isinstance(a, np.ndarray) or a.shape != spec.shape or a.dtype != spec.dtype \
                    or not a.flags.c_contiguous or not a.flags.writeable:
                raise ValueError(f"ps.Worker.{what}: out[{n!r}] must be a writeable C-contiguous "
                                 f"{spec.dtype} array of shape {spec.shape}")
            res[n] = a
        return res

    def pull(self, keys: Iterable[str], out: Optional[Mapping[str, np.ndarray]] = None
             ) -> Dict[str, np.ndarray]:
        """The current values of ``keys``.

        Under staleness 0 it waits until every worker's push of this worker's last clock is
        applied; under k, until the slowest worker is at most k clocks behind.

        Args:
            keys (Iterable[str]): The names to fetch (one name is fine).
            out (Mapping | None): ``{name: array}`` to fill instead of new arrays (each a writeable
                C-contiguous array of the key's shape and dtype).

        Returns:
            (dict): ``{name: array}``: new arrays, or the ``out`` arrays filled.

        Raises:
            RuntimeError: Before ``init``, or after ``close``.
            TypeError: A name that is not a str.
            ValueError: A name ``init`` did not give, or an ``out`` array of the wrong shape, dtype
                or layout.
            PeerFailure: A server died.

        Examples:
            >>> params = kv.pull(["w1", "b1"])  # doctest: +SKIP
        """
        self._check_ready("pull")
        if isinstance(keys, str):
            keys = [keys]
        names = list(dict.fromkeys(keys))
        for n in names:
            self._spec(n, "pull")
        results = self._results(names, out, "pull")
        req = _Outstanding("pull", self._next_seq(), pull=True)
        for s in range(self.num_servers):
            pieces = self.plan.pieces_of(names, s)
            if pieces:
                frame = wire.encode(wire.PULL, req.seq, clock=self._clocks[s],
                                    pieces=self._refs(pieces))
                self._post(req, s, frame, (), pieces, results)
        self._complete(req, expect_pieces=True)
        return results

    def push(self, grads: Mapping[str, object], wait: bool = True) -> int:
        """Send gradients; with ``wait`` (default) return once the servers applied them.

        Staleness 0: once every worker's gradients of this clock were averaged and applied.

        Args:
            grads (Mapping): ``{name: gradient}`` for some or all keys.
            wait (bool): Wait for the servers; False returns at once, and the arrays must then stay
                unchanged until ``wait(ts)``.

        Returns:
            (int): A timestamp for ``wait``.

        Raises:
            RuntimeError: Before ``init``, or after ``close``.
            TypeError: Not a dict, or a gradient of a dtype that does not fit its key.
            ValueError: No gradients, a name ``init`` did not give, or a shape that differs from its
                key's.
            PeerFailure: A server died (in synchronous mode, also a worker).

        Examples:
            >>> ts = kv.push({"w1": np.ones((4, 4))}, wait=False)  # doctest: +SKIP
            >>> kv.wait(ts)  # doctest: +SKIP
        """
        ts = self._push(grads, wire.PUSH, "push")
        if wait:
            self.wait(ts)
        return ts

    def pushpull(self, grads: Mapping[str, object],
                 out: Optional[Mapping[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
        """Push gradients, then return the updated values of the same keys (one round trip).

        Args:
            grads (Mapping): ``{name: gradient}``.
            out (Mapping | None): Arrays to fill, as for ``pull``.

        Returns:
            (dict): ``{name: array}`` of the updated values.

        Raises:
            RuntimeError: Before ``init``, or after ``close``.
            TypeError: Not a dict, or a gradient of a dtype that does not fit its key.
            ValueError: A name ``init`` did not give, or a gradient or ``out`` array that does not
                fit its key.
            PeerFailure: A server died.

        Examples:
            >>> params = kv.pushpull({"w1": np.ones((4, 4))})  # doctest: +SKIP
        """
        ts = self._push(grads, wire.PUSHPULL, "pushpull", out)
        return self.wait(ts)

    def _push(self, grads, opcode: int, what: str, out=None) -> int:
        self._check_ready(what)
        flat = self._gradients(grads, what)
        names = list(flat)
        pull = opcode == wire.PUSHPULL
        results = self._results(names, out, what) if pull else None
        req = _Outstanding(what, self._next_seq(), pull=pull)
        for s in range(self.num_servers):
            pieces = self.plan.pieces_of(names, s)
            frame = wire.encode(opcode, req.seq, clock=self._clocks[s], pieces=self._refs(pieces))
            payload = [flat[p.name][p.offset:p.offset + p.count] for p in pieces]
            self._post(req, s, frame, payload, pieces, results)
            self._clocks[s] += 1
        req.result = results
        self._outstanding[req.seq] = req
        return req.seq

    def wait(self, ts: int):
        """Wait for ``push(..., wait=False)``'s timestamp ``ts``.

        Args:
            ts (int): What ``push`` returned.

        Returns:
            (dict | None): For a ``pushpull``, the updated values; None for a push.

        Raises:
            ValueError: No outstanding push with that timestamp.
            ProtocolError: A server refused the request.
            PeerFailure: A server died.

        Examples:
            >>> kv.wait(kv.push(grads, wait=False))  # doctest: +SKIP
        """
        req = self._outstanding.pop(ts, None)
        if req is None:
            raise ValueError(f"ps.Worker.wait: no outstanding push with timestamp {ts!r}")
        try:
            self._complete(req, expect_pieces=req.pull)
        finally:
            for s in req.refused:             # that server did not count this push
                self._clocks[s] -= 1
        return req.result

    def close(self) -> None:
        """Finish outstanding pushes and tell every server this worker is done.

        Returns:
            (None): A second close does nothing.

        Raises:
            PeerFailure: A server died while an outstanding push waited.

        Examples:
            >>> kv.close()  # doctest: +SKIP
        """
        if self._closed:
            return
        try:
            for ts in list(self._outstanding):
                self.wait(ts)
        finally:
            self._closed = True
            try:
                self._say_goodbye()
            finally:
                self._comm.close()

    def _say_goodbye(self) -> None:
        # A server that is already dead needs no goodbye: PeerFailure is not an error here.
        req = _Outstanding("close", self._next_seq(), pull=False)
        for s in range(self.num_servers):
            try:
                self._post(req, s, wire.encode(wire.CLOSE, req.seq), ())
            except PeerFailure:
                pass
        try:
            self._complete(req, expect_pieces=False)
        except PeerFailure:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _error_of(frame: wire.Frame, server: int, what: str) -> BaseException:
    msg = f"parameter server {server} refused {what}: {frame.message}"
    if frame.flags == wire.PEER_FAILED:
        err = PeerFailure(msg)
        err.peer = frame.clock
        return err
    if frame.flags == wire.MISMATCH:
        return MismatchError(msg)
    return wire.ProtocolError(msg)
