"""Point-to-point messages of a communicator: argument checks and ``Work`` handles over the
matching engine (minicomm.p2p), which runs on the communicator's p2p context."""
from __future__ import annotations

import numbers
import time
from typing import Optional, Tuple

import numpy as np

from ..errors import CommError, CommTimeout, PeerFailure
from ..flightrecord import ENDED, end, received
from ..p2p import ANY_SOURCE, ANY_TAG, MAX_TAG, Status
from ..settings import timeout_arg
from .lifecycle import Work, serialized, translate_peer


class PointToPoint:
    """send / recv and their non-blocking forms (module doc)."""

    def _check_peer(self, rank: int, what: str, any_ok: bool) -> int:
        if isinstance(rank, numbers.Integral):
            rank = int(rank)
            if any_ok and rank == ANY_SOURCE:
                return rank
            if 0 <= rank < self.size:
                return rank
        raise ValueError(f"{what}: rank {rank!r} is not in 0..{self.size - 1}"
                         + (" or ANY_SOURCE" if any_ok else ""))

    @staticmethod
    def _check_tag(tag, what: str, any_ok: bool) -> int:
        if isinstance(tag, numbers.Integral):
            tag = int(tag)
            if (any_ok and tag == ANY_TAG) or 0 <= tag <= MAX_TAG:
                return tag
        raise ValueError(f"{what}: tag {tag!r} must be an int in 0..{MAX_TAG}"
                         + (" or ANY_TAG" if any_ok else ""))

    def _p2p_ended(self, rec, error: Optional[BaseException] = None, got=None) -> None:
        """Close a point-to-point call's flight record (``got``: what a receive received); a
        timeout or a failed peer dumps it."""
        if rec is None or rec[ENDED] is not None:
            return
        if isinstance(got, np.ndarray):
            received(rec, got)
        end(rec, error)
        if isinstance(error, (CommTimeout, PeerFailure)):
            self._dump_flight(f"{type(error).__name__}: {error}")

    def _p2p_deadline(self, timeout: Optional[float]) -> float:
        return time.monotonic() + (self.timeout if timeout is None else float(timeout))

    def _isend(self, x, dst, tag) -> Work:
        arr, flat = self._flat_in(x)
        dst = self._check_peer(dst, "send", False)
        tag = self._check_tag(tag, "send", False)
        self._usable("send")
        reqs = self._p2p.isend(arr, flat, dst, tag)
        rec = None if self._flight is None else self._flight.p2p("send", flat.size, arr.dtype,
                                                                  dst, tag)
        what = f"send to rank {dst} (tag {tag})"
        work = Work(what)
        if not reqs:
            work._finish(None)
            self._p2p_ended(rec)
            return work
        transport = self.transport

        def drive(timeout):
            self._enter("wait on " + what)
            try:
                if not work.is_completed():
                    try:
                        transport.wait_all(reqs, self._p2p_deadline(timeout), what)
                        work._finish(None)
                        self._p2p_ended(rec)
                    except CommTimeout as e:
                        if timeout is None:
                            self._p2p_ended(rec, e)
                            raise
                    except CommError as e:
                        work._finish(error=translate_peer(e, self.world_ranks))
                        self._p2p_ended(rec, e)
            finally:
                self._exit()
        work._drive = drive
        work._keep = flat             # the buffer must live until the send completes
        return work

    def _irecv(self, src, tag, out) -> Tuple[Work, object, Optional[list]]:
        src = self._check_peer(src, "recv", True)
        tag = self._check_tag(tag, "recv", True)
        if out is not None and not isinstance(out, np.ndarray):
            raise TypeError("recv: out= must be a numpy array")
        self._usable("recv")
        work = Work(f"recv from {'any source' if src == ANY_SOURCE else f'rank {src}'} "
                    f"({'any tag' if tag == ANY_TAG else f'tag {tag}'})")
        work.status = Status()
        r = self._p2p.post(src, tag, out, work)
        rec = None if self._flight is None else self._flight.p2p("recv", None, None, src, tag)
        engine = self._p2p

        def drive(timeout):
            self._enter("wait on " + work.description)
            try:
                if work.is_completed():
                    return
                try:
                    engine.progress(r.done, self._p2p_deadline(timeout), work.description)
                except CommTimeout as e:
                    if timeout is not None:   # wait(timeout) may be retried: keep the receive
                        raise
                    engine.cancel(r)
                    work._finish(error=e)
                    self._p2p_ended(rec, e)
                    return
                except CommError as e:
                    engine.cancel(r)
                    work._finish(error=e)
                    self._p2p_ended(rec, e)
                    return
                if r.error is not None:
                    work._finish(error=r.error)
                else:
                    work._finish(r.result)
                self._p2p_ended(rec, r.error, r.result)
            finally:
                self._exit()
        work._drive = drive
        if r.done():
            drive(None)
        return work, r, rec

    def _recv(self, src, tag, out, status: Optional[Status], timeout):
        timeout = timeout_arg("recv: timeout", timeout)     # checked before anything is consumed
        work, r, rec = self._irecv(src, tag, out)
        if not work.is_completed():
            try:
                self._p2p.progress(r.done, self._p2p_deadline(timeout), work.description)
            except CommError as e:
                self._p2p.cancel(r)
                self._p2p_ended(rec, e)
                raise
            work._finish(r.result, r.error)
            self._p2p_ended(rec, r.error, r.result)
        y = work.wait(0)
        if status is not None:
            st = work.status
            status.source, status.tag, status.nbytes = st.source, st.tag, st.nbytes
            status.dtype, status.shape = st.dtype, st.shape
        return y

    @serialized("isend")
    def isend(self, x, dst: int, tag: int = 0) -> Work:
        """Post one message to rank ``dst``, matched on (source, tag) by the receiver.

        Args:
            x (np.ndarray): A numeric or bool array; it must not change until the send completes.
            dst (int): The destination rank.
            tag (int): An int in 0..MAX_TAG (2**31 - 1) the receiver matches on.

        Returns:
            (Work): ``wait()`` returns None once ``x`` may be reused.

        Raises:
            TypeError: A non-numeric ``x``.
            ValueError: A rank outside the communicator or a bad tag.
            CommError: The communicator is broken or closed (``wait()`` raises the send's own
                failure: ``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> w = comm.isend(np.arange(3) + 10 * comm.rank, 1 - comm.rank)   # to the other rank
            >>> y = comm.recv(1 - comm.rank)
            >>> w.wait()
            >>> y - 10 * (1 - comm.rank)
            array([0, 1, 2])
        """
        work = self._isend(x, dst, tag)
        return work if self._batch is None else self._hold_p2p(work)

    @serialized("send")
    def send(self, x, dst: int, tag: int = 0) -> None:
        """Send one message to rank ``dst``; returns once ``x`` may be reused.

        Args:
            x (np.ndarray): A numeric or bool array; shape and dtype travel with it.
            dst (int): The destination rank.
            tag (int): An int in 0..MAX_TAG (2**31 - 1) the receiver matches on.

        Returns:
            (None): Once the message is on its way (a large one: once the receiver took it);
                inside ``comm.group()``, a ``Work`` at once, done at the group's exit.

        Raises:
            TypeError: A non-numeric ``x``.
            ValueError: A rank outside the communicator or a bad tag.
            CommTimeout: The message could not be handed over within the communicator's timeout.
            PeerFailure: The destination died or left.
            CommError: The communicator is broken or closed.

        Examples:
            >>> if comm.rank == 0: comm.send(np.arange(3), dst=1, tag=7)
            >>> if comm.rank == 1: y = comm.recv(0, tag=7)
            >>> comm.rank == 0 or y.tolist() == [0, 1, 2]
            True
        """
        work = self._isend(x, dst, tag)
        if self._batch is not None:
            return self._hold_p2p(work)       # inside comm.group(): done at its exit
        work.wait()

    @serialized("irecv")
    def irecv(self, src: int, tag: int = 0, out=None) -> Work:
        """Post a receive of one message from ``src`` with ``tag`` (either may be ANY).

        Args:
            src (int): The source rank, or ``mc.ANY_SOURCE``.
            tag (int): The tag to match, or ``mc.ANY_TAG``.
            out (np.ndarray | None): An array to receive into, checked against the message's dtype
                and size before its payload is touched.

        Returns:
            (Work): ``wait()`` returns the array (``out`` if given); its ``status`` (a ``Status``)
                tells what it matched.

        Raises:
            TypeError: ``out`` is not a numpy array.
            ValueError: A rank outside the communicator or a bad tag.
            CommError: The communicator is broken or closed.

        Examples:
            >>> w = comm.irecv(mc.ANY_SOURCE, tag=7)
            >>> comm.send(np.array([comm.rank]), dst=1 - comm.rank, tag=7)
            >>> w.wait() + comm.rank                         # the other rank's, 1 - rank
            array([1])
            >>> w.status.source == 1 - comm.rank
            True
        """
        work = self._irecv(src, tag, out)[0]
        return work if self._batch is None else self._hold_p2p(work)

    @serialized("recv")
    def recv(self, src: int, tag: int = 0, out=None, status: Optional[Status] = None,
             timeout: Optional[float] = None):
        """Receive one message from ``src`` (or ``ANY_SOURCE``) with ``tag`` (or ``ANY_TAG``).

        The array's shape and dtype come from the message.

        Args:
            src (int): The source rank, or ``mc.ANY_SOURCE``.
            tag (int): The tag to match, or ``mc.ANY_TAG``.
            out (np.ndarray | None): An array to receive into, checked against the message's dtype
                and size before anything is consumed (a wrong one leaves the message in place).
            status (Status | None): A ``Status`` to fill with the source, tag, size, dtype and shape
                of what matched.
            timeout (float | None): Seconds to wait (default: the communicator's); a timeout cancels
                this receive only, not the communicator.

        Returns:
            (np.ndarray): The received array (``out`` if given); inside ``comm.group()``, a
                ``Work`` at once whose ``wait()`` returns it after the group's exit.

        Raises:
            TypeError: ``out`` is not a numpy array, or does not fit the message.
            ValueError: A rank outside the communicator or a bad tag.
            CommTimeout: No matching message within ``timeout``.
            PeerFailure: The source died or left.
            CommError: The communicator is broken or closed.

        Examples:
            >>> w = comm.isend(np.array([comm.rank]), dst=1 - comm.rank, tag=3)
            >>> st = mc.Status()
            >>> y = comm.recv(mc.ANY_SOURCE, tag=3, status=st)
            >>> w.wait()
            >>> (st.source, st.tag, int(y[0])) == (1 - comm.rank, 3, 1 - comm.rank)
            True
        """
        if self._batch is not None:           # inside comm.group(): done at its exit
            timeout_arg("recv: timeout", timeout)
            return self._hold_p2p(self._irecv(src, tag, out)[0], status)
        return self._recv(src, tag, out, status, timeout)
