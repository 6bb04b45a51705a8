"""Communicators that survive a failure: ``revoke``, ``agree``, ``shrink``, ``failed_ranks``.

ULFM's model. ``revoke`` breaks the communicator on every member (its notice wakes the blocked
ones); ``agree(flag)`` is a fault-tolerant AND that returns the same value and the same failed set
on every survivor; ``shrink`` agrees on the failed set and builds the communicator of the
survivors on the same transport links (no reconnection).

The agreement (docs/guide/failures.md, "Surviving failures") runs on a context of its own per
agreement, ``a << 40 | comm_id << 2 | FT``, over the transport's links only. A rank learns that a
peer died from its link (a receive on that peer raises ``PeerFailure``), never from an error's
``peer``: notices name live ranks. Protocol, with coordinator ``c`` = the lowest rank not known
failed and ballot = ``c``: every rank REPORTs (its flag, failed set, accepted decision) to ``c``;
``c`` takes the accepted decision of the highest ballot, else (AND of the flags, its failed set,
a new communicator id), PROPOSEs it, collects ACKs from every live rank, and COMMITs; every rank
relays the first COMMIT it gets to every survivor before it returns. A coordinator that dies is
replaced by the next lowest rank, which reads an earlier decision from the reports (Paxos) or
from a relayed COMMIT: every survivor returns the same decision.
"""
from __future__ import annotations

import time
from typing import FrozenSet, List, Optional, Set, Tuple

import numpy as np

from ..errors import CommError, PeerFailure, Revoked
from ..settings import timeout_arg
from ..transports.base import CLEAN_CLOSE, Tag
from .lifecycle import FT, SPLIT_BASE, id_counter, serialized

FT_CALL = -32                 # Tag.call of every agreement message (call & 31 == 0: p2p-like)
REPORT, PROPOSE, ACK, COMMIT = 1, 2, 3, 4
_HEAD = 7                     # kind, ballot, value, new_id, accepted ballot, value, new_id
# Test hooks: ``TEST_HOOKS["ft_send"](kind, k)`` runs before this rank's k-th send (from 0) of a
# message of ``kind`` in one agreement (tests kill the rank there).
TEST_HOOKS: dict = {}

Decision = Tuple[bool, FrozenSet[int], int]      # (value, failed comm ranks, new comm id)


class FaultTolerance:
    """revoke, agree, shrink, failed_ranks (module doc). State from ``Lifecycle``."""

    def revoke(self) -> None:
        """Fail this communicator on every member: pending and later calls raise ``Revoked``.

        Safe from any thread and on a broken communicator. Members blocked in a call of this
        communicator are woken by this rank's notice; the others learn of it at their next call.
        Recover with ``shrink()``.

        Returns:
            (None): At once.

        Raises:
            CommError: The communicator is closed.

        Examples:
            >>> sub = comm.split(0)
            >>> sub.revoke()
            >>> try:
            ...     sub.barrier()
            ... except mc.errors.Revoked as e:
            ...     print(type(e).__name__)
            Revoked
        """
        if self._closed:
            raise CommError("revoke: communicator is closed")
        self._break(Revoked(f"rank {self.rank} revoked the communicator"))

    def failed_ranks(self, agreed: bool = False) -> List[int]:
        """The ranks of this communicator known dead.

        Args:
            agreed (bool): False: what this rank knows now (from its links and agreements; it
                may differ between ranks). True: the failed set fixed by the last ``agree`` or
                ``shrink`` on this communicator, identical on every survivor.

        Returns:
            (list): Sorted ranks of this communicator.

        Examples:
            >>> comm.failed_ranks()
            []
        """
        if agreed:
            return sorted(self._agreed_failed)
        return sorted(self._known_dead(finished=False))

    @serialized("agree")
    def agree(self, flag: bool, timeout: Optional[float] = None) -> bool:
        """Fault-tolerant AND of ``flag`` over the survivors (ULFM's agree).

        Every live member calls it; it completes although members die before or during it, and
        returns the same value on every survivor. It works on a broken or revoked communicator
        (it does not use the communicator's collective messages). The failed set decided with it
        is ``failed_ranks(agreed=True)``, the same on every survivor.

        Args:
            flag (bool): This rank's vote.
            timeout (float | None): Seconds to wait for each coordinator (default: the
                communicator's timeout).

        Returns:
            (bool): The AND of the survivors' flags.

        Raises:
            CommTimeout: A live member did not take part within the timeout.
            CommError: The communicator is closed.

        Examples:
            >>> sub = comm.split(0)
            >>> sub.agree(True), sub.failed_ranks(agreed=True)
            (True, [])
        """
        value, _, _ = self._agreement(bool(flag), timeout, "agree")
        return value

    @serialized("shrink")
    def shrink(self, timeout: Optional[float] = None):
        """The communicator of the survivors, ranks renumbered in their old order.

        Revokes this communicator (a call this rank has done still completes on the others),
        agrees on the failed ranks, and builds the new one on the same links (no reconnection). Every survivor calls it, after any error (``PeerFailure``,
        ``CommTimeout``, ``Revoked``) in any call, or none. A shrunk world shares the world's
        transport: closing either closes it (the launcher closes the world at the end).

        Args:
            timeout (float | None): Seconds to wait for each coordinator (default: the
                communicator's timeout).

        Returns:
            (Communicator): The survivors' communicator (``failed_ranks(agreed=True)`` of this
                one are the ranks left out).

        Raises:
            CommTimeout: A live member did not call shrink within the timeout.
            CommError: The communicator is closed.

        Examples:
            >>> sub = comm.split(0)
            >>> new = sub.shrink()
            >>> new.size, new.allreduce(np.ones(2))
            (2, array([2., 2.]))
        """
        if not self._closed and self._broken is None:
            self._stop_worker()       # this rank's calls end first: its notice claims them done
            self._break(Revoked(f"rank {self.rank} revoked the communicator to shrink it"),
                        shrinking=True)
        self._stop_worker()
        _, failed, new_id = self._agreement(True, timeout, "shrink")
        survivors = [r for r in range(self.size) if r not in failed]
        new = self._subgroup(survivors, new_id, owner=self._owner)
        new._world = self._world      # closing either closes the world's transport, once
        return new

    # ------------------------------------------------------------------ the agreement
    def _agreement(self, flag: bool, timeout: Optional[float], what: str) -> Decision:
        if self._closed:
            raise CommError(f"{what}: communicator is closed")
        limit = timeout_arg("timeout", timeout) or self.timeout
        self._agreement_no += 1
        ctx = self._agreement_no << 40 | self.comm_id << 2 | FT
        what = f"{what} (agreement #{self._agreement_no} of communicator {self.comm_id})"
        run = _Agreement(self, ctx, flag, what)
        try:
            decision = run.decide(limit)
            self._finish_sends(run.sends, what)
        finally:
            self.transport.cancel_context(ctx, CommError(f"{what} is over"))
        self._agreed_failed = set(decision[1])
        self._seen_dead |= run.failed | set(decision[1])
        return decision

    def _finish_sends(self, sends, what: str) -> None:
        """Our messages leave before the context is dropped; a dead target's never will."""
        deadline = time.monotonic() + self.timeout
        for req in sends:
            try:
                self.transport.wait_all([req], deadline, what)
            except PeerFailure:
                pass

    def _known_dead(self, finished: bool = True) -> Set[int]:
        """Agreed, seen in an agreement, or a link the transport knows ended (never a notice's
        ``peer``: a rank that broke a communicator is alive); ``finished``: with the peers that
        closed in order (they take part in no agreement either)."""
        links = {self._rank_of(w) for w, why in self.transport.dead_peers().items()
                 if finished or not why.startswith(CLEAN_CLOSE)} - {None, self.rank}
        return set(self._agreed_failed) | self._seen_dead | links

    def _rank_of(self, world: Optional[int]) -> Optional[int]:
        return self.world_ranks.index(world) if world in self.world_ranks else None


class _Agreement:
    """One agreement on one rank (module doc): its messages, the Paxos state, the loop."""

    def __init__(self, comm, ctx: int, flag: bool, what: str):
        self.comm, self.t, self.flag, self.what = comm, comm.transport, flag, what
        self.n, self.me = comm.size, comm.rank
        self.width = _HEAD + 2 * self.n
        self.tag = Tag(ctx, 0, 0, FT_CALL, self.width)
        self.failed: Set[int] = comm._known_dead()
        self.accepted: Tuple[int, Optional[Decision]] = (-1, None)
        self.reports: dict = {}       # rank -> (flag, failed set, accepted)
        self.acks: Set[int] = set()
        self.proposal: Optional[Decision] = None
        self.recvs: dict = {}         # rank -> (request, buffer)
        self.sends: list = []
        self.counts = {REPORT: 0, PROPOSE: 0, ACK: 0, COMMIT: 0}
        self.reported_to, self.promise = -1, -1
        self.hook = TEST_HOOKS.get("ft_send")

    # --- messages: kind, ballot, a decision, an accepted (ballot, decision), a rank set
    def post(self, r: int) -> None:
        buf = np.empty(self.width, dtype=np.int64)
        self.recvs[r] = (self.t.irecv(self.comm.world_ranks[r], buf, self.tag), buf)

    def send(self, r: int, kind: int, ballot: int, dec: Optional[Decision],
             acc=(-1, None), flags=()) -> None:
        if self.hook is not None:
            self.hook(kind, self.counts[kind])
        self.counts[kind] += 1
        n, msg = self.n, np.zeros(self.width, dtype=np.int64)
        msg[0], msg[1] = kind, ballot
        if dec is not None:
            msg[2], msg[3] = dec[0], dec[2]
            msg[[_HEAD + i for i in dec[1]]] = 1
        if acc[1] is not None:
            msg[4], msg[5], msg[6] = acc[0], acc[1][0], acc[1][2]
            msg[[_HEAD + n + i for i in acc[1][1]]] = 1
        else:
            msg[4] = -1
        if flags:
            msg[[_HEAD + i for i in flags]] = 1
        try:
            self.sends.append(self.t.isend(self.comm.world_ranks[r], msg, self.tag))
        except (PeerFailure, OSError):
            self.failed.add(r)        # that link is gone

    def decode(self, msg) -> Tuple[int, int, Decision, Tuple[int, Optional[Decision]]]:
        n = self.n
        fset = frozenset(int(i) for i in np.flatnonzero(msg[_HEAD:_HEAD + n]))
        aset = frozenset(int(i) for i in np.flatnonzero(msg[_HEAD + n:]))
        acc = (int(msg[4]), (bool(msg[5]), aset, int(msg[6])) if msg[4] >= 0 else None)
        return int(msg[0]), int(msg[1]), (bool(msg[2]), fset, int(msg[3])), acc

    def commit(self, dec: Decision) -> Decision:
        """Relay the decision to every survivor (a coordinator that dies after one COMMIT)."""
        for r in range(self.n):
            if r != self.me and r not in dec[1]:
                self.send(r, COMMIT, -1, dec)
        return dec

    def live(self, but: int = -1) -> List[int]:
        return [r for r in range(self.n) if r not in self.failed and r != but]

    # --- the loop
    def decide(self, limit: float) -> Decision:
        for r in self.live(but=self.me):
            self.post(r)
        deadline, coordinator = time.monotonic() + limit, -1
        while True:
            c = min(self.live())
            if c != coordinator:
                coordinator = c
                deadline = time.monotonic() + limit       # each coordinator gets the timeout
            if c == self.me:
                decision = self.coordinate()
                if decision is not None:
                    return decision
            elif self.reported_to != c:
                self.reported_to, self.promise = c, max(self.promise, c)
                self.send(c, REPORT, c, (self.flag, frozenset(), 0), self.accepted,
                          flags=self.failed)
                if c in self.failed:
                    continue
            if not self.recvs:
                continue
            decision = self.receive(deadline)
            if decision is not None:
                return decision

    def coordinate(self) -> Optional[Decision]:
        """As coordinator: propose once every live rank reported, commit once all acked."""
        me = self.promise = self.me
        if self.proposal is None and all(r in self.reports for r in self.live(but=me)):
            self.reports[me] = (self.flag, frozenset(self.failed), self.accepted)
            best = max((rep[2] for rep in self.reports.values()), key=lambda a: a[0])
            if best[1] is not None:
                self.proposal = best[1]
            else:
                value = all(self.reports[r][0] for r in self.reports if r not in self.failed)
                new_id = ((self.comm.world_ranks[me] + 1) * SPLIT_BASE
                          + next(id_counter) % SPLIT_BASE)
                self.proposal = (value, frozenset(self.failed), new_id)
            self.accepted, self.acks = (me, self.proposal), {me}
            for r in self.live(but=me):
                self.send(r, PROPOSE, me, self.proposal)
        if self.proposal is not None and all(r in self.acks for r in self.live()):
            return self.commit(self.proposal)
        return None

    def receive(self, deadline: float) -> Optional[Decision]:
        """Wait for a message or a death; handle what arrived; a COMMIT decides."""
        try:
            self.t.wait_any([req for req, _ in self.recvs.values()], deadline, self.what)
        except PeerFailure as e:
            r = self.comm._rank_of(e.peer)
            if r is None or r not in self.recvs:
                raise
            self.failed.add(r)
            del self.recvs[r]
            return None
        for r, (req, buf) in list(self.recvs.items()):
            if not req.done:
                continue
            kind, ballot, dec, acc = self.decode(buf)
            self.post(r)
            if kind == REPORT:
                # a rank's failed set is of dead ranks only (links end only by death)
                self.failed.update(x for x in dec[1] if x != self.me)
                self.reports[r] = (dec[0], dec[1], acc)
            elif kind == PROPOSE and ballot >= self.promise:
                self.promise, self.accepted = ballot, (ballot, dec)
                self.send(r, ACK, ballot, None)
            elif kind == ACK and ballot == self.me and self.proposal is not None:
                self.acks.add(r)
            elif kind == COMMIT:
                return self.commit(dec)
        return None
