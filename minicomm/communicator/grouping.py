"""``comm.group()``: NCCL's group semantics, with Horovod's tensor fusion.

Inside ``with comm.group():`` every call returns a ``Work`` at once. A collective is checked
and bound as usual (TypeError / ValueError at the call) and held; a point-to-point call is
posted at once and completed at the exit, so a send and a receive in one group cannot deadlock
on each other (NCCL's rule). At the exit:

1. with collectives held (and more than one rank), the ranks compare the group: one 24-byte
   allgather of a digest of the calls' fingerprints. On a difference, a second,
   fixed-size exchange finds the first call they disagree on, and every rank raises a
   ``MismatchError`` naming it, before any data moves;
2. allreduces with the same op, dtype and requested algorithm are packed into one flat buffer
   (up to ``MINICOMM_FUSION_BYTES`` each; more start another) and run as one allreduce at the
   place of the first; every other call runs as itself, in call order;
3. the point-to-point calls complete.

An error in any call is raised at the exit, naming that call; the other calls' works fail with
it. An exception inside the block issues no collective: the held calls' works fail with a
``CommError`` naming it, and the exception goes on (point-to-point calls were posted already;
their works stay usable). Groups nest (the outermost exit issues).
"""
from __future__ import annotations

import contextlib
import zlib
from typing import List, Optional

import numpy as np

from .. import ops as _ops
from ..errors import CommError, MismatchError, describe_call
from ..settings import byte_setting
from ..transports.base import Tag
from .cache import BoundedCache
from .collectives import BoundCall
from .lifecycle import Work, same_error

DEFAULT_FUSION_BYTES = 64 << 20     # Horovod's default fusion buffer


def fusion_bytes() -> int:
    """MINICOMM_FUSION_BYTES: the largest fused buffer of a group (0: no fusion)."""
    return byte_setting("MINICOMM_FUSION_BYTES", DEFAULT_FUSION_BYTES)


class GroupWork(Work):
    """A grouped call's handle: done at the group's exit, on the thread that opened it. Its
    description is made when asked for (errors, repr): a group holds many calls."""

    def __init__(self, name: str, index: int):
        self._name, self._index, self._result, self._error = name, index, None, None
        self._drive, self._event, self.status = None, None, None

    @property
    def description(self) -> str:
        return f"{self._name} (call {self._index} of a comm.group())"

    def _finish(self, result=None, error: Optional[BaseException] = None):
        self._result, self._error, self._event = result, error, True

    def is_completed(self) -> bool:
        return self._event is not None

    def wait(self, timeout: Optional[float] = None):
        if self._event is None:
            raise CommError(f"wait() on {self.description} inside its comm.group(): the group's "
                            f"calls run at the exit of the with block")
        if self._error is not None:
            raise self._error
        return self._result

    result = wait


class Batch:
    """What one open group holds: its collectives as (bound call, work) and its posted
    point-to-point works as (work, a recv's ``status=`` or None)."""
    __slots__ = ("calls", "p2p", "depth")

    def __init__(self):
        self.calls: list = []
        self.p2p: list = []
        self.depth = 1


class Grouping:
    """``comm.group()`` (module doc)."""

    @contextlib.contextmanager
    def group(self):
        """Group the calls made inside the ``with`` block (NCCL's ``ncclGroupStart/End``).

        Every call inside returns a ``Work`` at once; at the exit every call has been issued
        and completed, allreduces with the same op, dtype and algorithm fused into one buffer
        (up to ``MINICOMM_FUSION_BYTES``). Point-to-point calls in a group cannot deadlock on
        each other. Calls that make calls (``split``, the object collectives, ``window``)
        cannot be grouped.

        Returns:
            (contextmanager): Use it as ``with comm.group():``.

        Raises:
            MismatchError: At the exit, the ranks' groups differ: names the first call that
                differs, on every rank.
            CommError: At the exit, the first failing call's error, naming it (the other works
                fail with it); the communicator is broken then, as after any failed call.

        Examples:
            >>> a, b = np.ones(4), np.full(4, 2.0)
            >>> with comm.group():
            ...     wa = comm.allreduce(a, out=a)
            ...     wb = comm.allreduce(b, out=b)
            >>> wb.wait()                              # 2 ranks
            array([4., 4., 4., 4.])
        """
        batch = self._batch
        if batch is not None:                 # a nested group joins the outer one
            batch.depth += 1
            try:
                yield
            finally:
                batch.depth -= 1
            return
        self._usable("group")
        batch = self._batch = Batch()
        outer, self._intercept = self._intercept, self._hold
        with self._qlock:
            self._pending += 1                # plain calls leave their fast path while grouping
        done = False
        try:
            yield
            done = True
        finally:
            self._batch, self._intercept = None, outer
            with self._qlock:
                self._pending -= 1
            if not done:
                self._abandon(batch)
        self._issue(batch)

    def _hold(self, name: str, bound) -> GroupWork:
        """The last step of a call inside a group (the general path's, or the fast path's for
        a signature bound before): hold the bound call."""
        if self._depth > 1:
            raise CommError(f"{self.busy_with} inside comm.group(): it makes calls of its own "
                            f"and cannot be grouped; call it outside the group")
        calls = self._batch.calls
        work = GroupWork(name, len(calls) + 1)
        calls.append((bound, work))
        return work

    def _hold_p2p(self, work: Work, status=None) -> Work:
        """A point-to-point call inside a group: posted already, completed at the exit."""
        self._batch.p2p.append((work, status))
        return work

    def _abandon(self, batch: Batch) -> None:
        """An exception left the block: the held collectives were not issued and fail; the
        point-to-point calls were posted already, and their works stay the caller's to wait."""
        for _, work in batch.calls:
            work._finish(error=CommError(f"{work.description}: not issued: an exception left "
                                         f"the comm.group() block"))

    def _issue(self, batch: Batch) -> None:
        """The group's exit (module doc): check, run fused, complete the point-to-point."""
        calls, error = batch.calls, None
        if calls:
            self._enter("group")
            try:                              # behind queued work, in program order
                self._submit("group", lambda: self._run_held(calls), False)
            except BaseException as e:
                error = e
                for _, work in calls:
                    if not work.is_completed():
                        work._finish(error=same_error(e))
            finally:
                self._exit()
        # receives first: waiting on one moves the matching engine, which a peer's send needs
        for work, status in sorted(batch.p2p, key=lambda ws: ws[0].status is None):
            try:
                work.wait()
            except CommError as e:
                error = error or e
                continue
            if status is not None and work.status is not None:
                st = work.status
                status.source, status.tag, status.nbytes = st.source, st.tag, st.nbytes
                status.dtype, status.shape = st.dtype, st.shape
        if error is not None:
            raise error

    def _run_held(self, calls) -> None:
        """Check the group, then run its units (``_issue`` fails the works left on an error)."""
        if self.size > 1:
            self._check_group(calls)
        for unit in self._fused(calls):
            self._run_unit(unit)

    def _fused(self, calls) -> List[list]:
        """The group's calls as units in call order: one call each, except allreduces with the
        same (op, dtype, requested algorithm), packed together up to the fusion limit."""
        limit = fusion_bytes()
        units, open_units = [], {}
        for bound, work in calls:
            if type(bound) is BoundCall and bound.name == "allreduce" and limit \
                    and bound.c.algo != "innet":
                key = (bound.op, bound.outb.dtype, bound.algorithm)
                nbytes = bound.count * bound.outb.itemsize
                unit = open_units.get(key)
                if unit is None or unit[0] + nbytes > limit:
                    unit = open_units[key] = [0]
                    units.append(unit)
                unit[0] += nbytes
                unit.append((bound, work))
            else:
                units.append([0, (bound, work)])
        return units

    def _run_unit(self, unit: list) -> None:
        """One unit of ``_fused``: a call, or allreduces packed into one buffer."""
        members = unit[1:]
        if len(members) == 1:
            bound, work = members[0]
            work._finish(self._named(work, bound))
            return
        first = members[0][0]
        dtype = first.outb.dtype
        packed, result = self._fusion_buffers(dtype, sum(b.count for b, _ in members))
        np.concatenate([b.inb for b, _ in members], out=packed)
        total = packed.size
        try:
            self._execute("allreduce", packed, result, total, first.op, 0, first.algorithm,
                          (total,))
        except CommError as e:
            e.args = (f"{first.name} calls {', '.join(str(w._index) for _, w in members)} of a "
                      f"comm.group(), fused into one allreduce of {total} x {dtype}: {e}",)
            raise
        if first.op == _ops.AVG:
            np.true_divide(result, self.size, out=result)
        at = 0
        for b, work in members:
            n = b.count
            b.outb[:] = result[at:at + n]
            at += n
            work._finish(b.res)

    @staticmethod
    def _named(work: GroupWork, bound):
        """Run one held call; its error names it."""
        try:
            return bound()
        except CommError as e:
            e.args = (f"{work.description}: {e}",)
            raise

    def _fusion_buffers(self, dtype: np.dtype, total: int):
        """Two scratch arrays of ``total`` elements (packed input, result), kept per dtype."""
        cache = self.__dict__.get("_fusion")
        if cache is None:
            cache = self._fusion = BoundedCache(8)
        bufs = cache.get(dtype)
        if bufs is None or bufs[0].size < total:
            bufs = cache.put(dtype, (np.empty(total, dtype), np.empty(total, dtype)))
        return bufs[0][:total], bufs[1][:total]

    # ------------------------------------------------------------------ the group's check
    def _group_rows(self, calls) -> np.ndarray:
        """One fingerprint row per held call: (packed signature, count, crc32 of the shape);
        an uneven or header call, whose counts may differ by rank: (crc32 of its name, -1, 0)."""
        rows = np.empty((len(calls), 3), dtype=np.int64)
        for i, (bound, work) in enumerate(calls):
            if type(bound) is BoundCall:
                rows[i] = self._fingerprint(bound.c.call, bound.count, bound.shape)
            else:
                rows[i] = (zlib.crc32(work._name.encode()), -1, 0)
        return rows

    @staticmethod
    def _group_digest(calls) -> int:
        """A digest of the calls' signatures, counts and shapes that every rank computes alike
        (the hash of a tuple of ints does not depend on the process; names go through crc32)."""
        return hash(tuple((b.c.call, b.count, b.shape) if type(b) is BoundCall
                          else zlib.crc32(w._name.encode()) for b, w in calls))

    def _check_group(self, calls) -> None:
        """Every rank learns whether the ranks' groups are the same; if not, which call is the
        first to differ (module doc): a ``MismatchError`` naming it, on every rank."""
        mine = np.array([self._group_digest(calls), len(calls), 0], dtype=np.int64)
        table = np.empty((self.size, 3), dtype=np.int64)
        self._execute("allgather", mine, table.reshape(-1), 3, "none", 0, "rhd", table.shape)
        if (table == mine).all():
            return
        rows = self._group_rows(calls)
        n = int(table[:, 1].min())
        first, other = n, int(np.argmin(table[:, 1]))
        if n:
            everyone = np.empty((self.size, n, 3), dtype=np.int64)
            self._execute("allgather", rows[:n].copy().reshape(-1), everyone.reshape(-1),
                          3 * n, "none", 0, "rhd", everyone.shape)
            differ = (everyone != everyone[0]).any(axis=(0, 2))
            if differ.any():
                first = int(np.argmax(differ))
                other = next(r for r in range(self.size)
                             if not np.array_equal(everyone[r, first], rows[first]))
        if first < n:
            theirs = everyone[other, first]
            text = (f"ranks disagree on call {first + 1} of a comm.group(): rank {other} called "
                    f"{self._row_call(theirs)}, rank {self.rank} called "
                    f"{self._row_call(rows[first], calls[first][1])}")
        elif len(calls) > n:
            text = (f"ranks disagree on a comm.group(): rank {other} grouped {n} calls, rank "
                    f"{self.rank} {len(calls)}: call {n + 1} "
                    f"({self._row_call(rows[n], calls[n][1])}) has no match on rank {other}")
        else:
            longer = int(np.argmax(table[:, 1]))
            text = (f"ranks disagree on a comm.group(): rank {longer} grouped "
                    f"{int(table[longer, 1])} calls, rank {self.rank} {n}: rank {longer}'s call "
                    f"{n + 1} has no match here")
        self._fail(MismatchError(text))

    @staticmethod
    def _row_call(row, work: Optional[GroupWork] = None) -> str:
        """What a fingerprint row says of its call (``work``: this rank's own, for the name)."""
        if row[1] < 0:
            return work._name if work is not None else "an uneven or scatter call"
        return describe_call(Tag(0, 0, 0, int(row[0]), int(row[1])))
