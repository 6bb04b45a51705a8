"""The simulator against published multi-node and single-node figures (``minicomm sim --validate``).

Each ``Point`` (from ``validation.json``) is one public figure: what it is (collective, busbw as nccl-tests reports it),
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

import json
import math
import os
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


POINTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "validation.json")


def load_points(path: str = POINTS_FILE) -> Tuple[Point, ...]:
    """The published figures (``validation.json``: data, as the presets are)."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return tuple(Point(d["name"], d["setup"], d["source"], tuple(d["published_busbw"]),
                       d["preset"], d["servers"], d["size"], d.get("collective", "allreduce"),
                       d.get("algorithm", "ring"), dict(d.get("changes", {})), d.get("nic"))
                 for d in doc["points"])


POINTS = load_points()


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
    best = max((simulate(point.collective, fam, topo, nbytes) for fam in families),
               key=lambda r: r.busbw)
    return Row(point, best.algorithm, best.channels, best.busbw)


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
