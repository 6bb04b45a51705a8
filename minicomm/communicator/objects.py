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

        Args: obj, the root's object (ignored elsewhere); root, a rank.
        Returns the object (a copy on every rank but the root). Raises: ValueError for a
        bad root; CommError subclasses on failure.
        >>> cfg = comm.broadcast_object(cfg if comm.rank == 0 else None)
        """
        root = self._check_root(root, "broadcast_object")
        data = pickled(obj) if self.rank == root else np.empty(0, dtype=np.uint8)
        n = self.broadcast(np.array([data.size], dtype=np.int64), root=root, algorithm="tree")
        buf = data if self.rank == root else np.empty(int(n[0]), dtype=np.uint8)
        return unpickled(self.broadcast(buf, root=root))

    @serialized("allgather_object")
    def allgather_object(self, obj) -> List[Any]:
        """Every rank gets the list of every rank's ``obj``, by rank.

        Args: obj, any object cloudpickle can carry. Returns a list of ``size`` objects.
        Raises: CommError subclasses on failure.
        >>> names = comm.allgather_object(socket.gethostname())
        """
        data = pickled(obj)
        sizes = self.allgather(np.array([data.size], dtype=np.int64))[:, 0]
        rows = self.allgather(self._padded(data, sizes))
        return [unpickled(rows[r, :sizes[r]]) for r in range(self.size)]

    @serialized("gather_object")
    def gather_object(self, obj, root=0):
        """The root gets the list of every rank's ``obj``, by rank; the others get None.

        Args: obj, any object cloudpickle can carry; root, a rank.
        Returns the list at the root, else None. Raises: ValueError for a bad root;
        CommError subclasses on failure.
        >>> stats = comm.gather_object(local_stats, root=0)
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

        Args: objs, at the root a sequence of ``size`` objects (ignored elsewhere); root, a
        rank. Returns this rank's object. Raises: ValueError for a bad root or a root's
        sequence of the wrong length; CommError subclasses on failure.
        >>> part = comm.scatter_object(parts if comm.rank == 0 else None)
        """
        root = self._check_root(root, "scatter_object")
        table = self._object_table(objs) if self.rank == root else None
        row = self.scatter(table, root=root)
        n = int(np.frombuffer(row[:8].tobytes(), dtype=np.int64)[0])
        return unpickled(row[8:8 + n])

    def send_object(self, obj, dst: int, tag: int = 0) -> None:
        """Send ``obj`` (cloudpickled) to rank ``dst`` as one message with ``tag``.

        Returns None. Raises: ValueError for a bad rank or tag; CommTimeout, PeerFailure or
        CommError when it cannot be delivered.
        >>> comm.send_object({"step": 3}, dst=1)
        """
        self.send(pickled(obj), dst, tag)

    def recv_object(self, src: int, tag: int = 0, status: Optional[Status] = None,
                    timeout: Optional[float] = None):
        """Receive an object sent by ``send_object`` from ``src`` (or ``ANY_SOURCE``).

        Args: tag (or ``ANY_TAG``), status and timeout as for ``recv``. Returns the object.
        Raises: ValueError for a bad rank or tag; CommTimeout, PeerFailure, CommError.
        >>> msg = comm.recv_object(0)
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
