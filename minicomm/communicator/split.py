"""New communicators from an existing one (``split``) and one-sided windows over it."""
from __future__ import annotations

import numbers
from typing import List, Tuple

import numpy as np

from ..window import Window
from .lifecycle import SPLIT_BASE, id_counter, serialized


class Split:
    """split and window (module doc)."""

    @serialized("split")
    def split(self, color, key=None):
        """MPI_Comm_split: the ranks that pass the same ``color`` form a new communicator.

        Collective over this communicator; the new one's ranks are ordered by (key, rank).

        Args:
            color (int | None): The group to join; None or a negative int (MPI_UNDEFINED): join
                none.
            key (int | None): This rank's sort key in its group (default: this rank).

        Returns:
            (Communicator | None): The new communicator, or None for a rank that joined none.

        Raises:
            TypeError: A color or key that is not an int.
            CommError: On failure (``MismatchError``, ``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> alone = comm.split(comm.rank)              # a communicator of one rank each
            >>> alone.size, alone.rank
            (1, 0)
            >>> reverse = comm.split(0, key=-comm.rank)    # the same ranks, numbered backwards
            >>> reverse.rank == comm.size - 1 - comm.rank
            True
        """
        color, k = self._split_args(color, key)
        table = self.allgather(np.array([color, k], dtype=np.int64))
        members = sorted((int(table[r, 1]), r) for r in range(self.size)
                         if color >= 0 and table[r, 0] == color)
        ranks = [r for _, r in members]
        mine = -1                     # the group's number, allocated by its lowest rank
        if ranks and self.rank == min(ranks):
            mine = (self.world_ranks[self.rank] + 1) * SPLIT_BASE + next(id_counter) % SPLIT_BASE
        ids = self.allgather(np.array([mine], dtype=np.int64))
        return None if color < 0 else self._subgroup(ranks, int(ids[min(ranks), 0]))

    def _split_args(self, color, key) -> Tuple[int, int]:
        if color is not None and (not isinstance(color, numbers.Integral)
                                  or isinstance(color, bool)):
            raise TypeError(f"split: color must be an int (or None / negative for no group), "
                            f"got {type(color).__name__} {color!r}")
        if key is not None and not isinstance(key, numbers.Integral):
            raise TypeError(f"split: key must be an int, got {type(key).__name__} {key!r}")
        color = -1 if color is None or int(color) < 0 else int(color)
        return color, self.rank if key is None else int(key)

    def _subgroup(self, ranks: List[int], comm_id: int, owner: bool = False):
        """The communicator of ``ranks`` (of this one) numbered ``comm_id``, on this transport;
        ``owner``: it closes the transport (shrink hands a world's ownership on)."""
        new = type(self)(self.transport, ranks.index(self.rank), len(ranks),
                         world_ranks=[self.world_ranks[r] for r in ranks],
                         topology=[self.topology[r] for r in ranks], comm_id=comm_id,
                         timeout=self.timeout, check=self.check, link_model=self.link_model,
                         _owner=owner, _caps=self.caps)
        if new._flight is not None and self._flight is not None:
            new._flight.directory = self._flight.directory   # the job's dumps stay together
        new._switch = self._switch
        return new

    @serialized("window")
    def window(self, array) -> Window:
        """A one-sided RMA window exposing a copy of ``array`` to every rank (collective).

        See ``minicomm.window`` for put / get / accumulate / fence / lock.

        Args:
            array (np.ndarray): This rank's numeric array (every rank the same dtype; sizes may
                differ). ``Window.free`` copies the final contents back into it.

        Returns:
            (Window): The window; ``local`` is this rank's memory of it.

        Raises:
            RMAError: The transport has no one-sided access (tcp, inproc).
            TypeError: A non-numeric array, or dtypes that differ between ranks.
            CommError: On failure (``CommTimeout``, ``PeerFailure``).

        Examples:
            >>> w = comm.window(np.zeros(4))
            >>> w.fence()
            >>> for t in range(comm.size): w.put(np.array([comm.rank + 1.0]), t, offset=comm.rank)
            >>> w.fence()
            >>> w.local                                    # 2 ranks: each wrote its slot everywhere
            array([1., 2., 0., 0.])
            >>> w.free()
        """
        return Window(self, array)
