"""Call fingerprints: how ranks that disagree on a call all learn of it.

Every message carries the call's packed signature, so ranks that disagree find out from the
first header they exchange. Ranks that disagree on the *root* may never exchange one (each
"root" only sends): rooted calls therefore exchange fingerprints -- (packed signature, count,
crc32 of the shape) -- and ``check="full"`` does it before every call. Rooted calls do it
without a round trip (docs/decisions/lazy-fingerprint-checks.md): the fingerprints travel
beside the data and are compared as they arrive (``_post_fingerprints`` for the executor,
``_small_guard`` for the small path: the same messages and tags, so the paths interoperate).
"""
from __future__ import annotations

import zlib
from typing import Tuple

import numpy as np

from .. import ops as _ops
from ..errors import MismatchError, describe_call, fingerprint_call
from ..executor import LazyCheck, Plan, run_plan
from ..smallpath import Guard
from ..transports.base import Tag
from .cache import BoundedCache


class Fingerprints:
    """The fingerprint checks of a communicator (module doc)."""

    def _init_fingerprints(self, entries: int) -> None:
        self._fingerprints = BoundedCache(entries)   # (call, count, shape) -> int64[3]

    def _fingerprint(self, call: int, count: int, shape: Tuple[int, ...]) -> np.ndarray:
        """This rank's fingerprint of a call: (packed signature, count, crc32 of the shape),
        memoised (calls repeat; read-only, it is only ever sent and compared)."""
        key = (call, count, shape)
        mine = self._fingerprints.get(key)
        if mine is None:
            mine = np.array([call, count, zlib.crc32(repr(tuple(shape)).encode())],
                            dtype=np.int64)
            mine.flags.writeable = False
            self._fingerprints.put(key, mine)
        return mine

    def _fingerprint_check(self, call: int, count: int, shape: Tuple[int, ...]) -> None:
        """check='full': every rank learns whether all ranks make the same call, before any data
        moves -- a fixed-size allgather, so it cannot itself mismatch."""
        mine = self._fingerprint(call, count, shape)
        seq = self._next_seq()
        everyone = np.empty(3 * self.size, dtype=np.int64)
        plan = self._plan("allgather", "rhd", 3, 0)
        # the tag names the checked call: a rank in another call finds out from the header
        tag = Tag(self._ctx, seq, 0, fingerprint_call(call), 3)
        bufs = (mine, everyone, self._tmp(np.dtype(np.int64), plan.tmp_count))
        run_plan(plan, self.transport, bufs, _ops.get_kernel("sum"), tag, self._deadline(),
                 f"fingerprint check of sequence #{seq + 1}",
                 oversubscribed=self.caps.oversubscribed)
        self._compare_fingerprints(everyone.reshape(self.size, 3), mine, call, count, seq)

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
        t, group = self.transport, self.world_ranks
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
        """MismatchError naming the first rank whose row differs from ``mine``, if any."""
        if rows.tobytes() == mine.tobytes() * self.size:
            return
        bad = [r for r in range(self.size) if not np.array_equal(rows[r], mine)]
        if bad:
            theirs = Tag(0, 0, 0, int(rows[bad[0]][0]), int(rows[bad[0]][1]))
            me = Tag(0, 0, 0, call, count)
            extra = "" if rows[bad[0]][:2].tolist() != mine[:2].tolist() else " (different shapes)"
            raise MismatchError(f"ranks disagree (sequence #{seq + 1}): rank {bad[0]} called "
                                f"{describe_call(theirs)}{extra}, rank {self.rank} called "
                                f"{describe_call(me)}; mismatched ranks: {bad}")
