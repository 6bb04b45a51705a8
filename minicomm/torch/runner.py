"""``CollectiveRunner``: runs one process group's collectives in issue order.

Queued calls run on one worker thread per group (the communicator's one-thread rule holds by
construction); a synchronous call with nothing queued runs on the caller's thread instead,
sparing the hand-off (docs/decisions/torch-backend.md). ``async_op=True`` returns at once and
the work's future completes on the worker.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable, Optional

from ..errors import CommError, CommTimeout
from .works import MinicommWork


class CollectiveRunner:
    """Runs a group's collectives in issue order: queued calls on one worker thread; a
    synchronous call with nothing queued on the caller's thread. ``_exec`` makes sure only one
    thread at a time is inside the collective communicator.

    A call made by a future's callback (which runs on the worker, right after the call it
    follows: DDP comm hooks such as PowerSGD chain collectives this way) runs at once, sync or
    async: its place in the order is then the same on every rank — after the call whose
    completion triggered it, before whatever the main thread queued meanwhile (queuing it
    would put it behind a varying number of those, and mismatch or mix up calls)."""

    def __init__(self, name: str, timeout: float):
        self.name, self.timeout = name, timeout
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._exec = threading.Lock()
        self._queue: "collections.deque" = collections.deque()
        self._pending = 0                       # queued + running on the worker
        self._completed = 0                     # progress counter (bounded waits)
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, work: MinicommWork, fn: Callable[[], None], inline: bool) -> None:
        """Run ``fn`` for ``work``: at once on this thread when ``inline`` and nothing is queued
        (or when called from the worker itself), else queued behind the calls before it."""
        with self._lock:
            if self._closed:
                raise CommError(f"{work.description}: the process group was shut down")
            on_worker = self._thread is not None and threading.current_thread() is self._thread
            if not (on_worker or (inline and self._pending == 0)):
                self._pending += 1
                self._queue.append((work, fn))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True,
                                                    name=f"minicomm-torch-{self.name}")
                    self._thread.start()
                self._cv.notify()
                return
        self._run(work, fn)

    def _run(self, work: MinicommWork, fn) -> None:
        # bounded: whoever holds _exec is inside one call, which has its own deadline
        if not self._exec.acquire(timeout=self.timeout + 60.0):
            work.finish(CommTimeout(f"{work.description}: another call of this group did not "
                                    f"finish within {self.timeout + 60.0:g} s"))
            return
        try:
            try:
                fn()
                error = None
            except BaseException as e:   # delivered through wait() and the future
                error = e
        finally:
            self._exec.release()
        work.finish(error)              # callbacks run here, outside _exec
        with self._lock:
            self._completed += 1

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._cv.wait()     # idle: woken by submit() or close()
                if not self._queue:
                    return
                work, fn = self._queue.popleft()
            try:
                self._run(work, fn)
            finally:
                with self._lock:
                    self._pending -= 1

    def wait_done(self, done: threading.Event, what: str) -> None:
        """Wait for ``done`` while the runner makes progress: every call it runs is bounded by
        the communicator's timeout, so a full timeout with no call finishing is a hang."""
        window = self.timeout + 30.0
        while True:
            seen = self._completed
            if done.wait(window):
                return
            if self._completed == seen:
                raise CommTimeout(f"{what}: no collective of this group finished within "
                                  f"{window:g} s")

    def close(self, timeout: float) -> bool:
        """Stop taking calls, let the queued ones run (each bounded), stop the thread; False if
        the worker is still inside a call after ``timeout``."""
        with self._lock:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True
