"""Uneven blocks and prefix reductions: allgatherv, gatherv, scatterv, alltoallv,
reduce_scatter with counts, scan and exscan.

Blocks are rows: a rank's block is its array's rows (axis 0), every rank with the same row shape
and dtype; schedules move elements (rows x elements per row), their blocks of ``counts`` in rank
order (schedule.py's doc). A rank learns the counts it lacks in one small exchange before the
data, which is also the call's argument check (row shape and dtype, compared on every rank):

- allgatherv, gatherv: an allgather of every rank's (rows, row size, dtype, row shape's crc)
  unless the call passes ``counts``;
- scatterv: a broadcast of the root's counts, dtype and row shape (non-roots have no data to
  learn them from); a non-root's ``counts`` is checked against it;
- alltoallv: an allgather of every rank's send counts (the whole matrix: Bruck's and the
  hierarchical schedules need it) unless the call passes ``recv_counts``; then a pairwise
  family runs (ring, or rhd when asked), whose schedule at a rank reads only its own row and
  column of the matrix.

``counts`` that disagree with the data (a rank's rows) are a ``MismatchError``: that rank breaks
the communicator, and its abort notice fails the others' calls with the same error.
"""
from __future__ import annotations

import math
import zlib
from typing import Sequence, Tuple

import numpy as np

from .. import ops as _ops
from ..errors import MismatchError
from .buffers import META_WORDS, decode_meta, encode_meta

PAIRWISE = ("ring", "rhd")       # alltoallv families whose rank r reads only row and column r


def _row_header(rows: int, arr: np.ndarray) -> np.ndarray:
    """(rows, elements per row, dtype number, crc32 of the row shape)."""
    inner = arr.shape[1:]
    return np.array([rows, math.prod(inner), arr.dtype.num,
                     zlib.crc32(np.array(inner, dtype=np.int64).tobytes())], dtype=np.int64)


def _check_counts(counts, size: int, what: str) -> Tuple[int, ...]:
    """``counts`` as a tuple of ``size`` non-negative ints (TypeError / ValueError)."""
    try:
        out = tuple(int(c) for c in counts)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of {size} ints, got "
                        f"{type(counts).__name__}") from None
    if len(out) != size or any(c < 0 for c in out) or any(
            isinstance(c, float) and c != int(c) for c in counts):
        raise ValueError(f"{what} must be {size} non-negative ints (one per rank), got "
                         f"{list(counts)[:8]}")
    return out


class UnevenCollectives:
    """The uneven and prefix collectives (module doc)."""

    # ------------------------------------------------------------------ shared parts
    def _rows_in(self, x, name: str) -> Tuple[np.ndarray, np.ndarray]:
        arr, flat = self._flat_in(x)
        if arr.ndim == 0:
            raise ValueError(f"{name}: x must have at least one dimension (its rows are the "
                             f"block), got a scalar")
        return arr, flat

    def _uneven(self, name: str, bind, async_op: bool):
        self._enter(name)
        try:
            return self._submit(name, bind(), async_op)
        finally:
            self._exit()

    def _exchange_rows(self, name: str, arr: np.ndarray, lead: Sequence[int]) -> np.ndarray:
        """Allgather every rank's ``lead`` words (its rows, or its send counts) with its row
        size, dtype and row shape, and check that every rank has this rank's; returns every
        rank's ``lead`` as a (size, len(lead)) table."""
        words = np.concatenate([np.asarray(lead, dtype=np.int64), _row_header(0, arr)[1:]])
        k = len(lead)
        table = np.empty((self.size, words.size), dtype=np.int64)
        self._execute("allgather", words, table.reshape(-1), words.size, "none", 0, None,
                      table.shape)
        for r in range(self.size):
            if not np.array_equal(table[r, k:], words[k:]):
                self._fail(MismatchError(
                    f"{name}: rank {r}'s rows are not this rank's ({arr.dtype}, rows of shape "
                    f"{arr.shape[1:]}): every rank's blocks must share row shape and dtype"))
        return table[:, :k]

    def _learn_rows(self, name: str, arr: np.ndarray, rows: int) -> Tuple[int, ...]:
        """Every rank's rows (``_exchange_rows``)."""
        return tuple(int(v) for v in self._exchange_rows(name, arr, (rows,))[:, 0])

    def _own_rows(self, name: str, counts: Tuple[int, ...], rows: int) -> None:
        if counts[self.rank] != rows:
            self._fail(MismatchError(f"{name}: counts[{self.rank}] = {counts[self.rank]} but "
                                     f"this rank's x has {rows} rows"))

    def _run_v(self, name: str, op: str, algorithm, dtype, counts_el: Tuple[int, ...],
               total: int, root: int, inflat, outflat, shape) -> None:
        c = self._prepare(name, op, algorithm, dtype, total, root, counts_el)
        self._run_call(c, inflat, outflat, total, shape)

    # ------------------------------------------------------------------ allgatherv, gatherv
    def allgatherv(self, x, counts=None, algorithm="auto", out=None, async_op=False):
        """Concatenate every rank's ``x`` along axis 0, in rank order, on every rank.

        Args:
            x (np.ndarray): This rank's rows; ranks may differ in ``x.shape[0]`` only (0
                allowed).
            counts (Sequence[int] | None): Every rank's rows, to skip the exchange that learns
                them (every rank passes them, or none).
            algorithm (str): "auto", "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array, of shape ``(sum(counts), *x.shape[1:])``.
            async_op (bool): Return a ``Work`` at once; its ``wait()`` returns the result.

        Returns:
            (np.ndarray | Work): The concatenation (or ``out``).

        Raises:
            TypeError: A non-numeric ``x`` or bad ``counts``.
            ValueError: ``counts`` of the wrong length or negative, a scalar ``x``.
            MismatchError: ``counts`` that disagree with a rank's rows, or ranks whose rows
                differ in shape or dtype, on every rank.

        Examples:
            >>> comm.allgatherv(np.arange(comm.rank + 1))      # 2 ranks
            array([0, 0, 1])
        """
        return self._uneven("allgatherv", lambda: self._bind_gatherv(
            "allgatherv", x, counts, 0, algorithm, out), async_op)

    def gatherv(self, x, root=0, counts=None, algorithm="auto", out=None, async_op=False):
        """``allgatherv`` at ``root`` only; the other ranks get None.

        Args:
            x (np.ndarray): This rank's rows (ranks may differ in ``x.shape[0]`` only).
            root (int): The rank that gets the concatenation.
            counts (Sequence[int] | None): Every rank's rows, to skip their exchange.
            algorithm (str): "auto", "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The root's result array.
            async_op (bool): Return a ``Work`` at once.

        Returns:
            (np.ndarray | None | Work): The concatenation at the root, None elsewhere.

        Raises:
            ValueError: A bad root or ``counts``. MismatchError: as ``allgatherv``.

        Examples:
            >>> y = comm.gatherv(np.full(comm.rank + 1, comm.rank), root=0)   # 2 ranks
            >>> y.tolist() == [0, 1, 1] if comm.rank == 0 else y is None
            True
        """
        return self._uneven("gatherv", lambda: self._bind_gatherv(
            "gatherv", x, counts, root, algorithm, out), async_op)

    def _bind_gatherv(self, name, x, counts, root, algorithm, out):
        if name == "gatherv":
            root = self._check_root(root, name)
        arr, inflat = self._rows_in(x, name)
        rows = arr.shape[0]
        if counts is not None:
            counts = _check_counts(counts, self.size, f"{name}: counts")
        inner, per = arr.shape[1:], math.prod(arr.shape[1:])
        at_root = name == "allgatherv" or self.rank == root
        if out is not None and at_root and counts is not None:
            self._make_out(out, (sum(counts),) + inner, arr.dtype, name)    # checked early

        def run():
            nonlocal counts
            if counts is None:
                counts = self._learn_rows(name, arr, rows)
            else:
                self._own_rows(name, counts, rows)
            shape = (sum(counts),) + inner
            res, outflat = (self._make_out(out, shape, arr.dtype, name) if at_root
                            else (None, np.empty(sum(counts) * per, arr.dtype)))
            src = self._separate(inflat, outflat, out)
            el = tuple(c * per for c in counts)
            self._run_v(name, "none", algorithm, arr.dtype, el, sum(el), root, src, outflat,
                        shape)
            return res
        return run

    # ------------------------------------------------------------------ scatterv
    def scatterv(self, x, counts=None, root=0, algorithm="auto", out=None, async_op=False):
        """Split the root's ``x`` along axis 0 by ``counts``; rank i gets block i.

        Args:
            x (np.ndarray | None): The root's rows (``sum(counts)`` of them); ignored
                elsewhere (None allowed).
            counts (Sequence[int] | None): Rows per rank; required at the root. Elsewhere
                optional: the root's are sent with its dtype and row shape, and a rank's own
                ``counts`` must agree with them.
            root (int): The rank whose ``x`` is split.
            algorithm (str): "auto", "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): This rank's block.
            async_op (bool): Return a ``Work`` at once.

        Returns:
            (np.ndarray | Work): This rank's ``counts[rank]`` rows.

        Raises:
            ValueError: No ``counts`` at the root, a bad root, counts of the wrong length.
            MismatchError: ``counts`` that disagree with the root's rows or with the root's
                ``counts``.

        Examples:
            >>> y = comm.scatterv(np.arange(3) if comm.rank == 0 else None, [1, 2])  # 2 ranks
            >>> y.tolist() == ([0] if comm.rank == 0 else [1, 2])
            True
        """
        return self._uneven("scatterv", lambda: self._bind_scatterv(
            x, counts, root, algorithm, out), async_op)

    def _bind_scatterv(self, x, counts, root, algorithm, out):
        name = "scatterv"
        root = self._check_root(root, name)
        if counts is not None:
            counts = _check_counts(counts, self.size, f"{name}: counts")
        arr = inflat = None
        if self.rank == root:
            if counts is None:
                raise ValueError("scatterv: the root must pass counts (rows per rank)")
            arr, inflat = self._rows_in(x, name)
            if arr.ndim > META_WORDS - 3:
                encode_meta(arr.dtype, arr.shape[1:])     # refuses, before any message

        def run():
            p = self.size
            header = np.zeros(p + META_WORDS, dtype=np.int64)
            if self.rank == root:
                header[:p] = counts
                header[p:] = encode_meta(arr.dtype, arr.shape[1:])
            got = np.empty_like(header)
            self._execute("broadcast", header, got, header.size, "none", root, None,
                          header.shape)
            theirs = tuple(int(v) for v in got[:p])
            dtype, inner = decode_meta(got[p:])
            if self.rank == root and arr.shape[0] != sum(theirs):
                self._fail(MismatchError(f"scatterv: x has {arr.shape[0]} rows but counts "
                                         f"add up to {sum(theirs)}"))
            if counts is not None and counts != theirs:
                self._fail(MismatchError(f"scatterv: this rank's counts {list(counts)[:8]} "
                                         f"differ from the root's {list(theirs)[:8]}"))
            per = math.prod(inner)
            res, outflat = self._make_out(out, (theirs[self.rank],) + inner, dtype, name)
            src = (self._separate(inflat, outflat, out) if self.rank == root
                   else np.empty(0, dtype))
            el = tuple(c * per for c in theirs)
            self._run_v(name, "none", algorithm, dtype, el, sum(el), root, src, outflat,
                        (sum(theirs),) + inner)
            return res
        return run

    # ------------------------------------------------------------------ alltoallv
    def alltoallv(self, x, send_counts, recv_counts=None, return_counts=False,
                  algorithm="auto", out=None, async_op=False):
        """Send rank j the ``send_counts[j]`` rows of ``x`` that follow the earlier ranks'
        blocks; receive every rank's block for this one, concatenated in source-rank order.

        Args:
            x (np.ndarray): This rank's rows, ``sum(send_counts)`` of them, blocks in
                destination-rank order.
            send_counts (Sequence[int]): Rows for each rank.
            recv_counts (Sequence[int] | None): Rows from each rank, to skip the exchange of
                the counts (then a pairwise family runs: ring under auto).
            return_counts (bool): Also return the rows received from each rank.
            algorithm (str): "auto", "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array.
            async_op (bool): Return a ``Work`` at once.

        Returns:
            (np.ndarray | tuple | Work): The blocks received, or ``(y, recv_counts)``.

        Raises:
            ValueError: Bad counts, or ``x`` whose rows are not ``sum(send_counts)``.
            MismatchError: Ranks whose rows differ in shape or dtype, or ``recv_counts`` that
                disagree with what the peers send.

        Examples:
            >>> send = [1, 2] if comm.rank == 0 else [2, 1]         # 2 ranks, 3 rows each
            >>> y, got = comm.alltoallv(np.full(3, comm.rank), send, return_counts=True)
            >>> got == ([1, 2] if comm.rank == 0 else [2, 1]), sorted(set(y.tolist()))
            (True, [0, 1])
        """
        return self._uneven("alltoallv", lambda: self._bind_alltoallv(
            x, send_counts, recv_counts, return_counts, algorithm, out), async_op)

    def _bind_alltoallv(self, x, send_counts, recv_counts, return_counts, algorithm, out):
        name, p, me = "alltoallv", self.size, self.rank
        arr, inflat = self._rows_in(x, name)
        send = _check_counts(send_counts, p, f"{name}: send_counts")
        if arr.shape[0] != sum(send):
            raise ValueError(f"alltoallv: x has {arr.shape[0]} rows, send_counts add up to "
                             f"{sum(send)}")
        if recv_counts is not None:
            recv_counts = _check_counts(recv_counts, p, f"{name}: recv_counts")
        inner, per = arr.shape[1:], math.prod(arr.shape[1:])
        fam = algorithm
        if recv_counts is not None and algorithm in (None, "auto"):
            fam = "ring"          # a pairwise family needs only this rank's row and column

        def run():
            if recv_counts is None or fam not in PAIRWISE:
                matrix = self._exchange_rows(name, arr, send)
                got = tuple(int(v) for v in matrix[:, me])
                if recv_counts is not None and recv_counts != got:
                    self._fail(MismatchError(f"alltoallv: recv_counts {list(recv_counts)[:8]} "
                                             f"but the peers send {list(got)[:8]}"))
            else:
                matrix = np.zeros((p, p), dtype=np.int64)    # only row and column me are read
                matrix[me, :] = send
                matrix[:, me] = recv_counts
                got = recv_counts
            res, outflat = self._make_out(out, (sum(got),) + inner, arr.dtype, name)
            src = self._separate(inflat, outflat, out)
            el = tuple(int(v) * per for v in matrix.reshape(-1))
            # the tag's count is 0: with recv_counts the ranks do not share the whole matrix
            # (message lengths check each block)
            c = self._prepare(name, "none", fam, arr.dtype, sum(el), 0, el)
            self._run_call(c, src, outflat, 0, (p,) + inner)
            return (res, list(got)) if return_counts else res
        return run

    # ------------------------------------------------------------------ reduce_scatter(counts)
    def _reduce_scatterv(self, x, op, counts, algorithm, out, async_op):
        name = "reduce_scatterv"

        def bind():
            o = _ops.normalize(op)
            arr, inflat = self._rows_in(x, "reduce_scatter")
            _ops.check_dtype(o, arr.dtype)
            cts = _check_counts(counts, self.size, "reduce_scatter: counts")
            if arr.shape[0] != sum(cts):
                raise ValueError(f"reduce_scatter: x has {arr.shape[0]} rows, counts add up "
                                 f"to {sum(cts)}")
            inner, per = arr.shape[1:], math.prod(arr.shape[1:])
            res, outflat = self._make_out(out, (cts[self.rank],) + inner, arr.dtype,
                                          "reduce_scatter")

            def run():
                src = self._separate(inflat, outflat, out)
                el = tuple(c * per for c in cts)
                self._run_v(name, o, algorithm, arr.dtype, el, sum(el), 0, src, outflat,
                            arr.shape)
                if o == _ops.AVG:
                    np.true_divide(outflat, self.size, out=outflat)
                return res
            return run
        return self._uneven("reduce_scatter", bind, async_op)

    # ------------------------------------------------------------------ scan, exscan
    def scan(self, x, op="sum", algorithm="auto", out=None, async_op=False):
        """Inclusive prefix reduction: rank r gets ``x`` of ranks 0..r combined with ``op``.

        Args:
            x (np.ndarray): Every rank the same shape and dtype.
            op (str): "sum", "prod", "min", "max", "avg" (the prefix's mean), "band", "bor"
                or "bxor".
            algorithm (str): "auto", "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array (may be ``x``).
            async_op (bool): Return a ``Work`` at once.

        Returns:
            (np.ndarray | Work): The prefix.

        Raises:
            TypeError / ValueError: As ``allreduce``.

        Examples:
            >>> comm.scan(np.array([1])) - comm.rank        # rank r gets r + 1
            array([1])
        """
        return self._uneven("scan", lambda: self._bind_prefix("scan", x, op, algorithm, out),
                            async_op)

    def exscan(self, x, op="sum", algorithm="auto", out=None, async_op=False):
        """Exclusive prefix reduction: rank r gets ``x`` of ranks 0..r-1; rank 0 gets None.

        Args:
            x (np.ndarray): Every rank the same shape and dtype.
            op (str): As ``scan``.
            algorithm (str): "auto", "ring", "tree", "rhd" or "hier".
            out (np.ndarray | None): The result array (not written on rank 0).
            async_op (bool): Return a ``Work`` at once.

        Returns:
            (np.ndarray | None | Work): The prefix; None on rank 0.

        Examples:
            >>> y = comm.exscan(np.array([1]))
            >>> y is None if comm.rank == 0 else y.tolist() == [1]
            True
        """
        return self._uneven("exscan",
                            lambda: self._bind_prefix("exscan", x, op, algorithm, out), async_op)

    def _bind_prefix(self, name, x, op, algorithm, out):
        o = _ops.normalize(op)
        arr, inflat = self._flat_in(x)
        _ops.check_dtype(o, arr.dtype)
        none_here = name == "exscan" and self.rank == 0
        res, outflat = ((None, np.empty(inflat.size, arr.dtype)) if none_here
                        else self._make_out(out, arr.shape, arr.dtype, name))
        src = self._separate(inflat, outflat, None if none_here else out)

        def run():
            self._run_v(name, o, algorithm, arr.dtype, (), inflat.size, 0, src, outflat,
                        arr.shape)
            if o == _ops.AVG and res is not None:
                np.true_divide(outflat, self.rank + (name == "scan"), out=outflat)
            return res
        return run
