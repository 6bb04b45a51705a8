"""The simulator against published multi-node and single-node figures (``minicomm sim --validate``).

Each ``Point`` is one public figure: what it is (collective, busbw as nccl-tests reports it),
on what (its ``setup``, and the preset with the changes that make it that machine), where it
was published (``source``) and, for a rule rather than a measurement, how the figure follows from
the rule. ``rows()`` simulates every point with minicomm's own schedules: the ring on one channel
per NIC (NCCL's default) for the ring figures, the fastest family for the all-to-all rule. The
error of a point is the model's busbw against the middle of the published range.

Left out on purpose: runs the maintainers call misconfigured in those threads, and NCCL's tree
figures: minicomm's tree is a binomial
tree, not NCCL's pipelined double binary tree, so a tree figure would compare two algorithms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..algorithms import FAMILIES
from .engine import simulate
from .presets import get_topology, link
from .units import parse_size

TOLERANCE = 0.15          # every point within 15% of its published figure
MEAN_TOLERANCE = 0.10     # and the geometric mean of the errors under 10%


@dataclass(frozen=True)
class Point:
    """One published figure and the simulated machine it is compared with."""
    name: str
    setup: str
    source: str
    published: Tuple[float, float]        # busbw GB/s, low and high (equal: one figure)
    preset: str
    servers: int
    size: str
    collective: str = "allreduce"
    algorithm: Optional[str] = "ring"     # None: the fastest family
    changes: Dict[str, object] = field(default_factory=dict)   # Topology fields
    nic: Optional[str] = None             # a link preset between the servers instead

    @property
    def figure(self) -> float:
        return (self.published[0] + self.published[1]) / 2


POINTS: Tuple[Point, ...] = (
    Point("DGX-A100 multi-node allreduce",
          "8 x A100 SXM per node, NVSwitch, 8 x HDR 200G per node; nodes: 3, 8 GiB",
          "NVIDIA maintainer, https://github.com/NVIDIA/nccl/issues/812 (192 GB/s for 8 x HDR)",
          (192.0, 192.0), "dgx-a100", 3, "8GiB"),
    Point("3 x 8 A100, 4 x HDR",
          "8 x A100 SXM per node, 4 x HDR 200G per node, 3 nodes, about 128 MB",
          "https://github.com/NVIDIA/nccl-tests/issues/119 (95.75-96.45 GB/s)",
          (95.75, 96.45), "dgx-a100", 3, "128MiB", changes={"nics_per_server": 4}),
    Point("5 x 8 H100, 4 x 400G RoCE, ring",
          "8 x H100 SXM per node, 4 x 400G RoCE per node, 5 nodes, 1 GiB (the sweep's peak)",
          "https://github.com/NVIDIA/nccl/issues/1368 (ring about 190 GB/s from 1 MB to 1 GB)",
          (190.0, 190.0), "dgx-h100", 5, "1GiB", changes={"nics_per_server": 4},
          nic="roce-400"),
    Point("2 x 8 A100, 4 x HDR (user run)",
          "HGX A100 SXM 80GB, 4 x ConnectX-6 HDR 200G per node, 2 nodes, 1-8 GiB (8 GiB here)",
          "user measurement, https://github.com/NVIDIA/nccl-tests/issues/100 (91 GB/s; the "
          "maintainers' target for 4 x HDR is 4 x 24 = 96 GB/s, nccl-tests#119)",
          (91.0, 91.0), "dgx-a100", 2, "8GiB", changes={"nics_per_server": 4}),
    Point("4 x 8 H100, 8 x 400G (user run)",
          "HGX H100, 8 GPU-NIC pairs of 400G per node, 4 nodes, the sweep's largest busbw (8 "
          "GiB here)",
          "user measurement, https://github.com/NVIDIA/nccl-tests/issues/309 (365.84 GB/s; "
          "NVIDIA gives up to about 396 GB/s for such nodes with the ring, nccl-tests#319)",
          (365.84, 365.84), "dgx-h100", 4, "8GiB"),
    Point("DGX-H100 one node",
          "8 x H100 SXM, NVSwitch (NVLink4), one node, 8 GiB",
          "365-370 GB/s as the issue gives it; NCCL developer: an effective 370 GB/s with the "
          "ring, https://github.com/NVIDIA/nccl-tests/issues/212",
          (365.0, 370.0), "dgx-h100", 1, "8GiB"),
    Point("DGX-A100 one node",
          "8 x A100 SXM, NVSwitch (NVLink3), one node, 8 GiB",
          "231.6 GB/s as the issue gives it (its run not found); NVIDIA: 'close to 240 GB/s', "
          "https://github.com/NVIDIA/nccl/issues/1712",
          (231.6, 231.6), "dgx-a100", 1, "8GiB"),
    Point("8 x H100 PCIe, one node",
          "8 x H100 PCIe 5.0 x16 under one CPU root, no NVLink, one node, 1 GiB",
          "37.6-41.1 GB/s as the issue gives it; 35-45 GB/s in a vendor blog (alayanew.com, "
          "nccl-tests on 8 x H100 PCIe), not NVIDIA",
          (37.6, 41.1), "pcie-8gpu", 1, "1GiB"),
    Point("All-to-all across 4 DGX-H100 (rule)",
          "8 x H100 per node, 8 x NDR 400G (47 GB/s each), 4 nodes, 1 GiB; the rule: busbw = "
          "N/(N-1) x the per-GPU network bandwidth, N nodes (47 x 4/3 = 62.7 GB/s)",
          "NCCL maintainers, https://github.com/NVIDIA/nccl-tests/issues/130 and #267 (all-to-all "
          "cannot aggregate the NICs)",
          (62.67, 62.67), "dgx-h100", 4, "1GiB", collective="alltoall", algorithm=None),
)


@dataclass
class Row:
    """A point and the model's figure for it."""
    point: Point
    algorithm: str
    channels: int
    busbw: float

    @property
    def error(self) -> float:
        """The model's busbw against the published figure: (model - published) / published."""
        return self.busbw / self.point.figure - 1.0


def machine(point: Point):
    """The point's simulated machine: its preset with its server count and changes."""
    topo = get_topology(point.preset).with_servers(point.servers)
    changes = dict(point.changes)
    if point.nic is not None:
        changes["nic_link"] = link(point.nic)
    return topo.replace(**changes) if changes else topo


def simulate_point(point: Point) -> Row:
    """The model's figure for ``point``: its algorithm, or the fastest family."""
    topo = machine(point)
    nbytes = parse_size(point.size)
    families = [point.algorithm] if point.algorithm else list(FAMILIES)
    results = [simulate(point.collective, fam, topo, nbytes) for fam in families]
    best = max(range(len(results)), key=lambda i: results[i].busbw)
    channels = topo.channels if families[best] == "ring" else 1
    return Row(point, families[best], channels, results[best].busbw)


def rows(points: Sequence[Point] = POINTS) -> List[Row]:
    """Every point simulated, in order."""
    return [simulate_point(p) for p in points]


def geometric_mean_error(found: Sequence[Row]) -> float:
    """exp(mean |ln(model / published)|) - 1: the typical factor the model is off by."""
    return math.exp(sum(abs(math.log1p(r.error)) for r in found) / len(found)) - 1.0


def render_markdown(found: Sequence[Row]) -> str:
    """The docs' table: each point's setup, source, published and model figures, and error."""
    lines = ["| point | setup | source | published busbw (GB/s) | model (GB/s) | algorithm | "
             "error |", "|---|---|---|---|---|---|---|"]
    for r in found:
        p = r.point
        pub = (f"{p.published[0]:g}" if p.published[0] == p.published[1]
               else f"{p.published[0]:g}-{p.published[1]:g}")
        algo = (f"ring, {r.channels} channel{'s' if r.channels > 1 else ''}"
                if r.algorithm == "ring" else r.algorithm)
        lines.append(f"| {p.name} | {p.setup} | {p.source} | {pub} | {r.busbw:.1f} | {algo} | "
                     f"{100 * r.error:+.1f}% |")
    lines.append(f"\nGeometric-mean error: {100 * geometric_mean_error(found):.1f}%; largest: "
                 f"{100 * max(abs(r.error) for r in found):.1f}%.")
    return "\n".join(lines)
