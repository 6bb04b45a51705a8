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
from .base import ReduceFn, Request, Tag, Transport, check_tag


class Fabric:
    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.queues = defaultdict(deque)       # (src, dst, comm) -> deque[(tag, payload)]
        self.failure: Optional[BaseException] = None
        self.closed = set()

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

    def isend(self, peer: int, buf: np.ndarray, tag: Tag) -> Request:
        fab = self.fabric
        payload = buf.copy()
        with fab.cond:
            fab.queues[(self.rank, peer, tag.comm)].append((tag, payload))
            fab.cond.notify_all()
        req = Request(peer, buf, tag, None, True)
        req.done = True
        return req

    def irecv(self, peer: int, buf: np.ndarray, tag: Tag,
              reduce: Optional[ReduceFn] = None) -> Request:
        return Request(peer, buf, tag, reduce, False)

    def wait_all(self, requests: List[Request], deadline: float, what: str) -> None:
        fab = self.fabric
        for req in requests:
            if req.done:
                continue
            q = fab.queues[(req.peer, self.rank, req.tag.comm)]
            with fab.cond:
                while not q:
                    if fab.failure is not None:
                        raise type(fab.failure)(str(fab.failure))
                    if req.peer in fab.closed:
                        raise PeerFailure(f"{what}: rank {req.peer} closed its communicator while "
                                          f"rank {self.rank} waits for it (step {req.tag.step})")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CommTimeout(f"{what}: rank {self.rank} timed out at step {req.tag.step} "
                                          f"waiting for a message from rank {req.peer}")
                    fab.cond.wait(left)
                tag, payload = q.popleft()
            check_tag(req.peer, req.tag, tag, req.buf.nbytes, payload.nbytes)
            if req.reduce is not None:
                req.reduce(req.buf, payload)
            else:
                req.buf[...] = payload
            req.done = True

    def abort(self, reason: str) -> None:
        self.fabric.abort(self.rank, PeerFailure(reason))

    def close(self) -> None:
        with self.fabric.cond:
            self.fabric.closed.add(self.rank)
            self.fabric.cond.notify_all()
