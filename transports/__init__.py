"""minicomm.transports: byte movers, chosen per peer.

``connect`` builds the transport of one rank. ``kind`` forces one transport for every peer, or
``"auto"`` takes, per peer, the first transport that can reach it: shm for a peer on the same node
(same node id in ``node_of_rank``), tcp for the others. Nodes are logical (``mc.spawn(...,
nodes=k)`` emulates k of them on one machine); what a transport can physically reach is decided by
``host_of_rank``, the machine each rank runs on (default: the node map): shm reaches only ranks of
its own host, so forcing shm across emulated nodes of one machine works, across hosts it is a
clear error. A rank that needs more than one kind gets a
``RoutedTransport``: it dispatches each request to its peer's transport, and its ``wait_all``
progresses all of them in one loop over one shared epoll set (progress.py), so a hierarchical
algorithm's intra-node and inter-node messages move at the same time.

The one-sided transports ``rdma`` and ``ub`` (simulated NICs, nic.py) are forced, never auto:
they share memory with the peers of their own node and host (``local``) and reach the others
through a per-process NIC agent thread; their two-sided messages for the collectives ride on
one-sided writes (landing.py). ``rma_backend`` gives windows (minicomm.window) the one-sided
interface of a transport: rdma and ub themselves, shm through shmrma.py.

Adding a transport: give it a builder in ``_BUILDERS`` and, to take part in ``"auto"``, a
reachability rule in ``_AUTO_ORDER``; to be routed with others it implements the engine
interface of progress.py (base.py's ``ProgressEngine``) on a shared ``Progress``. What it offers
beyond the two-sided core it declares in ``capabilities()`` (base.py's ``Capabilities``).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

from .base import Capabilities, OneSided, RegisteredMemory, Request, Tag, Transport, capabilities_of
from .progress import Progress


def _build_shm(rank, size, store, job_id, token, peers, deadline, bind_host, progress, local):
    from .shm import ShmTransport
    return ShmTransport(rank, size, store, job_id, peers, _left(deadline), token=token,
                        progress=progress)


def _build_tcp(rank, size, store, job_id, token, peers, deadline, bind_host, progress, local):
    from .tcp import TcpTransport
    return TcpTransport(rank, size, store, token, peers, bind_host, _left(deadline),
                        progress=progress)


def _build_rdma(rank, size, store, job_id, token, peers, deadline, bind_host, progress, local):
    from .rdma import RdmaTransport
    return RdmaTransport(rank, size, store, job_id, token, peers, local, _left(deadline),
                         bind_host, progress=progress)


def _build_ub(rank, size, store, job_id, token, peers, deadline, bind_host, progress, local):
    from .ub import UbTransport
    return UbTransport(rank, size, store, job_id, token, peers, local, _left(deadline),
                       bind_host, progress=progress)


# kind -> builder(..., local): ``local`` are the peers on this rank's node and host (the
# one-sided transports share memory with them and reach the others through their NIC agent).
_BUILDERS: Dict[str, Callable[..., Transport]] = {"shm": _build_shm, "tcp": _build_tcp,
                                                  "rdma": _build_rdma, "ub": _build_ub}

# "auto": the first kind whose rule accepts (my node, peer's node) carries that peer.
_AUTO_ORDER = (("shm", lambda mine, theirs: mine == theirs),
               ("tcp", lambda mine, theirs: True))

# Kinds that physically reach only ranks on the same host (shared memory).
_SAME_HOST = frozenset({"shm"})


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def connect(kind: str, rank: int, size: int, store, job_id: str, token: bytes,
            node_of_rank: Sequence, timeout: float, bind_host: str = "127.0.0.1",
            host_of_rank: Optional[Sequence] = None,
            peers: Optional[Sequence[int]] = None) -> Transport:
    """The transport of ``rank``: ``kind`` is "auto", or one of ``_BUILDERS`` for every peer.
    ``node_of_rank``: the logical node of every rank; ``host_of_rank``: the physical host of
    every rank (None: the node map, i.e. every node its own host). ``peers``: the ranks to
    connect to (None: every other rank; the in-network switch's links are a star)."""
    nodes = list(node_of_rank)
    hosts = nodes if host_of_rank is None else list(host_of_rank)
    if len(nodes) != size or len(hosts) != size:
        raise ValueError(f"node_of_rank / host_of_rank have {len(nodes)} / {len(hosts)} entries "
                         f"for a world of {size}")
    peers = ([r for r in range(size) if r != rank] if peers is None
             else [r for r in peers if r != rank])

    def reachable(k: str, r: int) -> bool:
        return k not in _SAME_HOST or hosts[r] == hosts[rank]
    if kind == "auto":
        routes: Dict[str, List[int]] = {}
        for r in peers:
            k = next(k for k, reaches in _AUTO_ORDER
                     if reaches(nodes[rank], nodes[r]) and reachable(k, r))
            routes.setdefault(k, []).append(r)
    elif kind in _BUILDERS:
        others = [r for r in peers if not reachable(kind, r)]
        if others:
            raise ValueError(f"transport {kind!r} cannot reach ranks {others} on other hosts; "
                             f"use 'auto' or 'tcp'")
        routes = {kind: peers}
    else:
        raise ValueError(f"unknown transport {kind!r}: choose auto, {', '.join(_BUILDERS)}")
    if not routes:                   # a world of one
        routes = {kind if kind in _BUILDERS else "shm": []}
    local = [r for r in peers if nodes[r] == nodes[rank] and hosts[r] == hosts[rank]]

    deadline = time.monotonic() + timeout
    progress = Progress()
    built: Dict[str, Transport] = {}
    try:
        # Every rank builds its kinds in the same order, so setups that wait on each other
        # through the store never wait in a cycle.
        for k in _BUILDERS:
            if k in routes:
                built[k] = _BUILDERS[k](rank, size, store, job_id, token, routes[k], deadline,
                                        bind_host, progress, local)
    except BaseException:
        for t in built.values():
            t.close()
        raise
    if len(built) == 1:
        return next(iter(built.values()))
    return RoutedTransport(rank, size, built, routes, progress)


class RoutedTransport(Transport):
    """Per-peer dispatch over several transports sharing one ``Progress``."""

    def __init__(self, rank: int, size: int, transports: Dict[str, Transport],
                 routes: Dict[str, List[int]], progress: Progress):
        self.rank, self.size = rank, size
        self.name = "+".join(transports)
        self._transports = transports
        self._routes = routes
        self._progress = progress
        self._by_peer: Dict[int, Transport] = {p: transports[k] for k, ps in routes.items()
                                               for p in ps}
        self._parts: List[Capabilities] = [capabilities_of(t) for t in transports.values()]

    def capabilities(self) -> Capabilities:
        """Registered memory is its shm part's; single-copy aggregates the parts'. No eager
        channel (the small path would bypass the routing) and no one-sided access (a tcp peer
        cannot be reached one-sided); helper threads stay off."""
        registered = next((c.registered for c in self._parts if c.registered is not None), None)
        return Capabilities(registered=registered, single_copy=self, describe=self.describe)

    def single_copy_peers(self) -> List[int]:
        """The peers our large sends reach single-copy, over whichever transport reaches them."""
        return [p for c in self._parts if c.single_copy is not None
                for p in c.single_copy.single_copy_peers()]

    def single_copy_from(self) -> int:
        """The size from which collective sends go single-copy to the peers that read us (the
        largest over the transports that have such peers; 0: none)."""
        return max((c.single_copy.single_copy_from() for c in self._parts
                    if c.single_copy is not None), default=0)

    def _route(self, peer: int) -> Transport:
        try:
            return self._by_peer[peer]
        except KeyError:
            raise ValueError(f"rank {self.rank}: no route to rank {peer}") from None

    def isend(self, peer: int, buf, tag: Tag) -> Request:
        return self._route(peer).isend(peer, buf, tag)

    def irecv(self, peer: int, buf, tag: Tag, reduce=None) -> Request:
        return self._route(peer).irecv(peer, buf, tag, reduce)

    def wait_all(self, requests: List[Request], deadline: float, what: str) -> None:
        self._progress.wait(requests, deadline, what)

    def wait_any(self, requests: List[Request], deadline: float, what: str) -> None:
        self._progress.wait(requests, deadline, what, any_done=True)

    def cancel_context(self, ctx: int, error: BaseException) -> None:
        for t in self._transports.values():
            t.cancel_context(ctx, error)

    def detach(self, req: Request):
        return self._route(req.peer).detach(req)

    def describe(self) -> str:
        return f"rank {self.rank}: " + ", ".join(f"{k} to {self._routes[k]}"
                                                 for k in self._transports)

    def abort(self, reason: str) -> None:
        for t in self._transports.values():
            t.abort(reason)

    def dead_peers(self) -> Dict[int, str]:
        """Every route's ended links (each peer has one route)."""
        dead: Dict[int, str] = {}
        for t in self._transports.values():
            dead.update(t.dead_peers())
        return dead

    def exclude_peer(self, peer: int, reason: str) -> None:
        self._route(peer).exclude_peer(peer, reason)

    def close(self) -> None:
        for t in self._transports.values():
            t.close()


def rma_backend(transport) -> Optional[OneSided]:
    """The one-sided interface of ``transport`` (``rma_expose`` / ``rma_attach``, what windows
    use), or None: rdma and ub are their own; shm shares the window memory directly; tcp,
    inproc and routed shm+tcp have none (a tcp peer cannot be reached one-sided). A thin read
    of ``capabilities_of(transport).one_sided``."""
    return capabilities_of(transport).one_sided


def registered_memory(transport) -> Optional[RegisteredMemory]:
    """What hands out registered memory for ``transport`` (shm's ``register_memory`` /
    ``free_memory`` / ``is_registered``: the peers on the node map it), or None: on tcp, inproc
    and the one-sided transports registered arrays are plain arrays. A thin read of
    ``capabilities_of(transport).registered``."""
    return capabilities_of(transport).registered
