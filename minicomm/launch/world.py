"""Building a world communicator from a configuration: what every launch path ends in.

``connect_world(cfg)`` is called in each rank process (by ``mc.spawn``'s child worker, by
``mc.init`` under ``minicomm run`` / the ssh agent / torchrun / mpirun / srun): it joins the
rendezvous store, learns the node map, connects the transports and returns the world
``Communicator``, whose link model every rank then agrees on.

Link agreement is a hook (``set_link_agreement``): measuring links is ``minicomm.tuning``, a layer
above this one, and ``minicomm/__init__.py`` (the composition root) plugs its
``agree_link_model`` in when the package is imported, i.e. before any rank can get here. Without
a hook the world keeps the default link constants (``LinkModel.for_transports``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

from ..communicator import Communicator
from ..cost import LinkModel
from ..rendezvous import StoreClient, StoreServer
from ..transports import connect
from ..transports.progress import SPIN_S

TRANSPORTS = ("auto", "shm", "tcp", "rdma", "ub", "inproc")

# (world communicator, intra transport, inter transport) -> the LinkModel every rank uses.
LinkAgreement = Callable[[Communicator, str, str], LinkModel]
_link_agreement: Optional[LinkAgreement] = None


def set_link_agreement(agree: Optional[LinkAgreement]) -> None:
    """Install the collective that gives a new world its agreed ``LinkModel`` (None: defaults)."""
    global _link_agreement
    _link_agreement = agree


def node_map(world_size: int, nodes: int) -> Tuple[int, ...]:
    """``nodes`` emulated nodes as blocks of consecutive ranks (sizes differ by at most one)."""
    if not 1 <= nodes <= max(1, world_size):
        raise ValueError(f"nodes={nodes} must be between 1 and world_size={world_size}")
    return tuple(r * nodes // world_size for r in range(world_size))



def link_names(kind: str, several_nodes: bool) -> Tuple[str, str]:
    """The transports carrying intra-node and inter-node pairs (the link model's and the tuned
    table's names): auto is shm inside a node, tcp between; a forced transport carries both.
    With one node the inter name keeps its default (tcp for shm), so tables stay keyed alike."""
    if kind == "auto":
        return "shm", "tcp"
    return kind, kind if several_nodes or kind != "shm" else "tcp"


def connect_world(cfg: Dict[str, Any], store: Any = None) -> Communicator:
    """Build the world communicator from a configuration (from ``spawn`` or ``init``): ``rank``,
    ``size``, ``node`` (logical) or ``topology`` (every rank's), ``host`` (the machine, default
    the node) or ``hosts`` (every rank's), the store's address and token, ``transport``...

    ``store``: a rendezvous store the caller already has (``set``, ``get(key, timeout)``,
    ``add``, ``local_address()``, ``close()``; minicomm.torch adapts the c10d store torch gives
    a backend). Then ``master_port`` and ``host_store`` are not used."""
    rank, size = cfg["rank"], cfg["size"]
    token = bytes.fromhex(cfg["token"])
    timeout = cfg.get("timeout")
    env_timeout = os.environ.get("MINICOMM_TIMEOUT")
    setup_timeout = float(timeout if timeout is not None else env_timeout or 300.0)
    kind = cfg["transport"]
    if kind not in TRANSPORTS or kind == "inproc":
        raise ValueError(f"transport {kind!r} cannot connect processes; choose auto, shm, tcp, rdma or ub")
    server = None
    if store is None:
        if cfg.get("host_store"):
            server = StoreServer("0.0.0.0", cfg["master_port"], token)
        store = StoreClient(cfg["master_addr"], cfg["master_port"], token, timeout=setup_timeout)
    topology = cfg.get("topology")
    if topology is None:
        store.set(f"node/{rank}", str(cfg["node"]).encode())
        names = [store.get(f"node/{r}").decode() for r in range(size)]
        topology = tuple(names.index(n) for n in names)
    hosts = cfg.get("hosts")          # the machines (what shm can reach); default: the nodes
    if hosts is None:
        store.set(f"host/{rank}", str(cfg.get("host", cfg["node"])).encode())
        hosts = tuple(store.get(f"host/{r}").decode() for r in range(size))
    bind = os.environ.get("MINICOMM_BIND") or os.environ.get("MINICOMM_SOCKET_IFNAME_ADDR")
    t = connect(kind, rank, size, store, cfg["job_id"], token, tuple(topology), setup_timeout,
                bind_host=bind or ("127.0.0.1" if cfg["master_addr"] in ("127.0.0.1", "localhost")
                                   else "0.0.0.0"), host_of_rank=tuple(hosts))
    intra, inter = link_names(kind, len(set(topology)) > 1)
    comm = Communicator(t, rank, size, topology=topology, timeout=timeout,
                        link_model=LinkModel.for_transports(intra, inter, spin=SPIN_S))
    comm._store, comm._store_server = store, server
    try:
        # rank 0's measured (or cached) links and tuned table, so auto agrees on every rank
        if _link_agreement is not None:
            comm.link_model = _link_agreement(comm, intra, inter)
    except BaseException:
        comm.close()
        raise
    if comm.debug_info and hasattr(t, "describe"):
        comm._log(f"transports: {t.describe()}")
    return comm
