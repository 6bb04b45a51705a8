"""A rank's link to the job's emulated in-network switch (``algorithm="innet"``).

The switch (minicomm/launch/switch.py) is one process per job that plays an aggregation switch:
it receives each rank's data, reduces it and multicasts the result (SHARP across a fat-tree,
NVLS inside an NVSwitch server). Every rank holds one authenticated link to it over the job's
transports (shm on the switch's host, tcp otherwise: ``transports.connect`` with the switch as
the only peer), numbered as the world plus one: the switch is transport rank ``world size``.

One call, three messages per rank beside the data. Before its schedule a rank sends the switch a
header on the control context (``CONTROL_CTX``): the call's communicator context, sequence
number, packed signature, count, root, and the group's world ranks. The switch collects the
headers of the whole group, compares them, and answers every member with one verdict:

- ``OK``: both sides now run the innet schedule (minicomm/algorithms/innet.py) with one switch
  (the rank's half: send up, receive the result), tagged as any collective's messages are;
- ``MISMATCH``: the members made different calls (the verdict names one that differs);
- ``BUSY``: the switch already holds its ``max_groups`` aggregation groups (SHARP gives a
  communicator one, from a limited pool), so it refuses this group;
- ``TOO_LARGE``: the message is over ``max_bytes`` per operation.

``auto`` asks only for what fits and falls back to a host family on ``BUSY``, with a debug-log
line; a call that asked for ``innet`` by name raises instead. Control messages are numbered per
link on each side (headers and verdicts separately), so the tags of both ends agree without a
handshake. A process issues its innet calls one at a time (``SwitchLink.lock``): the switch
serves the operations of a job one after another.

The switch's failure: its link ends, and every rank waiting on it gets a ``PeerFailure`` naming
the switch (``failure``) at once.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ..errors import CommError, MismatchError, PeerFailure, describe_call, signature
from ..schedule import buffer_counts
from ..transports.base import Tag

CONTROL_CTX = 3                  # context (comm id 0, kind 3): no communicator has it
HEADER_FIELDS = 8                # int64 fields before the group's world ranks
OP, RELEASE = 1, 2               # header kinds: an operation; a communicator gives its group back
OK, MISMATCH, BUSY, TOO_LARGE, FAILED = range(5)
VERDICT_FIELDS = 4
ENV_SWITCH = "MINICOMM_SWITCH"   # "1": the job has a switch (rank 0 starts it)
DEFAULT_MAX_BYTES = 256 << 20    # per operation (SHARP streams larger ones; docs/guide)
DEFAULT_MAX_GROUPS = 8           # aggregation groups the switch holds at once


def operation_bytes(collective: str, size: int, count: int, itemsize: int) -> int:
    """The largest buffer of an operation: what a switch's per-operation limit bounds."""
    return max(buffer_counts(collective, size, count)) * itemsize


class SwitchRefused(CommError):
    """The switch declined the operation (``BUSY`` or ``TOO_LARGE``): under ``auto`` the call
    runs on a host family instead; an explicit ``algorithm="innet"`` raises this."""
    status = BUSY


def header(kind: int, ctx: int, seq: int, call: int, count: int, root: int,
           members: Sequence[int], world_size: int) -> np.ndarray:
    """The control message a rank sends before an operation (module doc)."""
    h = np.full(HEADER_FIELDS + world_size, -1, dtype=np.int64)
    h[:HEADER_FIELDS] = (kind, ctx, seq, call, count, root, len(members), 0)
    h[HEADER_FIELDS:HEADER_FIELDS + len(members)] = members
    return h


def control_tag(n: int, verdict: bool, fields: int) -> Tag:
    """The tag of a link's ``n``-th header (or verdict): its own context, numbered per link."""
    return Tag(CONTROL_CTX, n, int(verdict), 0, fields)


class SwitchLink:
    """This process's link to the switch, shared by all its communicators.

    ``transport``: the star link (this rank and the switch); ``switch_rank``: the switch's rank
    on it (the world size); ``pid``, ``max_bytes``, ``max_groups``: what the switch announced.
    ``on_close``: called after the link closes (rank 0 reaps the switch process there)."""

    def __init__(self, transport, switch_rank: int, pid: int, max_bytes: int, max_groups: int,
                 on_close: Optional[Callable[[], None]] = None):
        self.transport, self.switch_rank, self.pid = transport, switch_rank, pid
        self.max_bytes, self.max_groups = max_bytes, max_groups
        self.lock = threading.Lock()
        self._headers = self._verdicts = 0
        self._on_close = on_close
        self.closed = False

    def describe(self) -> str:
        return f"the in-network switch (pid {self.pid}, rank {self.switch_rank} of its links)"

    def failure(self, e: BaseException) -> PeerFailure:
        """``e`` (the link ended) as the PeerFailure every rank reports: it names the switch."""
        err = PeerFailure(f"{self.describe()} failed: {e}")
        err.peer = self.switch_rank
        return err

    def admit(self, ctx: int, seq: int, call: int, count: int, root: int,
              members: Sequence[int], deadline: float, what: str) -> Tuple[int, int]:
        """Send the header of an operation and wait for the switch's verdict: (status, detail).
        Raises MismatchError when the group's calls differ, the switch's PeerFailure when it
        is gone."""
        t = self.transport
        h = header(OP, ctx, seq, call, count, root, members, self.switch_rank)
        v = np.empty(VERDICT_FIELDS, dtype=np.int64)
        try:
            self._headers += 1
            s = t.isend(self.switch_rank, h, control_tag(self._headers, False, h.size))
            self._verdicts += 1
            r = t.irecv(self.switch_rank, v, control_tag(self._verdicts, True, VERDICT_FIELDS))
            t.wait_all([s, r], deadline, f"{what}: the switch's verdict")
        except PeerFailure as e:
            raise self.failure(e) from None
        status, a, b, c = (int(x) for x in v)
        if status == MISMATCH:
            raise MismatchError(f"{what}: the switch compared the group's calls: this rank "
                                f"called {describe_call(signature(call, count))}, rank {a} "
                                f"called {describe_call(signature(b, c))}")
        if status == FAILED:
            err = PeerFailure(f"{what}: the switch lost rank {a} of this group before the "
                              f"operation began")
            err.peer = a
            raise err
        return status, a

    def release(self, ctx: int, members: Sequence[int]) -> None:
        """Give the group of context ``ctx`` back to the switch (a communicator closed);
        best effort: a switch that is gone holds nothing."""
        h = header(RELEASE, ctx, 0, 0, 0, -1, members, self.switch_rank)
        with self.lock:
            if self.closed:
                return
            try:
                self._headers += 1
                self.transport.isend(self.switch_rank, h,
                                     control_tag(self._headers, False, h.size))
            except CommError:
                pass

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        try:
            self.transport.close()
        finally:
            if self._on_close is not None:
                self._on_close()
