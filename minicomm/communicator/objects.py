"""Object collectives: any Python object cloudpickle can carry, as uint8 arrays over the array
collectives (a size first where the receivers need it). Only data from this job's own
processes is unpickled (SECURITY.md)."""
from __future__ import annotations

from typing import Any, List, Optional

import cloudpickle
import numpy as np

from ..p2p import Status
from .lifecycle import serialized


def pickled(obj) -> np.ndarray:
    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)


def unpickled(arr: np.ndarray):
    return cloudpickle.loads(arr.tobytes())


class ObjectCollectives:
    """broadcast / allgather / gather / scatter / send / recv of objects (module doc)."""

    @serialized("broadcast_object")
    def broadcast_object(self, obj=None, root=0):
        """Every rank gets the root's ``obj`` (cloudpickled).

        Args:
            obj (object): The root's object (ignored elsewhere).
            root (int): The rank that holds it.

        Returns:
            (object): The object (a copy on every rank but the root).

        Raises:
            ValueError: A root outside the communicator.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> cfg = {"lr": 0.1} if comm.rank == 0 else None
            >>> comm.broadcast_object(cfg, root=0)
            {'lr': 0.1}
        """
        root = self._check_root(root, "broadcast_object")
        data = pickled(obj) if self.rank == root else np.empty(0, dtype=np.uint8)
        n = self.broadcast(np.array([data.size], dtype=np.int64), root=root, algorithm="tree")
        buf = data if self.rank == root else np.empty(int(n[0]), dtype=np.uint8)
        return unpickled(self.broadcast(buf, root=root))

    @serialized("allgather_object")
    def allgather_object(self, obj) -> List[Any]:
        """Every rank gets the list of every rank's ``obj``, by rank.

        Args:
            obj (object): Any object cloudpickle can carry.

        Returns:
            (list): ``size`` objects, rank r's at index r.

        Raises:
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> comm.allgather_object(f"rank {comm.rank}")
            ['rank 0', 'rank 1']
        """
        data = pickled(obj)
        sizes = self.allgather(np.array([data.size], dtype=np.int64))[:, 0]
        rows = self.allgather(self._padded(data, sizes))
        return [unpickled(rows[r, :sizes[r]]) for r in range(self.size)]

    @serialized("gather_object")
    def gather_object(self, obj, root=0):
        """The root gets the list of every rank's ``obj``, by rank; the others get None.

        Args:
            obj (object): Any object cloudpickle can carry.
            root (int): The rank that gets the list.

        Returns:
            (list | None): At the root ``size`` objects, rank r's at index r; None elsewhere.

        Raises:
            ValueError: A root outside the communicator.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> stats = comm.gather_object({"rank": comm.rank}, root=0)
            >>> stats == [{"rank": 0}, {"rank": 1}] if comm.rank == 0 else stats is None
            True
        """
        root = self._check_root(root, "gather_object")
        data = pickled(obj)
        sizes = self.allgather(np.array([data.size], dtype=np.int64))[:, 0]
        rows = self.gather(self._padded(data, sizes), root=root)
        if rows is None:
            return None
        return [unpickled(rows[r, :sizes[r]]) for r in range(self.size)]

    @serialized("scatter_object")
    def scatter_object(self, objs=None, root=0):
        """Rank r gets ``objs[r]`` of the root's sequence.

        Args:
            objs (Sequence | None): At the root, a sequence of ``size`` objects; ignored elsewhere.
            root (int): The rank that holds the sequence.

        Returns:
            (object): This rank's object.

        Raises:
            ValueError: A root outside the communicator, or a root's sequence not of ``size``
                objects.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> parts = ["a", "b"] if comm.rank == 0 else None
            >>> comm.scatter_object(parts) == "ab"[comm.rank]
            True
        """
        root = self._check_root(root, "scatter_object")
        table = self._object_table(objs) if self.rank == root else None
        row = self.scatter(table, root=root)
        n = int(np.frombuffer(row[:8].tobytes(), dtype=np.int64)[0])
        return unpickled(row[8:8 + n])

    def send_object(self, obj, dst: int, tag: int = 0) -> None:
        """Send ``obj`` (cloudpickled) to rank ``dst`` as one message with ``tag``.

        Args:
            obj (object): Any object cloudpickle can carry.
            dst (int): The destination rank.
            tag (int): An int in 0..MAX_TAG the receiver matches on.

        Returns:
            (None): Once the message is on its way.

        Raises:
            ValueError: A rank outside the communicator or a bad tag.
            CommTimeout: The message could not be handed over within the communicator's timeout.
            PeerFailure: The destination died or left.
            CommError: The communicator is broken or closed.

        Examples:
            >>> if comm.rank == 0: comm.send_object({"step": 3}, dst=1, tag=5)
            >>> if comm.rank == 1: msg = comm.recv_object(0, tag=5)
            >>> comm.rank == 0 or msg == {"step": 3}
            True
        """
        self.send(pickled(obj), dst, tag)

    def recv_object(self, src: int, tag: int = 0, status: Optional[Status] = None,
                    timeout: Optional[float] = None):
        """Receive an object sent by ``send_object`` from ``src`` (or ``ANY_SOURCE``).

        Only this job's processes can send one (the transport authenticates every peer); the
        object is unpickled.

        Args:
            src (int): The source rank, or ``mc.ANY_SOURCE``.
            tag (int): The tag to match, or ``mc.ANY_TAG``.
            status (Status | None): A ``Status`` to fill (as for ``recv``).
            timeout (float | None): Seconds to wait (default: the communicator's).

        Returns:
            (object): The object.

        Raises:
            ValueError: A rank outside the communicator or a bad tag.
            CommTimeout: No matching message within ``timeout``.
            PeerFailure: The source died or left.
            CommError: The communicator is broken or closed.

        Examples:
            >>> if comm.rank == 1: comm.send_object(("hello", [1, 2]), dst=0)
            >>> if comm.rank == 0: msg = comm.recv_object(mc.ANY_SOURCE)
            >>> comm.rank == 1 or msg == ("hello", [1, 2])
            True
        """
        return unpickled(self.recv(src, tag, status=status, timeout=timeout))

    @staticmethod
    def _padded(data: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``data`` zero-padded to the longest of ``sizes`` (every rank's row of one table)."""
        padded = np.zeros(int(sizes.max()), dtype=np.uint8)
        padded[:data.size] = data
        return padded

    def _object_table(self, objs) -> np.ndarray:
        """The root's scatter_object table: per rank, its pickle's length (8 bytes), then it."""
        if objs is None or len(objs) != self.size:
            raise ValueError(f"scatter_object: root needs a sequence of {self.size} objects")
        blobs = [pickled(o) for o in objs]
        width = max(b.size for b in blobs)
        table = np.zeros((self.size, width + 8), dtype=np.uint8)
        for r, b in enumerate(blobs):
            table[r, :8] = np.frombuffer(np.int64(b.size).tobytes(), dtype=np.uint8)
            table[r, 8:8 + b.size] = b
        return table
