"""inproc: ranks as threads of one process — the fast path for property tests.

A ``Fabric`` is the shared wire of one in-process world: per (src, dst, communicator) a FIFO of
(tag, payload) and one condition variable for the whole world. Sends are eager (the payload is
copied at isend, so the sender may reuse its buffer at once); receives copy or reduce out of the
queued payload. Because sends never block, a schedule's rendezvous safety is checked by the
verifier, not by this transport.

Failure: a rank that fails calls ``Fabric.abort``; every rank blocked in ``wait_all`` then raises
at once — the same exception class for a mismatch (every rank learns the call was mismatched),
``PeerFailure`` for anything else — instead of waiting for its timeout.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import List, Optional

import numpy as np

from minicomm.errors import CommTimeout, MismatchError, PeerFailure
from .base import Capabilities, ReduceFn, Request, Tag, Transport, check_foreign, check_tag


class Fabric:
    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.queues = defaultdict(deque)       # (src, dst, comm) -> deque[(tag, payload)]
        self.failure: Optional[BaseException] = None
        self.closed = set()
        self.cancelled = set()                 # (rank, comm): that rank dropped that context

    def abort(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                cls = MismatchError if isinstance(exc, MismatchError) else PeerFailure
                self.failure = cls(f"rank {rank} failed: {type(exc).__name__}: {exc}")
            self.cond.notify_all()


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
                    or tag.comm in self._cancelled:
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
                if not pending.is_send:
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

    def capabilities(self) -> Capabilities:
        """The two-sided core only: ranks are threads of one process, every message a copy."""
        return Capabilities()

    def close(self) -> None:
        with self.fabric.cond:
            self.fabric.closed.add(self.rank)
            self.fabric.cond.notify_all()
