"""inproc: ranks as threads of one process — the fast path for property tests.

A ``Fabric`` is the shared wire of one in-process world: per (src, dst, communicator) a FIFO of
(tag, payload) and one condition variable for the whole world. Sends are eager (the payload is
copied at isend, so the sender may reuse its buffer at once); receives copy or reduce out of the
queued payload. Because sends never block, a schedule's rendezvous safety is checked by the
verifier, not by this transport.

Failure: a rank that fails calls ``Fabric.abort``: that rank is dead, and every wait on a
request to or from it raises at once (``MismatchError`` when it failed on a mismatch,
``PeerFailure`` otherwise) instead of waiting for its timeout. Waits on other ranks go on: the
communicators' abort notices tell the ranks that do not wait on it, as on the other transports,
so the survivors' communicators keep working. ``Fabric.shutdown`` ends every wait (the job is
over).
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Dict, List, Optional

import numpy as np

from minicomm.errors import CommTimeout, MismatchError, PeerFailure
from .base import (
    Capabilities,
    ReduceFn,
    Request,
    Tag,
    Transport,
    check_foreign,
    check_tag,
    fenced_reason,
)


class Fabric:
    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.queues = defaultdict(deque)       # (src, dst, comm) -> deque[(tag, payload)]
        self.failure: Optional[BaseException] = None      # set by shutdown: every wait ends
        self.dead: Dict[int, BaseException] = {}           # rank -> what waits on it raise
        self.closed = set()
        self.cancelled = set()                 # (rank, comm): that rank dropped that context
        self.excluded: Dict[tuple, str] = {}   # (excluder, excluded) -> the excluder's reason

    def abort(self, rank: int, exc: BaseException) -> None:
        """``rank`` failed with ``exc``: the waits on it raise (the others go on)."""
        with self.cond:
            if rank not in self.dead:
                cls = MismatchError if isinstance(exc, MismatchError) else PeerFailure
                err = cls(f"rank {rank} failed: {type(exc).__name__}: {exc}")
                err.peer = rank
                self.dead[rank] = err
            self.cond.notify_all()

    def shutdown(self, exc: BaseException) -> None:
        """The job is over: every wait of every rank raises ``exc``'s class and message."""
        with self.cond:
            if self.failure is None:
                self.failure = exc
            self.cond.notify_all()

    def link_reason(self, rank: int, peer: int) -> Optional[str]:
        """Under the lock: why ``rank``'s link to ``peer`` ended, or None."""
        if peer in self.dead:
            return f"it failed ({self.dead[peer]})"
        why = self.excluded.get((rank, peer))
        if why is not None:
            return fenced_reason(why)
        why = self.excluded.get((peer, rank))
        if why is not None:
            return f"it aborted: {why}"
        if peer in self.closed:
            return "it closed its transport (it finished)"
        return None


class InprocTransport(Transport):
    name = "inproc"

    def __init__(self, fabric: Fabric, rank: int):
        self.fabric, self.rank, self.size = fabric, rank, fabric.size
        self._cancelled: dict = {}
        self._posted = defaultdict(deque)      # (peer, comm) -> receives in posting order

    def isend(self, peer: int, buf: np.ndarray, tag: Tag) -> Request:
        fab = self.fabric
        payload = buf.copy()
        with fab.cond:
            if peer in fab.closed or (peer, tag.comm) in fab.cancelled \
                    or tag.comm in self._cancelled or peer in fab.dead \
                    or (self.rank, peer) in fab.excluded or (peer, self.rank) in fab.excluded:
                req = Request(peer, buf, tag, None, True)
                req.done = True           # nobody will receive it: dropped, as on a wire
                return req
            fab.queues[(self.rank, peer, tag.comm)].append((tag, payload))
            fab.cond.notify_all()
        req = Request(peer, buf, tag, None, True)
        req.done = True
        return req

    def irecv(self, peer: int, buf: np.ndarray, tag: Tag,
              reduce: Optional[ReduceFn] = None) -> Request:
        req = Request(peer, buf, tag, reduce, False)
        with self.fabric.cond:
            self._posted[(peer, tag.comm)].append(req)   # matched in posting order (FIFO)
        return req

    def wait_all(self, requests: List[Request], deadline: float, what: str) -> None:
        self._wait(requests, deadline, what, any_done=False)

    def wait_any(self, requests: List[Request], deadline: float, what: str) -> None:
        self._wait(requests, deadline, what, any_done=True)

    def _wait(self, requests: List[Request], deadline: float, what: str, any_done: bool) -> None:
        fab = self.fabric
        with fab.cond:
            while True:
                pending = None
                for req in requests:
                    if not req.done:
                        self._try_complete(req, what)
                    if req.done:
                        if any_done:
                            return
                    elif pending is None:
                        pending = req
                if pending is None:
                    return
                if fab.failure is not None:
                    raise type(fab.failure)(str(fab.failure))
                for req in requests:
                    if not req.done:
                        self._check(req, what)
                self._foreign(pending.tag)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"{what}: rank {self.rank} timed out at step "
                                      f"{pending.tag.step} waiting for a message from rank "
                                      f"{pending.peer}")
                fab.cond.wait(left)

    def _try_complete(self, req: Request, what: str) -> None:
        """Under the fabric's lock: complete the receives posted on ``req``'s (peer, context)
        in posting order, as far as their messages are there."""
        key = (req.peer, req.tag.comm)
        if req.tag.comm in self._cancelled:
            return
        q = self.fabric.queues.get((req.peer, self.rank, req.tag.comm))
        posted = self._posted.get(key)
        while q and posted:
            head = posted[0]
            tag, payload = q.popleft()
            posted.popleft()
            check_tag(head.peer, head.tag, tag, head.buf.nbytes, payload.nbytes)
            if head.reduce is not None:
                head.reduce(head.buf, payload)
            else:
                head.buf[...] = payload
            head.done = True
            if head is req:
                return

    def _foreign(self, tag: Tag) -> None:
        """Under the fabric's lock: the first unclaimed message of ``tag``'s context from each
        peer, checked against the call we wait in (base.check_foreign)."""
        queues = self.fabric.queues
        for p in range(self.size):
            q = queues.get((p, self.rank, tag.comm))
            if q:
                check_foreign(p, tag, q[0][0])

    def _check(self, req: Request, what: str) -> None:
        err = self._cancelled.get(req.tag.comm)
        if err is not None:
            raise type(err)(str(err))
        fab = self.fabric
        for rank in (req.peer, self.rank):        # a dead peer, or this rank's own abort
            dead = fab.dead.get(rank)
            if dead is not None:
                e = type(dead)(str(dead))
                e.peer = rank if rank != self.rank else None
                raise e
        if (self.rank, req.peer) in fab.excluded or (req.peer, self.rank) in fab.excluded:
            e = PeerFailure(f"{what}: rank {self.rank} waiting for rank {req.peer} (step "
                            f"{req.tag.step}): {fab.link_reason(self.rank, req.peer)}")
            e.peer = req.peer
            raise e
        if req.peer in self.fabric.closed:
            e = PeerFailure(f"{what}: rank {req.peer} closed its communicator while "
                            f"rank {self.rank} waits for it (step {req.tag.step})")
            e.peer, e.clean = req.peer, True
            raise e

    def cancel_context(self, ctx: int, error: BaseException) -> None:
        fab = self.fabric
        with fab.cond:
            self._cancelled[ctx] = error
            fab.cancelled.add((self.rank, ctx))
            for key in [k for k in fab.queues if k[1] == self.rank and k[2] == ctx]:
                del fab.queues[key]          # what peers sent on it is dropped
            for key in [k for k in self._posted if k[1] == ctx]:
                del self._posted[key]
            fab.cond.notify_all()

    def detach(self, req: Request) -> np.ndarray:
        with self.fabric.cond:               # receives land atomically here: nothing half-done
            if not req.done and not req.is_send:
                private = np.empty(req.buf.nbytes, dtype=np.uint8)
                req.buf, req.reduce = private, None
                return private
            return req.buf

    def abort(self, reason: str) -> None:
        self.fabric.abort(self.rank, PeerFailure(reason))

    def dead_peers(self) -> Dict[int, str]:
        """The peers that failed, finished, or were excluded either way (base.Transport)."""
        fab = self.fabric
        with fab.cond:
            dead = {}
            for p in range(self.size):
                why = fab.link_reason(self.rank, p) if p != self.rank else None
                if why is not None:
                    dead[p] = why
            return dead

    def exclude_peer(self, peer: int, reason: str) -> None:
        """End this rank's link to ``peer`` alone: both sides' waits on it raise with
        ``reason`` (base.Transport.exclude_peer)."""
        fab = self.fabric
        with fab.cond:
            if fab.link_reason(self.rank, peer) is None:
                fab.excluded[(self.rank, peer)] = reason
                for key in [k for k in fab.queues if k[0] == peer and k[1] == self.rank]:
                    del fab.queues[key]            # nothing it sent is read any more
            fab.cond.notify_all()

    def capabilities(self) -> Capabilities:
        """The two-sided core only: ranks are threads of one process, every message a copy."""
        return Capabilities()

    def close(self) -> None:
        with self.fabric.cond:
            self.fabric.closed.add(self.rank)
            self.fabric.cond.notify_all()
