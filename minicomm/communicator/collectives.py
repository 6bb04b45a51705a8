"""The collectives: each public method validates, binds and runs (or submits) its call.

One fast path serves every collective (``_fast``): a synchronous call whose signature ran
before (so its op, dtype, root and shapes were validated then), with nothing queued, on a
C-contiguous array whose layout is the collective's (``buffers.LAYOUT``) goes straight to its
bound ``Call`` (the cache in front of what ``*_init`` binds, persistent.py); an unrooted small
one (``Call.hot``) runs its compiled plan right there. Inside ``comm.group()`` the same lookup
binds the call, which the group holds (grouping.py). Anything
else goes the general path (``_general``): the guard, ``_bind`` (the argument checks, TypeError /
ValueError before any message, and the flat buffers), then run now or submit to the worker.
The fast path keeps the general path's semantics: in-place aliasing, program order behind
queued work, broken and closed communicators, avg's division, rooted calls' non-root outputs.

Arguments every collective shares: ``x`` a numeric or bool array (every rank the same dtype);
``algorithm`` "auto" or a family (ring tree rhd hier); ``out`` the result array (checked
against the result's shape and dtype; it may be ``x`` itself: in place); ``async_op`` return a
``Work`` at once. Errors: TypeError / ValueError before any message moves; on failure a
``CommError`` subclass (``MismatchError``, ``CommTimeout``, ``PeerFailure``), after which the
communicator is broken.
"""
from __future__ import annotations

import time

import numpy as np

from .. import ops as _ops
from ..errors import CommError
from ..schedule import ROOTED
from ..smallpath import SMALL_SPIN_S
from .buffers import (
    BLOCKS,
    EMPTY,
    LAYOUT,
    MISS,
    NONE,
    REDUCING,
    RESULT_AT_ROOT,
    SAME,
    SCATTER_HEADER,
    STACKED,
    InPlace,
)
from .lifecycle import get_ident

_monotonic = time.monotonic


class BoundCall:
    """A collective's arguments, checked and bound to flat buffers and to their ``Call``
    (``_bind``): what the async worker runs (``bound()``, outside the guard), what a persistent
    request runs again and again (``inline()``: on the caller's thread, inside the guard, small
    calls on their compiled plan) and what ``comm.group()`` fuses (``op``, ``algorithm``: as
    the user asked for them)."""
    __slots__ = ("comm", "name", "op", "algorithm", "c", "inb", "outb", "res", "count", "shape")

    def __init__(self, comm, name, op, algorithm, c, inb, outb, res, count, shape):
        self.comm, self.name, self.op, self.algorithm, self.c = comm, name, op, algorithm, c
        self.inb, self.outb, self.res, self.count, self.shape = inb, outb, res, count, shape

    def __call__(self):
        comm, outb = self.comm, self.outb
        comm._run_call(self.c, self.inb, outb, self.count, self.shape)
        if self.c.avg:
            np.true_divide(outb, comm.size, out=outb)        # outb /= size
        return self.res

    def inline(self):
        self.comm._run_now(self.name, self.c, self.inb, self.outb, self.count, self.shape)
        return self.res


class Collectives:
    """The nine collectives (module doc): allreduce, reduce, broadcast, allgather, gather,
    reduce_scatter, alltoall, scatter, barrier."""

    def _fast(self, name: str, op, algorithm, root, x, out):
        """A repeated synchronous call (module doc), or ``MISS``: nothing done, the general
        path runs the call (and explains what is wrong with it)."""
        layout = LAYOUT[name]
        if layout == SCATTER_HEADER:
            return self._scatter_fast(x, root, algorithm, out)
        if type(x) is not np.ndarray or not x.flags.c_contiguous \
                or self._closed or self._broken is not None or type(root) is not int:
            return MISS
        if (self._pending or self._started) and \
                (self._started or self._batch is None or self._depth):
            return MISS               # queued or started work (program order), a call's call
        if layout < BLOCKS:
            count = x.size
        elif x.ndim and x.shape[0] == self.size:
            count = x.size // self.size
        else:
            return MISS
        c = self._calls.get((name, op, algorithm, x.dtype, count, root))
        if c is None:
            return MISS
        flat = x.ndim == 1
        inb = x if flat else x.reshape(-1)
        if c.no_result:               # barrier; reduce and gather off the root (out= ignored)
            res, outb = None, (inb if layout == NONE else np.empty(c.out_count, x.dtype))
        elif out is None and flat and layout == SAME:
            res = outb = np.empty(count, x.dtype)      # 1-D in, 1-D out: nothing to shape
        else:
            shape = x.shape if layout == SAME else (self.size,) + x.shape \
                if layout == STACKED else x.shape[1:] if layout == BLOCKS else x.shape
            if out is None:
                res = np.empty(shape, x.dtype)
            elif type(out) is np.ndarray and out.shape == shape and out.dtype == x.dtype \
                    and out.flags.c_contiguous:
                res = out
            else:
                return MISS
            outb = res if res.ndim == 1 else res.reshape(-1)
            if out is not None and c.separate:
                inb = self._separate(inb, outb, out)
        if self._pending:             # inside comm.group(): held, with what it bound before
            return self._hold(name, BoundCall(self, name, op, algorithm, c, inb, outb, res,
                                              count, x.shape))
        self._run_now(name, c, inb, outb, count, x.shape)
        return res

    def _run_now(self, name: str, c, inb: np.ndarray, outb: np.ndarray, count: int,
                  shape) -> None:
        """Run a bound call on this thread, inside the guard: what a repeated plain call and a
        persistent request's ``wait`` both end in. An unrooted small call (``Call.hot``) runs
        its compiled plan right here with its own scratch: the general path's steps with
        nothing recomputed (docs/decisions/small-message-path.md)."""
        if not self._guard.acquire(False):
            self._enter(name)         # a call made by a call, or another thread's: it says so
            try:
                self._run_call(c, inb, outb, count, shape)
            finally:
                self._exit()
        else:
            self._busy_thread, self._depth, self.busy_with = get_ident(), 1, name
            self._user_calls += 1
            try:
                if c.hot and self.small_path and inb.__class__ is not InPlace:
                    self._seq = seq = self._seq + 1
                    if inb is outb and not c.alias0:
                        inb = inb.copy()
                    flight, now = self._flight, _monotonic()
                    if flight is not None:    # FlightRecorder.repeat, inlined for its common case
                        rec = flight.latest
                        if rec is None or rec[1] is not c or rec[3] is None:
                            rec = flight.repeat(seq, c, now)
                        else:
                            rec[5] += rec[3] - rec[2]
                            rec[4] += 1
                            rec[0], rec[2], rec[3] = seq, now, None
                    try:
                        c.run((inb, outb, c.tmp), self._small_io, c.kernel, self._ctx, seq,
                              c.call, count, now + self.timeout, c.label, SMALL_SPIN_S)
                    except CommError as e:
                        self._fail(e)
                    if flight is not None:
                        rec[3] = _monotonic()
                else:
                    self._run_call(c, inb, outb, count, shape)
            finally:
                self._depth, self.busy_with, self._busy_thread = 0, None, None
                self._guard.release()
        if c.avg:
            outb /= self.size

    def _general(self, name: str, x, op, algorithm, root, out, async_op: bool):
        """The general path (module doc): inside the guard, bind the call, then run or submit."""
        self._enter(name)
        try:
            return self._submit(name, self._bind(name, x, op, algorithm, root, out), async_op)
        finally:
            self._exit()

    def _bind(self, name: str, x, op, algorithm, root, out):
        """Check a collective's arguments (TypeError / ValueError before any message) and bind
        them to flat buffers and their ``Call``; returns ``run()``, which executes the call and
        returns its result (a ``BoundCall`` where the layout has one)."""
        layout = LAYOUT[name]
        if layout == SCATTER_HEADER:
            return self._bind_scatter(x, root, algorithm, out)
        if layout == NONE:
            c = self._prepare(name, "none", algorithm, EMPTY.dtype, 0, 0)
            return BoundCall(self, name, "none", algorithm, c, EMPTY, EMPTY, None, 0, EMPTY.shape)
        if name in REDUCING:
            op = _ops.normalize(op)
        if name in ROOTED:
            root = self._check_root(root, name)
        arr, inflat = self._flat_in(x)
        if name in REDUCING:
            _ops.check_dtype(op, arr.dtype)
        size, count, shape = self.size, inflat.size, arr.shape
        if layout == STACKED:
            shape = (size,) + arr.shape
        elif layout >= BLOCKS:
            block = self._blocked(arr, name)
            count //= size
            shape = block if layout == BLOCKS else arr.shape
        if name in RESULT_AT_ROOT and self.rank != root:
            res, outflat = None, np.empty(count * size if layout == STACKED else count, arr.dtype)
        else:
            res, outflat = self._make_out(out, shape, arr.dtype, name)
        if name != "broadcast" or self.rank == root:      # a non-root never reads its x
            inflat = self._separate(inflat, outflat, out)
        c = self._prepare(name, op, algorithm, arr.dtype, count, root)
        return BoundCall(self, name, op, algorithm, c, inflat, outflat, res, count, arr.shape)

    def allreduce(self, x, op="sum", algorithm="auto", out=None, async_op=False):
        """Reduce ``x`` elementwise over all ranks with ``op``; every rank gets the result.

        Args:
            x (np.ndarray): A numeric or bool array (every rank the same shape and dtype).
            op (str): "sum", "prod", "min", "max", "avg", "band", "bor" or "bxor" (avg on
                floating and complex dtypes only; the bitwise ops on integer and bool ones).
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array, checked against the result's shape and
                dtype; it may be ``x`` itself (in place).
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.

        Returns:
            (np.ndarray | Work): The result (a new array of ``x``'s shape, or ``out``); a ``Work``
                with ``async_op``.

        Raises:
            TypeError: A non-numeric ``x``, an op the dtype has no meaning for, or a bad ``out``,
                before any message moves.
            ValueError: An unknown op or algorithm, before any message moves.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> comm.allreduce(np.ones(4))                  # 2 ranks
            array([2., 2., 2., 2.])
            >>> comm.allreduce(np.array([comm.rank]), op="max")
            array([1])
        """
        if not async_op:
            y = self._fast("allreduce", op, algorithm, 0, x, out)
            if y is not MISS:
                return y
        return self._general("allreduce", x, op, algorithm, 0, out, async_op)

    def reduce(self, x, root=0, op="sum", algorithm="auto", out=None, async_op=False):
        """Reduce ``x`` elementwise over all ranks with ``op`` into rank ``root``.

        Args:
            x (np.ndarray): A numeric or bool array (every rank the same shape and dtype).
            root (int): The rank that gets the result.
            op (str): "sum", "prod", "min", "max", "avg", "band", "bor" or "bxor" (avg on
                floating and complex dtypes only; the bitwise ops on integer and bool ones).
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The root's result array (checked against the result's shape and
                dtype; it may be ``x``); ignored elsewhere.
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.

        Returns:
            (np.ndarray | None | Work): The result at the root (a new array, or ``out``), None
                elsewhere; a ``Work`` with ``async_op``.

        Raises:
            TypeError: A non-numeric ``x``, an op the dtype has no meaning for, or a bad ``out``.
            ValueError: A root outside the communicator, an unknown op or algorithm.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> y = comm.reduce(np.arange(3) * (comm.rank + 1), root=0)     # 2 ranks
            >>> y.tolist() == [0, 3, 6] if comm.rank == 0 else y is None
            True
        """
        if not async_op:
            y = self._fast("reduce", op, algorithm, root, x, out)
            if y is not MISS:
                return y
        return self._general("reduce", x, op, algorithm, root, out, async_op)

    def broadcast(self, x, root=0, algorithm="auto", out=None, async_op=False):
        """Every rank gets the root's ``x``.

        Args:
            x (np.ndarray): The root's data; the other ranks pass an array of the same shape and
                dtype (its contents are not read).
            root (int): The rank that holds the data.
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array, checked against the result's shape and
                dtype; it may be ``x`` itself (in place).
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.

        Returns:
            (np.ndarray | Work): The root's data (a new array, or ``out``); a ``Work`` with
                ``async_op``.

        Raises:
            TypeError: A non-numeric ``x`` or a bad ``out``, before any message moves.
            ValueError: A root outside the communicator or an unknown algorithm.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> comm.broadcast(np.arange(3) * (comm.rank + 1), root=1)
            array([0, 2, 4])
        """
        if not async_op:
            y = self._fast("broadcast", "none", algorithm, root, x, out)
            if y is not MISS:
                return y
        return self._general("broadcast", x, "none", algorithm, root, out, async_op)

    def allgather(self, x, algorithm="auto", out=None, async_op=False):
        """Every rank gets every rank's ``x``, stacked by rank.

        Args:
            x (np.ndarray): This rank's array (every rank the same shape and dtype).
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array, of shape ``(size, *x.shape)``.
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.

        Returns:
            (np.ndarray | Work): An array of shape ``(size, *x.shape)`` whose row r is rank r's
                ``x`` (or ``out``); a ``Work`` with ``async_op``.

        Raises:
            TypeError: A non-numeric ``x`` or a bad ``out``, before any message moves.
            ValueError: An unknown algorithm.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> comm.allgather(np.arange(3) + 10 * comm.rank)
            array([[ 0,  1,  2],
                   [10, 11, 12]])
        """
        if not async_op:
            y = self._fast("allgather", "none", algorithm, 0, x, out)
            if y is not MISS:
                return y
        return self._general("allgather", x, "none", algorithm, 0, out, async_op)

    def gather(self, x, root=0, algorithm="auto", out=None, async_op=False):
        """Rank ``root`` gets every rank's ``x``, stacked by rank.

        Args:
            x (np.ndarray): This rank's array (every rank the same shape and dtype).
            root (int): The rank that gets the result.
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The root's result array, of shape ``(size, *x.shape)``;
                ignored elsewhere.
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.

        Returns:
            (np.ndarray | None | Work): At the root an array of shape ``(size, *x.shape)`` (or
                ``out``), None elsewhere; a ``Work`` with ``async_op``.

        Raises:
            TypeError: A non-numeric ``x`` or a bad ``out``.
            ValueError: A root outside the communicator or an unknown algorithm.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> y = comm.gather(np.array([comm.rank, 7]), root=0)
            >>> y.tolist() == [[0, 7], [1, 7]] if comm.rank == 0 else y is None
            True
        """
        if not async_op:
            y = self._fast("gather", "none", algorithm, root, x, out)
            if y is not MISS:
                return y
        return self._general("gather", x, "none", algorithm, root, out, async_op)

    def reduce_scatter(self, x, op="sum", algorithm="auto", out=None, async_op=False,
                       counts=None):
        """Reduce ``x`` of shape ``(size, *s)`` over all ranks with ``op``; rank r gets block r.

        With ``counts`` the blocks are uneven: ``x`` has ``sum(counts)`` rows and rank r gets
        the ``counts[r]`` rows that follow the earlier ranks' (MPI_Reduce_scatter).

        Args:
            x (np.ndarray): This rank's blocks, of shape ``(size, *s)`` (every rank the same shape
                and dtype); with ``counts``, of shape ``(sum(counts), *s)``.
            op (str): "sum", "prod", "min", "max", "avg", "band", "bor" or "bxor" (avg on
                floating and complex dtypes only; the bitwise ops on integer and bool ones).
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array, of shape ``s`` (with ``counts``:
                ``(counts[rank], *s)``).
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.
            counts (Sequence[int] | None): Rows of the result per rank (the same on every
                rank).

        Returns:
            (np.ndarray | Work): The reduced block of shape ``s`` (or ``out``); a ``Work`` with
                ``async_op``.

        Raises:
            TypeError: A non-numeric ``x``, an op the dtype has no meaning for, or a bad ``out``.
            ValueError: ``x`` not of shape ``(size, ...)``, an unknown op or algorithm.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> comm.reduce_scatter(np.ones((comm.size, 4)))
            array([2., 2., 2., 2.])
        """
        if counts is not None:
            return self._reduce_scatterv(x, op, counts, algorithm, out, async_op)
        if not async_op:
            y = self._fast("reduce_scatter", op, algorithm, 0, x, out)
            if y is not MISS:
                return y
        return self._general("reduce_scatter", x, op, algorithm, 0, out, async_op)

    def alltoall(self, x, algorithm="auto", out=None, async_op=False):
        """Rank r sends block j of its ``x`` (shape ``(size, *s)``) to rank j.

        Args:
            x (np.ndarray): This rank's blocks, of shape ``(size, *s)`` (every rank the same shape
                and dtype).
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array, of ``x``'s shape (it may be ``x``).
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.

        Returns:
            (np.ndarray | Work): ``y`` of ``x``'s shape with ``y[j]`` = rank j's ``x[rank]`` (or
                ``out``); a ``Work`` with ``async_op``.

        Raises:
            TypeError: A non-numeric ``x`` or a bad ``out``.
            ValueError: ``x`` not of shape ``(size, ...)`` or an unknown algorithm.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> x = np.array([[10 * comm.rank], [10 * comm.rank + 1]])
            >>> comm.alltoall(x)[:, 0] - comm.rank          # rank r gets x[r] of every rank
            array([ 0, 10])
        """
        if not async_op:
            y = self._fast("alltoall", "none", algorithm, 0, x, out)
            if y is not MISS:
                return y
        return self._general("alltoall", x, "none", algorithm, 0, out, async_op)

    def scatter(self, x, root=0, algorithm="auto", out=None, async_op=False):
        """Rank r gets block ``x[r]`` of the root's ``x`` (shape ``(size, *s)``).

        Args:
            x (np.ndarray | None): The root's blocks, of shape ``(size, *s)``; ignored off the root
                (None is fine there).
            root (int): The rank that holds the data.
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array, of shape ``s``; off the root it must match
                the root's block, and without it the block's shape and dtype come from the root.
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.

        Returns:
            (np.ndarray | Work): This rank's block of shape ``s`` (or ``out``); a ``Work`` with
                ``async_op``.

        Raises:
            TypeError: A non-numeric ``x`` or a bad ``out``.
            ValueError: A root outside the communicator, the root's ``x`` not of shape
                ``(size, ...)``, or an unknown algorithm.
            MismatchError: ``out`` does not match the root's block.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> blocks = np.arange(6).reshape(comm.size, 3) if comm.rank == 0 else None
            >>> comm.scatter(blocks, root=0) - 3 * comm.rank
            array([0, 1, 2])
        """
        if not async_op:
            y = self._fast("scatter", "none", algorithm, root, x, out)
            if y is not MISS:
                return y
        return self._general("scatter", x, "none", algorithm, root, out, async_op)

    def barrier(self, algorithm="auto", async_op=False):
        """Return once every rank has entered the barrier.

        Args:
            algorithm (str): "auto" (the α-β model's choice, or ``MINICOMM_ALGO``) or a family:
                "ring", "tree", "rhd" or "hier".
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns None once every rank
                has entered.

        Returns:
            (None | Work): None; a ``Work`` with ``async_op``.

        Raises:
            ValueError: An unknown algorithm.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``); the
                communicator is broken from then on.

        Examples:
            >>> comm.barrier()
        """
        if not async_op:
            y = self._fast("barrier", "none", algorithm, 0, EMPTY, None)
            if y is not MISS:
                return y
        return self._general("barrier", EMPTY, "none", algorithm, 0, None, async_op)
