"""One-sided communication: MPI-3 RMA windows in numpy shape, over shm, rdma and ub.

    win = comm.window(array)          # collective: exposes a copy of ``array`` to every rank
    win.fence()                       # active-target epoch boundary (collective)
    win.put(data, target, offset=0)
    got = win.get(target, offset=0, count=None)                # a new array, complete on return
    win.accumulate(data, target, offset=0, op="sum")           # element-wise atomic
    old = win.get_accumulate(data, target, offset=0, op="sum")
    old = win.fetch_and_op(value, target, offset=0, op="sum")  # one element; numpy scalar
    old = win.compare_and_swap(value, compare, target, offset=0)
    win.lock(target, exclusive=True); win.flush(target); win.unlock(target)   # passive target
    win.local                         # this rank's window memory, as an array shaped like array
    win.free()                        # collective; ``array`` receives the final contents

Offsets and counts are in elements of the window's dtype (every rank exposes the same dtype;
sizes may differ). Ops: sum prod min max band bor bxor and "replace"; fetch_and_op also "no_op"
(an atomic read). compare_and_swap takes integer and bool windows (as MPI).

Values. An ndarray given as data follows numpy's dtype rule: it is cast to the window's dtype
when that is a same-kind cast (``np.can_cast(..., "same_kind")``), else TypeError. Anything else
-- a Python number, a numpy scalar, a list of them, and every value / compare of
``fetch_and_op`` / ``compare_and_swap`` given that way -- is checked by value, the same on every
transport: an integer window takes integers (Python ints, numpy integers, bools) within its
dtype's range, a float window real numbers within its finite range (inf and nan are values
too), a complex window any number, a bool window bools. A value of another kind is a TypeError,
one out of range a ValueError naming the value, the dtype and the range; both are raised before
anything moves. (To decrement an unsigned counter, use a signed window or add 2**bits - 1.)

The window's end. Every operation on a freed window, or on a window whose communicator is
closed, raises ``mc.RMAError`` saying which; ``free()`` of a window whose communicator was
closed first releases this rank's memory (no barrier is possible, ``array`` is not updated) and
raises that RMAError once. Free windows before closing their communicator.

Epochs (MPI-3). An operation on ``target`` needs an access epoch: after a ``fence()`` (active
target: every rank calls it; each fence completes every operation issued before it, on every
rank, before any rank returns), or between ``lock(target)`` and ``unlock(target)`` (passive
target: the target makes no call at all -- it may be busy computing). Outside both it raises
``mc.RMAError``, as does an offset or count outside the target's window -- from the call itself,
before anything moves. ``flush(target)`` completes this rank's operations at the target; ``unlock``
does too. Locks: exclusive excludes every other lock on that target; shared ones coexist. Nested
locks on one target, unlock without lock, fence or free while holding a lock: RMAError.

Atomicity. ``accumulate`` / ``get_accumulate`` / ``fetch_and_op`` / ``compare_and_swap`` are atomic
per element with respect to each other when concurrent ones use the same op (or no_op) -- MPI's
default ``accumulate_ops = same_op_no_op`` -- and over shm with respect to every op. How (by
the features each channel declares, transports/base.py's ``OneSidedChannel``):
  shm   every read-modify-write runs under the target's process-shared mutex (one critical
        section: load, op, store);
  rdma, ub  an 8-byte integer window with op sum / replace / no_op uses the NIC's atomics
        (FETCH_ADD, swap or a CAS loop, a READ), compare_and_swap on it CMP_SWAP; anything else
        takes the target's *accumulate lock* (a word acquired with CMP_SWAP), then READ, op,
        WRITE, release -- the way Open MPI's osc/rdma does -- unless this rank holds an
        exclusive lock on the target, which already excludes everyone.
Passive-target locks are a lock word in the target's window (the exclusive holder's rank + 1
in the high 32 bits, the count of shared holders in the low 32), taken with atomics; a contended
lock is polled with exponential backoff (yield, then sleeps from a microsecond doubling to a
millisecond) -- no RDMA NIC notifies a lock release -- until ``comm.timeout``. A holder that is
gone (it exited, crashed, aborted or closed its transport without unlocking; what the transport
learns from the peer's link, ``peer_gone`` of its channel) ends the wait at once with
``PeerFailure`` naming it, for the exclusive lock and for the accumulate lock (which holds the
holder's rank + 1) alike; the lock stays held, so that target cannot be locked again. Shared
holders are counted, not named: a waiter for an exclusive lock behind a dead shared holder gets
the CommTimeout.

Memory. ``array`` is copied into memory the transport can expose (a /dev/shm mapping the peers
share, or the simulated NIC's registered region); ``win.local`` is that memory. ``free()`` copies
it back into ``array`` (when it is a writable numpy array), so code that reads ``array`` after
the window is gone sees what the epochs left there.

Cost per operation of n bytes (alpha-beta; see the transports' headers): shm put/get = one
memcpy; rdma/ub same node = one memcpy plus the simulated NIC's checks; other node = one round
trip to the target's NIC agent plus n/beta; an accumulate without native atomics = lock +
READ + WRITE + unlock (four round trips across nodes).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import time
from typing import Dict, List, Optional

import numpy as np

from . import ops as _ops
from .errors import CommTimeout, PeerFailure, RMAError

CONTROL = 64                          # bytes before the data: the lock word, the accumulate lock
_LOCK, _ACC = 0, 8
EXCL = 1 << 32                        # lock word: (exclusive holder + 1) * EXCL + shared count
ACC_OPS = ("sum", "prod", "min", "max", "band", "bor", "bxor", "replace")
FOP_OPS = ACC_OPS + ("no_op",)
_channels = itertools.count(1000)     # rdma QP numbers of windows (landing traffic uses 1)
_WORDS = {np.dtype(np.int64): ("q", (int,), 64, True), np.dtype(np.uint64): ("Q", (int,), 64, False),
          np.dtype(np.int32): ("i", (int,), 32, True), np.dtype(np.uint32): ("I", (int,), 32, False),
          np.dtype(np.float64): ("d", (int, float), 0, False)}
_U8 = np.dtype(np.uint8)
# the kinds of values a window of each kind takes (module doc, Values); numpy's "u" counts as "i"
_TAKES = {"b": {"b"}, "i": {"b", "i"}, "u": {"b", "i"}, "f": {"b", "i", "f"},
          "c": {"b", "i", "f", "c"}}
_TAKES_TEXT = {"b": "bools", "i": "integers (Python ints, numpy integers, bools)",
               "f": "real numbers", "c": "numbers"}
_TAKES_TEXT["u"] = _TAKES_TEXT["i"]


def _kind_of(v) -> str:
    """The kind of one Python or numpy value: b, i, f, c, or "" for anything else."""
    if isinstance(v, (bool, np.bool_)):
        return "b"
    if isinstance(v, (int, np.integer)):
        return "i"
    if isinstance(v, (float, np.floating)):
        return "f"
    if isinstance(v, (complex, np.complexfloating)):
        return "c"
    return ""


def _holder(word: int) -> int:
    """The rank holding a lock word exclusively, or -1 (free, or shared holders: unnamed)."""
    return (word >> 32) - 1 if word >= EXCL else -1


def _apply(op: str, target: np.ndarray, src: np.ndarray) -> None:
    if op == "replace":
        target[...] = src
    elif op != "no_op":
        _ops.ufunc(op)(target, src, out=target)


class Window:
    """An RMA window of one communicator (module doc); create with ``comm.window(array)``.

    Operations on a target need an access epoch: after ``fence()`` (active target, collective)
    or between ``lock(target)`` and ``unlock(target)`` (passive target). Offsets and counts are
    in elements of the window's dtype.

    Attributes:
        local (np.ndarray): This rank's window memory, shaped like the array it exposes.
        dtype (np.dtype): The dtype every rank's window holds.
        rank (int): This rank in the communicator.
        size (int): The number of ranks.
        comm (Communicator): The communicator the window belongs to.

    Examples:
        >>> w = comm.window(np.zeros(4))
        >>> w.fence()
        >>> w.accumulate(np.ones(4), target=0)         # every rank adds into rank 0's
        >>> w.fence()
        >>> w.get(0)
        array([2., 2., 2., 2.])
        >>> w.free()
    """

    def __init__(self, comm, array):
        backend = comm.caps.one_sided
        if backend is None:
            raise RMAError(f"comm.window needs the shm, rdma or ub transport to every rank; this "
                           f"communicator runs on {comm.transport.name} (tcp "
                           f"cannot reach memory one-sided)")
        arr = np.asarray(array)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"a window holds numeric or bool elements, got dtype {arr.dtype}")
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.dtype = arr.dtype
        self._isz = arr.dtype.itemsize
        # the values the dtype holds (module doc, Values): the fast paths compare with these
        if arr.dtype.kind in "iu":
            info = np.iinfo(arr.dtype)
            self._lo, self._hi = int(info.min), int(info.max)
        elif arr.dtype.kind in "fc":
            big = float(np.finfo(arr.dtype).max)
            self._lo, self._hi = -big, big
        else:
            self._lo, self._hi = 0, 1
        self._user = array if isinstance(array, np.ndarray) and array.flags.writeable else None
        self._fence = False
        self._freed = False
        self._typed: List = []
        self._words: List = []
        self._locks: Dict[int, str] = {}
        self._channels: List = []
        self._exposure = None
        try:
            self._exposure = exp = backend.rma_expose(CONTROL + arr.nbytes,
                                                      f"win{os.urandom(4).hex()}")
            exp.u8[:CONTROL] = 0
            exp.u8[CONTROL:] = np.ascontiguousarray(arr).reshape(-1).view(_U8)
            infos = comm.allgather_object((exp.descriptor, int(arr.size), arr.dtype.str))
            dtypes = sorted({d for _, _, d in infos})
            if len(dtypes) > 1:
                raise TypeError(f"comm.window: ranks expose different dtypes {dtypes}; a window "
                                f"has one dtype")
            self._counts = [c for _, c, _ in infos]
            channel = next(_channels)
            self._channels = [backend.rma_attach(comm.world_ranks[r], infos[r][0], channel)
                              for r in range(self.size)]
            comm.barrier()            # every rank mapped every window: the names can go
            exp.seal()
        except BaseException:
            self._release()
            raise
        self.local = exp.u8[CONTROL:].view(self.dtype).reshape(arr.shape)
        # mapped (shm) targets: typed views of their memory for fetch_and_op's fast path
        self._typed = [ch.typed(CONTROL, self.dtype, self._counts[r]) if ch.mapped else None
                       for r, ch in enumerate(self._channels)]
        # ... and, for the common dtypes, Python-level word views (no numpy call at all)
        fmt = _WORDS.get(self.dtype)
        self._words = [memoryview(v).cast("B").cast(fmt[0]) if v is not None and fmt else None
                       for v in self._typed]
        self._word_types = fmt[1] if fmt else ()
        bits, signed = (fmt[2], fmt[3]) if fmt else (0, False)
        self._wrap = (1 << bits) - 1 if bits else 0
        self._wrap_off = (1 << (bits - 1)) if bits and signed else 0
        self._scalar = self.dtype.type

    def __repr__(self):
        return (f"<Window rank {self.rank}/{self.size} dtype={self.dtype} "
                f"elements={self._counts[self.rank]}{' freed' if self._freed else ''}>")

    # ------------------------------------------------------------------ argument checks
    def _live(self, what: str) -> None:
        """THE check every operation makes first (``_target`` for those with a target): a freed
        window, or one whose communicator is closed, refuses it (module doc, The window's end)."""
        if self._freed:
            raise RMAError(f"win.{what}: the window is freed (win.free() ended it)")
        if self.comm._closed:
            raise RMAError(f"win.{what}: the window's communicator is closed (comm.close() "
                           f"before win.free()); the window can no longer be used")

    def _target(self, target, what: str) -> int:
        self._live(what)
        if not isinstance(target, (int, np.integer)) or not 0 <= target < self.size:
            raise ValueError(f"win.{what}: target {target!r} is not a rank of this window's "
                             f"communicator (size {self.size})")
        return int(target)

    def _begin(self, target, what: str):
        t = self._target(target, what)
        if not self._fence and t not in self._locks:
            raise RMAError(f"win.{what}(target={t}) outside an access epoch: call win.fence() "
                           f"(active target) or win.lock({t}) (passive target) first")
        return t, self._channels[t]

    def _span(self, t: int, offset, n: int, what: str) -> int:
        if not isinstance(offset, (int, np.integer)):
            raise TypeError(f"win.{what}: offset must be an int (elements), got {offset!r}")
        offset = int(offset)
        if offset < 0 or n < 0 or offset + n > self._counts[t]:
            raise RMAError(f"win.{what}: elements [{offset}, {offset + n}) are outside rank "
                           f"{t}'s window of {self._counts[t]} elements")
        return CONTROL + offset * self._isz

    def _data(self, data, what: str) -> np.ndarray:
        """``data`` as a flat contiguous array of the window's dtype (module doc, Values)."""
        if not isinstance(data, np.ndarray):
            return self._values(data, what)
        a = data
        if a.dtype != self.dtype:
            if not np.can_cast(a.dtype, self.dtype, casting="same_kind"):
                raise TypeError(f"win.{what}: data of dtype {a.dtype} does not fit a window of "
                                f"{self.dtype}")
            a = a.astype(self.dtype)
        return np.ascontiguousarray(a).reshape(-1)

    def _values(self, data, what: str) -> np.ndarray:
        """Python numbers, numpy scalars or sequences of them, checked by value: the one rule
        of every transport (module doc, Values)."""
        dt = self.dtype
        try:
            a = np.asarray(data)
        except (ValueError, TypeError, OverflowError) as e:
            raise TypeError(f"win.{what}: {data!r:.80} is not numbers for a window of {dt} "
                            f"({e})") from None
        if a.dtype.kind == "O":       # Python ints beyond 64 bits, or mixed: one by one
            for v in a.reshape(-1):
                self._check_value(v, _kind_of(v), what)
            return np.array(a.reshape(-1).tolist(), dtype=dt)
        flat = a.reshape(-1)
        kind = "i" if a.dtype.kind == "u" else a.dtype.kind
        if flat.size == 0:            # no values (an empty list): nothing to refuse
            return np.empty(0, dtype=dt)
        if kind not in _TAKES[dt.kind]:
            self._check_value(flat[0].item(), "", what)
        if dt.kind in "iu" and kind == "i":
            bad = (flat < self._lo) | (flat > self._hi)
        elif dt.kind in "fc" and kind in ("i", "f", "c"):
            x = flat.astype(np.clongdouble if kind == "c" else np.longdouble)
            parts = (x.real, x.imag) if kind == "c" else (x,)
            bad = np.zeros(flat.size, dtype=bool)
            for x in parts:
                bad |= np.isfinite(x) & (np.abs(x) > self._hi)
        else:
            bad = None
        if bad is not None and bad.any():
            self._check_value(flat[int(np.argmax(bad))].item(), kind, what)
        return flat.astype(dt)

    def _check_value(self, v, kind: str, what: str) -> None:
        """Raise the named TypeError / ValueError if the one value ``v`` (of ``kind``, see
        ``_kind_of``) does not fit the window's dtype (module doc, Values)."""
        dt = self.dtype
        if kind not in _TAKES[dt.kind]:
            raise TypeError(f"win.{what}: {v!r:.80} ({type(v).__name__}) does not fit a window "
                            f"of {dt}, which takes {_TAKES_TEXT[dt.kind]}")
        if dt.kind in "iu":
            fits = kind == "b" or self._lo <= int(v) <= self._hi
        elif dt.kind in "fc":
            try:
                parts = (complex(v).real, complex(v).imag)
            except OverflowError:
                parts = (float("inf"),)
            fits = all(not np.isfinite(x) and kind != "i" or abs(x) <= self._hi
                       for x in parts)
        else:
            fits = True
        if not fits:
            raise ValueError(f"win.{what}: value {v!r:.80} does not fit the window's dtype {dt} "
                             f"(range {self._lo!r} .. {self._hi!r})")

    def _value(self, value, what: str) -> np.ndarray:
        """The one value of an atomic, as a one-element array of the window's dtype."""
        src = self._data(value, what)
        if src.size != 1:
            raise ValueError(f"win.{what}: one value, got {src.size}")
        return src

    def _op(self, op, allowed, what: str) -> str:
        name = str(op).lower()
        if name not in allowed:
            raise ValueError(f"win.{what}: unknown op {op!r}; choose one of {', '.join(allowed)}")
        if name not in ("replace", "no_op"):
            _ops.check_dtype(name, self.dtype)
        return name

    # ------------------------------------------------------------------ data movement
    def put(self, data, target: int, offset: int = 0) -> None:
        """Write ``data`` into the target's window at ``offset``.

        Complete at the target after the next ``fence()``, ``flush(target)`` or ``unlock(target)``.

        Args:
            data (np.ndarray): The elements to write (cast to the window's dtype when that is safe).
            target (int): The rank whose window is accessed.
            offset (int): The first element (of the window's dtype) at the target.

        Returns:
            (None): Once ``data`` may be reused.

        Raises:
            RMAError: Outside an access epoch (no ``fence()`` and no ``lock(target)``), elements
                outside the target's window, a freed window or a closed communicator; before
                anything moves.
            TypeError: Data of a dtype or kind the window does not take, or an offset not an
                int.
            ValueError: A Python value outside the dtype's range, or a target that is not a
                rank of the communicator.

        Examples:
            >>> for t in range(comm.size): win.put(np.array([comm.rank + 1.0]), t, offset=comm.rank)
            >>> win.fence()                                # every put has landed, on every rank
            >>> win.local[:2]
            array([1., 2.])
        """
        t, ch = self._begin(target, "put")
        src = self._data(data, "put")
        boff = self._span(t, offset, src.size, "put")
        if src.size:
            ch.put(boff, src.view(_U8))

    def get(self, target: int, offset: int = 0, count: Optional[int] = None) -> np.ndarray:
        """Read ``count`` elements of the target's window from ``offset``.

        Args:
            target (int): The rank whose window is accessed.
            offset (int): The first element (of the window's dtype) at the target.
            count (int | None): The number of elements; None: to the end of the target's window.

        Returns:
            (np.ndarray): A new array, complete on return.

        Raises:
            RMAError: Outside an access epoch (no ``fence()`` and no ``lock(target)``), elements
                outside the target's window, a freed window or a closed communicator; before
                anything moves.
            TypeError: An offset that is not an int.
            ValueError: A target that is not a rank of the communicator.

        Examples:
            >>> if comm.rank == 0: win.local[:3] = [1, 2, 3]
            >>> win.fence()
            >>> win.get(0, offset=0, count=3)
            array([1., 2., 3.])
        """
        t, ch = self._begin(target, "get")
        if count is None:
            self._span(t, offset, 0, "get")
            count = self._counts[t] - int(offset)
        boff = self._span(t, offset, int(count), "get")
        out = np.empty(int(count), dtype=self.dtype)
        if out.size:
            ch.get(boff, out.view(_U8))
        return out

    def accumulate(self, data, target: int, offset: int = 0, op="sum") -> None:
        """Combine ``data`` into the target's window with ``op``, element-wise atomically.

        Atomic per element with respect to other accumulates with the same op (module doc:
        Atomicity).

        Args:
            data (np.ndarray): The elements to combine (cast to the window's dtype when safe).
            target (int): The rank whose window is accessed.
            offset (int): The first element (of the window's dtype) at the target.
            op (str): "sum", "prod", "min", "max", "band", "bor", "bxor" or "replace".

        Returns:
            (None): Complete at the target after the next ``fence()``, ``flush`` or ``unlock``.

        Raises:
            RMAError: Outside an access epoch (no ``fence()`` and no ``lock(target)``), elements
                outside the target's window, a freed window or a closed communicator; before
                anything moves.
            TypeError: Data of a dtype or kind the window does not take, or an op the dtype has
                no meaning for.
            ValueError: A Python value outside the dtype's range, an unknown op, or a target
                that is not a rank of the communicator.

        Examples:
            >>> win.accumulate(np.ones(2), target=0, offset=0)      # both ranks add into rank 0's
            >>> win.fence()
            >>> win.get(0, count=2)
            array([2., 2.])
        """
        t, ch = self._begin(target, "accumulate")
        op = self._op(op, ACC_OPS, "accumulate")
        src = self._data(data, "accumulate")
        boff = self._span(t, offset, src.size, "accumulate")
        if src.size:
            self._rmw(t, ch, boff, src, op, False)

    def get_accumulate(self, data, target: int, offset: int = 0, op="sum") -> np.ndarray:
        """Combine ``data`` into the target's window with ``op`` and return what was there.

        Args:
            data (np.ndarray): The elements to combine (cast to the window's dtype when safe).
            target (int): The rank whose window is accessed.
            offset (int): The first element (of the window's dtype) at the target.
            op (str): As for ``accumulate``, or "no_op" (an atomic read).

        Returns:
            (np.ndarray): The target's elements before the operation, one per element of ``data``.

        Raises:
            RMAError: Outside an access epoch (no ``fence()`` and no ``lock(target)``), elements
                outside the target's window, a freed window or a closed communicator; before
                anything moves.
            TypeError: Data of a dtype or kind the window does not take, or an op the dtype has
                no meaning for.
            ValueError: A Python value outside the dtype's range, an unknown op, or a target
                that is not a rank of the communicator.

        Examples:
            >>> win.get_accumulate(np.array([5.0]), target=0, offset=comm.rank)
            array([0.])
            >>> win.fence()
            >>> win.get(0, count=2)
            array([5., 5.])
        """
        t, ch = self._begin(target, "get_accumulate")
        op = self._op(op, FOP_OPS, "get_accumulate")
        src = self._data(data, "get_accumulate")
        boff = self._span(t, offset, src.size, "get_accumulate")
        if not src.size:
            return np.empty(0, self.dtype)
        return self._rmw(t, ch, boff, src, op, True)

    def fetch_and_op(self, value, target: int, offset: int = 0, op="sum"):
        """Combine ``value`` into one element of the target's window; return the old one.

        The counter / ticket primitive: concurrent calls with the same op are atomic.

        Args:
            value (int | float): The operand.
            target (int): The rank whose window is accessed.
            offset (int): The first element (of the window's dtype) at the target.
            op (str): As for ``accumulate``, or "no_op" (an atomic read).

        Returns:
            (np.generic): The element before the operation, a numpy scalar of the window's dtype.

        Raises:
            RMAError: Outside an access epoch (no ``fence()`` and no ``lock(target)``), elements
                outside the target's window, a freed window or a closed communicator; before
                anything moves.
            TypeError: A value of a kind the window does not take (module doc, Values), or an
                op the dtype has no meaning for.
            ValueError: A value outside the dtype's range, more than one value, an unknown op,
                or a bad target.

        Examples:
            >>> ticket = win.fetch_and_op(1.0, target=0, offset=7)   # each rank draws one
            >>> sorted(comm.allgather_object(int(ticket)))
            [0, 1]
        """
        t, ch = self._begin(target, "fetch_and_op")
        # The hot case (a counter, a ticket): a shm target of a common dtype, a Python number
        # in its range, op sum -- one critical section on a word view of the target.
        words = self._hot_words(t, offset, (value,), self._word_types) if op == "sum" else None
        if words is not None:
            m = ch.mutex
            m.acquire()
            try:
                old = words[offset]
                new = old + value
                if self._wrap:
                    new = ((new + self._wrap_off) & self._wrap) - self._wrap_off
                words[offset] = new
            finally:
                m.release()
            return self._scalar(old)
        op = self._op(op, FOP_OPS, "fetch_and_op")
        src = self._value(value, "fetch_and_op")
        boff = self._span(t, offset, 1, "fetch_and_op")
        return self._rmw(t, ch, boff, src, op, True)[0]

    def _hot_words(self, t: int, offset, values, types):
        """The target's word view when the atomics' hot case applies (a mapped target of a
        common dtype, Python numbers of ``types`` in its range, an int offset inside), else
        None."""
        words = self._words[t]
        if words is None or type(offset) is not int or not 0 <= offset < self._counts[t]:
            return None
        for v in values:
            if type(v) not in types or not self._lo <= v <= self._hi:
                return None
        return words

    def compare_and_swap(self, value, compare, target: int, offset: int = 0):
        """Write ``value`` into one element of the target's window if it equals ``compare``.

        Atomic; integer and bool windows only (as MPI).

        Args:
            value (int): The new value.
            compare (int): The value the element must hold for the swap to happen.
            target (int): The rank whose window is accessed.
            offset (int): The first element (of the window's dtype) at the target.

        Returns:
            (np.generic): The element before the call (the swap happened if it equals ``compare``).

        Raises:
            RMAError: Outside an access epoch (no ``fence()`` and no ``lock(target)``), elements
                outside the target's window, a freed window or a closed communicator; before
                anything moves.
            TypeError: A window that is not of an integer or bool dtype, or a value of another
                kind than its dtype's.
            ValueError: A value outside the dtype's range, more than one value, or a bad target.

        Examples:
            >>> flag = comm.window(np.zeros(1, dtype=np.int64))
            >>> flag.fence()
            >>> won = flag.compare_and_swap(comm.rank + 1, 0, target=0) == 0
            >>> sorted(comm.allgather_object(bool(won)))                # exactly one rank wins
            [False, True]
            >>> flag.free()
        """
        t, ch = self._begin(target, "compare_and_swap")
        if self.dtype.kind not in "biu":
            raise TypeError(f"win.compare_and_swap needs an integer or bool window (as MPI), "
                            f"this one holds {self.dtype}")
        # the hot case, as fetch_and_op's: an integer shm target, Python ints in its range
        words = self._hot_words(t, offset, (value, compare), (int,))
        if words is not None:
            m = ch.mutex
            m.acquire()
            try:
                old = words[offset]
                if old == compare:
                    words[offset] = value
            finally:
                m.release()
            return self._scalar(old)
        new = self._value(value, "compare_and_swap")
        cmp = self._value(compare, "compare_and_swap")
        boff = self._span(t, offset, 1, "compare_and_swap")
        if ch.native_atomics and self._isz == 8:
            old = ch.cas(boff, int(cmp.view(np.int64)[0]), int(new.view(np.int64)[0]))
            return np.array([old], dtype=np.int64).view(self.dtype)[0]

        def swap_if_equal(cur: np.ndarray) -> None:
            if cur[0] == cmp[0]:
                cur[0] = new[0]
        return self._rmw(t, ch, boff, new, swap_if_equal, True)[0]

    def _rmw(self, t: int, ch, boff: int, src: np.ndarray, op, fetch: bool):
        """The read-modify-write of an accumulate-family call (module doc: Atomicity)."""
        n = src.size
        apply = op if callable(op) else (lambda cur: _apply(op, cur, src))
        if ch.mapped:                 # shm: one critical section on the target's memory
            dtype = self.dtype

            def fn(view_u8):
                cur = view_u8.view(dtype)
                old = cur.copy() if fetch else None
                apply(cur)
                return old
            return ch.update(boff, n * self._isz, fn)
        if ch.native_atomics and self._isz == 8 and self.dtype.kind in "iu" and \
                op in ("sum", "replace", "no_op"):
            words = src.view(np.int64)
            old = np.empty(n, dtype=np.int64)
            for i in range(n):
                off = boff + 8 * i
                if op == "sum":
                    old[i] = ch.fadd(off, int(words[i]))
                elif op == "replace":
                    old[i] = self._swap(ch, off, int(words[i]))
                else:
                    ch.get(off, old[i:i + 1].view(_U8))
            return old.view(self.dtype) if fetch else None
        with self._accumulate_lock(t, ch):
            cur = np.empty(n, dtype=self.dtype)
            ch.get(boff, cur.view(_U8))
            old = cur.copy() if fetch else None
            apply(cur)
            ch.put(boff, cur.view(_U8))
            ch.flush()
        return old

    @staticmethod
    def _swap(ch, off: int, value: int) -> int:
        if ch.native_swap:
            return ch.swap(off, value)
        cur = ch.fadd(off, 0)         # no native swap (rdma): a CAS loop
        while True:
            seen = ch.cas(off, cur, value)
            if seen == cur:
                return cur
            cur = seen

    @contextlib.contextmanager
    def _accumulate_lock(self, t: int, ch):
        if self._locks.get(t) == "exclusive":
            yield                     # our exclusive lock already excludes everyone
            return
        me = self.rank + 1            # the word names its holder (module doc: Passive-target)

        def attempt():
            seen = ch.cas(_ACC, 0, me)
            return None if seen == 0 else seen - 1
        self._acquire(attempt, f"win accumulate lock of rank {t}")
        try:
            yield
        finally:
            ch.cas(_ACC, me, 0)

    def _acquire(self, attempt, what: str) -> None:
        """Poll ``attempt()`` with exponential backoff until it succeeds (returns None; else it
        returns the rank holding the lock, -1 when unnamed). A holder whose death is known ends
        the wait with PeerFailure at once; anything else, comm.timeout with CommTimeout."""
        deadline = time.monotonic() + self.comm.timeout
        k = 0
        while True:
            holder = attempt()
            if holder is None:
                return
            named = 0 <= holder < self.size and holder != self.rank
            if named and k >= 8:      # past the first yields: the holder is not just slow
                self._holder_alive(holder, what)
            if time.monotonic() > deadline:
                held = f"rank {holder}" if named else "another rank"
                raise CommTimeout(f"{what}: still held by {held} after "
                                  f"{self.comm.timeout:.0f} s")
            if k < 8:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 1e-6 * (1 << min(k - 8, 10))))
            k += 1

    def _holder_alive(self, holder: int, what: str) -> None:
        """Raise PeerFailure naming ``holder`` if its transport knows it is gone: it can never
        release the lock (the channel reads the link's failure notices without blocking)."""
        why = self._channels[holder].peer_gone()
        if why is None:
            return
        e = PeerFailure(f"{what}: rank {holder} holds the lock and is gone ({why}); it can "
                        f"never release it")
        e.peer, e.clean = holder, "(it finished)" in why
        raise e

    # ------------------------------------------------------------------ synchronization
    def fence(self) -> None:
        """Complete every operation of the epoch on every rank, then open the next (collective).

        Returns:
            (None): Once every rank's operations issued before it have completed everywhere.

        Raises:
            RMAError: The window is freed or its communicator closed, or this rank holds
                passive-target locks.
            CommError: On failure of the barrier (``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> win.put(np.array([7.0]), target=0, offset=comm.rank)
            >>> win.fence()
            >>> win.get(0, count=2)
            array([7., 7.])
        """
        self._live("fence")
        if self._locks:
            raise RMAError(f"win.fence while holding passive-target locks on ranks "
                           f"{sorted(self._locks)}: unlock them first")
        for ch in self._channels:
            ch.flush()
        self.comm.barrier()
        self._fence = True

    def lock(self, target: int, exclusive: bool = True) -> None:
        """Open a passive-target access epoch on ``target``; the target makes no call.

        A contended lock is polled with exponential backoff until ``comm.timeout``; a holder
        that is gone (exited, crashed, or closed its transport without unlocking) ends the wait
        as soon as this rank's transport knows it.

        Args:
            target (int): The rank whose window is accessed.
            exclusive (bool): Exclude every other lock on the target (True), or share it with other
                shared locks (False).

        Returns:
            (None): Once the lock is held.

        Raises:
            RMAError: This rank already holds a lock on ``target``, or the window is freed or
                its communicator closed.
            ValueError: A target that is not a rank of the communicator.
            PeerFailure: The rank holding the lock exclusively is gone (``peer`` names it); it
                can never release the lock.
            CommTimeout: The lock was still held by another rank after ``comm.timeout``.

        Examples:
            >>> win.lock(0)                                  # exclusive: one rank at a time
            >>> win.put(win.get(0, offset=6, count=1) + 1, 0, offset=6)
            >>> win.unlock(0)
            >>> win.fence()
            >>> win.get(0, offset=6, count=1)
            array([2.])
        """
        t = self._target(target, "lock")
        if t in self._locks:
            raise RMAError(f"win.lock: rank {t} is already locked by this rank (unlock it first)")
        ch = self._channels[t]
        if exclusive:
            mine = (self.rank + 1) * EXCL     # the word names its holder

            def attempt():
                seen = ch.cas(_LOCK, 0, mine)
                return None if seen == 0 else _holder(seen)
            self._acquire(attempt, f"win.lock({t}, exclusive)")
        else:
            def attempt():
                seen = ch.fadd(_LOCK, 1)
                if seen < EXCL:
                    return None
                ch.fadd(_LOCK, -1)    # an exclusive holder: back off
                return _holder(seen)
            self._acquire(attempt, f"win.lock({t}, shared)")
        self._locks[t] = "exclusive" if exclusive else "shared"

    def unlock(self, target: int) -> None:
        """Complete this rank's operations at ``target`` and release its lock there.

        Args:
            target (int): The rank whose window is accessed.

        Returns:
            (None): Once the operations are complete at the target.

        Raises:
            RMAError: This rank holds no lock on ``target``, or the window is freed or its
                communicator closed.
            ValueError: A target that is not a rank of the communicator.

        Examples:
            >>> win.lock(1, exclusive=False)
            >>> win.accumulate(np.array([1.0]), target=1, offset=5)
            >>> win.unlock(1)
            >>> win.fence()
            >>> win.get(1, offset=5, count=1)
            array([2.])
        """
        t = self._target(target, "unlock")
        kind = self._locks.get(t)
        if kind is None:
            raise RMAError(f"win.unlock: rank {t} is not locked by this rank")
        ch = self._channels[t]
        try:
            ch.flush()
        finally:
            del self._locks[t]
            ch.fadd(_LOCK, -(self.rank + 1) * EXCL if kind == "exclusive" else -1)

    def flush(self, target: int) -> None:
        """Complete this rank's operations at ``target``, within the epoch.

        Args:
            target (int): The rank whose window is accessed.

        Returns:
            (None): Once they are complete at the target.

        Raises:
            RMAError: Outside an access epoch, a freed window or a closed communicator.
            ValueError: A target that is not a rank of the communicator.

        Examples:
            >>> win.lock(0, exclusive=False)
            >>> win.accumulate(np.array([1.0]), target=0, offset=4)
            >>> win.flush(0)                                 # at rank 0 now; the lock is still held
            >>> win.unlock(0)
        """
        t, ch = self._begin(target, "flush")
        ch.flush()

    def flush_all(self) -> None:
        """Complete this rank's operations at every target, within the epoch.

        Returns:
            (None): Once they are complete everywhere.

        Raises:
            RMAError: The window is freed or its communicator closed.

        Examples:
            >>> win.put(np.array([3.0]), target=1 - comm.rank, offset=3)
            >>> win.flush_all()
        """
        self._live("flush_all")
        for ch in self._channels:
            ch.flush()

    # ------------------------------------------------------------------ lifetime
    def free(self) -> None:
        """Complete everything, copy the memory back into ``array``, release (collective).

        The array the window was made from receives the final contents when it is a writable numpy
        array. A second free does nothing; a window is also a context manager that frees on exit.

        Returns:
            (None): Once every rank has stopped accessing every window.

        Raises:
            RMAError: This rank holds passive-target locks.
            CommError: On failure of the barrier (``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> a = np.zeros(2)
            >>> with comm.window(a) as w:
            ...     w.fence()
            ...     w.accumulate(np.ones(2), target=0)
            ...     w.fence()
            >>> a if comm.rank == 0 else a + 2   # the sum at rank 0; rank 1's stays zeros
            array([2., 2.])
        """
        if self._freed:
            return
        if self.comm._closed:         # no barrier is possible: release, and say why once
            self._release()
            raise RMAError("win.free: the window's communicator was closed first (comm.close() "
                           "before win.free()); this rank's window memory is released without "
                           "the closing barrier and the array did not receive its contents")
        if self._locks:
            raise RMAError(f"win.free while holding locks on ranks {sorted(self._locks)}")
        try:
            for ch in self._channels:
                ch.flush()
            self.comm.barrier()       # nobody accesses anybody's window any more
            if self._user is not None:
                self._user[...] = self.local.reshape(self._user.shape)
        finally:
            self._release()

    def _release(self) -> None:
        self._freed = True
        self.local = None
        for w in self._words:
            if w is not None:
                w.release()
        self._typed, self._words = [], []
        for ch in self._channels:
            try:
                ch.close()
            except Exception:
                pass
        self._channels = []
        if self._exposure is not None:
            self._exposure.close()
            self._exposure = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.free()
        else:
            self._release()
