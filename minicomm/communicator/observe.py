"""Seeing what a communicator did: its flight record on demand, a summary of its calls, and a
barrier that names the ranks that did not arrive (minicomm.flightrecord, minicomm.diagnosis)."""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import numpy as np

from .. import flightrecord
from ..algorithms import FAMILIES
from ..cost import model_costs
from ..errors import CommError, CommTimeout, pack_call
from ..schedule import COLLECTIVES
from ..settings import timeout_arg
from ..transports.base import Tag
from .lifecycle import serialized

MONITORED_BARRIER = pack_call("monitored_barrier", "none", "none", None, 0)
ARRIVE, RELEASE = 0, 1        # the steps of a monitored barrier


class Observability:
    """dump_flight_record, stats, monitored_barrier (module doc)."""

    def dump_flight_record(self, directory: Optional[str] = None) -> List[str]:
        """Write this rank's flight record now: the last calls of each of its communicators.

        The same file a failure or ``SIGUSR1`` writes (the troubleshooting guide has the
        format); ``minicomm doctor DIR`` reads a job's files.

        Args:
            directory (str | None): Where to write (default ``MINICOMM_FLIGHT_DIR``, else the
                job's ``<tmp>/minicomm-flight-<job id>``).

        Returns:
            (list): The paths written (``rank-<world rank>.json``); empty when
                ``MINICOMM_FLIGHT_RECORDS=0`` turned the recorder off.

        Examples:
            >>> import tempfile
            >>> y = comm.allreduce(np.ones(2))
            >>> paths = comm.dump_flight_record(tempfile.mkdtemp())
            >>> paths[0].endswith(f"rank-{comm.rank}.json")
            True
        """
        if self._flight is None:
            return []
        return self._dump_flight("dump_flight_record()", directory)

    def stats(self) -> List[Dict]:
        """What this communicator's calls did, per (kind, op, algorithm), busiest first.

        Counted from the flight recorder: the calls its ring holds (the last
        ``MINICOMM_FLIGHT_RECORDS``, default 2048; set it higher for a longer window).
        ``predicted_us`` is what the α-β model that ``algorithm="auto"`` chooses by predicts
        for a call of the mean size, against ``mean_us`` measured here (None where it does not
        price the call: point-to-point, hier on one node). ``MINICOMM_DEBUG=info`` prints it at
        ``close()``.

        Returns:
            (list): One dict per row: ``kind`` ("collective" or "p2p"), ``op``,
                ``algorithm``, ``calls``, ``bytes``, ``seconds`` (of the calls that finished),
                ``mean_us``, ``predicted_us``.

        Examples:
            >>> y = comm.allreduce(np.ones(4), algorithm="ring")
            >>> row = next(r for r in comm.stats() if r["op"] == "allreduce")
            >>> row["algorithm"], row["calls"] >= 1, row["bytes"] >= 32
            ('ring', True, True)
        """
        if self._flight is None:
            return []
        rows = []
        for (kind, op, algo), (calls, nbytes, seconds, finished) in \
                self._flight.totals().items():
            mean_us = seconds / finished * 1e6 if finished else None
            rows.append({"kind": kind, "op": op, "algorithm": algo, "calls": calls,
                         "bytes": nbytes, "seconds": seconds, "mean_us": mean_us,
                         "predicted_us": self._predicted_us(op, algo, nbytes // max(calls, 1))})
        return sorted(rows, key=lambda r: -r["seconds"])

    def _predicted_us(self, op: str, algo: Optional[str], nbytes: int) -> Optional[float]:
        if op not in COLLECTIVES or algo not in FAMILIES or self.size < 2:
            return None
        try:
            t = model_costs(op, self.size, max(nbytes, 8), self.topology, self.link_model)
        except (ValueError, KeyError, ZeroDivisionError):
            return None
        return t[algo] * 1e6 if algo in t else None

    def _log_stats(self) -> None:
        """``MINICOMM_DEBUG=info``: the ``stats()`` table, one line per row, at close."""
        for r in self.stats():
            mean = "-" if r["mean_us"] is None else f"{r['mean_us']:.1f} us"
            pred = "-" if r["predicted_us"] is None else f"{r['predicted_us']:.1f} us"
            self._log(f"stats: {r['op']} ({r['algorithm'] or r['kind']}): {r['calls']} calls, "
                      f"{r['bytes']} bytes, {r['seconds']:.6f} s, mean {mean}, model {pred}")

    @serialized("monitored_barrier")
    def monitored_barrier(self, timeout: Optional[float] = None) -> None:
        """A barrier that names the ranks that did not arrive (torch's ``monitored_barrier``).

        Every rank tells rank 0 it arrived; rank 0 waits up to ``timeout`` for all of them,
        then releases the others with the list of the missing. Slower than ``barrier()`` (two
        messages per rank, all through rank 0): meant for debugging a hang.

        Args:
            timeout (float | None): Seconds rank 0 waits for the others (default: the
                communicator's timeout); the others wait twice as long for rank 0.

        Returns:
            (None): Once every rank has arrived.

        Raises:
            CommTimeout: Some ranks did not arrive in time (every rank that did raises it,
                naming them), or rank 0 did not answer; the communicator is broken, as after
                any failed collective.
            CommError: The communicator is broken or closed.

        Examples:
            >>> comm.monitored_barrier(timeout=10)
        """
        limit = timeout_arg("monitored_barrier: timeout", timeout) or self.timeout
        self._submit("monitored_barrier", lambda: self._monitored_barrier(limit), False)

    def _monitored_barrier(self, limit: float) -> None:
        seq = self._next_seq()
        rec = None if self._flight is None else self._flight.call(
            seq, flightrecord.COLLECTIVE, "monitored_barrier", None, 0, None, 0)
        try:
            missing = (self._gather_arrivals(seq, limit) if self.rank == 0
                       else self._await_release(seq, 2 * limit))
        except CommError as e:
            self._fail(e)
        if missing:
            self._fail(CommTimeout(
                f"monitored_barrier #{seq}: rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} did not arrive within {limit:g}s"))
        if rec is not None:
            flightrecord.end(rec)

    def _monitored_tag(self, seq: int, step: int) -> Tag:
        return Tag(self._ctx, seq, step, MONITORED_BARRIER, 0)

    def _gather_arrivals(self, seq: int, limit: float) -> List[int]:
        """Rank 0: wait for every arrival until the deadline; release who came; the missing."""
        t, group = self.transport, self.world_ranks
        deadline = time.monotonic() + limit
        what = f"monitored_barrier #{seq}"
        got = {r: t.irecv(group[r], np.empty(0, np.uint8), self._monitored_tag(seq, ARRIVE))
               for r in range(1, self.size)}
        missing = []
        for r, req in got.items():
            try:
                t.wait_all([req], deadline, what)
            except CommTimeout:
                missing.append(r)
        note = np.full(self.size, -1, dtype=np.int64)
        note[:len(missing)] = missing
        sends = [t.isend(group[r], note, self._monitored_tag(seq, RELEASE))
                 for r in range(1, self.size) if r not in missing]
        t.wait_all(sends, time.monotonic() + self.timeout, what)
        return missing

    def _await_release(self, seq: int, limit: float) -> List[int]:
        """Any other rank: arrive, then wait for rank 0's release; the ranks it names missing."""
        t, root = self.transport, self.world_ranks[0]
        what = f"monitored_barrier #{seq} (waiting for rank 0's release)"
        t.wait_all([t.isend(root, np.empty(0, np.uint8), self._monitored_tag(seq, ARRIVE))],
                   time.monotonic() + self.timeout, what)
        note = np.empty(self.size, dtype=np.int64)
        t.wait_all([t.irecv(root, note, self._monitored_tag(seq, RELEASE))],
                   time.monotonic() + limit, what)
        return [int(r) for r in note if r >= 0]
