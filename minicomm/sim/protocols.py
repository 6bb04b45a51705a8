"""NCCL's three protocols, LL, LL128 and Simple, as the simulator prices a message with them.

NCCL moves every message with one of three protocols. LL (low latency) sends 8-byte lines of 4
bytes of data and a 4-byte flag the receiver polls: the least latency per hop, a quarter of the
link's bandwidth in NCCL's model. LL128 does the same with 128-byte lines of 120 bytes of data.
Simple sends plain chunks and synchronises with flags in memory: full bandwidth, the most latency
per hop. NCCL's tuner (``src/graph/tuning.cc``) prices each algorithm and protocol as a launch
latency, a hardware latency per hop on NVLink, PCIe or the network, and a bandwidth, and picks
the cheapest for the call's size. ``Topology.protocols = "nccl"`` gives the simulator the same
table:

- a message pays the hop latency of the protocol that moves it soonest over its first link
  class, and its bytes grow by that protocol's overhead (``EFFICIENCY``): the protocol switch by
  size falls out of the messages' sizes (NCCL picks one protocol per call; the model per
  message, so a hierarchical call may move its small inter-node messages with LL and its large
  intra-node ones with Simple);
- the call starts after the launch latency of the protocol of its largest message;
- the tree family uses NCCL's tree rows, every other family its ring rows (a point-to-point step
  is what a ring step is); on more than one server LL's intra-node latency is 1.8x, as NCCL's.

The figures are NCCL's defaults (``ncclTunerConstantsDefaults``, NCCL 2.2x; microseconds) and
its model's protocol bandwidth factors (LL: 1/4 on a multi-node ring; LL128: 0.92, "120/128").
Without ``protocols`` a link class has one latency, that of ``LinkSpec.latency``.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

PROTOCOLS = ("LL", "LL128", "Simple")
US = 1e-6

# Launch (base) latency of a call, per protocol, us.
BASE_LATENCY = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
# Hardware latency per hop, per link class and protocol, us.
HOP_LATENCY = {
    "tree": {"nvlink": (0.6, 1.25, 4.0), "pci": (1.0, 1.9, 4.0), "net": (5.0, 8.5, 14.0)},
    "ring": {"nvlink": (0.6, 1.9, 3.4), "pci": (1.0, 2.5, 5.7), "net": (2.7, 4.0, 14.0)},
}
EFFICIENCY = (0.25, 0.92, 1.0)        # share of a link's bandwidth that carries data
LL_INTRA_MULTINODE = 1.8              # NCCL: LL's intra-node hops cost more when nodes > 1

KINDS = ("", "nccl")


def row(algorithm: str) -> str:
    """The table row a family is priced with."""
    return "tree" if algorithm == "tree" else "ring"


def intra_class(intra: str) -> str:
    return "pci" if intra == "pcie" else "nvlink"


def price(algorithm: str, intra: str, cross: np.ndarray, nbytes: np.ndarray,
          bandwidth: np.ndarray, multi_server: bool) -> Tuple[np.ndarray, np.ndarray, float]:
    """Each message's protocol: (latency s, bytes on the wire, the call's launch latency s).

    Args:
        algorithm (str): The family ("tree" uses the tree rows).
        intra (str): ``Topology.intra``.
        cross (np.ndarray): bool per message: between servers.
        nbytes (np.ndarray): The message's data bytes.
        bandwidth (np.ndarray): Its first link's bandwidth, bytes/s.
        multi_server (bool): The call spans more than one server.

    Returns:
        (tuple): Per-message latency and wire bytes, and the launch latency.
    """
    table = HOP_LATENCY[row(algorithm)]
    intra_lat = np.array(table[intra_class(intra)], dtype=float)
    if multi_server:
        intra_lat[0] *= LL_INTRA_MULTINODE
    lat = np.where(cross[:, None], np.array(table["net"]), intra_lat) * US    # (M, 3)
    eff = np.array(EFFICIENCY)
    wire = nbytes[:, None] / eff                                               # (M, 3)
    cost = lat + wire / np.maximum(bandwidth, 1.0)[:, None]
    pick = np.argmin(cost, axis=1) if len(nbytes) else np.zeros(0, dtype=np.int64)
    rows = np.arange(len(nbytes))
    largest = int(pick[np.argmax(nbytes)]) if len(nbytes) else 0
    launch = BASE_LATENCY[row(algorithm)][largest] * US
    return lat[rows, pick], wire[rows, pick], launch


def nccl_model_latency(algorithm: str, ranks: int, nodes: int, intra: str) -> float:
    """NCCL's own tuner's latency for an allreduce with LL, in seconds (tuning.cc): the ring
    pays the launch latency and a hop on each of its 2(p-1) steps, 2(nodes-1) of them on the
    network; the tree twice (up and down) the chain of the ranks of a node and lg(nodes)
    network hops. What the simulator's protocol model is compared with."""
    table = HOP_LATENCY[row(algorithm)]
    intra_lat = table[intra_class(intra)][0] * (LL_INTRA_MULTINODE if nodes > 1 else 1.0)
    net = table["net"][0] if nodes > 1 else intra_lat
    base = BASE_LATENCY[row(algorithm)][0]
    if algorithm == "tree":
        lat = base + 2 * ((ranks // nodes - 1) * intra_lat + (nodes.bit_length() - 1) * net)
    else:
        steps, inter = 2 * (ranks - 1), 2 * (nodes - 1)
        lat = base + (steps - inter) * intra_lat + inter * net
    return lat * US
