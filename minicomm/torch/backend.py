"""The backend creator torch calls for ``init_process_group("minicomm")`` and
``new_group(backend="minicomm")``, and its registration.

Bootstrap. The minicomm world is built on torch's c10d store (``connect_world(cfg,
store=adapter)``): rank 0 publishes a fresh random job token and job id, and the transports
exchange their addresses through it — no second port. The token authenticates minicomm's own
links; it is as private as torch's store is (that store is not authenticated).
``MINICOMM_TRANSPORT``, ``MINICOMM_BIND``, ``MINICOMM_NODE``/``MINICOMM_HOST`` work as under
``mc.init``. ``dist.new_group(ranks)`` builds its communicators on the world's transports (no
new connections): the group's lowest rank allocates their ids and publishes them in the group's
store.
"""
from __future__ import annotations

import itertools
import json
import os
import secrets
import socket
from typing import List, Optional, Sequence

import torch.distributed as dist

from ..communicator import Communicator
from ..launch.world import connect_world
from ..rendezvous import new_token
from .group import BACKEND, MinicommProcessGroup
from .store import TorchStore, is_loopback, store_generation

# Ids of the communicators this module builds on an existing transport: above every id
# Communicator.split allocates ((world rank + 1) << 24 | counter < 2**48), unique per leader.
_TORCH_IDS = 1 << 50
_id_counter = itertools.count(1)


def connect_new_world(ts: TorchStore, rank: int, size: int, timeout: float) -> Communicator:
    """A minicomm world over ``size`` processes, bootstrapped through a c10d store: rank 0
    publishes a fresh job token and job id; the transports exchange addresses through it."""
    if rank == 0:
        ts.set("boot", json.dumps({"token": new_token().hex(),
                                   "job": f"torch{secrets.token_hex(6)}"}).encode())
    boot = json.loads(ts.get("boot").decode())
    node = os.environ.get("MINICOMM_NODE") or socket.gethostname()
    cfg = dict(rank=rank, size=size, node=node, host=os.environ.get("MINICOMM_HOST") or node,
               topology=None, master_addr="127.0.0.1" if is_loopback(ts.host) else "0.0.0.0",
               master_port=0, token=boot["token"], host_store=False, job_id=boot["job"],
               transport=os.environ.get("MINICOMM_TRANSPORT", "auto"), timeout=timeout)
    return connect_world(cfg, store=ts)


def on_transport(world: Communicator, ranks: Sequence[int], rank: int, ts: TorchStore,
                 timeout: float, count: int) -> List[Communicator]:
    """``count`` communicators over the world ranks ``ranks`` (this process is ``ranks[rank]``),
    built on the world's transport by the members alone: the lowest member allocates the ids
    and publishes them in the group's own store."""
    if rank == 0:
        base = _TORCH_IDS + ((world.world_ranks[world.rank] + 1) << 24)
        ids = [base + next(_id_counter) % (1 << 24) for _ in range(count)]
        ts.set("ids", json.dumps(ids).encode())
    ids = json.loads(ts.get("ids").decode())
    group = [world.world_ranks[r] for r in ranks]
    # _owner=False: the world owns the transport; closing these must not close it
    return [Communicator(world.transport, rank, len(ranks), world_ranks=group,
                         topology=[world.topology[r] for r in ranks], comm_id=int(cid),
                         timeout=timeout, check=world.check, link_model=world.link_model,
                         _owner=False) for cid in ids]


def _default_group() -> Optional[MinicommProcessGroup]:
    if not dist.is_initialized():
        return None
    pg = dist.distributed_c10d._get_default_group()
    return pg if isinstance(pg, MinicommProcessGroup) and not pg.is_shut else None


def create(dist_opts, backend_options=None) -> MinicommProcessGroup:
    """torch's backend creator (extended API): the default group builds a minicomm world through
    torch's store; a sub-group of a minicomm world builds its communicators on that world."""
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    timeout = dist_opts.timeout.total_seconds() if dist_opts.timeout is not None else 1800.0
    ranks = list(dist_opts.global_ranks_in_group)
    parent = _default_group()
    ts = store_generation(dist_opts.store, size, timeout)
    if ranks and parent is not None:
        coll, p2p = on_transport(parent.communicator, ranks, rank, ts, timeout, 2)
        return MinicommProcessGroup(coll, p2p, timeout, owned=[p2p, coll])
    world = connect_new_world(ts, rank, size, timeout)
    try:
        (p2p,) = on_transport(world, list(range(size)), rank, ts, timeout, 1)
    except BaseException:
        world.close()
        raise
    return MinicommProcessGroup(world, p2p, timeout, owned=[p2p, world])


def register() -> None:
    """Register the backend ``"minicomm"`` with torch.distributed (idempotent; done on import).

    Returns:
        (None): Once ``dist.init_process_group("minicomm")`` can find the backend.

    Examples:
        >>> from minicomm.torch import register
        >>> register()                  # importing minicomm.torch did it already
    """
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
