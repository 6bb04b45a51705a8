"""The progress engine shared by the shm and tcp transports (and by ``RoutedTransport``).

Progress model. Transports do no work in the background: every byte moves inside a call, from
``isend`` / ``irecv`` (an eager first attempt) or ``wait_all``. ``wait_all`` advances *every*
posted request of every engine attached to this ``Progress``, not only the caller's: one rank's
ring step sends and receives at once, the messages of one communicator never wait behind another's
unprogressed ones, and a routed rank drives shm and tcp peers in the same loop.

Waiting. After a pass that moved nothing, the caller spins briefly (hot for ``HOT_SPIN_S``
unless an engine says its node's ranks outnumber the cores, then ``os.sched_yield`` between
passes, so ranks sharing a core hand it over; ``SPIN_S`` in all, or for a large message about
its copy time, at most ``SPIN_MAX_S``, when the ranks have a core each; ``SPIN_SHARED_S``, about
a wake-up's cost, when they do not), then blocks in ``epoll_wait`` on every engine's file
descriptors until the deadline -- or, when the only engine is shm with a futex word
(``futex_ok``), in ``futex(FUTEX_WAIT)`` on that word, in slices of ``FUTEX_SLICE_S`` after each of
which ``epoll_wait(0)`` reads the doorbell sockets (a peer's EOF or abort). Before blocking it tells the engines (``sleep(True)``: shm raises
a flag its peers read before deciding to ring a doorbell), issues a full fence, and makes one
last pass: what arrived before the flag was visible is found by that pass, what arrives after it
rings. The pass includes ``check_foreign`` (a collective's look at every peer's unclaimed
messages): an abort notice lands where no request looks, and rings nobody while the flag is
down. All descriptors are edge-triggered: an edge means "something changed, look again"; engines
keep their own readable/writable hints and drain what they read. shm doorbells and tcp sockets
both report a dead peer as EOF/HUP, so death is noticed while blocked, without polling.

Engines implement ``progress() -> bool`` (one non-blocking pass over their posted work; True if
anything moved), ``check(req, what)`` (raise if ``req`` can never complete: its peer failed, its
stream mismatched), ``sleep(flag)``, and carry ``rank`` and ``name``. They register their file
descriptors with ``register(fd, handler)``; handlers run under the lock.

Threads. Communicators run async work on their own threads, all sharing one transport. Engine
state is guarded by one lock; only one thread at a time blocks in ``epoll_wait`` (the poller), the
others wait on a condition that every productive pass and every poller wake-up notifies. Blocking
always happens outside the lock, so a poller never stops another thread from posting.
"""
from __future__ import annotations

import os
import select
import threading
import time
from collections import deque
from typing import Callable, Dict, List, Optional

import numpy as np

from minicomm import settings
from minicomm.errors import CommError, CommTimeout, PeerFailure, describe_call
from minicomm.settings import byte_setting
from .base import (
    ABORT_CALL,
    CLEAN_CLOSE,
    ReduceFn,
    Request,
    Tag,
    Transport,
    check_foreign,
    check_tag,
    fenced_reason,
)

# Bytes of out-of-the-way messages one link may hold (see Inbox.match_header).
UNEXPECTED_LIMIT = byte_setting("MINICOMM_UNEXPECTED_BYTES", 256 << 20)   # a peer's orderly goodbye, not a crash
EDGE = select.EPOLLIN | select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLET
# Spin SPIN_S, then sleep; or, waiting on a large message, about as long as its bytes take to
# copy (at SPIN_BYTES_PER_S, a cross-core copy's pace) up to SPIN_MAX_S, as a peer busy copying
# answers sooner than a futex wake-up would: docs/decisions/shm-spin-then-sleep.md
SPIN_S, SPIN_BYTES_PER_S, SPIN_MAX_S = settings.SPIN_S, settings.SPIN_BYTES_PER_S, settings.SPIN_MAX_S
SPIN_SHARED_S = settings.SPIN_SHARED_S   # the spin when ranks outnumber cores (it yields)
HOT_SPIN_S = 4e-6                     # poll without yielding first: the peer is usually running
# A rank asleep on a futex word (shm alone) wakes at least this often to read its doorbell
# sockets: a peer that died without a word (SIGKILL) is noticed within this bound.
FUTEX_SLICE_S = 0.05
_U8 = np.dtype(np.uint8)

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: acquiring and releasing a lock executes locked read-modify-write
    instructions (``lock cmpxchg`` / ``lock xadd`` on x86-64), which order every earlier store
    before every later load. Used for the store-flag / load-other-side's-word handshakes (Dekker)
    that decide whether a peer needs a doorbell; plain stores and loads cannot do that."""
    _fence_lock.acquire()
    _fence_lock.release()


# fence() as its two calls, for hot paths that inline it (shm's small-message path)
fence_acquire, fence_release = _fence_lock.acquire, _fence_lock.release


class Req(Request):
    """A request of the shm / tcp engines: the base fields plus a byte view and a cursor."""
    __slots__ = ("engine", "u8", "nbytes", "off", "hdr")

    def __init__(self, engine, peer: int, buf: np.ndarray, tag: Tag,
                 reduce: Optional[ReduceFn], is_send: bool):
        # Fields set here rather than through Request.__init__: this runs twice per message.
        self.peer, self.buf, self.tag, self.reduce, self.is_send = peer, buf, tag, reduce, is_send
        self.done = False
        if not buf.flags.c_contiguous:
            raise ValueError("transport buffers must be contiguous")
        self.engine = engine
        # the bytes this request moves, no copy (1-D buffers, the executor's, skip the reshape)
        self.u8 = (buf if buf.ndim == 1 else buf.reshape(-1)).view(_U8)
        self.nbytes = buf.nbytes
        self.off = 0                               # bytes moved so far
        self.hdr = None                            # engine-specific (tcp: the framed header)


_SCRATCH = np.empty(1, dtype=np.uint8)


class Unexpected:
    """A message that arrived before its receive was posted and had to be moved out of the way
    (it blocked a message for another communicator). ``claim`` is the receive that matched it
    while it was still arriving. Engines fill it like a plain receive (``u8``, ``off``).
    A ``dropped`` one (for a cancelled or poisoned communicator) is read and thrown away."""
    __slots__ = ("tag", "nbytes", "u8", "off", "reduce", "claim", "buf", "dropped")

    def __init__(self, tag: Tag, nbytes: int, dropped: bool = False):
        self.tag, self.nbytes = tag, nbytes
        self.dropped = dropped        # single-copy records of it are consumed without a read
        if dropped:
            # thrown away: one scratch byte seen nbytes times (zero stride), so a huge message
            # for a poisoned or cancelled communicator costs no memory (not contiguous: engines
            # fill it through staging, never recv_into it)
            self.u8 = np.lib.stride_tricks.as_strided(_SCRATCH, shape=(nbytes,), strides=(0,))
        else:
            self.u8 = np.empty(nbytes, dtype=np.uint8)
        self.buf = self.u8
        self.off = 0
        self.reduce = None
        self.claim: Optional[Req] = None


class Inbox:
    """Receive-side matching for one peer: posted receives and unexpected messages, FIFO per
    communicator (``tag.comm``), so communicators never steal each other's messages.

    ``errors`` holds, per communicator, the mismatch its stream hit (that communicator is
    poisoned, the others go on); ``discard`` the communicators that were cancelled: their
    arriving messages are drained into a scratch buffer and dropped."""
    __slots__ = ("peer", "posted", "unexpected", "n_posted", "errors", "discard", "held",
                 "held_back", "notices")

    def __init__(self, peer: int):
        self.peer = peer
        self.posted: Dict[int, deque] = {}
        self.unexpected: Dict[int, deque] = {}
        self.n_posted = 0
        self.errors: Dict[int, BaseException] = {}
        self.discard: set = set()
        self.held = 0                 # bytes of unexpected messages held for this peer
        self.held_back: Optional[str] = None     # why a message was left in the stream
        # per communicator, the first abort notice held among its unexpected messages: a
        # point-to-point wait finds it without scanning every held message
        self.notices: Dict[int, Tag] = {}

    def post(self, req: Req) -> None:
        """Match ``req`` against an unexpected message of its communicator, or queue it."""
        comm = req.tag[0]
        if self.unexpected:
            q = self.unexpected.get(comm)
            if q:
                u = q.popleft()
                self.held -= u.nbytes
                if u.off == u.nbytes:
                    self.deliver_unexpected(u, req)
                else:
                    u.claim = req     # still arriving: handed over when complete
                return
        q = self.posted.get(comm)
        if q is None:
            q = self.posted[comm] = deque()
        q.append(req)
        self.n_posted += 1

    def match(self, tag: Tag, nbytes: int):
        """Target for a message whose header just arrived: the oldest receive posted for its
        communicator, an ``Unexpected`` if it blocks receives of other communicators, or None
        (leave it where it is until its receive is posted: no copy)."""
        return self.match_header(tag[0], tag[1], tag[2], tag[3], tag[4], nbytes)

    def match_header(self, comm: int, seq: int, step: int, call: int, count: int, nbytes: int):
        """``match`` on the header's fields: the common case builds no ``Tag``."""
        q = self.posted.get(comm)
        if q:
            req = q.popleft()
            self.n_posted -= 1
            t = req.tag
            if t[1] == seq and t[3] == call and t[4] == count and req.nbytes == nbytes:
                return req
            try:
                check_tag(self.peer, t, Tag(comm, seq, step, call, count), req.nbytes, nbytes)
            except CommError as e:
                # the communicator is poisoned: its waiter raises this (``check``), and this
                # message and the rest of its stream are drained and dropped
                self.errors[comm] = e
            return Unexpected(Tag(comm, seq, step, call, count), nbytes, dropped=True)
        if comm in self.discard or comm in self.errors:
            return Unexpected(Tag(comm, seq, step, call, count), nbytes, dropped=True)
        if self.n_posted:
            if self.held + nbytes > UNEXPECTED_LIMIT:
                # bounded: leave it in the stream; the receive behind it times out saying why
                self.held_back = (f"{self.held} bytes of messages that no receive has taken yet "
                                  f"are held for rank {self.peer} (the limit is "
                                  f"{UNEXPECTED_LIMIT}); the next one ({nbytes} bytes, "
                                  f"context {comm}) blocks the stream")
                return None
            self.held += nbytes
            u = Unexpected(Tag(comm, seq, step, call, count), nbytes)
            if call == ABORT_CALL and comm not in self.notices:
                self.notices[comm] = u.tag
            self.unexpected.setdefault(comm, deque()).append(u)
            return u
        return None

    def complete(self, target) -> None:
        if isinstance(target, Unexpected):
            if target.claim is not None:
                self.deliver_unexpected(target, target.claim)
        else:
            target.done = True

    def deliver_unexpected(self, u: Unexpected, req: Req) -> None:
        try:
            check_tag(self.peer, req.tag, u.tag, req.nbytes, u.nbytes)
        except CommError as e:
            self.errors[req.tag[0]] = e
            return
        if req.reduce is not None:
            req.reduce(req.buf.reshape(-1), u.u8.view(req.buf.dtype))
        else:
            req.u8[:] = u.u8
        req.done = True

    def cancel(self, comm: int) -> List:
        """Forget communicator ``comm``'s posted receives and unexpected messages; drop what
        arrives for it from now on. Returns the receives that were posted."""
        self.discard.add(comm)
        self.notices.pop(comm, None)
        q = self.posted.pop(comm, None) or ()
        self.n_posted -= len(q)
        for u in self.unexpected.pop(comm, None) or ():
            self.held -= u.nbytes
        return list(q)


def deliver(target, off: int, src_u8: np.ndarray) -> None:
    """Copy or reduce the bytes ``src_u8`` (landing memory) into ``target`` at byte ``off``.
    For reduce, ``off`` and ``len(src_u8)`` are whole elements (transports chunk accordingly)."""
    n = src_u8.shape[0]
    if target.reduce is None:
        if n == target.nbytes:
            target.u8[...] = src_u8           # the whole message: no slice to build
        else:
            target.u8[off:off + n] = src_u8
    else:
        buf = target.buf
        if n == target.nbytes and buf.ndim == 1:
            dst = buf
        else:
            isz = buf.itemsize
            dst = buf.reshape(-1)[off // isz:(off + n) // isz]
        target.reduce(dst, src_u8.view(buf.dtype))


class Progress:
    """One epoll set, one lock, and the wait loop for a group of engines (see module doc)."""

    def __init__(self):
        self.ep = select.epoll()
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.engines: List = []
        self.spin = False             # spin before blocking: some engine polls memory
        self.hot_spin = HOT_SPIN_S    # poll without yielding first (0: ranks outnumber cores)
        self.spin_long = True         # spin longer for large messages (not when oversubscribed)
        self.spin_s = SPIN_S          # the spin before sleeping (SPIN_SHARED_S: oversubscribed)
        self._handlers: Dict[int, Callable[[int], None]] = {}
        self._polling = False
        self._waiters = 0             # threads in cv.wait: notify only when there are some
        self._closed = False
        # ``interrupt`` writes here: a poller blocked in epoll_wait wakes and re-checks its
        # requests (a communicator closed or broken by another thread)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._handlers[self._wake_r] = self._drain_wake
        self.ep.register(self._wake_r, EDGE)

    def _drain_wake(self, events: int) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def interrupt(self) -> None:
        """Wake every thread waiting in this progress engine (from any thread)."""
        with self.lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"\x01")
            except (BlockingIOError, OSError):
                pass                  # a wake-up is already pending
            for e in self.engines:
                e.kick()              # a poller asleep on a futex word
            self.cv.notify_all()

    def _futex_engine(self):
        """The engine whose futex word the poller sleeps on: only when it is the only engine
        (a tcp or routed peer needs epoll) and it offers one; else None."""
        if len(self.engines) == 1 and self.engines[0].futex_ok:
            return self.engines[0]
        return None

    def attach(self, engine, spin: bool) -> None:
        with self.lock:
            self.engines.append(engine)
            self.spin = self.spin or spin
            if engine.oversubscribed:
                self.hot_spin = 0.0   # a peer may need our core: yield from the first poll
                self.spin_long = False
                self.spin_s = SPIN_SHARED_S   # yielding, for about a wake-up's cost

    def register(self, fd: int, handler: Callable[[int], None]) -> None:
        """``handler(events)`` runs under the lock after ``epoll_wait`` reports ``fd``."""
        self._handlers[fd] = handler
        self.ep.register(fd, EDGE)

    def unregister(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            try:
                self.ep.unregister(fd)
            except (OSError, ValueError):
                pass

    def detach(self, engine) -> None:
        with self.lock:
            if engine in self.engines:
                self.engines.remove(engine)
            if not self.engines and not self._closed:
                self._closed = True
                self.ep.close()
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)
            self.cv.notify_all()

    def _check_foreign(self, tag) -> None:
        """Raise if a message from any peer of any engine proves the call waiting on ``tag``
        cannot complete (``LinkEngine.check_foreign``)."""
        for e in self.engines:
            e.check_foreign(tag)

    def _pass(self) -> bool:
        moved = False
        for e in self.engines:
            if e.progress():
                moved = True
        return moved

    def wait(self, reqs: List[Req], deadline: float, what: str, any_done: bool = False) -> None:
        """Progress until every request in ``reqs`` is done (``any_done``: at least one).

        Each round is one pass over every engine under the lock; then, while nothing moves,
        spin (hot, then yielding with ``os.sched_yield``), then block: wait for the thread that
        polls (``_wait_for_poller``), or become the poller (``_ready_to_block``, ``_block``).
        Raises what a pending request's engine reports (``check``), CommTimeout at
        ``deadline``, CommError once the transport is closed."""
        if _first_pending(reqs, any_done) is None:
            return                                # completed on the spot (eager isend/irecv)
        lock = self.lock
        started = time.monotonic()
        # Poll without yielding first (the peer usually runs on another core and answers at
        # once), then with os.sched_yield between passes (a peer sharing our core gets it), then
        # block: docs/decisions/shm-spin-then-sleep.md
        hot_until = spin_until = started
        hot, spin = self.hot_spin, self.spin_s
        longer = self.spin and self.spin_long   # priced once, when the short spin runs out
        if self.spin:
            hot_until += hot
            spin_until += spin
        while True:
            lock.acquire()
            try:
                moved = self._pass()
                if moved and self._waiters:
                    self.cv.notify_all()          # another thread's requests may be done
                pending = _first_pending(reqs, any_done)
                if pending is None:
                    return
                now = self._check_pending(reqs, pending, deadline, what, started)
                if moved:
                    if self.spin:
                        hot_until, spin_until = now + hot, now + spin
                    continue
                if now >= spin_until and longer:
                    longer = False                # a large message: spin about its copy time
                    spin, spin_until = _spin_for_copy(reqs, spin, spin_until)
                sleep_on = None
                if now >= spin_until:
                    # about to block: a message from any peer may prove the call cannot complete
                    self._check_foreign(pending.tag)
                    if self._polling:
                        self._wait_for_poller(deadline - now)
                        continue
                    sleep_on = self._ready_to_block(pending)
                    if sleep_on is None:
                        continue                  # the last pass moved something
            finally:
                lock.release()
            if sleep_on is None:
                if now >= hot_until:
                    os.sched_yield()
                continue
            self._block(sleep_on, deadline - now)
            # after a wake-up, spin again: the next message often follows closely
            if self.spin:
                now = time.monotonic()
                hot_until, spin_until = now + hot, now + spin

    def _check_pending(self, reqs: List[Req], pending: Req, deadline: float, what: str,
                       started: float) -> float:
        """Under the lock: raise what ends a wait before its requests are done (a request that
        can never complete, the deadline, a closed transport); else return the time now."""
        for r in reqs:
            if not r.done:
                r.engine.check(r, what)   # raises PeerFailure / MismatchError
        now = time.monotonic()
        if deadline - now <= 0:
            raise _timeout(pending, reqs, what, now - started)
        if self._closed:
            raise CommError(f"{what}: transport is closed")
        return now

    def _wait_for_poller(self, left: float) -> None:
        """Under the lock, while another thread polls: wait for its next wake-up (it notifies
        after every one) or a productive pass of another thread."""
        self._waiters += 1
        try:
            self.cv.wait(left)
        finally:
            self._waiters -= 1

    def _ready_to_block(self, pending: Req):
        """Under the lock, nothing moving: raise the engines' sleep flags (shm's peers read them
        before deciding to ring a doorbell), fence, and make one last pass. Returns what to
        block on, (the futex engine or None for epoll, the futex word's value), this thread now
        the poller; or None when that pass moved something (the flags are down again)."""
        fx = self._futex_engine()
        fx_value = None
        if fx is not None:
            fx.sleep(2)               # asleep on the futex word (shm/doorbell.py)
            fence()
            fx_value = fx.futex_value()
        else:
            for e in self.engines:
                e.sleep(True)
            fence()
        try:
            # what arrived before our flag was visible: a message for a request, or one from
            # any peer that proves the call cannot complete (an abort notice lands in a ring
            # nobody waits on, and rings no doorbell while our flag is down: found here or
            # woken for)
            moved = self._pass()
            if not moved:
                self._check_foreign(pending.tag)
        except BaseException:
            for e in self.engines:
                e.sleep(False)
            raise
        if moved:
            for e in self.engines:
                e.sleep(False)
            if self._waiters:
                self.cv.notify_all()
            return None
        self._polling = True
        return fx, fx_value

    def _block(self, sleep_on, left: float) -> None:
        """The poller, outside the lock: block on the futex word for a slice, then read the
        doorbell sockets, or block in ``epoll_wait`` for up to ``left``; then, under the lock,
        stop polling, lower the sleep flags, run the handlers of the reported descriptors and
        wake the threads waiting for the poller."""
        fx, fx_value = sleep_on
        events = ()
        try:
            if fx is not None:
                fx.futex_block(fx_value, min(left, FUTEX_SLICE_S))
                events = self.ep.poll(0)      # doorbell sockets: a peer's EOF or abort
            else:
                events = self.ep.poll(left)
        except (OSError, ValueError):         # closed by another thread: next pass raises
            pass
        finally:
            with self.lock:
                self._polling = False
                for e in self.engines:
                    e.sleep(False)
                for fd, ev in events:
                    h = self._handlers.get(fd)
                    if h is not None:
                        h(ev)
                if self._waiters:
                    self.cv.notify_all()


def _first_pending(reqs: List[Req], any_done: bool) -> Optional[Req]:
    """The request a wait still waits on (the first not done), or None when the wait is over:
    every request is done, or with ``any_done`` one of them is (or there are none)."""
    pending = None
    for r in reqs:
        if not r.done:
            if pending is None:
                pending = r
                if not any_done:
                    return r
        elif any_done:
            return None
    return pending


def _spin_for_copy(reqs: List[Req], spin: float, spin_until: float):
    """A wait on a large message spins about as long as its bytes take to copy, at most
    SPIN_MAX_S: (spin, spin_until), grown if that is longer than ``spin``."""
    # default: another thread (a NIC agent) may complete the last one meanwhile
    want = max((r.nbytes for r in reqs if not r.done), default=0) / SPIN_BYTES_PER_S
    if want > spin:
        spin = want if want < SPIN_MAX_S else SPIN_MAX_S
        spin_until += spin - SPIN_S
    return spin, spin_until

def _timeout(pending: Req, reqs: List[Req], what: str, waited: float) -> CommTimeout:
    n = sum(1 for r in reqs if not r.done)
    t = pending.tag
    direction = (f"send {pending.nbytes} bytes to" if pending.is_send
                 else f"receive {pending.nbytes} bytes from")
    note = ""
    try:
        held = pending.engine._link(pending.peer).inbox.held_back
        if held and not pending.is_send:
            note = f"; {held}"
    except Exception:
        pass
    e = CommTimeout(
        f"{what}: rank {pending.engine.rank} timed out after {waited:.1f}s at step {t.step} of "
        f"call #{t.seq} ({describe_call(t)}) waiting to {direction} rank {pending.peer} over "
        f"{pending.engine.name} ({n} of {len(reqs)} requests of this wait still pending){note}")
    e.peer = pending.peer
    return e


def peer_failure(engine, req: Req, what: str, reason: str) -> PeerFailure:
    direction = "sending to" if req.is_send else "receiving from"
    e = PeerFailure(f"{what}: rank {engine.rank} {direction} rank {req.peer} over "
                    f"{engine.name} at step {req.tag.step} of call #{req.tag.seq}: {reason}")
    e.peer = req.peer
    e.clean = reason.startswith(CLEAN_CLOSE)
    return e


class LinkEngine(Transport):
    """What the shm and tcp engines share: one link object per peer (``_link(peer)``) holding
    an ``inbox`` and a ``closed`` reason, and an ``_aborted`` reason for this rank."""
    name = "link"
    rank: int
    peer_ranks: List[int]
    _aborted: Optional[str]
    futex_ok = False          # the poller may sleep on this engine's futex word (shm sets it)
    oversubscribed = False    # this node's ranks outnumber its cores: the poller yields at once

    def kick(self) -> None:
        """Wake this engine's own futex sleeper (an engine without one has nothing to wake)."""

    def _link(self, peer: int):
        raise NotImplementedError

    _progress: "Progress"

    def wait_all(self, requests: List[Req], deadline: float, what: str) -> None:
        self._progress.wait(requests, deadline, what)

    def wait_any(self, requests: List[Req], deadline: float, what: str) -> None:
        self._progress.wait(requests, deadline, what, any_done=True)

    _cancelled: Dict[int, BaseException]

    def check(self, req: Req, what: str) -> None:
        ctx = req.tag[0]
        cancelled = self._cancelled.get(ctx) if self._cancelled else None
        if cancelled is not None:
            raise _copy_error(cancelled)
        link = self._link(req.peer)
        if not req.is_send and link.inbox.errors:
            e = link.inbox.errors.get(ctx)
            if e is not None:
                raise _copy_error(e)
        if self._aborted is not None:
            raise peer_failure(self, req, what, f"this rank aborted: {self._aborted}")
        if link.closed is not None:
            raise peer_failure(self, req, what, link.closed)

    def check_foreign(self, tag: Tag) -> None:
        """Before blocking in a collective (``tag``): the unclaimed messages of its context from
        every peer, closed ones included (as far as ``_peek_all`` sees: shm's whole ring, tcp's
        staged frames, else the head), checked by base.check_foreign (an abort notice, or this
        call's sequence number with another signature, raises MismatchError / PeerFailure naming
        the peer); and the error a receive of the context met on any link (a notice matched
        against a receive posted for a later step, which nobody waits on yet)."""
        ctx = tag[0]
        p2p = not (tag[3] & 31)         # p2p waits: only abort notices (other traffic is normal)
        for link in self._links():
            ib = link.inbox
            if ib.errors:
                e = ib.errors.get(ctx)
                if e is not None and (not p2p or getattr(e, "notice", False)):
                    raise _copy_error(e)        # a receive not waited on here met a notice
            if p2p:
                n = ib.notices.get(ctx) if ib.notices else None
                if n is not None:
                    check_foreign(ib.peer, tag, n)
                if link.rx_cur is None:
                    for head in self._peek_all(link):
                        if head[3] == ABORT_CALL:
                            check_foreign(ib.peer, tag, Tag(*head))
                continue
            q = ib.unexpected.get(ctx) if ib.unexpected else None
            if q:
                for u in q:                     # held already: a notice may sit behind data
                    check_foreign(ib.peer, tag, u.tag)
            if link.rx_cur is None:
                for head in self._peek_all(link):
                    check_foreign(ib.peer, tag, Tag(*head))

    def _peek(self, link):
        """The header (comm, seq, step, call, count) of the next message in ``link``'s inbound
        stream, without consuming it; None when none is visible. Engines override it."""
        return None

    def _peek_all(self, link):
        """The headers of the messages visible in ``link``'s inbound stream, oldest first, none
        consumed. Here only the head (``_peek``): an engine that can read further (shm's ring,
        tcp's staging buffer) overrides it, so that an abort notice behind an unreceived message
        is seen too."""
        head = self._peek(link)
        if head is not None:
            yield head

    def dead_peers(self) -> Dict[int, str]:
        """The peers whose link is closed, with the reason (base.Transport.dead_peers)."""
        with self._lock:
            return {link.inbox.peer: link.closed for link in self._links()
                    if link.closed is not None}

    def exclude_peer(self, peer: int, reason: str) -> None:
        """End the link to ``peer`` alone (base.Transport.exclude_peer): the engine's
        ``_exclude`` tells the peer and shuts the link; this rank's waits on it raise."""
        with self._lock:
            link = self._link(peer)
            if link.closed is not None:
                return                   # ended already (died, finished, or excluded before)
            link.closed = fenced_reason(reason)
            self._exclude(link, reason)
            link.txq.clear()             # nothing more goes to it (a started send is cut too)
        self._progress.interrupt()

    def _exclude(self, link, reason: str) -> None:
        """Engine hook: tell ``link``'s peer ``reason`` (an abort of this link alone), and shut
        the link down."""

    def describe(self) -> str:
        return (f"rank {self.rank}: {self.name} to {self.peer_ranks}" if self.peer_ranks
                else f"rank {self.rank}: no peers")

    def _links(self):
        raise NotImplementedError

    def cancel_context(self, ctx: int, error: BaseException) -> None:
        with self._lock:
            self._cancelled[ctx] = error
            for link in self._links():
                for req in link.inbox.cancel(ctx):
                    _detach_locked(req)
                cur = link.rx_cur
                if cur is not None and cur.tag[0] == ctx and cur.__class__ is Req:
                    _detach_locked(cur)          # mid-arrival: finish into a private buffer
                # sends that have not started to move are dropped; a started one finishes (the
                # stream must stay framed for the other communicators), and an abort notice
                # stays: it is how the peers learn of this (a notice queued behind a send
                # still flowing goes once that send has)
                kept = [r for r in link.txq
                        if r.tag[0] != ctx or r.off > 0 or r.tag[3] == ABORT_CALL]
                if len(kept) != len(link.txq):
                    link.txq.clear()
                    link.txq.extend(kept)
        self._progress.interrupt()

    def detach(self, req: Req) -> np.ndarray:
        with self._lock:
            return _detach_locked(req)


def _detach_locked(req) -> np.ndarray:
    if req.done or req.is_send:
        return req.buf
    private = np.empty(req.nbytes, dtype=np.uint8)
    if req.off:
        private[:req.off] = req.u8[:req.off]
    req.buf = req.u8 = private
    req.reduce = None
    return private


def _copy_error(e: BaseException) -> BaseException:
    """A fresh exception of the same class and message (one instance is never raised by two
    threads at once); keeps ``peer``."""
    try:
        c = type(e)(str(e))
    except Exception:
        return e
    if getattr(e, "peer", None) is not None:
        c.peer = e.peer
    if getattr(e, "notice", False):
        c.notice = True
    return c
