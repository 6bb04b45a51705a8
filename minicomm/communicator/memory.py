"""Registered buffers: arrays in memory the peers on this node map (NCCL's user-buffer
registration, MPI_Win_allocate_shared), so a large message from one is copied once, straight
into the receiver's destination (docs/decisions/registered-buffers.md). Where the transport
has no registered memory (tcp, inproc) they are plain arrays."""
from __future__ import annotations

from typing import Tuple

import numpy as np


class RegisteredBuffers:
    """empty / register / is_registered / free over ``caps.registered`` (module doc)."""

    def empty(self, shape, dtype=np.float64) -> np.ndarray:
        """An uninitialised array in registered memory.

        Over shm, a large message from it moves with one copy, no staging ring and no system call.
        Use it like any array (in, out, in place); ``free`` ends the registration. Costs one
        /dev/shm segment per call.

        Args:
            shape (int | tuple): The array's shape.
            dtype (np.dtype): A numeric or bool dtype.

        Returns:
            (np.ndarray): The array (a plain one where the transport has no registered memory).

        Raises:
            TypeError: A non-numeric dtype.
            ValueError: A negative dimension.

        Examples:
            >>> buf = comm.empty((1 << 10,), np.float32)
            >>> buf[:] = 1
            >>> comm.allreduce(buf, out=buf)[:3]
            array([2., 2., 2.], dtype=float32)
            >>> comm.free(buf)
        """
        dtype = np.dtype(dtype)
        shape, nbytes = self._registered_size(shape, dtype)
        reg = self.caps.registered
        if reg is None:
            return np.empty(shape, dtype)
        return reg.register_memory(nbytes).view(dtype).reshape(shape)

    @staticmethod
    def _registered_size(shape, dtype: np.dtype) -> Tuple[Tuple[int, ...], int]:
        if dtype.kind not in "biufc":
            raise TypeError(f"minicomm moves numeric and bool arrays, got dtype {dtype}")
        shape = tuple(int(d) for d in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
        if any(d < 0 for d in shape):
            raise ValueError(f"empty: negative dimension in {shape}")
        return shape, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def register(self, array) -> np.ndarray:
        """``array`` itself if it lies in registered memory already, else a registered copy of it.

        The copy has the same shape, dtype and values: pass the returned array to the collectives.

        Args:
            array (np.ndarray): Anything ``np.asarray`` takes (numeric or bool).

        Returns:
            (np.ndarray): The registered array.

        Raises:
            TypeError: A non-numeric dtype.

        Examples:
            >>> x = comm.register(np.ones(1 << 10))
            >>> comm.allreduce(x)[:2]
            array([2., 2.])
            >>> comm.free(x)
        """
        arr = np.asarray(array)
        if self.is_registered(arr) and arr.flags.c_contiguous:
            return arr
        reg = self.empty(arr.shape, arr.dtype)
        reg[...] = arr
        return reg

    def is_registered(self, array) -> bool:
        """Whether ``array`` lies wholly in this transport's registered memory.

        Args:
            array (object): Any object.

        Returns:
            (bool): False for anything not a numpy array, and wherever the transport has no
                registered memory (tcp, inproc).

        Examples:
            >>> comm.is_registered(np.zeros(4))
            False
        """
        reg = self.caps.registered
        return reg is not None and isinstance(array, np.ndarray) and reg.is_registered(array)

    def free(self, array) -> None:
        """End the registration of memory from ``empty`` / ``register``.

        Peers stop mapping it and its name goes; the array stays valid as a plain (private) array.
        Do not free a buffer an unfinished ``async_op`` call uses.

        Args:
            array (np.ndarray): An array from ``empty`` or ``register``.

        Returns:
            (None): Also where the transport has no registered memory (nothing to do there).

        Raises:
            ValueError: An array that is not registered memory of this communicator.

        Examples:
            >>> buf = comm.empty(4)
            >>> comm.free(buf)
        """
        reg = self.caps.registered
        if reg is None:
            return                    # it was a plain array all along (tcp, inproc)
        if not isinstance(array, np.ndarray) or not reg.free_memory(array):
            raise ValueError("free: the array is not registered memory of this communicator")
