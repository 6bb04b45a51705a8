"""``TorchStore``: minicomm's rendezvous-store interface over the c10d store torch hands the
backend creator (a ``PrefixStore`` of the group).

Every rank of one ``init_process_group`` counts itself in (``store_generation``), so a later
init on the same store (after ``destroy_process_group``) reads fresh keys, never stale ones.
torch owns the store: ``close`` only drops the reference.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Dict, Optional

import torch.distributed as dist

from ..errors import CommTimeout, PeerFailure
from ..rendezvous import RendezvousError, rank_ranges


class TorchStore:
    """minicomm's rendezvous-store interface over a c10d store: ``set``, ``get(key, timeout)``,
    ``add``, ``join`` / ``wait_world`` (membership), ``local_address``. Keys live under
    ``minicomm/<generation>/``; torch owns the store (``close`` drops the reference, leaving it
    open)."""

    def __init__(self, store, timeout: float):
        self._store = store
        self.timeout = timeout
        self.prefix = "minicomm/"
        self.host = store_host(store)
        self._job = ("", 0)

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self.prefix + key, bytes(value))

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """The value of ``key`` once some rank has set it; ``CommTimeout`` after ``timeout``
        seconds (default: the group's), ``PeerFailure`` if the store fails."""
        wait = self.timeout if timeout is None else float(timeout)
        k = self.prefix + key
        try:
            # never 0: a zero timedelta means "no timeout" to some c10d stores
            self._store.wait([k], datetime.timedelta(seconds=max(wait, 1e-3)))
            return self._store.get(k)
        except dist.DistStoreError as e:
            raise CommTimeout(f"torch store: key {k!r} was not set within {wait:g}s (has every "
                              f"rank started?): {e}") from None
        except dist.DistError as e:
            raise PeerFailure(f"torch store: {k!r}: {e}") from None

    def add(self, key: str, delta: int = 1) -> int:
        return int(self._store.add(self.prefix + key, int(delta)))

    def join(self, job: str, size: int, rank: int, **info) -> None:
        """``StoreClient.join``: become ``rank`` of the job (a rank joins once per generation)."""
        rec = dict(info, job=str(job), size=int(size), rank=int(rank), pid=os.getpid())
        rec.setdefault("host", socket.gethostname())
        if self.add(f"claims/{int(rank)}", 1) != 1:
            raise RendezvousError(f"torch store: rank {rank} joined this job twice")
        self.set(f"member/{int(rank)}", json.dumps(rec).encode())
        self._job = (str(job), int(size))

    def wait_world(self, timeout: Optional[float] = None) -> Dict[int, dict]:
        """``StoreClient.wait_world``: rank -> join record once every rank has joined;
        CommTimeout with ``arrived`` / ``missing`` if they have not within ``timeout``."""
        job, size = self._job
        wait = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + wait
        members: Dict[int, dict] = {}
        for r in range(size):
            try:
                raw = self.get(f"member/{r}", timeout=max(1e-3, deadline - time.monotonic()))
            except CommTimeout:
                raise self._missing_members(size, wait) from None
            members[r] = json.loads(raw.decode())
            if (members[r].get("job"), members[r].get("size")) != (job, size):
                raise RendezvousError(f"torch store: rank {r} belongs to another job "
                                      f"({members[r].get('job')}, size {members[r].get('size')})")
        return members

    def _missing_members(self, size: int, wait: float) -> CommTimeout:
        arrived = [q for q in range(size) if self._store.check([f"{self.prefix}member/{q}"])]
        missing = sorted(set(range(size)) - set(arrived))
        err = CommTimeout(f"torch store: {len(arrived)} of {size} ranks arrived within "
                          f"{wait:g}s (missing ranks {rank_ranges(missing)})")
        err.arrived, err.missing = arrived, missing
        return err

    def local_address(self) -> str:
        """The address of this host on the route to the store's host: what peers can reach."""
        host = self.host
        if host is None:
            try:
                return socket.gethostbyname(socket.gethostname())
            except OSError:
                return "127.0.0.1"
        try:
            info = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(info[0], socket.SOCK_DGRAM) as s:
                s.connect(info[4])        # UDP: picks the route, sends nothing
                return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"

    def close(self) -> None:
        # torch owns the store; only let go of it (a TCPStore server in this process must be
        # free to end when torch drops it, so a later init can bind its port again)
        self._store = None


def store_host(store) -> Optional[str]:
    """The host of the TCPStore under a chain of PrefixStores (None for file / hash stores)."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:
        store, seen = store.underlying_store, seen + 1
    return getattr(store, "host", None) if isinstance(store, dist.TCPStore) else None


def is_loopback(host: Optional[str]) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    if host is None:
        return False
    if host in ("localhost", "127.0.0.1", "::1"):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def store_generation(store, size: int, timeout: float) -> TorchStore:
    """The adapter of a c10d store, keyed by generation: every rank of one init counts itself
    in, so a re-init on the same store (after destroy_process_group) uses fresh keys."""
    ts = TorchStore(store, timeout)
    generation = (ts.add("arrivals", 1) - 1) // size
    ts.prefix = f"minicomm/{generation}/"
    return ts
