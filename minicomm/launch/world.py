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

import errno
import os
import socket
import time
from typing import Any, Callable, Dict, Optional, Tuple

from .. import flightrecord
from ..communicator import Communicator
from ..communicator.switchlink import ENV_SWITCH
from ..cost import LinkModel
from ..errors import CommError, CommTimeout
from ..rendezvous import AuthError, RendezvousError, StoreClient, StoreServer, rank_ranges
from ..settings import env_flag, env_timeout, timeout_arg
from ..transports import connect, fault
from ..transports.progress import SPIN_S
from . import switch

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

    Rendezvous: this rank joins the store as a member of its job (``identity``, default the job
    id, and ``size``: the store refuses a member of another job), waits until every rank has
    joined, and learns every rank's node and host from their join records. All of it, and the
    transports' connections, within ``setup_timeout`` (default ``timeout``, MINICOMM_TIMEOUT or
    300 s). ``host_store``: this process serves the store on ``master_port`` (``store_bind``);
    ``store_server``: it already does.

    ``store``: a rendezvous store the caller already has, with ``StoreClient``'s interface
    (``set``, ``get(key, timeout)``, ``add``, ``join``, ``wait_world``, ``local_address``,
    ``close``; minicomm.torch adapts the c10d store torch gives a backend). This rank joins it;
    ``master_port``, ``host_store`` and ``store_server`` are not used."""
    rank, size = cfg["rank"], cfg["size"]
    flightrecord.install_signal_handler()   # SIGUSR1 dumps this rank's flight record
    fault.from_env()             # a bad MINICOMM_FAULT is a ValueError before anything is built
    token = bytes.fromhex(cfg["token"])
    timeout = timeout_arg("timeout", cfg.get("timeout"))
    setup_timeout = (timeout_arg("setup_timeout", cfg.get("setup_timeout")) or timeout
                     or env_timeout())
    deadline = time.monotonic() + setup_timeout
    kind = cfg["transport"]
    if kind not in TRANSPORTS or kind == "inproc":
        raise ValueError(f"transport {kind!r} cannot connect processes; choose auto, shm, tcp, rdma or ub")
    identity = str(cfg.get("identity") or cfg["job_id"])
    addr = cfg["master_addr"]
    server = cfg.get("store_server")
    want_switch = bool(cfg.get("switch")) or env_flag(ENV_SWITCH, False)
    if want_switch and store is not None:
        raise ValueError("an in-network switch (MINICOMM_SWITCH=1) needs minicomm's own "
                         "rendezvous store, which the switch joins; this world was given "
                         "another store")
    if store is not None:
        server = None
        store.join(identity, cfg["size"], rank, node=str(cfg.get("node")),
                   machine=str(cfg.get("host", cfg.get("node"))))
    else:
        if server is None and cfg.get("host_store"):
            server = _host_store(cfg, token, identity, deadline)
        try:
            store = _join(cfg, token, identity, deadline)
        except BaseException:
            _close_server(server, deadline)
            raise
    members = _wait_world(store, server, rank, size, setup_timeout, deadline)
    topology = cfg.get("topology")
    if topology is None:
        names = [str(members[r].get("node")) for r in range(size)]
        topology = tuple(names.index(n) for n in names)
    hosts = cfg.get("hosts")          # the machines (what shm can reach); default: the nodes
    if hosts is None:
        hosts = tuple(str(members[r].get("machine")) for r in range(size))
    bind = os.environ.get("MINICOMM_BIND") or os.environ.get("MINICOMM_SOCKET_IFNAME_ADDR")
    bind_host = bind or _peer_bind(addr, store)
    switch_process = t = link = None
    try:
        if want_switch and rank == 0:     # started first: its start overlaps the ranks' links
            switch_process = switch.start(cfg, topology, hosts, bind_host, _left(deadline))
        t = connect(kind, rank, size, store, cfg["job_id"], token, tuple(topology),
                    _left(deadline), bind_host=bind_host, host_of_rank=tuple(hosts))
        if want_switch:
            link = switch.connect_link(cfg, store, topology, hosts, bind_host, deadline,
                                       switch_process)
    except BaseException:
        if t is not None:
            t.close()
        switch.stop(switch_process)
        store.close()
        _close_server(server, deadline)
        raise
    t = fault.wrap(t, rank)      # MINICOMM_FAULT: t itself unless set (then no per-message cost)
    intra, inter = link_names(kind, len(set(topology)) > 1)
    comm = Communicator(t, rank, size, topology=topology, timeout=timeout,
                        link_model=LinkModel.for_transports(intra, inter, spin=SPIN_S))
    comm._store, comm._store_server = store, server
    comm._switch = link
    _agree_links(comm, t, intra, inter)
    if comm.debug_info and comm.caps.describe is not None:
        comm._log(f"transports: {comm.caps.describe()}")
    return comm


def _wait_world(store: Any, server: Optional[StoreServer], rank: int, size: int,
                setup_timeout: float, deadline: float) -> Dict[int, dict]:
    """Every rank's join record, once all ``size`` ranks have joined within the setup deadline.
    On a failure the store is closed (and the one this rank serves); a timeout names the
    missing ranks."""
    try:
        return store.wait_world(_left(deadline))
    except CommTimeout as e:
        store.close()
        _close_server(server, deadline)
        msg = (f"rank {rank}: {len(e.arrived)} of {size} ranks arrived within {setup_timeout:g}s "
               f"(the setup timeout, MINICOMM_SETUP_TIMEOUT); missing ranks "
               f"{rank_ranges(e.missing)}. Did every rank start, with the same world size?")
        err = CommTimeout(msg)
        err.arrived, err.missing = e.arrived, e.missing
        raise err from None
    except BaseException:
        store.close()
        _close_server(server, deadline)
        raise


def _agree_links(comm: Communicator, t: Any, intra: str, inter: str) -> None:
    """Give the new world its agreed link model (the installed hook; none: the defaults). A
    rank that fails here aborts its transport and closes the communicator before raising."""
    try:
        # rank 0's links (probed or cached) and tuned table, so auto agrees on every rank:
        # docs/decisions/link-tuning-probes.md
        if _link_agreement is not None:
            with comm._setup_calls():     # setup's calls: errors number the user's from 1
                comm.link_model = _link_agreement(comm, intra, inter)
    except BaseException as e:
        # a failing rank is not a finished one: peers must hear of a failure (abort), not the
        # orderly goodbye close() alone sends (they reported "it finished")
        try:
            t.abort(f"{type(e).__name__}: {e}")
        finally:
            comm.close()
        raise


def _peer_bind(store_addr: str, store: Any) -> str:
    """Where this rank's tcp listeners bind: loopback for a loopback job, else the interface
    this host reaches the store through (the address it advertises), never every interface."""
    if store_addr in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1" if store_addr != "::1" else "::1"
    try:
        return store.local_address()
    except (AttributeError, OSError, NotImplementedError):
        return "0.0.0.0"


def _close_server(server: Optional[StoreServer], deadline: float) -> None:
    """Close the store this rank hosts on a failed setup. A poisoned store (two processes
    claimed one rank, or conflicting writes) is first kept up until every connected member has
    been sent the verdict, within the setup deadline: this rank read it first, and leaving at
    once would give the others a lost store instead of the conflict (StoreServer.close)."""
    if server is not None:
        server.close(linger=max(_left(deadline), _MIN_LINGER))


# a verdict reached at the very end of the setup deadline still gets this long to be delivered
_MIN_LINGER = 1.0


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _port_hint(cfg: Dict[str, Any]) -> str:
    src = cfg.get("port_from")
    return f"port {cfg['master_port']}" + (f" ({src})" if src else "")


def _host_store(cfg: Dict[str, Any], token: bytes, identity: str,
                deadline: float) -> StoreServer:
    """Serve the job's store on the agreed port. If the port is taken, say by whom — and when the
    holder is a look-alike job (same identity, same token), join it as rank 0 so that it stops
    too instead of mixing with our ranks (see rendezvous.py, "Membership")."""
    port = cfg["master_port"]
    for _ in range(20):
        try:
            # only where the ranks come from: the store's own address, never every interface
            return StoreServer(cfg.get("store_bind") or _store_host(cfg), port, token,
                               job=(identity, cfg["size"]))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise RendezvousError(f"rank {cfg['rank']} cannot serve the rendezvous store on "
                                      f"{_port_hint(cfg)}: {e}") from None
        if _listening("127.0.0.1", port) or _left(deadline) <= 0:
            break
        # Nobody listens there, yet the port is taken: a connection holds it for a moment (a
        # peer's connect that met itself, or one in TIME_WAIT without SO_REUSEADDR). Try again.
        time.sleep(0.05)
    holder = "by another program"
    try:
        with StoreClient("127.0.0.1", port, token, timeout=min(5.0, max(0.5, _left(deadline))))                 as probe:
            probe.join(identity, cfg["size"], cfg["rank"], node=str(cfg.get("node")),
                       machine=str(cfg.get("host", cfg.get("node"))))
            holder = "by another minicomm job that looks exactly like this one"
    except AuthError:
        holder = "by another job (its rendezvous store refused this job's token)"
    except RendezvousError as e:
        holder = f"by another minicomm job ({e})"
    except CommError:
        holder = "by another program (it does not answer minicomm's protocol)"
    raise RendezvousError(
        f"rank {cfg['rank']}: {_port_hint(cfg)} is already in use {holder}. Two jobs cannot "
        f"share a rendezvous port: this job stops here; give it its own MASTER_PORT") from None


def _store_host(cfg: Dict[str, Any]) -> str:
    addr = str(cfg.get("master_addr") or "127.0.0.1")
    return "127.0.0.1" if addr == "localhost" else addr


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0) as s:
            return s.getsockname() != s.getpeername()
    except OSError:
        return False


def _join(cfg: Dict[str, Any], token: bytes, identity: str, deadline: float) -> StoreClient:
    """Reach the job's store and join it as this rank, within the setup deadline."""
    rank, addr = cfg["rank"], cfg["master_addr"]
    where = f"the rendezvous store at {addr}:{cfg['master_port']}"
    try:
        store = StoreClient(addr, cfg["master_port"], token, timeout=max(0.0, _left(deadline)))
    except AuthError:
        raise RendezvousError(
            f"rank {rank}: {where} ({_port_hint(cfg)}) belongs to another job: it refused this "
            f"job's token. Two jobs cannot share a rendezvous port: give this one its own "
            f"MASTER_PORT") from None
    except CommTimeout:
        raise CommTimeout(f"rank {rank}: {where} did not answer within the setup timeout "
                          f"({cfg.get('setup_timeout') or 'MINICOMM_TIMEOUT'} s): the rank that "
                          f"serves it (rank 0) has not started or is unreachable") from None
    try:
        store.join(identity, cfg["size"], rank, node=str(cfg.get("node")),
                   machine=str(cfg.get("host", cfg.get("node"))))
    except BaseException:
        store.close()
        raise
    return store
