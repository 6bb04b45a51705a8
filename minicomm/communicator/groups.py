"""New communicators from an existing one (``split``) and one-sided windows over it."""
from __future__ import annotations

import numbers
from typing import List, Tuple

import numpy as np

from ..window import Window
from .lifecycle import SPLIT_BASE, id_counter, serialized


class Groups:
    """split and window (module doc)."""

    @serialized("split")
    def split(self, color, key=None):
        """MPI_Comm_split: the ranks that pass the same ``color`` form a new communicator,
        ordered by (key, rank). Collective over this communicator.

        Args: color, an int, or None / negative (MPI_UNDEFINED: this rank joins none); key, an
        int (default this rank). Returns the new ``Communicator``, or None.
        Raises: TypeError for a color or key that is not an int; CommError on failure.
        >>> row = comm.split(comm.rank // 2)
        """
        color, k = self._split_args(color, key)
        table = self.allgather(np.array([color, k], dtype=np.int64))
        members = sorted((int(table[r, 1]), r) for r in range(self.size)
                         if color >= 0 and table[r, 0] == color)
        ranks = [r for _, r in members]
        mine = -1                     # the group's number, allocated by its lowest rank
        if ranks and self.rank == min(ranks):
            mine = (self.group[self.rank] + 1) * SPLIT_BASE + next(id_counter) % SPLIT_BASE
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

    def _subgroup(self, ranks: List[int], comm_id: int):
        """The communicator of ``ranks`` (of this one) numbered ``comm_id``, on this transport."""
        return type(self)(self.transport, ranks.index(self.rank), len(ranks),
                          group=[self.group[r] for r in ranks],
                          topology=[self.topology[r] for r in ranks], comm_id=comm_id,
                          timeout=self.timeout, check=self.check, link_model=self.link_model,
                          _owner=False, _caps=self.caps)

    def window(self, array) -> Window:
        """A one-sided RMA window exposing a copy of ``array`` to every rank (collective; see
        minicomm.window for put / get / accumulate / fence / lock).

        Args: array, this rank's numeric array (every rank the same dtype). Returns a
        ``Window``. Raises: RMAError where the transport has no one-sided access (tcp,
        inproc); TypeError for a non-numeric array or dtypes that differ between ranks.
        >>> win = comm.window(np.zeros(8))
        """
        return Window(self, array)
