"""Argument and buffer handling: the caller's input, its output, and in place.

Every collective hands its schedule flat (1-D, C-contiguous) views: ``_flat_in`` of the input,
``_make_out`` of the output (the caller's ``out=``, checked, or a new array). Schedules never
write ``in`` but may read it after writing ``out``, so ``_separate`` decides whether the two
share memory: the same array (an in-place call), a whole-element shift inside it (``_InPlace``),
or anything else that overlaps (a private copy).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

U8 = np.dtype(np.uint8)


class InPlace(np.ndarray):
    """An input that lies inside the output's memory, ``shift`` elements from its start
    (``in[i]`` is ``out[i + shift]``): see ``Buffers._separate``."""
    shift = 0


class Buffers:
    """Argument checks and flat views for the collectives (module doc)."""

    @staticmethod
    def _flat_in(x) -> Tuple[np.ndarray, np.ndarray]:
        """(x as an array, its flat C-contiguous view); TypeError for non-numeric dtypes."""
        if type(x) is np.ndarray and x.ndim == 1 and x.flags.c_contiguous \
                and x.dtype.kind in "biufc":
            return x, x                       # the common case: nothing to convert
        arr = np.asarray(x)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"minicomm moves numeric and bool arrays, got dtype {arr.dtype}")
        return arr, np.ascontiguousarray(arr).reshape(-1)

    @staticmethod
    def _make_out(out, shape, dtype, name: str) -> Tuple[np.ndarray, np.ndarray]:
        """(the result array, its flat view): ``out`` checked against ``shape`` and ``dtype``,
        or a new array when ``out`` is None."""
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
        """The block shape of ``arr``, which must be ``(size, *block)``."""
        if arr.ndim == 0 or arr.shape[0] != self.size:
            raise ValueError(f"{name}: input must have shape (size={self.size}, ...), "
                             f"got {arr.shape}")
        return arr.shape[1:]

    @staticmethod
    def _separate(inflat: np.ndarray, outflat: np.ndarray, out) -> np.ndarray:
        """``inflat``, or a copy of it if it overlaps ``outflat``: schedules never write 'in' but
        may read it after writing 'out'. ``out`` is the caller's out= (None: ``outflat`` is a
        fresh array, which cannot overlap). An in-place call (``in`` is ``out``, or lies at a
        whole-element offset in the same memory) returns ``outflat`` itself or an ``InPlace``
        view: the call copies it only if the plan is not ``alias_safe`` at that offset."""
        if out is None or inflat is outflat:
            return inflat
        ib, ob = inflat.base, outflat.base
        if ib is None and ob is None:
            return inflat             # two arrays that own their memory: never the same bytes
        # views of two different arrays that own their memory (numpy points a view's base at the
        # owner): never the same bytes either, decided without np.may_share_memory, which costs
        # a noticeable part of a small call (inline: this runs on every repeated call)
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
                np.may_share_memory(inflat.view(U8)[:1], outflat.view(U8)[:1]):
            return outflat            # the same first byte: the same array (a view of it)
        diff = inflat.__array_interface__["data"][0] - outflat.__array_interface__["data"][0]
        if inflat.dtype == outflat.dtype and diff % inflat.itemsize == 0:
            if diff == 0 and inflat.size == outflat.size:
                return outflat
            view = inflat.view(InPlace)
            view.shift = diff // inflat.itemsize
            return view
        return inflat.copy()


# How each collective lays out its input and output: what the fast path checks of a repeated
# call, and how the general path shapes its result.
NONE = 0            # no data (barrier)
SAME = 1            # out has x's shape (allreduce, broadcast, reduce)
STACKED = 2         # out is (size,) + x.shape (allgather, gather)
BLOCKS = 3          # x is (size, *block), out one block (reduce_scatter)
ALL_BLOCKS = 4      # x and out are (size, *block) (alltoall)
SCATTER_HEADER = 5  # only the root has x; the header exchange tells the others (scatter)
LAYOUT = {"barrier": NONE, "allreduce": SAME, "broadcast": SAME, "reduce": SAME,
          "allgather": STACKED, "gather": STACKED, "reduce_scatter": BLOCKS,
          "alltoall": ALL_BLOCKS, "scatter": SCATTER_HEADER}
REDUCING = frozenset({"allreduce", "reduce", "reduce_scatter"})     # the ones that take op=
RESULT_AT_ROOT = frozenset({"reduce", "gather"})   # the other ranks get None (and a scratch out)
EMPTY = np.empty(0, dtype=np.uint8)    # barrier's buffers (never written: zero elements)
MISS = object()     # the fast path's answer when a call is not its case: the general path runs it


META_WORDS = 16                     # an array's dtype and shape as int64 words (encode_meta)


def encode_meta(dtype: np.dtype, shape: Tuple[int, ...]) -> np.ndarray:
    """A block's dtype and shape as ``META_WORDS`` int64 words (ValueError: too many dims)."""
    if len(shape) > META_WORDS - 3:
        raise ValueError(f"arrays of more than {META_WORDS - 2} dimensions are not supported")
    m = np.zeros(META_WORDS, dtype=np.int64)
    code = np.dtype(dtype).str.encode().ljust(8, b"\0")
    m[0] = np.frombuffer(code, dtype=np.int64)[0]
    m[1] = len(shape)
    m[2:2 + len(shape)] = shape
    return m


def decode_meta(m: np.ndarray) -> Tuple[np.dtype, Tuple[int, ...]]:
    dtype = np.dtype(m[:1].tobytes().rstrip(b"\0").decode())
    nd = int(m[1])
    return dtype, tuple(int(v) for v in m[2:2 + nd])
