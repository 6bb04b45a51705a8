"""A communicator's life: the one-thread guard, async work in program order, break and close.

A communicator is used by one thread at a time (MPI_THREAD_SERIALIZED): ``_enter`` / ``_exit``
take and release the guard, re-entrantly for calls made by calls (object collectives, split).
``async_op=True`` queues a call for the communicator's one worker thread, which runs the queue
in program order; a synchronous call made while work is queued waits for it. The first error
of a collective is final (as in Gloo and NCCL): ``_break`` tells the peers and cancels this
communicator's messages, and every later call raises.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import queue
import re
import sys
import threading
import time
from typing import Optional, Sequence

import numpy as np

from .. import flightrecord
from ..errors import CommError, CommTimeout, MismatchError, PeerFailure, Revoked
from ..p2p import Status
from ..transports.base import ABORT_CALL, ABORT_KINDS, Tag

# Context ids (Tag.comm). A communicator has a number, ``comm_id``, unique among the
# communicators that share a transport; its collectives travel on context ``comm_id << 2`` and its
# point-to-point messages on ``comm_id << 2 | 1``. Numbers: the world is 1; numbers below
# ``SPLIT_BASE`` are reserved for internal pairs (link measurement); split() numbers are
# allocated by the lowest rank of each new group from its own counter, as
# ``(world rank + 1) << 24 | counter``, and broadcast to the group: unique without a hash.
# Agreement ``a`` (faulttolerance.py) travels on ``a << 40 | comm_id << 2 | FT``.
WORLD_ID = 1
SPLIT_BASE = 1 << 24
COLL, P2P, FT = 0, 1, 2
id_counter = itertools.count(1)
get_ident = threading.get_ident

# The calls errors number for the user (``Lifecycle._number``): each collective the user calls,
# once, however many exchanges it makes inside (rooted calls' fingerprints, split, objects).
# The transports number messages by the internal sequence (``_seq``: setup's calls and those
# exchanges included), which stays what matching uses; errors call that number "sequence #".
USER_COLLECTIVES = frozenset((
    "allreduce", "reduce", "broadcast", "allgather", "gather", "reduce_scatter", "alltoall",
    "scatter", "barrier", "split", "window", "broadcast_object", "allgather_object",
    "gather_object", "scatter_object", "agree", "shrink", "monitored_barrier", "allgatherv",
    "gatherv", "scatterv", "alltoallv", "scan", "exscan"))
SEQUENCE_NUMBER = re.compile(r"\bcall #(\d+)")
DUMPED_ERRORS = (CommTimeout, PeerFailure, MismatchError)   # the flight record is dumped on them


def context(comm_id: int, kind: int) -> int:
    """The ``Tag.comm`` of communicator ``comm_id``'s collectives (COLL) or messages (P2P)."""
    return comm_id << 2 | kind


def serialized(name: str):
    """Run a public method inside the communicator's one-thread-at-a-time guard."""
    def deco(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            self._enter(name)
            try:
                return method(self, *args, **kwargs)
            finally:
                self._exit()
        return wrapper
    return deco


class Work:
    """Handle of an ``async_op=True`` collective, an ``isend`` or an ``irecv``.

    Attributes:
        description (str): What the operation is (errors name it).
        status (Status | None): An ``irecv``'s: the source and tag it matched, once done.

    Examples:
        >>> w = comm.allreduce(np.ones(2), async_op=True)
        >>> w.wait()
        array([2., 2.])
    """

    def __init__(self, description: str, drive=None):
        self.description = description
        self._event = threading.Event()
        self._result = None
        self._error: Optional[BaseException] = None
        self._drive = drive           # p2p: moves the messages, in the waiting thread
        self.status: Optional[Status] = None

    def _finish(self, result=None, error: Optional[BaseException] = None):
        self._result, self._error = result, error
        self._event.set()

    def is_completed(self) -> bool:
        """Whether the operation finished (successfully or not).

        Returns:
            (bool): True once done; ``wait()`` then returns (or raises) at once.

        Examples:
            >>> w = comm.barrier(async_op=True)
            >>> w.wait()
            >>> w.is_completed()
            True
        """
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None):
        """The operation's result, once done (``result`` is the same method).

        Args:
            timeout (float | None): Seconds to wait at most; None: no limit (the operation's own
                deadline, the communicator's timeout, still applies).

        Returns:
            (object): The collective's result (an array, or None); an ``irecv``'s array; None
                for an ``isend``.

        Raises:
            CommTimeout: Not done within ``timeout`` (a receive stays posted: wait again).
            CommError: The operation's own error.

        Examples:
            >>> y = comm.allreduce(np.ones(3), async_op=True).wait()
            >>> y
            array([2., 2., 2.])
        """
        if self._drive is not None and not self._event.is_set():
            self._drive(timeout)
        if not self._event.wait(timeout):
            raise CommTimeout(f"{self.description} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    result = wait


def same_error(e: BaseException) -> BaseException:
    """A fresh exception of ``e``'s class and message (one instance per raise)."""
    try:
        c = type(e)(str(e))
    except Exception:
        return CommError(str(e))
    c.peer = getattr(e, "peer", None)
    if getattr(e, "notice", False):
        c.notice = True           # from a live peer's notice (errors.Revoked, PeerFailure)
    return c


def translate_peer(e: BaseException, group: Sequence[int]) -> BaseException:
    """A transport's PeerFailure names a world rank: give this communicator's rank instead."""
    world = getattr(e, "peer", None)
    if isinstance(e, PeerFailure) and world in group:
        e.peer = list(group).index(world)
    return e


class Lifecycle:
    """The guard, the async worker, break, abort and close (module doc). State set up by
    ``_init_lifecycle``; the communicator's ``transport``, ``rank``, ``group``, ``timeout``,
    ``_ctx`` and ``_p2p`` are the composing class's."""

    def _init_lifecycle(self, owner: bool) -> None:
        self._owner = owner
        self._seq = 0
        self._user_calls = 0          # the user's collectives begun here (USER_COLLECTIVES)
        self._worker_call = 0         # ... the number of the one the worker thread runs
        self._calls_of = "the user's"
        # async work: a queue with its own lock (submitting never waits for running work) and
        # one worker thread that runs the queued calls in program order
        self._qlock = threading.Lock()
        self._queue: "queue.Queue" = queue.Queue()
        self._pending = 0             # queued work and an open group
        self._worker: Optional[threading.Thread] = None
        # persistent requests started and not yet run, in start order (persistent.py); the
        # next call of any kind hands them to the worker first
        self._started: "collections.deque" = collections.deque()
        # comm.group() or *_init: what the general path gives a bound call to, instead of
        # running it (grouping.py, persistent.py)
        self._intercept = None
        self._batch = None            # the open comm.group()'s held calls (grouping.py)
        # one user thread at a time (MPI_THREAD_SERIALIZED), checked by _enter/_exit
        self._guard = threading.Lock()
        self._busy_thread: Optional[int] = None
        self._depth = 0
        self.busy_with: Optional[str] = None     # the call that holds the guard now
        self._broken: Optional[BaseException] = None
        self._closed = False
        self._closing_error: Optional[BaseException] = None
        self._store = self._store_server = None  # a launched world's rendezvous (launch sets them)
        self._world = self            # the owner of the transport; shrink()'s results share it
        # fault tolerance (faulttolerance.py): agreements run here, their decided failed set,
        # and the ranks this rank saw die
        self._agreement_no = 0
        self._agreed_failed: set = set()
        self._seen_dead: set = set()

    def _log(self, msg: str) -> None:
        if self.debug_info:
            print(f"[minicomm rank {self.world_ranks[self.rank]}] {msg}", file=sys.stderr,
                  flush=True)

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ the one-thread guard
    def _enter(self, what: str) -> None:
        if self._guard.acquire(False):
            self._busy_thread = get_ident()
            self._depth, self.busy_with = 1, what
            if what in USER_COLLECTIVES:
                self._user_calls += 1
            if self._started:
                self._launch_started()        # started requests go before this call
            return
        if self._busy_thread == get_ident():
            self._depth += 1          # a call made by a call (object collectives, split)
            return
        busy = next((t.name for t in threading.enumerate() if t.ident == self._busy_thread),
                    str(self._busy_thread))          # named only on this error path
        raise CommError(
            f"{what} called on thread {threading.current_thread().name!r} while this "
            f"communicator is in {self.busy_with} on thread {busy!r}: a communicator "
            f"is used by one thread at a time (like MPI_THREAD_SERIALIZED); give each thread its "
            f"own communicator with split(), or overlap with async_op=True")

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.busy_with, self._busy_thread = None, None
            self._guard.release()

    def _usable(self, what: str) -> None:
        if self._broken is not None:
            e = self._broken
            cls = Revoked if isinstance(e, Revoked) else CommError     # shrink() is the way on
            raise cls(f"{what}: communicator is broken: {type(e).__name__}: {e}")
        if self._closed:
            raise CommError(f"{what}: communicator is closed")

    # ------------------------------------------------------------------ errors
    def _break(self, error: BaseException, shrinking: bool = False) -> None:
        """The first error of a collective is final (as in Gloo and NCCL): tell the peers, drop
        this communicator's posted and queued messages, and fail whatever is queued.
        ``shrinking``: a Revoked from ``shrink`` between calls, whose notice leaves the peers'
        calls up to this rank's last one to complete (base.ABORT_KINDS)."""
        if self._broken is not None:
            return
        self._broken = error
        kind = "Shrink" if shrinking else type(error).__name__
        step = ABORT_KINDS.index(kind) if kind in ABORT_KINDS else ABORT_KINDS.index("CommError")
        count = self._seq + 1 if shrinking else self._seq
        notice = np.empty(0, dtype=np.uint8)
        skip = getattr(error, "peer", None)
        # a revoke also reaches members blocked in point-to-point calls of this communicator
        contexts = (self._ctx, self._p2p.ctx) if isinstance(error, Revoked) else (self._ctx,)
        for r, peer in enumerate(self.world_ranks):
            if r == self.rank or peer == skip:
                continue
            for ctx in contexts:
                try:
                    self.transport.isend(peer, notice, Tag(ctx, -1, step, ABORT_CALL, count))
                except (CommError, OSError, ValueError):
                    pass              # that link is gone: its peer learns of it anyway
        cls = Revoked if isinstance(error, Revoked) else CommError
        broken = cls(f"communicator is broken: {kind}: {error}")
        self.transport.cancel_context(self._ctx, broken)
        self.transport.cancel_context(self._p2p.ctx, broken)

    def _fail(self, e: CommError):
        """A call's error is final: break the communicator and raise it (see ``_break``); the
        flight record marks the call and, for a timeout, a failed peer or a mismatch, is
        dumped (minicomm.flightrecord)."""
        if self._closing_error is not None and not isinstance(e, (MismatchError, PeerFailure)):
            e = same_error(self._closing_error)      # woken by close() from another thread
        self._number(e)
        if self._flight is not None:
            self._flight.failed(e)
            if isinstance(e, DUMPED_ERRORS):
                self._dump_flight(f"{type(e).__name__}: {e}")
        self._break(e)
        raise e from None

    def _dump_flight(self, reason: str, directory: Optional[str] = None) -> list:
        """Dump the records of every communicator of this rank; the paths written."""
        return flightrecord.dump(reason, flightrecord.recorders_of(self.world_ranks[self.rank]),
                                 directory)

    def _number(self, e: BaseException) -> None:
        """Prefix ``e``'s message with the number of the user's call it ended (counted from 1 on
        this communicator; USER_COLLECTIVES) and call the internal numbers "sequence #"."""
        if getattr(e, "user_call", None) is not None:
            return                    # numbered where it first failed (a call made by a call)
        worker = self._worker
        n = self._worker_call if worker is not None and worker.ident == get_ident() \
            else self._user_calls
        e.user_call = n
        text = SEQUENCE_NUMBER.sub(r"sequence #\1", str(e))
        e.args = (f"{self._calls_of} collective call #{n} on this communicator: {text}",)

    @contextlib.contextmanager
    def _setup_calls(self):
        """The calls made inside are the launcher's setup (a new world's link agreement), not
        the user's: errors say so, and the user's calls are numbered from 1 after it."""
        self._calls_of = "the launcher's setup"
        try:
            yield
        finally:
            self._calls_of, self._user_calls = "the user's", 0

    # ------------------------------------------------------------------ async work
    def _submit(self, description: str, fn, async_op: bool):
        """Run ``fn`` now (sync) or on this communicator's worker thread (async), keeping the
        program order of calls: a sync call issued after async ones waits for them."""
        self._usable(description)
        if self._intercept is not None:
            return self._intercept(description, fn)
        if not async_op:
            if self._pending == 0:
                return fn()
            return self._enqueue(description, fn).wait()
        return self._enqueue(description, fn)

    def _enqueue(self, description: str, fn) -> Work:
        work = Work(description)
        number = self._user_calls     # this call's: submitted in program order, run later
        rec = None if self._flight is None else self._flight.queued(description)
        with self._qlock:
            self._pending += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._work_loop, daemon=True,
                                                name=f"minicomm-comm{self.comm_id}-r{self.rank}")
                self._worker.start()
        self._queue.put((work, fn, number, rec))
        return work

    def _work_loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, fn, self._worker_call, rec = item
            if rec is not None:
                flightrecord.started(rec)     # its collective record follows
            try:
                if self._broken is not None:
                    work._finish(error=same_error(self._broken))
                elif self._closed and self._closing_error is not None:
                    work._finish(error=same_error(self._closing_error))
                else:
                    work._finish(fn())
            except BaseException as e:   # delivered to whoever waits on the handle
                work._finish(error=e)
            finally:
                with self._qlock:
                    self._pending -= 1

    # ------------------------------------------------------------------ abort, close
    def abort(self, reason: str = "aborted by the user") -> None:
        """Fail this communicator now.

        A call blocked in another thread raises at once, queued work fails, later calls raise;
        peers blocked on this rank learn of it.

        Args:
            reason (str): The text every resulting ``CommError`` carries.

        Returns:
            (None): At once; it raises nothing itself, the later calls raise.

        Examples:
            >>> sub = comm.split(0)
            >>> sub.abort("lost the input")
            >>> try:
            ...     sub.barrier()
            ... except mc.CommError as e:
            ...     print(e)
            barrier: communicator is broken: CommError: communicator aborted: lost the input
        """
        err = CommError(f"communicator aborted: {reason}")
        self._closing_error = err
        self._break(err)

    def close(self) -> None:
        """Finish queued async work, then release the communicator.

        Each queued call is bounded by its own deadline; a world releases its transport and
        rendezvous connection with it. Called from another thread while a call runs, it fails
        that call and the queued ones with a ``CommError`` at once, and waits for it to leave before
        it frees anything. A communicator is also a context manager that closes on exit.

        Returns:
            (None): A second close does nothing; close raises nothing of its own.

        Examples:
            >>> with comm.split(0) as sub:
            ...     y = sub.allreduce(np.ones(2))
            >>> sub.close()
        """
        if self._closed:
            return
        busy = self._busy_thread
        if busy is not None and busy != get_ident():
            self._stop_running_call()
        if self._started:
            self._launch_started()    # started requests run (or fail) before the release
        self._stop_worker()
        if self.debug_info and self._flight is not None:
            self._log_stats()         # the Observability mixin's (the composed class has it)
        self._closed = True
        flightrecord.retire(self._flight)
        if self._closing_error is None:
            self._closing_error = CommError("communicator is closed")
        self._release()

    def _stop_running_call(self) -> None:
        """close() from another thread: fail the running call and wait for it to leave."""
        err = CommError(f"{self.busy_with}: communicator closed by close() on thread "
                        f"{threading.current_thread().name!r} while this call ran")
        self._closing_error = err
        self._closed = True
        self.transport.cancel_context(self._ctx, err)
        self.transport.cancel_context(self._p2p.ctx, err)
        # the woken call leaves promptly; never tear down under it
        if self._guard.acquire(timeout=max(10.0, min(self.timeout, 60.0))):
            self._guard.release()

    def _stop_worker(self) -> None:
        """Let the worker finish the queue, each call within its deadline, and end."""
        if self._worker is None:
            return
        self._queue.put(None)
        self._worker.join(self.timeout)
        if self._worker.is_alive():
            # a queued call outlived its own deadline: fail it before memory goes away
            err = self._closing_error or CommError("communicator closed while async work "
                                                   "was still running")
            self._closing_error = err
            self.transport.cancel_context(self._ctx, err)
            self._worker.join(10.0)

    def _release(self) -> None:
        """A split communicator drops its contexts; the world closes its transport and store."""
        sw = self._switch
        if sw is not None and self._innet_used:
            sw.release(self._ctx, self.world_ranks)    # the switch's aggregation group is free
        if not self._owner:
            closed = CommError("communicator is closed")
            self.transport.cancel_context(self._ctx, closed)     # drop what peers still send
            self.transport.cancel_context(self._p2p.ctx, closed)
            return
        if self._world is not self:
            self._world.close()       # a shrunk world: the launcher's world holds the store
            return
        if sw is not None:
            sw.close()
        self.transport.close()
        for res in (self._store, self._store_server):
            if res is not None:
                res.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
