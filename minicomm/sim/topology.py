"""Cluster topology model: servers of g accelerators, their intra-server fabric, NICs and a fat-tree.

A ``Topology`` is pure data (frozen, hashable); ``Fabric`` turns it into directed links (capacity in
bytes/s, latency in s) and routes messages between accelerators ("endpoints", numbered
``server * g + local``) onto them, vectorised over arrays of (src, dst) pairs.

What is modelled
- intra-server, ``intra``:
    "nvswitch": every accelerator has one up and one down link to a non-blocking crossbar (NVLink +
      NVSwitch); a message crosses its sender's up link and its receiver's down link.
    "pcie": every accelerator has a PCIe up/down link to the CPU root complex; peer-to-peer traffic
      also crosses the root, one shared link of ``pcie_root_bandwidth`` per server (None: no limit).
      Traffic to the NIC crosses the same PCIe links (the accelerator has no other way out).
    "fullmesh": a direct link between every ordered pair of the server's accelerators, each with
      ``intra_link.bandwidth / (g - 1)`` (the accelerator's bandwidth is split over its g-1 ports:
      UB-Mesh-style). Only direct paths are used (no multi-path routing).
    "fullmesh" with ``mesh_dims`` (d_0, ..., d_{k-1}), product g: an n-D full mesh, the
      hierarchically localised shape of UB-Mesh (Liao et al., arXiv 2503.20377) inside a mesh
      unit (a "server": a rack, a pod). Local index l has coordinates c_i = (l // s_i) % d_i,
      s_0 = 1, s_i = d_0 ... d_{i-1} (dimension 0 varies fastest: the NPUs of a board). Two
      accelerators are joined by a direct link, one per direction, when they differ in exactly
      one coordinate, so an accelerator has d_i - 1 neighbours in dimension i. Its bandwidth
      in dimension i, ``mesh_dim_bandwidth[i]`` (default: ``intra_link.bandwidth`` shared over
      all its sum(d_i - 1) ports, the same lanes per port in every dimension, as the paper's
      rack does), is split evenly over those d_i - 1 ports. A message between accelerators that
      differ in several coordinates is routed dimension-order (dimension 0 first) over the
      intermediate accelerators' links (the paper's NPUs route; its All-Path Routing, which also
      spreads such a message over the other paths, is not modelled), and pays ``switch_latency``
      per intermediate accelerator. mesh_dims = (g,) is the plain "fullmesh". Traffic to the NIC
      leaves the accelerator directly (no mesh link), as on the other kinds; the Clos above the
      mesh unit is the NIC / leaf / spine model below.
  ``intra_link.bandwidth`` is always one accelerator's total per direction.
- in-network reduction: ``nvls_bandwidth`` > 0 (nvswitch only): the NVSwitch reduces and
    multicasts (NVLink SHARP) for the ``innet`` family, whose switch participants are the
    server's NVSwitch (endpoint ids ``endpoints + server``); a message between an accelerator
    and it crosses the accelerator's NVSwitch link and its NVLS port, of that bandwidth.
- in-network reduction across servers: ``sharp`` (NVIDIA SHARP through NCCL's CollNet): the leaf,
    spine and core switches reduce and multicast too. The ``innet`` tree then has the fabric's
    shape (the simulator's engine builds it so): a switch participant per server, then one per
    leaf group (endpoint ids from ``Fabric.leaf_switch0``), per pod's spine (``spine_switch0``;
    tiers 2: the one spine) and the core (``core_switch``). An accelerator reaches its server's
    switch over NVLS (above), or, without NVLS, over its own link out and in (the GPUs reduce
    inside the server as NCCL's CollNet chain does: each moves the vector out and in, in both
    the reduce and the broadcast phase); alone on its server it reaches its NIC directly. A
    message between switches runs on one lane per NIC (the engine cuts it into
    ``nics_per_server`` equal parts): lane k leaves the server on NIC k, crosses ``sharp_up``
    (a switch port's reduction rate ``sharp_port_bandwidth``; 0: only the NIC bounds it) and,
    rails or not, the leaf trunk NIC k's traffic crosses; then the pod trunk. Latency: the NIC's
    plus a switch's between a server and its leaf, a switch's between switches, and
    ``sharp_latency`` more on every hop into a reducing switch; a switch multicasts down with no
    issue gap. ``sharp_max_bytes``: the payload of one SHARP operation; a larger message into
    the network is several, paced by the slower of the NIC's gap and ``sharp_latency``
    (engine.py, ``_sharp_program``). Not with "fullmesh" servers (no per-accelerator links).
- NICs: ``nics_per_server`` NICs; accelerator i uses NIC ``i * nics_per_server // g`` (so
  nics_per_server == g is one NIC per accelerator, 1 is one NIC per server, shared). ``rails``:
  rail-optimised wiring (NIC k of every server in a leaf group goes to leaf switch k of that group;
  traffic between different rails crosses the spine), else all NICs of a server share its leaf.
- network, ``tiers``: 1 = one non-blocking switch (contention only at NICs); 2 = leaves of
  ``servers_per_leaf`` servers and a spine; 3 = leaves grouped into pods of ``leaves_per_pod``
  server groups, pods joined by a core. A leaf's uplink (to the spine) is modelled as one trunk per
  direction of capacity (NIC bandwidth under the leaf) / ``oversubscription``; a pod's uplink to the
  core likewise with ``core_oversubscription``. Trunks assume ideal ECMP / adaptive routing (load
  spread evenly over the parallel uplinks).
- issue gap: a sender issues the messages it starts at once one ``gap`` apart (LogP's g: a NIC
  or copy engine posts one message at a time), that of their first link class; they start
  together when the last one is issued.
- latency: a message pays the latency of its first link class (``intra_link.latency`` inside a
  server; ``nic_link.latency`` between servers) plus ``switch_latency`` per switch it crosses in
  the network (1, 3 or 5). That sum is the α of the message.
- protocols: ``protocols = "nccl"`` prices every message with NCCL's LL / LL128 / Simple
  (protocols.py: a latency per hop, link class and protocol instead of the link's one α, the
  protocol's bandwidth overhead, the protocol switch by size, a launch latency per call).
- protocol: ``rendezvous`` (default) — a message moves once its receiver has posted the receive
  (NCCL's credits, MPI's large-message protocol); False: eager, as soon as it is sent.
- compute: ``gamma`` s per reduced byte, ``delta`` s per copied byte on an accelerator;
  ``reduce_overlap``: a reducing receive's reduction runs while its data arrives (GPU kernels, as
  NCCL does) instead of after it, and a copy that only stages that reduction's local operand
  (into the receive's region, in its step: ring's reduce-scatter) is part of the same kernel,
  which reads the local input itself, so it costs nothing of its own.

Restrictions: every server is alike; links are full duplex (independent directions); no
congestion control dynamics, no packet loss; without ``protocols``, no protocol switching (one
per-message α and an effective bandwidth per link class stand in for it).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

GB = 1e9          # bandwidths are in bytes/s; GB/s = 1e9 bytes/s (nccl-tests convention)
US = 1e-6

INTRA_KINDS = ("nvswitch", "pcie", "fullmesh")


@dataclass(frozen=True)
class LinkSpec:
    """One link class. ``bandwidth`` (bytes/s per direction) is the effective rate the model uses;
    ``line_rate`` the nominal one (informational); ``source`` where the figures come from;
    ``illustrative`` marks figures that are assumptions rather than published measurements."""
    name: str
    bandwidth: float
    latency: float
    line_rate: float = 0.0
    source: str = ""
    illustrative: bool = False
    gap: float = 0.0          # s between two messages one sender issues on it (LogP's g)

    def __post_init__(self):
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"link {self.name!r}: bandwidth must be a positive number")
        for f in ("latency", "gap"):
            v = getattr(self, f)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"link {self.name!r}: {f} must be >= 0")


@dataclass(frozen=True)
class Topology:
    name: str
    servers: int
    gpus_per_server: int
    intra: str
    intra_link: LinkSpec
    nic_link: LinkSpec
    nics_per_server: int = 1
    rails: bool = False
    tiers: int = 1
    servers_per_leaf: int = 0          # 0: every server under one leaf
    leaves_per_pod: int = 0            # server groups (of servers_per_leaf) per pod; 0: one pod
    oversubscription: float = 1.0
    core_oversubscription: float = 1.0
    switch_latency: float = 0.0
    pcie_root_bandwidth: Optional[float] = None
    nvls_bandwidth: float = 0.0        # NVLink SHARP per accelerator port, bytes/s (0: none)
    sharp: bool = False                # the network's switches reduce and multicast (SHARP)
    sharp_port_bandwidth: float = 0.0  # reduction rate of a switch port (one NIC's), bytes/s
    sharp_max_bytes: int = 0           # payload of one SHARP operation (0: no limit)
    sharp_latency: float = 0.0         # s a reducing switch adds to a hop into it
    gamma: float = 0.0
    delta: float = 0.0
    reduce_overlap: bool = False
    rendezvous: bool = True
    protocols: str = ""                # "nccl": NCCL's LL / LL128 / Simple (protocols.py)
    description: str = ""
    sources: Tuple[str, ...] = field(default=(), compare=False)
    mesh_dims: Tuple[int, ...] = ()    # fullmesh: the n-D full mesh's dimensions (): (g,)
    mesh_dim_bandwidth: Tuple[float, ...] = ()   # per accelerator and dimension, bytes/s

    def __post_init__(self):
        def positive_int(name):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"topology {self.name!r}: {name} must be an integer >= 1, got {v!r}")
        for f in ("servers", "gpus_per_server", "nics_per_server", "tiers"):
            positive_int(f)
        if self.intra not in INTRA_KINDS:
            raise ValueError(f"topology {self.name!r}: intra must be one of {INTRA_KINDS}, "
                             f"got {self.intra!r}")
        if self.nics_per_server > self.gpus_per_server:
            raise ValueError(f"topology {self.name!r}: more NICs than accelerators per server")
        if self.tiers > 3:
            raise ValueError(f"topology {self.name!r}: tiers must be 1, 2 or 3")
        for f in ("servers_per_leaf", "leaves_per_pod"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"topology {self.name!r}: {f} must be an integer >= 0")
        for f in ("oversubscription", "core_oversubscription"):
            v = getattr(self, f)
            if not (v >= 1.0 and math.isfinite(v)):
                raise ValueError(f"topology {self.name!r}: {f} must be >= 1 (downlink:uplink), "
                                 f"got {v!r}")
        for f in ("switch_latency", "gamma", "delta", "nvls_bandwidth", "sharp_port_bandwidth",
                  "sharp_latency"):
            v = getattr(self, f)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"topology {self.name!r}: {f} must be >= 0")
        _check_sharp(self)
        if self.nvls_bandwidth and self.intra != "nvswitch":
            raise ValueError(f"topology {self.name!r}: nvls_GBps needs intra kind 'nvswitch' "
                             f"(NVLink SHARP is the NVSwitch's)")
        if self.protocols not in ("", "nccl"):
            raise ValueError(f"topology {self.name!r}: protocols must be 'nccl' or '' (one "
                             f"latency per link class), got {self.protocols!r}")
        if self.pcie_root_bandwidth is not None and not self.pcie_root_bandwidth > 0:
            raise ValueError(f"topology {self.name!r}: pcie_root_bandwidth must be > 0 or None")
        if self.mesh_dims or self.mesh_dim_bandwidth:
            _check_mesh(self)

    # ------------------------------------------------------------------ derived shape
    @property
    def endpoints(self) -> int:
        return self.servers * self.gpus_per_server

    @property
    def mesh_shape(self) -> Tuple[int, ...]:
        """The full-mesh dimensions of a server ("mesh unit"): ``mesh_dims``, else (g,), one
        dimension, which is also how the mesh algorithm treats a server of another kind."""
        return tuple(self.mesh_dims) or (self.gpus_per_server,)

    def mesh_port_bandwidth(self) -> Tuple[float, ...]:
        """Bytes/s of one direct link in each dimension (module doc: an accelerator's bandwidth
        in a dimension split evenly over its d_i - 1 ports)."""
        dims = self.mesh_shape
        if self.mesh_dim_bandwidth:
            return tuple(bw / max(1, d - 1) for bw, d in zip(self.mesh_dim_bandwidth, dims))
        return (self.intra_link.bandwidth / max(1, sum(d - 1 for d in dims)),) * len(dims)

    @property
    def channels(self) -> int:
        """A ring's default channel count: one per NIC of a server (NCCL's rings per NIC)."""
        return self.nics_per_server

    @property
    def leaf_servers(self) -> int:
        """Servers per leaf group (all of them when not set or one tier)."""
        if self.tiers == 1 or self.servers_per_leaf <= 0:
            return self.servers
        return min(self.servers_per_leaf, self.servers)

    @property
    def groups(self) -> int:
        return -(-self.servers // self.leaf_servers)

    @property
    def pod_groups(self) -> int:
        if self.tiers < 3 or self.leaves_per_pod <= 0:
            return self.groups
        return min(self.leaves_per_pod, self.groups)

    def with_servers(self, servers: int) -> "Topology":
        return dataclasses.replace(self, servers=int(servers))

    def replace(self, **kw) -> "Topology":
        return dataclasses.replace(self, **kw)

    def node_map(self, placement: Optional[Sequence[int]] = None, ranks: Optional[int] = None
                 ) -> Tuple[int, ...]:
        """Server of every rank (the ``topology`` tuple the hier family takes)."""
        pl = default_placement(self, ranks) if placement is None else np.asarray(placement)
        return tuple(int(e) // self.gpus_per_server for e in pl)

    def describe(self) -> str:
        g = self.gpus_per_server
        nic = (f"{self.nics_per_server} x {self.nic_link.name} per server"
               f"{' (rail-optimised)' if self.rails and self.nics_per_server > 1 else ''}")
        net = ("one switch" if self.tiers == 1 else (
            f"{self.tiers}-tier fat-tree, {self.leaf_servers} servers per leaf"
            + (f", {self.pod_groups} leaf groups per pod" if self.tiers == 3 else "")
            + f", oversubscription {self.oversubscription:g}:1"
            + (f" (core {self.core_oversubscription:g}:1)" if self.tiers == 3 else ""))
            + ("; the switches reduce (SHARP)" if self.sharp else ""))
        intra = (f"{'x'.join(map(str, self.mesh_dims))} {self.intra}" if self.mesh_dims
                 else self.intra)
        return (f"{self.name}: {self.servers} servers x {g} accelerators ({self.endpoints}); intra "
                f"{intra} {self.intra_link.name} {self.intra_link.bandwidth / GB:g} GB/s; "
                f"{nic} {self.nic_link.bandwidth / GB:g} GB/s each; {net}")


MAX_MESH_DIMS = 8        # a dimension-order route inside a mesh unit must fit Fabric.MAX_HOPS


def _check_mesh(t: Topology) -> None:
    """``Topology.mesh_dims`` / ``mesh_dim_bandwidth``: a ValueError that says what is wrong."""
    dims, where = t.mesh_dims, f"topology {t.name!r}: mesh_dims"
    if t.intra != "fullmesh":
        raise ValueError(f"{where} needs intra kind 'fullmesh', not {t.intra!r}")
    if not isinstance(dims, tuple) or not 1 <= len(dims) <= MAX_MESH_DIMS:
        raise ValueError(f"{where} must be a list of 1 to {MAX_MESH_DIMS} dimension sizes, "
                         f"got {dims!r}")
    for d in dims:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 2:
            raise ValueError(f"{where} {list(dims)}: every dimension is an integer >= 2 (a full "
                             f"mesh of one accelerator has no links), got {d!r}")
    if math.prod(dims) != t.gpus_per_server:
        raise ValueError(f"{where} {list(dims)} hold {math.prod(dims)} accelerators, but a "
                         f"server (mesh unit) has gpus_per_server = {t.gpus_per_server}")
    bws = t.mesh_dim_bandwidth
    if bws and (len(bws) != len(dims)
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0
                            and math.isfinite(b) for b in bws)):
        raise ValueError(f"topology {t.name!r}: mesh_dim_bandwidth needs one positive number "
                         f"per dimension of mesh_dims {list(dims)}, got {list(bws)}")


def _check_sharp(t: Topology) -> None:
    """``Topology.sharp`` and its figures: a ValueError that says what is wrong."""
    m = t.sharp_max_bytes
    if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 0:
        raise ValueError(f"topology {t.name!r}: sharp_max_bytes must be an integer >= 0 (0: no "
                         f"limit), got {m!r}")
    if not isinstance(t.sharp, (bool, np.bool_)):
        raise ValueError(f"topology {t.name!r}: sharp must be true or false, got {t.sharp!r}")
    if t.sharp and t.intra == "fullmesh":
        # the GPUs' reduction inside a server is priced on per-accelerator links, which a full
        # mesh does not have
        raise ValueError(f"topology {t.name!r}: sharp with intra kind 'fullmesh' is not "
                         f"modelled (SHARP needs 'nvswitch' or 'pcie' servers)")


def default_placement(topo: Topology, ranks: Optional[int] = None) -> np.ndarray:
    """Ranks fill servers in order: rank r on endpoint r (server r // g, local index r % g)."""
    n = topo.endpoints if ranks is None else int(ranks)
    if n > topo.endpoints:
        raise ValueError(f"{n} ranks do not fit on {topo.name} ({topo.endpoints} accelerators)")
    return np.arange(n, dtype=np.int64)


class Fabric:
    """The directed links of a topology and the route of every (src, dst) endpoint pair.

    Link ids, in blocks: accelerator out / in (intra, or PCIe), PCIe roots, full-mesh pair links,
    NIC out / in, leaf up / down trunks, pod up / down trunks, and one local-copy link per
    endpoint (a message to oneself is a memcpy at 1/delta)."""

    MAX_HOPS = 9

    def __init__(self, topo: Topology):
        self.topo = t = topo
        g, S, E = t.gpus_per_server, t.servers, t.endpoints
        nps = t.nics_per_server
        caps: List[np.ndarray] = []
        names: List[str] = []
        kinds: List[np.ndarray] = []
        self._base: Dict[str, int] = {}

        def block(kind: str, n: int, cap: float, label) -> None:
            self._base[kind] = sum(len(c) for c in caps)
            caps.append(np.full(n, float(cap)))
            names.extend(label(i) for i in range(n)) if n <= 200_000 else None
            kinds.append(np.full(n, len(self._base) - 1))

        intra_bw = t.intra_link.bandwidth
        if t.intra in ("nvswitch", "pcie"):
            block("acc_out", E, intra_bw, lambda i: f"{t.intra} out of acc {i}")
            block("acc_in", E, intra_bw, lambda i: f"{t.intra} into acc {i}")
        if t.intra == "pcie":
            root = t.pcie_root_bandwidth if t.pcie_root_bandwidth else math.inf
            block("root", S, root, lambda i: f"PCIe root of server {i}")
        if t.intra == "fullmesh" and not t.mesh_dims:
            per = intra_bw / max(1, g - 1)
            block("pair", S * g * g, per,
                  lambda i: f"mesh link {i // (g * g)}:{i % (g * g) // g}->{i % g}")
        elif t.intra == "fullmesh":
            # one block per dimension: link (server, accelerator, coordinate x) leads to the
            # accelerator that has x in that dimension (x = its own coordinate is never used)
            for dim, (d, per) in enumerate(zip(t.mesh_dims, t.mesh_port_bandwidth())):
                block(f"mesh{dim}", S * g * d, per,
                      lambda i, d=d, dim=dim: f"mesh link {i // (g * d)}:{i % (g * d) // d} "
                                              f"dim {dim} -> {i % d}")
        if t.nvls_bandwidth:
            block("nvls_up", E, t.nvls_bandwidth, lambda i: f"NVLS port of acc {i}, up")
            block("nvls_down", E, t.nvls_bandwidth, lambda i: f"NVLS port of acc {i}, down")
        nic_bw = t.nic_link.bandwidth
        block("nic_out", S * nps, nic_bw, lambda i: f"NIC {i // nps}.{i % nps} out")
        block("nic_in", S * nps, nic_bw, lambda i: f"NIC {i // nps}.{i % nps} in")
        if t.sharp and t.sharp_port_bandwidth:
            block("sharp_up", S * nps, t.sharp_port_bandwidth,
                  lambda i: f"SHARP port of NIC {i // nps}.{i % nps}, up")
            block("sharp_down", S * nps, t.sharp_port_bandwidth,
                  lambda i: f"SHARP port of NIC {i // nps}.{i % nps}, down")
        self.nics_per_leaf = t.leaf_servers * (1 if t.rails else nps)
        self.leaves = t.groups * (nps if t.rails else 1)
        leaf_cap = self.nics_per_leaf * nic_bw / t.oversubscription
        if t.tiers >= 2:
            block("leaf_up", self.leaves, leaf_cap, lambda i: f"leaf {i} uplink")
            block("leaf_down", self.leaves, leaf_cap, lambda i: f"leaf {i} downlink")
        self.leaves_per_pod = t.pod_groups * (nps if t.rails else 1)
        self.pods = -(-t.groups // t.pod_groups)
        if t.tiers >= 3:
            pod_cap = self.leaves_per_pod * leaf_cap / t.core_oversubscription
            block("pod_up", self.pods, pod_cap, lambda i: f"pod {i} uplink")
            block("pod_down", self.pods, pod_cap, lambda i: f"pod {i} downlink")
        local = 1.0 / t.delta if t.delta > 0 else math.inf
        block("local", E, local, lambda i: f"local copy on acc {i}")
        self.capacity = np.concatenate(caps)
        self._names = names if len(names) == len(self.capacity) else None
        self.kind_of = np.concatenate(kinds)
        self.kinds = list(self._base)
        # switch participants' ids (innet): the servers' switches from ``endpoints``, then
        # (SHARP) a leaf switch per leaf group, a spine per pod (tiers 2: the one spine), the core
        self.leaf_switch0 = E + S
        self.spine_switch0 = self.leaf_switch0 + t.groups
        self.core_switch = self.spine_switch0 + self.pods

    def __len__(self) -> int:
        return len(self.capacity)

    def name(self, link: int) -> str:
        if self._names is not None:
            return self._names[link]
        kind = self.kinds[int(self.kind_of[link])]
        return f"{kind} {link - self._base[kind]}"

    def routes(self, src: np.ndarray, dst: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(links, latency): links is (F, MAX_HOPS) of link ids padded with -1; latency (F,) s."""
        links, lat, _ = self.routes_gaps(src, dst)
        return links, lat

    @property
    def endpoint_ids(self) -> int:
        """Ids a placement may use: the accelerators, then (with NVLS) each server's NVSwitch,
        and (with SHARP) every server's switch and the network's switches."""
        t = self.topo
        if t.sharp:
            return self.core_switch + 1
        return t.endpoints + (t.servers if t.nvls_bandwidth else 0)

    def routes_gaps(self, src: np.ndarray, dst: np.ndarray, lane: Optional[np.ndarray] = None
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """routes() and the issue gap of each (that of its first link class; 0 to oneself).
        An id from ``endpoints`` on is a switch participant (module doc: NVLS, SHARP); ``lane``:
        the NIC a message between switches takes (default 0)."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        E = self.topo.endpoints
        switch = (src >= E) | (dst >= E)
        if not switch.any():
            return self._accelerator_routes(src, dst)
        links = np.full((len(src), self.MAX_HOPS), -1, dtype=np.int64)
        lat, gap = np.zeros(len(src)), np.zeros(len(src))
        real = ~switch
        if real.any():
            links[real], lat[real], gap[real] = self._accelerator_routes(src[real], dst[real])
        lane = np.zeros(len(src), np.int64) if lane is None else np.asarray(lane, np.int64)
        self._switch_routes(switch, src, dst, lane, links, lat, gap)
        return links, lat, gap

    def _switch_level(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(level, index) of ids: 0 an accelerator, 1 a server's switch, 2 a leaf group's,
        3 a spine, 4 the core (the last three only with SHARP)."""
        E = self.topo.endpoints
        starts = [0, E] + ([self.leaf_switch0, self.spine_switch0, self.core_switch]
                           if self.topo.sharp else [])
        level = np.searchsorted(np.asarray(starts), ids, side="right") - 1
        return level, ids - np.asarray(starts)[level]

    def _switch_routes(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray,
                       lane: np.ndarray, links: np.ndarray, lat: np.ndarray,
                       gap: np.ndarray) -> None:
        """Fill ``rows`` (messages to or from a switch participant) of links / lat / gap."""
        t, b = self.topo, self._base
        g, nps = t.gpus_per_server, t.nics_per_server
        col = np.zeros(len(src), dtype=np.int64)

        def put(mask, ids):
            rows_ = np.nonzero(mask)[0]
            if rows_.size:
                links[rows_, col[rows_]] = ids[rows_]
                col[rows_] += 1

        ls, xs = self._switch_level(src)
        ld, xd = self._switch_level(dst)
        up = rows & (ls == 0) & (ld == 1)           # accelerator -> its server's switch
        down = rows & (ls == 1) & (ld == 0)
        acc = np.where(up, src, dst)
        if t.nvls_bandwidth:
            put(up, b["acc_out"] + acc)
            put(up, b["nvls_up"] + acc)
            put(down, b["nvls_down"] + acc)
            put(down, b["acc_in"] + acc)
        elif g > 1:
            # the GPUs reduce and broadcast inside the server themselves (CollNet's chain):
            # each moves the vector out and in over its own link, in both phases
            for m in (up, down):
                put(m, b["acc_out"] + acc)
                if t.intra == "pcie" and t.pcie_root_bandwidth:
                    put(m, b["root"] + acc // g)
                put(m, b["acc_in"] + acc)
        if t.nvls_bandwidth or g > 1:
            lat[up | down], gap[up | down] = t.intra_link.latency, t.intra_link.gap
        sw, agg = t.switch_latency, t.sharp_latency
        # a server's switch and its leaf group's, on lane k: NIC k and its SHARP port
        s_up = rows & (ls == 1) & (ld == 2)
        s_down = rows & (ls == 2) & (ld == 1)
        nic = np.where(s_up, xs, xd) * nps + lane
        put(s_up, b["nic_out"] + nic)
        put(s_down, b["nic_in"] + nic)
        if "sharp_up" in b:
            put(s_up, b["sharp_up"] + nic)
            put(s_down, b["sharp_down"] + nic)
        lat[s_up] = t.nic_link.latency + sw + agg
        lat[s_down] = t.nic_link.latency + sw
        gap[s_up] = t.nic_link.gap          # a switch multicasts down: no issue gap
        # a leaf group's switch and its spine: the trunk lane k crosses (rails: leaf k's)
        l_up = rows & (ls == 2) & (ld == 3)
        l_down = rows & (ls == 3) & (ld == 2)
        group = np.where(l_up, xs, xd)
        trunk = group * nps + lane if t.rails else group
        if t.tiers >= 2:
            put(l_up, b["leaf_up"] + trunk)
            put(l_down, b["leaf_down"] + trunk)
        # a pod's spine and the core
        p_up = rows & (ls == 3) & (ld == 4)
        p_down = rows & (ls == 4) & (ld == 3)
        if t.tiers >= 3:
            put(p_up, b["pod_up"] + np.where(p_up, xs, xd))
            put(p_down, b["pod_down"] + np.where(p_up, xs, xd))
        lat[l_up | p_up] = sw + agg
        lat[l_down | p_down] = sw
        routed = up | down | s_up | s_down | l_up | l_down | p_up | p_down
        stray = rows & ~routed & (src != dst) & ((ls != 1) | (ld != 1))
        if stray.any():
            i = int(np.nonzero(stray)[0][0])
            raise ValueError(f"no route between endpoint ids {int(src[i])} and {int(dst[i])}: "
                             f"a switch participant talks to its own server's accelerators and "
                             f"its parent or children in the fabric only")
        # between two servers' switches placed on one NVSwitch (NVLS, one server): no links

    def _accelerator_routes(self, src: np.ndarray, dst: np.ndarray
                            ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        t = self.topo
        g, nps = t.gpus_per_server, t.nics_per_server
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        F = len(src)
        links = np.full((F, self.MAX_HOPS), -1, dtype=np.int64)
        lat = np.zeros(F)
        sa, sb = src // g, dst // g
        ia, ib = src % g, dst % g
        self_msg = src == dst
        same = (sa == sb) & ~self_msg
        cross = sa != sb
        b = self._base
        col = np.zeros(F, dtype=np.int64)      # next free hop column per flow

        def put(mask, ids):
            if not mask.any():
                return
            rows = np.nonzero(mask)[0]
            links[rows, col[rows]] = ids[rows] if isinstance(ids, np.ndarray) else ids
            col[rows] += 1

        put(self_msg, b["local"] + src)
        # inside a server
        if t.intra in ("nvswitch", "pcie"):
            put(same, b["acc_out"] + src)
            if t.intra == "pcie" and t.pcie_root_bandwidth:
                put(same, b["root"] + sa)
            put(same, b["acc_in"] + dst)
        elif not t.mesh_dims:
            put(same, b["pair"] + sa * g * g + ia * g + ib)
        else:
            lat[same] = self._mesh_route(same, sa, ia, ib, put)
        lat[same] += t.intra_link.latency
        gap = np.zeros(F)
        gap[same] = t.intra_link.gap
        # between servers
        if cross.any():
            if t.intra == "pcie":
                put(cross, b["acc_out"] + src)
                if t.pcie_root_bandwidth:
                    put(cross, b["root"] + sa)
            ka, kb = ia * nps // g, ib * nps // g
            na, nb = sa * nps + ka, sb * nps + kb
            put(cross, b["nic_out"] + na)
            hops = np.ones(F)
            if t.tiers >= 2:
                ga, gb = sa // t.leaf_servers, sb // t.leaf_servers
                la = ga * nps + ka if t.rails else ga
                lb = gb * nps + kb if t.rails else gb
                up = cross & (la != lb)
                put(up, b["leaf_up"] + la)
                hops[up] = 3
                if t.tiers >= 3:
                    qa, qb = ga // t.pod_groups, gb // t.pod_groups
                    core = up & (qa != qb)
                    put(core, b["pod_up"] + qa)
                    put(core, b["pod_down"] + qb)
                    hops[core] = 5
                put(up, b["leaf_down"] + lb)
            put(cross, b["nic_in"] + nb)
            if t.intra == "pcie":
                if t.pcie_root_bandwidth:
                    put(cross, b["root"] + sb)
                put(cross, b["acc_in"] + dst)
            lat[cross] = t.nic_link.latency + hops[cross] * t.switch_latency
            gap[cross] = t.nic_link.gap
        return links, lat, gap

    def _mesh_route(self, same: np.ndarray, sa: np.ndarray, ia: np.ndarray, ib: np.ndarray,
                    put) -> np.ndarray:
        """Dimension-order hops inside a mesh unit (module doc); returns the extra latency of
        each flow of ``same``: ``switch_latency`` per intermediate accelerator."""
        t = self.topo
        g = t.gpus_per_server
        cur = ia.copy()
        hops = np.zeros(len(ia))
        stride = 1
        for dim, d in enumerate(t.mesh_dims):
            ca, cb = cur // stride % d, ib // stride % d
            move = same & (ca != cb)
            put(move, self._base[f"mesh{dim}"] + (sa * g + cur) * d + cb)
            hops += move
            cur = np.where(move, cur + (cb - ca) * stride, cur)
            stride *= d
        return np.maximum(hops[same] - 1, 0) * t.switch_latency


# ------------------------------------------------------------------------------ files
def _num(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{what}: expected a number, got {v!r}")
    return float(v)


def link_from_dict(d: Mapping[str, Any], name: str = "link",
                   links: Optional[Mapping[str, LinkSpec]] = None) -> LinkSpec:
    """A link from a file/preset entry: either ``{"preset": "ib-ndr-400", ...overrides}`` or
    ``{"bandwidth_GBps": 47, "latency_us": 4, "line_rate_GBps": 50, "source": "...",
    "illustrative": false}``. Overrides replace single fields of the preset."""
    if isinstance(d, str):
        d = {"preset": d}
    if not isinstance(d, Mapping):
        raise ValueError(f"{name}: expected a table/object or a link preset name, got {d!r}")
    known = {"preset", "name", "bandwidth_GBps", "latency_us", "line_rate_GBps", "source",
             "illustrative", "gap_us"}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{name}: unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
    base: Dict[str, Any] = {}
    if "preset" in d:
        links = links or {}
        if d["preset"] not in links:
            raise ValueError(f"{name}: unknown link preset {d['preset']!r}; "
                             f"known: {', '.join(sorted(links))}")
        base = dataclasses.asdict(links[d["preset"]])
    out = dict(base)
    out["name"] = str(d.get("name", base.get("name", name)))
    if "bandwidth_GBps" in d:
        out["bandwidth"] = _num(d["bandwidth_GBps"], f"{name}.bandwidth_GBps") * GB
    if "latency_us" in d:
        out["latency"] = _num(d["latency_us"], f"{name}.latency_us") * US
    if "gap_us" in d:
        out["gap"] = _num(d["gap_us"], f"{name}.gap_us") * US
    if "line_rate_GBps" in d:
        out["line_rate"] = _num(d["line_rate_GBps"], f"{name}.line_rate_GBps") * GB
    if "source" in d:
        out["source"] = str(d["source"])
    if "illustrative" in d:
        out["illustrative"] = bool(d["illustrative"])
    if "bandwidth" not in out or "latency" not in out:
        raise ValueError(f"{name}: give a preset or both bandwidth_GBps and latency_us")
    return LinkSpec(**out)


_TOP_KEYS = {"name", "base", "description", "servers", "gpus_per_server", "intra", "nic",
             "network", "compute", "sources", "protocols"}


def topology_from_dict(d: Mapping[str, Any], links: Mapping[str, LinkSpec],
                       topologies: Optional[Mapping[str, Topology]] = None) -> Topology:
    """Build a Topology from the file format (README "Simulator"); ``base`` starts from a preset."""
    if not isinstance(d, Mapping):
        raise ValueError("a topology must be a table/object")
    unknown = set(d) - _TOP_KEYS
    if unknown:
        raise ValueError(f"unknown topology keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    kw: Dict[str, Any] = {}
    if "base" in d:
        topologies = topologies or {}
        if d["base"] not in topologies:
            raise ValueError(f"unknown base topology {d['base']!r}; known: "
                             f"{', '.join(sorted(topologies))}")
        kw = {f.name: getattr(topologies[d["base"]], f.name)
              for f in dataclasses.fields(Topology)}
    kw["name"] = str(d.get("name", kw.get("name", "custom")))
    for k in ("servers", "gpus_per_server"):
        if k in d:
            kw[k] = d[k]
    if "description" in d:
        kw["description"] = str(d["description"])
    if "protocols" in d:
        kw["protocols"] = "" if d["protocols"] in (None, False, "") else str(d["protocols"])
    if "sources" in d:
        kw["sources"] = tuple(str(s) for s in d["sources"])

    def section(key: str, allowed: set) -> Mapping[str, Any]:
        sec = d.get(key, {})
        if not isinstance(sec, Mapping):
            raise ValueError(f"[{key}] must be a table/object")
        bad = set(sec) - allowed
        if bad:
            raise ValueError(f"[{key}]: unknown keys {sorted(bad)}; allowed: {sorted(allowed)}")
        return sec

    intra = section("intra", {"kind", "link", "pcie_root_GBps", "nvls_GBps", "mesh_dims",
                              "mesh_dim_GBps"})
    if "kind" in intra:
        kw["intra"] = intra["kind"]
    _mesh_keys(intra, kw)
    if "link" in intra:
        kw["intra_link"] = link_from_dict(intra["link"], "intra.link", links)
    if "nvls_GBps" in intra:
        kw["nvls_bandwidth"] = _num(intra["nvls_GBps"], "intra.nvls_GBps") * GB
    if "pcie_root_GBps" in intra:
        v = intra["pcie_root_GBps"]
        kw["pcie_root_bandwidth"] = None if v in (None, 0) else _num(v, "pcie_root_GBps") * GB
    nic = section("nic", {"per_server", "link", "rails"})
    if "per_server" in nic:
        kw["nics_per_server"] = nic["per_server"]
    if "link" in nic:
        kw["nic_link"] = link_from_dict(nic["link"], "nic.link", links)
    if "rails" in nic:
        kw["rails"] = bool(nic["rails"])
    net = section("network", {"tiers", "servers_per_leaf", "leaves_per_pod", "oversubscription",
                              "core_oversubscription", "switch_latency_us", "rendezvous",
                              "sharp", "sharp_port_GBps", "sharp_max_bytes", "sharp_latency_us"})
    _sharp_keys(net, kw)
    if "rendezvous" in net:
        kw["rendezvous"] = bool(net["rendezvous"])
    for k in ("tiers", "servers_per_leaf", "leaves_per_pod"):
        if k in net:
            kw[k] = net[k]
    for k in ("oversubscription", "core_oversubscription"):
        if k in net:
            kw[k] = _num(net[k], f"network.{k}")
    if "switch_latency_us" in net:
        kw["switch_latency"] = _num(net["switch_latency_us"], "switch_latency_us") * US
    comp = section("compute", {"reduce_GBps", "copy_GBps", "reduce_overlap"})
    if "reduce_GBps" in comp:
        v = _num(comp["reduce_GBps"], "compute.reduce_GBps")
        kw["gamma"] = 0.0 if v == 0 else 1.0 / (v * GB)
    if "copy_GBps" in comp:
        v = _num(comp["copy_GBps"], "compute.copy_GBps")
        kw["delta"] = 0.0 if v == 0 else 1.0 / (v * GB)
    if "reduce_overlap" in comp:
        kw["reduce_overlap"] = bool(comp["reduce_overlap"])
    missing = [k for k in ("servers", "gpus_per_server", "intra", "intra_link", "nic_link")
               if k not in kw]
    if missing:
        raise ValueError(f"topology {kw['name']!r} lacks {missing} (or give base = PRESET)")
    return Topology(**kw)


def _mesh_keys(intra: Mapping[str, Any], kw: Dict[str, Any]) -> None:
    """[intra] mesh_dims = [8, 8] and mesh_dim_GBps = [196, 196] (one per dimension, per
    accelerator and direction); a new kind other than fullmesh drops a base's mesh."""
    def numbers(key: str) -> list:
        v = intra[key]
        if not isinstance(v, (list, tuple)) or not v:
            raise ValueError(f"intra.{key}: expected a list with one entry per dimension, "
                             f"got {v!r}")
        return list(v)

    if "kind" in intra and intra["kind"] != "fullmesh" and "mesh_dims" not in intra:
        kw["mesh_dims"], kw["mesh_dim_bandwidth"] = (), ()
    if "mesh_dims" in intra:
        kw["mesh_dims"] = tuple(numbers("mesh_dims"))
        if "mesh_dim_GBps" not in intra:     # a base's per-dimension figures fit its own dims
            kw["mesh_dim_bandwidth"] = ()
    if "mesh_dim_GBps" in intra:
        kw["mesh_dim_bandwidth"] = tuple(_num(v, "intra.mesh_dim_GBps") * GB
                                         for v in numbers("mesh_dim_GBps"))


def _sharp_keys(net: Mapping[str, Any], kw: Dict[str, Any]) -> None:
    """[network] sharp = true, sharp_port_GBps, sharp_max_bytes, sharp_latency_us; a figure
    without SHARP on (here or in the base) is an error, not silently unused."""
    if "sharp" in net:
        if not isinstance(net["sharp"], bool):
            raise ValueError(f"network.sharp: expected true or false, got {net['sharp']!r}")
        kw["sharp"] = net["sharp"]
    figures = sorted({"sharp_port_GBps", "sharp_max_bytes", "sharp_latency_us"} & set(net))
    if figures and not kw.get("sharp"):
        raise ValueError(f"network.{figures[0]} needs network.sharp = true (switches that "
                         f"reduce)")
    if "sharp_port_GBps" in net:
        kw["sharp_port_bandwidth"] = _num(net["sharp_port_GBps"], "network.sharp_port_GBps") * GB
    if "sharp_max_bytes" in net:
        v = net["sharp_max_bytes"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"network.sharp_max_bytes: expected an integer >= 0 (0: no limit), "
                             f"got {v!r}")
        kw["sharp_max_bytes"] = v
    if "sharp_latency_us" in net:
        kw["sharp_latency"] = _num(net["sharp_latency_us"], "network.sharp_latency_us") * US


def read_topology_file(path: str, links: Mapping[str, LinkSpec],
                       topologies: Mapping[str, Topology]) -> Topology:
    """A topology from a .toml (Python >= 3.11, tomllib) or .json file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"topology file {path!r} not found")
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:      # Python < 3.11: no TOML parser in the standard library
            raise ValueError(f"{path}: reading TOML needs Python >= 3.11 (tomllib); "
                             f"write the same tables as a .json file instead") from None
        try:
            data = tomllib.loads(raw.decode())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    else:
        try:
            data = json.loads(raw.decode())
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
    try:
        return topology_from_dict(data, links, topologies)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
