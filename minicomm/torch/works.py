"""The works the process group returns: every call returns a ``dist._Work`` subclass that torch's
C++ side can hold (never None or a future).

- ``MinicommWork``: a collective's handle, with a future completed on the group's worker thread;
- ``P2PWork``: a send's or receive's handle, driven by ``wait()``, without a future (as gloo's);
- ``DoneWork``: an already completed work.

Errors through futures: ``Future.set_exception`` completes a future *successfully* as far as C++
knows (the DDP reducer then takes the exception object for its bucket and crashes), so a failed
collective's future fails with a real C++ error instead, raised by a ``then`` callback.
"""
from __future__ import annotations

import datetime
import sys
import threading
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..errors import CommTimeout


def wait_seconds(timeout) -> Optional[float]:
    """A wait timeout from Python (timedelta, seconds or None) or from C++ (a timedelta; 0 means
    none, torch's kNoTimeout) -> seconds or None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout)
    return s if s > 0 else None


class _Failed:
    """What a failed collective's source future carries to ``_unwrap``."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _unwrap(source: torch.futures.Future):
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class MinicommWork(dist._Work):
    """A collective's handle, as torch's ``Work``.

    ``wait()`` returns True or raises the collective's error (its own type: ``MismatchError``,
    ``CommTimeout``, ``PeerFailure``...); ``get_future()`` is a ``torch.futures.Future``
    completed on the group's worker thread, with the output tensors or in error; ``result()``
    the output tensors.

    The future's error is a real C++ error, not ``Future.set_exception`` (that one completes the
    future *successfully* with the exception as its value and only Python's ``wait()`` raises
    it; the DDP reducer would read the exception as its bucket's tensors and crash). It is made
    by a ``then`` callback that raises, so torch reports it as a ``RuntimeError`` naming the
    minicomm error (``work.wait()`` raises the original).

    Args:
        description (str): What the collective is (errors name it).
        outputs (list[torch.Tensor]): The tensors the future completes with.
        wait_done (Callable): ``wait_done(event, description)`` waits for ``event`` while the
            group makes progress (the runner's ``wait_done``): an untimed ``wait()`` uses it.

    Examples:
        >>> work = dist.all_reduce(t, async_op=True)  # doctest: +SKIP
        >>> work.wait()  # doctest: +SKIP
        True
    """

    def __init__(self, description: str, outputs: List[torch.Tensor],
                 wait_done: Callable[[threading.Event, str], None]):
        super().__init__()
        self.description = description
        self._outputs = outputs
        self._wait_done = wait_done
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._source = torch.futures.Future()
        self._future = self._source.then(_unwrap)

    def finish(self, error: Optional[BaseException]) -> None:
        """Complete the work (the runner calls it once, outside the communicator's lock).

        Args:
            error (BaseException | None): The collective's error, or None for success.
        """
        self._error = error
        self._done.set()
        try:
            self._source.set_result(self._outputs if error is None else _Failed(error))
        except Exception as e:        # a callback misbehaved inside markCompleted: say so
            print(f"minicomm.torch: completing the future of {self.description} raised "
                  f"{type(e).__name__}: {e}", file=sys.stderr)

    def wait(self, timeout=None) -> bool:
        """True once the collective has completed.

        Args:
            timeout (datetime.timedelta | float | None): The longest wait (None or 0: until done).

        Returns:
            (bool): True.

        Raises:
            CommTimeout: Not done within ``timeout``.
            CommError: The collective's own error (``MismatchError``, ``PeerFailure``...).
        """
        secs = wait_seconds(timeout)
        if secs is not None:
            if not self._done.wait(secs):
                raise CommTimeout(f"{self.description} did not complete within {secs:g} s")
        else:
            self._wait_done(self._done, self.description)
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """The future completed on the group's worker thread (with the output tensors, or in error).

        Returns:
            (torch.futures.Future): The future; its error names the minicomm error.
        """
        return self._future

    def is_completed(self) -> bool:
        """Whether the collective has finished (successfully or not).

        Returns:
            (bool): True once done.
        """
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether the collective has finished without an error.

        Returns:
            (bool): True once done successfully.
        """
        return self._done.is_set() and self._error is None

    def exception(self):
        """The collective's error, if it failed.

        Returns:
            (BaseException | None): The error, or None.
        """
        return self._error

    def result(self) -> List[torch.Tensor]:
        """The output tensors, once the collective has completed.

        Returns:
            (list[torch.Tensor]): The outputs.

        Raises:
            CommError: The collective's own error.
        """
        self.wait()
        return self._outputs

    def synchronize(self) -> None:      # CPU: nothing to synchronize with
        """Nothing to do: CPU tensors need no stream synchronization.

        Returns:
            (None): At once.
        """
        pass

    def __repr__(self):
        state = ("failed" if self._error is not None else "done") if self._done.is_set() else "pending"
        return f"<MinicommWork {self.description} {state}>"


class P2PWork(dist._Work):
    """A send's or receive's handle: the transfer moves when ``wait()`` is called (MPI progress
    rules). Like gloo's send/recv works it has no future (``get_future`` raises).

    ``drive(work, secs)`` runs ``work.complete(secs)`` under the group's send/recv lock;
    ``on_done`` runs once the transfer has completed; ``keep`` holds the staged buffer alive
    until then."""

    def __init__(self, description: str, drive: Callable[["P2PWork", Optional[float]], None],
                 mc_work, on_done=None, keep=None):
        super().__init__()
        self.description = description
        self._drive, self._mc, self._on_done, self._keep = drive, mc_work, on_done, keep
        self._done = False
        self._error: Optional[BaseException] = None
        self._source = -1

    def wait(self, timeout=None) -> bool:
        """True once the transfer has completed; raises its error, or ``CommTimeout``."""
        if not self._done:
            self._drive(self, wait_seconds(timeout))
        if self._error is not None:
            raise self._error
        return True

    def complete(self, secs: Optional[float]) -> None:
        """Drive the minicomm work (the caller holds the group's p2p lock)."""
        if self._done:
            return
        try:
            self._mc.wait(secs)
        except CommTimeout:
            if secs is not None and not self._mc.is_completed():
                raise                 # wait(timeout) may be retried: the transfer stays posted
            self._fail()
            return
        except BaseException:
            self._fail()
            return
        status = getattr(self._mc, "status", None)
        if status is not None:
            self._source = int(status.source)
        if self._on_done is not None:
            self._on_done()
        self._done, self._keep = True, None

    def _fail(self) -> None:
        self._error = sys.exc_info()[1]
        self._done, self._keep = True, None

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        raise RuntimeError(f"minicomm: {self.description} has no future (send/recv works "
                           f"complete in wait(), as gloo's do)")

    def _source_rank(self) -> int:
        if self._source < 0:
            raise RuntimeError(f"{self.description}: the source rank is known once a receive "
                               f"has completed")
        return self._source

    source_rank = _source_rank

    def result(self):
        self.wait()
        return []

    def synchronize(self) -> None:
        pass


class DoneWork(dist._Work):
    """An already completed work (a coalesced call with nothing in it)."""

    def __init__(self, outputs):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(outputs)
        self._outputs = outputs

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return self._outputs
