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
Passive-target locks are a lock word in the target's window (exclusive bit + shared count),
taken with atomics; a contended lock is polled with exponential backoff (yield, then sleeps
from a microsecond doubling to a millisecond) -- no RDMA NIC notifies a lock release -- until
``comm.timeout``.

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
from .errors import CommTimeout, RMAError

CONTROL = 64                          # bytes before the data: the lock word, the accumulate lock
_LOCK, _ACC = 0, 8
EXCL = 1 << 32                        # lock word: exclusive bit above the shared count
ACC_OPS = ("sum", "prod", "min", "max", "band", "bor", "bxor", "replace")
FOP_OPS = ACC_OPS + ("no_op",)
_channels = itertools.count(1000)     # rdma QP numbers of windows (landing traffic uses 1)
_WORDS = {np.dtype(np.int64): ("q", (int,), 64, True), np.dtype(np.uint64): ("Q", (int,), 64, False),
          np.dtype(np.int32): ("i", (int,), 32, True), np.dtype(np.uint32): ("I", (int,), 32, False),
          np.dtype(np.float64): ("d", (int, float), 0, False)}
_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
           "replace": None, "no_op": None}
_U8 = np.dtype(np.uint8)


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
        self._user = array if isinstance(array, np.ndarray) and array.flags.writeable else None
        self._fence = False
        self._freed = False
        self._typed: List = []
        self._words: List = []
        self._valid_ops: set = set()
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
            self._channels = [backend.rma_attach(comm.group[r], infos[r][0], channel)
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
        self._valid_ops = set()
        for op in FOP_OPS:
            try:
                self._op(op, FOP_OPS, "fetch_and_op")
                self._valid_ops.add(op)
            except TypeError:
                pass

    def __repr__(self):
        return (f"<Window rank {self.rank}/{self.size} dtype={self.dtype} "
                f"elements={self._counts[self.rank]}{' freed' if self._freed else ''}>")

    # ------------------------------------------------------------------ argument checks
    def _target(self, target, what: str) -> int:
        if self._freed:
            raise RMAError(f"win.{what}: the window is freed")
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
        a = np.asarray(data)
        if a.dtype != self.dtype:
            if not np.can_cast(a.dtype, self.dtype, casting="same_kind"):
                raise TypeError(f"win.{what}: data of dtype {a.dtype} does not fit a window of "
                                f"{self.dtype}")
            a = a.astype(self.dtype)
        return np.ascontiguousarray(a).reshape(-1)

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
                outside the target's window, or a freed window; before anything moves.
            TypeError: Data of a dtype that does not fit the window, or an offset not an int.
            ValueError: A target that is not a rank of the communicator.

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
                outside the target's window, or a freed window; before anything moves.
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
                outside the target's window, or a freed window; before anything moves.
            TypeError: Data that does not fit the window, or an op the dtype has no meaning for.
            ValueError: An unknown op, or a target that is not a rank of the communicator.

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
                outside the target's window, or a freed window; before anything moves.
            TypeError: Data that does not fit the window, or an op the dtype has no meaning for.
            ValueError: An unknown op, or a target that is not a rank of the communicator.

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
                outside the target's window, or a freed window; before anything moves.
            TypeError: A value that does not fit the window, or an op the dtype has no meaning for.
            ValueError: More than one value, an unknown op, or a bad target.

        Examples:
            >>> ticket = win.fetch_and_op(1.0, target=0, offset=7)   # each rank draws one
            >>> sorted(comm.allgather_object(int(ticket)))
            [0, 1]
        """
        # The hot case (a counter, a ticket): a shm target, a valid op and offset, an open
        # epoch -- one critical section on a typed view of the target, nothing else.
        if type(target) is int and 0 <= target < self.size and op in self._valid_ops \
                and (self._fence or target in self._locks) and type(offset) is int \
                and 0 <= offset < self._counts[target]:
            words = self._words[target]
            if words is not None and op == "sum" and type(value) in self._word_types:
                m = self._channels[target].mutex
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
            typed = self._typed[target]
            if typed is not None:
                seg = typed[offset:offset + 1]
                uf = _UFUNCS[op]
                m = self._channels[target].mutex
                m.acquire()
                try:
                    old = seg[0]
                    if uf is not None:
                        uf(seg, value, out=seg)
                    elif op == "replace":
                        seg[0] = value
                finally:
                    m.release()
                return old
        t, ch = self._begin(target, "fetch_and_op")
        op = self._op(op, FOP_OPS, "fetch_and_op")
        src = self._data(value, "fetch_and_op")
        if src.size != 1:
            raise ValueError(f"win.fetch_and_op: one value, got {src.size}")
        boff = self._span(t, offset, 1, "fetch_and_op")
        return self._rmw(t, ch, boff, src, op, True)[0]

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
                outside the target's window, or a freed window; before anything moves.
            TypeError: A window that is not of an integer or bool dtype.
            ValueError: More than one value, or a bad target.

        Examples:
            >>> flag = comm.window(np.zeros(1, dtype=np.int64))
            >>> flag.fence()
            >>> won = flag.compare_and_swap(comm.rank + 1, 0, target=0) == 0
            >>> sorted(comm.allgather_object(bool(won)))                # exactly one rank wins
            [False, True]
            >>> flag.free()
        """
        # the hot case, as fetch_and_op's: an integer shm target, Python ints, an open epoch
        if type(target) is int and 0 <= target < self.size and type(value) is int \
                and type(compare) is int and self.dtype.kind in "iu" \
                and (self._fence or target in self._locks) and type(offset) is int \
                and 0 <= offset < self._counts[target]:
            words = self._words[target]
            if words is not None:
                m = self._channels[target].mutex
                m.acquire()
                try:
                    old = words[offset]
                    if old == compare:
                        words[offset] = value
                finally:
                    m.release()
                return self._scalar(old)
        t, ch = self._begin(target, "compare_and_swap")
        if self.dtype.kind not in "biu":
            raise TypeError(f"win.compare_and_swap needs an integer or bool window (as MPI), "
                            f"this one holds {self.dtype}")
        new = self._data(value, "compare_and_swap")
        cmp = self._data(compare, "compare_and_swap")
        if new.size != 1 or cmp.size != 1:
            raise ValueError("win.compare_and_swap: one value and one compare value")
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
        me = self.rank + 1
        self._acquire(lambda: ch.cas(_ACC, 0, me) == 0, f"win accumulate lock of rank {t}")
        try:
            yield
        finally:
            ch.cas(_ACC, me, 0)

    def _acquire(self, attempt, what: str) -> None:
        """Poll ``attempt()`` with exponential backoff until it succeeds or comm.timeout."""
        deadline = time.monotonic() + self.comm.timeout
        k = 0
        while not attempt():
            if time.monotonic() > deadline:
                raise CommTimeout(f"{what}: still held by another rank after "
                                  f"{self.comm.timeout:.0f} s")
            if k < 8:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 1e-6 * (1 << min(k - 8, 10))))
            k += 1

    # ------------------------------------------------------------------ synchronization
    def fence(self) -> None:
        """Complete every operation of the epoch on every rank, then open the next (collective).

        Returns:
            (None): Once every rank's operations issued before it have completed everywhere.

        Raises:
            RMAError: The window is freed, or this rank holds passive-target locks.
            CommError: On failure of the barrier (``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> win.put(np.array([7.0]), target=0, offset=comm.rank)
            >>> win.fence()
            >>> win.get(0, count=2)
            array([7., 7.])
        """
        if self._freed:
            raise RMAError("win.fence: the window is freed")
        if self._locks:
            raise RMAError(f"win.fence while holding passive-target locks on ranks "
                           f"{sorted(self._locks)}: unlock them first")
        for ch in self._channels:
            ch.flush()
        self.comm.barrier()
        self._fence = True

    def lock(self, target: int, exclusive: bool = True) -> None:
        """Open a passive-target access epoch on ``target``; the target makes no call.

        A contended lock is polled with exponential backoff until ``comm.timeout``.

        Args:
            target (int): The rank whose window is accessed.
            exclusive (bool): Exclude every other lock on the target (True), or share it with other
                shared locks (False).

        Returns:
            (None): Once the lock is held.

        Raises:
            RMAError: This rank already holds a lock on ``target``, or the window is freed.
            ValueError: A target that is not a rank of the communicator.
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
            self._acquire(lambda: ch.cas(_LOCK, 0, EXCL) == 0, f"win.lock({t}, exclusive)")
        else:
            def shared() -> bool:
                if ch.fadd(_LOCK, 1) < EXCL:
                    return True
                ch.fadd(_LOCK, -1)    # an exclusive holder: back off
                return False
            self._acquire(shared, f"win.lock({t}, shared)")
        self._locks[t] = "exclusive" if exclusive else "shared"

    def unlock(self, target: int) -> None:
        """Complete this rank's operations at ``target`` and release its lock there.

        Args:
            target (int): The rank whose window is accessed.

        Returns:
            (None): Once the operations are complete at the target.

        Raises:
            RMAError: This rank holds no lock on ``target``, or the window is freed.
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
            ch.fadd(_LOCK, -EXCL if kind == "exclusive" else -1)

    def flush(self, target: int) -> None:
        """Complete this rank's operations at ``target``, within the epoch.

        Args:
            target (int): The rank whose window is accessed.

        Returns:
            (None): Once they are complete at the target.

        Raises:
            RMAError: Outside an access epoch, or a freed window.
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
            RMAError: The window is freed.

        Examples:
            >>> win.put(np.array([3.0]), target=1 - comm.rank, offset=3)
            >>> win.flush_all()
        """
        if self._freed:
            raise RMAError("win.flush_all: the window is freed")
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
