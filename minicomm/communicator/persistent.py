"""Persistent collectives (MPI-4 ``MPI_Allreduce_init``, then ``MPI_Start`` / ``MPI_Wait``).

``comm.allreduce_init(x, ...)`` does once what every plain call does: checks the arguments,
chooses the algorithm, binds the plan and the flat buffers (and, for a small call, its compiled
straight-line plan). The ``Request`` it returns runs only that bound call: ``start()`` marks it
started and returns at once; ``wait()`` runs it and returns the result. A request runs on the
caller's thread, inside the communicator's guard, when ``wait()`` finds it first in line (the
common loop: start, wait); if any other call of the communicator comes first, the started
requests are handed to the communicator's worker thread in start order, so they progress while
that call runs (a blocking receive after a start cannot deadlock). Either way requests take
their sequence numbers in start order: ranks match persistent calls in start order, like the
other collectives.

The buffers are the request's: ``x`` is read when the call runs (between ``start`` and
``wait``; MPI's rule: do not change it in between), and the result is written to ``out``, or to
the one array the request allocated at init, which every ``wait()`` returns (the uneven calls,
whose result sizes are learned, make a new one each time).
"""
from __future__ import annotations

import functools

from ..errors import CommError
from .collectives import BoundCall
from .lifecycle import get_ident

IDLE, STARTED, QUEUED, FREED = "idle", "started", "queued", "freed"


class Request:
    """A persistent collective: ``start()``, ``wait()``, again, then ``free()`` (module doc).

    Attributes:
        description (str): What the request is (errors name it).

    Examples:
        >>> x = np.ones(4)
        >>> with comm.allreduce_init(x, out=x) as req:
        ...     for step in range(3):
        ...         x[:] = step
        ...         req.start()
        ...         y = req.wait()            # y is x: 2 * step everywhere (2 ranks)
        >>> y
        array([4., 4., 4., 4.])
    """
    __slots__ = ("comm", "description", "_bound", "_inline", "_result", "_state", "_work")

    def __init__(self, comm, name: str, description: str, bound):
        self.comm, self.description, self._bound = comm, description, bound
        # a bound collective runs through _run_now (small calls on their compiled plan) and
        # returns its bound result; uneven and header calls run their closure in the guard
        if type(bound) is BoundCall:
            self._inline = functools.partial(comm._run_now, bound.name, bound.c, bound.inb,
                                             bound.outb, bound.count, bound.shape)
            self._result = bound.res
        else:
            self._inline = functools.partial(comm._run_guarded, name, bound)
            self._result = None
        self._state, self._work = IDLE, None

    def __repr__(self):
        return f"<Request {self.description}: {self._state}>"

    def start(self) -> None:
        """Start the call with the bound buffers' current contents; returns at once.

        Returns:
            (None): The call runs by ``wait()``, or sooner on the worker thread if another call
                of the communicator comes first.

        Raises:
            CommError: The request is still running (started and not waited for), or freed; the
                communicator is broken or closed.

        Examples:
            >>> req = comm.barrier_init()
            >>> req.start()
            >>> req.wait()
        """
        if self._state is not IDLE:
            raise CommError(f"start() on {self.description}, which is "
                            f"{'freed' if self._state is FREED else 'still running: wait() first'}")
        comm = self.comm
        if comm._broken is not None or comm._closed:
            comm._usable(self.description)
        if comm._intercept is not None:        # inside comm.group(): it runs at the group's exit
            self._work, self._state = comm._intercept(self.description, self._bound), QUEUED
            return
        comm._started.append(self)             # plain calls see it and wait (program order)
        self._state = STARTED

    def wait(self):
        """Run the started call (if it has not run yet) and return its result.

        Returns:
            (object): The collective's result: ``out``, or the request's own result array (the
                same array every time); None where the collective gives none.

        Raises:
            CommError: The request was not started, or is freed; the call's own failure
                (``MismatchError``, ``CommTimeout``, ``PeerFailure``), after which the
                communicator is broken.

        Examples:
            >>> req = comm.allreduce_init(np.ones(2))
            >>> req.start(); req.wait()
            array([2., 2.])
        """
        state = self._state
        if state is STARTED:
            comm = self.comm
            started = comm._started
            if started[0] is self and not comm._pending:
                started.popleft()              # first in line, nothing queued: run it here
                self._state = IDLE
                if comm._broken is not None or comm._closed:
                    comm._usable(self.description)
                result = self._inline()
                return self._result if result is None else result
            comm._launch_started()             # the worker runs them in start order
            state = self._state
        if state is QUEUED:
            work = self._work
            try:
                return work.wait()
            finally:
                if work.is_completed():        # not inside the group that holds it
                    self._state, self._work = IDLE, None
        raise CommError(f"wait() on {self.description}, which is "
                        f"{'freed' if state is FREED else 'not started'}")

    def is_active(self) -> bool:
        """Whether the request was started and not yet waited for.

        Returns:
            (bool): True between ``start()`` and the end of ``wait()``.
        """
        return self._state is STARTED or self._state is QUEUED

    def free(self) -> None:
        """Release the request; a running one is waited for first. A second free does nothing.

        Returns:
            (None)

        Raises:
            CommError: The running call's own failure.
        """
        if self._state is FREED:
            return
        try:
            if self.is_active():
                self.wait()
        finally:
            self._state, self._bound, self._inline, self._work = FREED, None, None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class PersistentCollectives:
    """``*_init`` for every collective (module doc), and running started requests."""

    def _persistent(self, name: str, *args, **kwargs) -> Request:
        """Bind the call ``name(*args, **kwargs)`` without running it: the collective's general
        path checks and binds as for any call, and hands the bound call here."""
        captured = []
        outer, user_calls = self._intercept, self._user_calls

        def capture(description, bound):
            if self._depth > 1:
                raise CommError(f"{name}_init: {self.busy_with} made it; it has no "
                                f"persistent form")
            captured.append(bound)
        self._intercept = capture
        try:
            getattr(self, name)(*args, async_op=True, **kwargs)
        finally:
            self._intercept, self._user_calls = outer, user_calls    # binding is not a call
        bound = captured[0]
        what = f"{name}_init request"
        if type(bound) is BoundCall:
            what += f" ({bound.count} x {bound.outb.dtype})"
        return Request(self, name, what, bound)

    def _run_guarded(self, name: str, fn):
        """``fn()`` on this thread, inside the guard (a persistent request's closure)."""
        if not self._guard.acquire(False):
            self._enter(name)         # a call made by a call, or another thread's: it says so
        else:
            self._busy_thread, self._depth, self.busy_with = get_ident(), 1, name
            self._user_calls += 1
        try:
            return fn()
        finally:
            self._exit()

    def _launch_started(self) -> None:
        """Hand the started requests to the worker thread, in start order."""
        started = self._started
        while started:
            req = started.popleft()
            req._work = self._enqueue(req.description, req._bound)
            req._state = QUEUED

    def allreduce_init(self, x, op="sum", algorithm="auto", out=None) -> Request:
        """A persistent ``allreduce`` (MPI_Allreduce_init): bound once, run by each ``start()``
        and ``wait()``.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``allreduce``).
            op (str): The reduction (as for ``allreduce``).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``allreduce`` raises them, at once, before any message.

        Examples:
            >>> req = comm.allreduce_init(np.ones(2))
            >>> req.start(); req.wait()
            array([2., 2.])
        """
        return self._persistent("allreduce", x, op=op, algorithm=algorithm, out=out)

    def reduce_init(self, x, root=0, op="sum", algorithm="auto", out=None) -> Request:
        """A persistent ``reduce``; ``wait()`` returns None off the root.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``reduce``).
            root (int): The root rank.
            op (str): The reduction (as for ``reduce``).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``reduce`` raises them, at once, before any message.

        Examples:
            >>> req = comm.reduce_init(np.ones(2), root=0)
            >>> req.start(); y = req.wait()
            >>> y.tolist() == [2.0, 2.0] if comm.rank == 0 else y is None
            True
        """
        return self._persistent("reduce", x, root=root, op=op, algorithm=algorithm, out=out)

    def broadcast_init(self, x, root=0, algorithm="auto", out=None) -> Request:
        """A persistent ``broadcast``.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``broadcast``).
            root (int): The root rank.
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``broadcast`` raises them, at once, before any message.

        Examples:
            >>> req = comm.broadcast_init(np.arange(3) * (comm.rank + 1), root=1)
            >>> req.start(); req.wait()
            array([0, 2, 4])
        """
        return self._persistent("broadcast", x, root=root, algorithm=algorithm, out=out)

    def allgather_init(self, x, algorithm="auto", out=None) -> Request:
        """A persistent ``allgather``.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``allgather``).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``allgather`` raises them, at once, before any message.

        Examples:
            >>> req = comm.allgather_init(np.array([comm.rank]))
            >>> req.start(); req.wait().ravel()
            array([0, 1])
        """
        return self._persistent("allgather", x, algorithm=algorithm, out=out)

    def gather_init(self, x, root=0, algorithm="auto", out=None) -> Request:
        """A persistent ``gather``; ``wait()`` returns None off the root.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``gather``).
            root (int): The root rank.
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``gather`` raises them, at once, before any message.

        Examples:
            >>> req = comm.gather_init(np.array([comm.rank]), root=0)
            >>> req.start(); y = req.wait()
            >>> y.ravel().tolist() == [0, 1] if comm.rank == 0 else y is None
            True
        """
        return self._persistent("gather", x, root=root, algorithm=algorithm, out=out)

    def reduce_scatter_init(self, x, op="sum", algorithm="auto", out=None,
                            counts=None) -> Request:
        """A persistent ``reduce_scatter`` (with ``counts``: the uneven form).

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for
                ``reduce_scatter``).
            op (str): The reduction (as for ``reduce_scatter``).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).
            counts (Sequence[int] | None): Rows of the result per rank (None: even blocks).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``reduce_scatter`` raises them, at once, before any message.

        Examples:
            >>> req = comm.reduce_scatter_init(np.ones((comm.size, 2)))
            >>> req.start(); req.wait()
            array([2., 2.])
        """
        return self._persistent("reduce_scatter", x, op=op, algorithm=algorithm, out=out,
                                counts=counts)

    def alltoall_init(self, x, algorithm="auto", out=None) -> Request:
        """A persistent ``alltoall``.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``alltoall``).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``alltoall`` raises them, at once, before any message.

        Examples:
            >>> req = comm.alltoall_init(np.array([[10 * comm.rank], [10 * comm.rank + 1]]))
            >>> req.start(); req.wait()[:, 0] - comm.rank
            array([ 0, 10])
        """
        return self._persistent("alltoall", x, algorithm=algorithm, out=out)

    def scatter_init(self, x, root=0, algorithm="auto", out=None) -> Request:
        """A persistent ``scatter`` (each start exchanges the root's header, as a plain scatter
        does).

        Args:
            x (np.ndarray | None): The bound input (as for ``scatter``; ignored off the root).
            root (int): The root rank.
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``scatter`` raises them, at once, before any message.

        Examples:
            >>> blocks = np.arange(6).reshape(comm.size, 3) if comm.rank == 0 else None
            >>> req = comm.scatter_init(blocks, root=0)
            >>> req.start(); req.wait() - 3 * comm.rank
            array([0, 1, 2])
        """
        return self._persistent("scatter", x, root=root, algorithm=algorithm, out=out)

    def barrier_init(self, algorithm="auto") -> Request:
        """A persistent ``barrier``; ``wait()`` returns None.

        Args:
            algorithm (str): "auto" or a family, chosen once, at init.

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``barrier`` raises them, at once, before any message.

        Examples:
            >>> req = comm.barrier_init()
            >>> req.start(); req.wait()
        """
        return self._persistent("barrier", algorithm=algorithm)

    def allgatherv_init(self, x, counts=None, algorithm="auto", out=None) -> Request:
        """A persistent ``allgatherv``.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``allgatherv``).
            counts (Sequence[int] | None): Every rank's rows (None: the first start learns
                them).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``allgatherv`` raises them, at once, before any message.

        Examples:
            >>> req = comm.allgatherv_init(np.arange(comm.rank + 1))
            >>> req.start(); req.wait()
            array([0, 0, 1])
        """
        return self._persistent("allgatherv", x, counts=counts, algorithm=algorithm, out=out)

    def gatherv_init(self, x, root=0, counts=None, algorithm="auto", out=None) -> Request:
        """A persistent ``gatherv``; ``wait()`` returns None off the root.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``gatherv``).
            root (int): The root rank.
            counts (Sequence[int] | None): Every rank's rows (None: the first start learns
                them).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``gatherv`` raises them, at once, before any message.

        Examples:
            >>> req = comm.gatherv_init(np.arange(comm.rank + 1), root=0)
            >>> req.start(); y = req.wait()
            >>> y.tolist() == [0, 0, 1] if comm.rank == 0 else y is None
            True
        """
        return self._persistent("gatherv", x, root=root, counts=counts, algorithm=algorithm,
                                out=out)

    def scatterv_init(self, x, counts=None, root=0, algorithm="auto", out=None) -> Request:
        """A persistent ``scatterv``.

        Args:
            x (np.ndarray | None): The bound input (as for ``scatterv``; ignored off the root).
            counts (Sequence[int] | None): The root's blocks (None off the root: each start
                brings them from the root).
            root (int): The root rank.
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``scatterv`` raises them, at once, before any message.

        Examples:
            >>> x, counts = (np.arange(3), [1, 2]) if comm.rank == 0 else (None, None)
            >>> req = comm.scatterv_init(x, counts, root=0)
            >>> req.start(); req.wait().tolist() == [[0], [1, 2]][comm.rank]
            True
        """
        return self._persistent("scatterv", x, counts=counts, root=root, algorithm=algorithm,
                                out=out)

    def alltoallv_init(self, x, send_counts, recv_counts=None, return_counts=False,
                       algorithm="auto", out=None) -> Request:
        """A persistent ``alltoallv``.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``alltoallv``).
            send_counts (Sequence[int]): Rows of ``x`` for each rank.
            recv_counts (Sequence[int] | None): Rows from each rank (None: each start learns
                them).
            return_counts (bool): ``wait()`` returns (result, recv_counts).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``alltoallv`` raises them, at once, before any message.

        Examples:
            >>> req = comm.alltoallv_init(np.arange(3) + 10 * comm.rank, [1, 2])
            >>> req.start(); req.wait().tolist() == [[0, 10], [1, 2, 11, 12]][comm.rank]
            True
        """
        return self._persistent("alltoallv", x, send_counts, recv_counts=recv_counts,
                                return_counts=return_counts, algorithm=algorithm, out=out)

    def scan_init(self, x, op="sum", algorithm="auto", out=None) -> Request:
        """A persistent ``scan`` (inclusive prefix).

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``scan``).
            op (str): The reduction (as for ``scan``).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``scan`` raises them, at once, before any message.

        Examples:
            >>> req = comm.scan_init(np.array([comm.rank + 1]))
            >>> req.start(); req.wait().tolist() == [[1], [3]][comm.rank]
            True
        """
        return self._persistent("scan", x, op=op, algorithm=algorithm, out=out)

    def exscan_init(self, x, op="sum", algorithm="auto", out=None) -> Request:
        """A persistent ``exscan``; rank 0's ``wait()`` returns None.

        Args:
            x (np.ndarray): The bound input, read each time the call runs (as for ``exscan``).
            op (str): The reduction (as for ``exscan``).
            algorithm (str): "auto" or a family, chosen once, at init.
            out (np.ndarray | None): The bound result array (None: the request allocates one, which
                every ``wait()`` returns).

        Returns:
            (Request): ``start()``, then ``wait()`` for the result, as often as needed, then
                ``free()``.

        Raises:
            TypeError, ValueError: As ``exscan`` raises them, at once, before any message.

        Examples:
            >>> req = comm.exscan_init(np.array([comm.rank + 1]))
            >>> req.start(); y = req.wait()
            >>> y is None if comm.rank == 0 else y.tolist() == [1]
            True
        """
        return self._persistent("exscan", x, op=op, algorithm=algorithm, out=out)
