"""algorithm="auto": pick the family with the lowest α-β-γ cost (Thakur, Rabenseifner, Gropp 2005).

Costs per family and collective, for p ranks and a message of n bytes per rank (``blocks`` of
n bytes for the block collectives), with α = latency per message, β = seconds per byte on the
link, γ = seconds per byte reduced. ``lg`` = ceil(log2 p). Non-powers of two add the fold steps of
recursive halving/doubling (2α + nβ). For hier, intra-node terms use the intra link, inter-node
terms the inter link; flat families crossing nodes are charged the slower link throughout (a flat
ring is only as fast as its slowest hop).

The choice must be identical on every rank: it depends only on the call's arguments, the
topology and a link table that is the same everywhere (constants here; measured values are agreed
at communicator start, see ``LinkModel.from_env``).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

# Defaults measured on a 2-core x86 VM (see README's benchmark section): per-message α, bytes/s.
DEFAULT_LINKS: Dict[str, Tuple[float, float]] = {
    "inproc": (30e-6, 2.0e9),
    "shm": (8e-6, 3.0e9),
    "tcp": (30e-6, 1.2e9),
    "rdma": (10e-6, 3.0e9),
    "ub": (8e-6, 3.0e9),
}
GAMMA = 1 / 6.0e9     # in-place add, bytes/s of array


@dataclass(frozen=True)
class LinkModel:
    alpha_intra: float
    beta_intra: float      # seconds per byte
    alpha_inter: float
    beta_inter: float
    gamma: float = GAMMA

    @classmethod
    def for_transports(cls, intra: str, inter: str) -> "LinkModel":
        ai, bwi = DEFAULT_LINKS.get(intra, DEFAULT_LINKS["tcp"])
        ae, bwe = DEFAULT_LINKS.get(inter, DEFAULT_LINKS["tcp"])
        return cls(ai, 1 / bwi, ae, 1 / bwe)


def _lg(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def flat_cost(collective: str, family: str, p: int, n: float, a: float, b: float, g: float) -> float:
    """Cost of a flat family on one link class. n = bytes per rank-block."""
    if p <= 1:
        return 0.0
    lg = _lg(p)
    f = (p - 1) / p
    pow2 = p & (p - 1) == 0
    fold = 0.0 if pow2 else 2 * a + n * b
    if collective == "allreduce":
        return {"ring": 2 * (p - 1) * a + 2 * f * n * b + f * n * g,
                "tree": 2 * lg * (a + n * b) + lg * n * g,
                "rhd": min(lg * (a + n * b + n * g), 2 * lg * a + 2 * f * n * b + f * n * g) + fold,
                }[family]
    if collective in ("reduce",):
        return {"ring": (p - 1) * a + f * n * b + f * n * g + (p - 1) * a + f * n * b,
                "tree": lg * (a + n * b + n * g),
                "rhd": 2 * lg * a + 2 * f * n * b + f * n * g + fold}[family]
    if collective == "broadcast":
        seg = max(1.0, n / (32768 * 4))
        return {"ring": (p - 2 + seg) * (a + n / seg * b),
                "tree": lg * (a + n * b),
                "rhd": 2 * lg * a + 2 * f * n * b + fold}[family]
    if collective in ("allgather",):
        return {"ring": (p - 1) * (a + n * b),
                "tree": 2 * lg * a + (p - 1) * n * b + lg * p * n * b,
                "rhd": lg * a + (p - 1) * n * b + fold}[family]
    if collective == "reduce_scatter":
        return {"ring": (p - 1) * (a + n * b + n * g),
                "tree": 2 * lg * a + lg * p * n * (b + g) + (p - 1) * n * b,
                "rhd": lg * a + (p - 1) * n * (b + g) + fold}[family]
    if collective in ("gather", "scatter"):
        return {"ring": (p - 1) * (a + n * b),
                "tree": lg * a + (p - 1) * n * b,
                "rhd": lg * a + (p - 1) * n * b + fold}[family]
    if collective == "alltoall":
        return {"ring": (p - 1) * (a + n * b),
                "tree": lg * (a + p / 2 * n * b) + 2 * p * n * b,   # Bruck: log steps, packing copies
                "rhd": (p - 1) * (a + n * b)}[family]
    if collective == "barrier":
        return {"ring": 2 * p * a, "tree": 2 * lg * a, "rhd": lg * a}[family]
    raise ValueError(collective)


def hier_cost(collective: str, p: int, n: float, topology: Sequence[int], m: LinkModel) -> Optional[float]:
    nodes = sorted(set(topology))
    k = len(nodes)
    if k <= 1 or k == p:
        return None       # hier degenerates to a flat algorithm: let the flat families compete
    local = max(list(topology).count(x) for x in nodes)
    ai, bi, ae, be, g = m.alpha_intra, m.beta_intra, m.alpha_inter, m.beta_inter, m.gamma
    intra_ring = lambda coll, nn: flat_cost(coll, "ring", local, nn, ai, bi, g)  # noqa: E731
    inter = lambda coll, nn: min(flat_cost(coll, f, k, nn, ae, be, g) for f in ("ring", "rhd"))  # noqa: E731
    if collective == "allreduce":
        return intra_ring("reduce_scatter", n / local) + inter("allreduce", n / local) + intra_ring("allgather", n / local)
    if collective == "reduce":
        return intra_ring("reduce", n) + inter("reduce", n)
    if collective == "broadcast":
        return inter("broadcast", n) + intra_ring("broadcast", n)
    if collective in ("allgather", "gather", "scatter"):
        return intra_ring("gather", n) + inter(collective, n * local) + intra_ring("broadcast", n * p)
    if collective == "reduce_scatter":
        return intra_ring("reduce_scatter", n * k) + inter("reduce_scatter", n * local)
    if collective == "alltoall":
        return intra_ring("gather", n * p) + inter("alltoall", n * local * local) + intra_ring("scatter", n * p)
    if collective == "barrier":
        return 2 * flat_cost("barrier", "tree", local, 0, ai, bi, g) + inter("barrier", 0)
    return None


def choose(collective: str, p: int, nbytes: int, topology: Sequence[int], m: LinkModel,
           table: Optional[Dict] = None) -> str:
    """The family auto picks. ``table`` (from ``minicomm bench --tune``) overrides the model."""
    if table:
        hit = table.get((collective, p, _size_class(nbytes)))
        if hit:
            return hit
    crosses = len(set(topology)) > 1
    a, b = (m.alpha_inter, m.beta_inter) if crosses else (m.alpha_intra, m.beta_intra)
    costs = {f: flat_cost(collective, f, p, nbytes, a, b, m.gamma) for f in ("ring", "tree", "rhd")}
    h = hier_cost(collective, p, nbytes, topology, m)
    if h is not None:
        costs["hier"] = h
    return min(costs, key=lambda f: (costs[f], f))


def _size_class(nbytes: int) -> int:
    return max(0, int(nbytes).bit_length())


def parse_algo_env(value: Optional[str] = None) -> Dict[str, str]:
    """MINICOMM_ALGO='allreduce:ring,broadcast:tree' -> {'allreduce': 'ring', ...}."""
    value = os.environ.get("MINICOMM_ALGO", "") if value is None else value
    out = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        coll, _, fam = item.partition(":")
        if not fam:
            raise ValueError(f"MINICOMM_ALGO entry {item!r} is not 'collective:algorithm'")
        out[coll.strip()] = fam.strip()
    return out
