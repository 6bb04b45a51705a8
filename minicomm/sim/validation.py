"""The simulator against published multi-node and single-node figures (``minicomm sim --validate``).

Each ``Point`` (from ``validation.json``) is one public figure: what it is (collective, busbw as nccl-tests reports it),
on what (its ``setup``, and the preset with the changes that make it that machine), where it
was published (``source``) and, for a rule rather than a measurement, how the figure follows from
the rule. ``rows()`` simulates every point with minicomm's own schedules: the ring on one channel
per NIC (NCCL's default) for the ring figures, the tree as NCCL's double binary tree on two
channels per NIC (tree.py) for the tree figures, the fastest family for the all-to-all rule.
The error of a point is the model's busbw against the middle of the published range.

In-network reduction (SHARP, ``sharp_points`` / ``sharp_latency_points``): published SHARP
figures against ``innet`` on the machine with ``sharp`` on, algbw for bandwidth (the busbw of an
in-network reduction is a convention, not a rate on a wire) and time for small messages, held to
``SHARP_TOLERANCE``.

Left out on purpose: runs the maintainers call misconfigured in those threads.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..algorithms import FAMILIES
from . import protocols
from .engine import simulate
from .presets import get_topology, link, links
from .topology import link_from_dict
from .units import parse_size

TOLERANCE = 0.15          # every point within 15% of its published figure
MEAN_TOLERANCE = 0.10     # and the geometric mean of the errors under 10%
SHARP_TOLERANCE = 0.20    # every in-network reduction (SHARP) point within 20%


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
    channels: Optional[int] = None        # the algorithm's channels (None: the default)
    metric: str = "busbw"                 # what ``published`` is: busbw or algbw, GB/s

    @property
    def figure(self) -> float:
        return (self.published[0] + self.published[1]) / 2


POINTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "validation.json")


def load_points(path: str = POINTS_FILE, key: str = "points") -> Tuple[Point, ...]:
    """The published figures (``validation.json``: data, as the presets are); ``key``: which
    list ("points", or "sharp_points", whose figures may be algbw: ``published_algbw``)."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return tuple(Point(d["name"], d["setup"], d["source"],
                       tuple(d["published_busbw"] if "published_busbw" in d
                             else d["published_algbw"]),
                       d["preset"], d["servers"], d["size"], d.get("collective", "allreduce"),
                       d.get("algorithm", "ring"), dict(d.get("changes", {})), d.get("nic"),
                       d.get("channels"), "busbw" if "published_busbw" in d else "algbw")
                 for d in doc.get(key, ()))


POINTS = load_points()
SHARP_POINTS = load_points(key="sharp_points")


@dataclass(frozen=True)
class LatencyPoint:
    """One published small-message time and the simulated machine it is compared with."""
    name: str
    setup: str
    source: str
    published_us: Tuple[float, float]
    preset: str
    servers: int
    size: str
    algorithm: str
    changes: Dict[str, object] = field(default_factory=dict)
    channels: Optional[int] = None
    nic: Optional[str] = None

    @property
    def figure(self) -> float:
        return (self.published_us[0] + self.published_us[1]) / 2


def load_latency_points(path: str = POINTS_FILE, key: str = "latency_points"
                        ) -> Tuple[LatencyPoint, ...]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return tuple(LatencyPoint(d["name"], d["setup"], d["source"], tuple(d["published_us"]),
                              d["preset"], d["servers"], d["size"], d["algorithm"],
                              dict(d.get("changes", {})), d.get("channels"), d.get("nic"))
                 for d in doc.get(key, ()))


LATENCY_POINTS = load_latency_points()
SHARP_LATENCY_POINTS = load_latency_points(key="sharp_latency_points")


@dataclass
class LatencyRow:
    """A latency point, NCCL's own model's time for it, and the simulator's without and with
    NCCL's protocols (microseconds)."""
    point: LatencyPoint
    nccl_model_us: float
    link_alpha_us: float
    protocols_us: float

    def error(self, us: float) -> float:
        return us / self.point.figure - 1.0


def latency_rows(points: Sequence[LatencyPoint] = LATENCY_POINTS) -> List[LatencyRow]:
    """Every latency point: NCCL's tuner's formula, the simulator with one latency per link
    class, and with ``protocols = "nccl"``."""
    out = []
    for pt in points:
        topo = machine(pt)
        nbytes = parse_size(pt.size)
        times = [simulate("allreduce", pt.algorithm, t, nbytes, channels=pt.channels).time_s
                 for t in (topo, topo.replace(protocols="nccl"))]
        model = protocols.nccl_model_latency(pt.algorithm, topo.endpoints, topo.servers,
                                             topo.intra)
        out.append(LatencyRow(pt, model * 1e6, times[0] * 1e6, times[1] * 1e6))
    return out


def render_latency_markdown(found: Sequence[LatencyRow]) -> str:
    """The docs' small-message table."""
    lines = ["| point | setup | source | published (us) | NCCL's model (us) | simulator, one "
             "latency per link (us) | simulator, `--protocols nccl` (us) |", "|---|---|---|---|"
             "---|---|---|"]
    for r in found:
        p = r.point
        cells = [f"{us:.1f} ({100 * r.error(us):+.0f}%)"
                 for us in (r.nccl_model_us, r.link_alpha_us, r.protocols_us)]
        lines.append(f"| {p.name} | {p.setup} | {p.source} | {p.published_us[0]:g}-"
                     f"{p.published_us[1]:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass
class Row:
    """A point and the model's figure for it."""
    point: Point
    algorithm: str
    channels: int
    busbw: float
    algbw: float = 0.0

    @property
    def model(self) -> float:
        """The model's figure in the point's metric (busbw, or algbw)."""
        return self.algbw if self.point.metric == "algbw" else self.busbw

    @property
    def error(self) -> float:
        """The model's figure against the published one: (model - published) / published."""
        return self.model / self.point.figure - 1.0


def machine(point):
    """A point's simulated machine (a ``Point`` or ``LatencyPoint``): its preset with its server
    count and changes (``nic_link`` may be a link table, as in a topology file)."""
    topo = get_topology(point.preset).with_servers(point.servers)
    changes = dict(point.changes)
    if isinstance(changes.get("nic_link"), dict):
        changes["nic_link"] = link_from_dict(changes["nic_link"], "nic_link", links())
    if point.nic is not None:
        changes["nic_link"] = link(point.nic)
    return topo.replace(**changes) if changes else topo


def simulate_point(point: Point) -> Row:
    """The model's figure for ``point``: its algorithm, or the fastest family."""
    topo = machine(point)
    nbytes = parse_size(point.size)
    families = [point.algorithm] if point.algorithm else list(FAMILIES)
    best = max((simulate(point.collective, fam, topo, nbytes, channels=point.channels)
                for fam in families), key=lambda r: r.busbw)
    return Row(point, best.algorithm, best.channels, best.busbw, best.algbw)


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
                if r.algorithm == "ring" else
                f"double binary tree, {r.channels} channels" if r.algorithm == "tree"
                and r.channels > 1 else r.algorithm)
        lines.append(f"| {p.name} | {p.setup} | {p.source} | {pub} | {r.busbw:.1f} | {algo} | "
                     f"{100 * r.error:+.1f}% |")
    lines.append(f"\nGeometric-mean error: {100 * geometric_mean_error(found):.1f}%; largest: "
                 f"{100 * max(abs(r.error) for r in found):.1f}%.")
    return "\n".join(lines)


@dataclass
class SharpLatencyRow:
    """A SHARP small-message point and the model's time for it (microseconds)."""
    point: LatencyPoint
    model_us: float

    @property
    def error(self) -> float:
        return self.model_us / self.point.figure - 1.0


def sharp_rows() -> List[Row]:
    """Every in-network reduction (SHARP) bandwidth point, simulated."""
    return rows(SHARP_POINTS)


def sharp_latency_rows(points: Sequence[LatencyPoint] = SHARP_LATENCY_POINTS
                       ) -> List[SharpLatencyRow]:
    """Every SHARP small-message point: the model's time with its algorithm (innet)."""
    return [SharpLatencyRow(pt, simulate("allreduce", pt.algorithm, machine(pt),
                                         parse_size(pt.size)).time_s * 1e6) for pt in points]


def render_sharp_markdown(found: Sequence[Row], timed: Sequence[SharpLatencyRow]) -> str:
    """The docs' in-network reduction table: bandwidth points (algbw) and small-message
    times, each with its source, the published figure, the model's and the error."""
    lines = ["| point | setup | source | published | model | error |", "|---|---|---|---|---|---|"]
    for r in found:
        p = r.point
        pub = (f"{p.published[0]:g}" if p.published[0] == p.published[1]
               else f"{p.published[0]:g}-{p.published[1]:g}")
        lines.append(f"| {p.name} | {p.setup} | {p.source} | {pub} GB/s {p.metric} | "
                     f"{r.model:.1f} GB/s | {100 * r.error:+.1f}% |")
    for r in timed:
        p = r.point
        pub = (f"{p.published_us[0]:g}" if p.published_us[0] == p.published_us[1]
               else f"{p.published_us[0]:g}-{p.published_us[1]:g}")
        lines.append(f"| {p.name} | {p.setup} | {p.source} | {pub} us | {r.model_us:.2f} us | "
                     f"{100 * r.error:+.1f}% |")
    return "\n".join(lines)

