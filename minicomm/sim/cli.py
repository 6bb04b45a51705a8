"""minicomm sim: predict collectives (and the parameter server) on a modelled cluster.

    minicomm sim --topology dgx-h100 --nodes 128 --collective allreduce --sizes 1K:1G --algorithms all
    minicomm sim --topology my.toml --sizes 1M,64M,1G --algorithms ring,hier --json
    minicomm sim --topology dgx-h100 --nodes 16 --sizes 1K:1G --plot busbw.png
    minicomm sim --topology dgx-h100 --nodes 1 --algorithms ring --sizes 1M --trace sim.json
    minicomm sim --explain
    minicomm sim --architecture ps --servers 8 --topology dgx-h100 --nodes 16 --model-bytes 1GiB
    minicomm sim --advise --model-bytes 350GB --gpus 1024 --topology dgx-h100
    minicomm sim --compare-interconnects --topology dgx-h100 --nodes 16 --sizes 1G

One question per run: a size sweep (the default), --architecture ps, --advise,
--compare-interconnects or --explain; an option the chosen question does not use is an error.

Sizes (--sizes, --model-bytes) have one convention: a byte count, or a number with K, M, G, T
or KiB, MiB, GiB, TiB (powers of 1024, as in nccl-tests and minicomm bench), or kB, MB, GB, TB
(powers of 1000: GPT-3's fp16 gradients are 350GB). --sizes is a range A:B (x2 steps) or a
comma list of nccl-tests sizes (the whole buffer, see minicomm bench). The output prints sizes
with their unit, times in s / ms / us and bandwidths in GB/s (1 GB = 1e9 B).

The sweep prints time and busbw per algorithm and the winner per size, then the sizes where the
winner changes and the busiest link. Every question ends with one line starting "Summary:".
--json prints JSON instead: for the sweep, a list of objects each with at least collective,
algorithm, bytes, ranks, time_s, algbw, busbw.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from ..algorithms import FAMILIES, registered
from ..schedule import ALL_COLLECTIVES, UNEVEN
from . import ps_model
from .engine import (
    ScheduleError,
    SimResult,
    busbw_factor,
    innet_runs_on,
    simulate,
    skewed_counts,
)
from .presets import INTERCONNECTS, get_topology, link, sharp_settings, topologies
from .topology import Topology
from .units import describe_link, format_size, format_time, parse_size, parse_sizes, size_units


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", default="dgx-h100",
                   help=f"a preset ({', '.join(sorted(topologies()))}) or a .toml / .json file "
                        f"(default: %(default)s)")
    p.add_argument("--nodes", type=int, default=None, help="servers (default: the preset's)")
    p.add_argument("--gpus", type=int, default=None,
                   help="accelerators in all (sets --nodes: a multiple of the server's)")
    p.add_argument("--protocols", choices=("nccl",), default=None,
                   help="price every message with NCCL's LL / LL128 / Simple protocols (hop "
                        "latency per link class and protocol, the protocol switch by size, a "
                        "launch latency per call; tuning.cc's table) instead of one latency per "
                        "link class")
    p.add_argument("--collective", default=None,
                   help=f"one of {', '.join(ALL_COLLECTIVES)} (default: allreduce)")
    p.add_argument("--skew", type=float, default=1.0, metavar="S",
                   help="the uneven collectives' blocks: Zipf exponent of their sizes over the "
                        "ranks (0: equal; alltoallv: every rank's rows favour the same hot "
                        "destinations, as a mixture-of-experts layer's; default %(default)s)")
    p.add_argument("--sizes", default=None,
                   help="A:B (x2 steps) or a comma list, e.g. 1K:1G or 1MiB,64MiB,1GB "
                        "(default 1K:1G; with --architecture ps: 1G)")
    p.add_argument("--algorithms", default=None,
                   help=f"'all' or a comma list of {', '.join(FAMILIES)} (default: all), or "
                        f"innet (in-network reduction: a server's NVSwitch with NVLink SHARP), "
                        f"or mesh (along an n-D full mesh's dimensions: ub-mesh)")
    p.add_argument("--root", type=int, default=None,
                   help="root rank of broadcast, reduce, gather, scatter (default: 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--plot", metavar="FILE",
                   help="sweep: draw busbw vs size per algorithm (matplotlib)")
    p.add_argument("--exact", action="store_true",
                   help="build every rank's schedule (no rank-symmetry shortcut)")
    p.add_argument("--channels", type=int, default=None, metavar="K",
                   help="rings of a ring allreduce / allgather / reduce_scatter (default: one "
                        "per NIC of a server, as NCCL's), and trees of a tree allreduce: on "
                        "K > 1, NCCL's double binary tree (default: one binomial tree)")
    p.add_argument("--trace", metavar="FILE",
                   help="sweep: write every simulated call's steps, rank by rank, as a Chrome "
                        "trace (the format MINICOMM_TRACE writes; open it in Perfetto)")
    q = p.add_argument_group("other questions (one at a time; without them: a size sweep)")
    q.add_argument("--validate", action="store_true",
                   help="the model against published nccl-tests figures: each point's source, "
                        "setup, figure, the model's and the error")
    q.add_argument("--explain", action="store_true",
                   help="the GPT-3 traffic arithmetic (flat ring vs hier, the 89.6 TB figure)")
    q.add_argument("--architecture", choices=("allreduce", "ps"), default=None,
                   help="ps: price a training step's communication with a parameter server too")
    q.add_argument("--advise", action="store_true",
                   help="which architecture / algorithm wins for --model-bytes on --gpus, and why")
    q.add_argument("--compare-interconnects", action="store_true",
                   help="the same collective with IB NDR, RoCEv2 and UB between the servers "
                        "(and IB NDR with SHARP: its switches reducing, innet)")
    q.add_argument("--innet-gain", action="store_true",
                   help="what in-network reduction buys on this cluster: per size, the fastest "
                        "family without it against innet (NVLS on one server, SHARP across "
                        "servers: e.g. --topology dgx-h100-sharp), time and busbw")
    q.add_argument("--model-bytes", default=None,
                   help="--advise, --architecture ps: gradient bytes per step (e.g. 350GB, 1GiB)")
    q.add_argument("--servers", default=None,
                   help="--advise, --architecture ps: PS server machines, K or a comma list "
                        "(default: 1,2,4,... up to the nodes)")
    p.set_defaults(_sim_parser=p)


# the options each question uses (--topology, --nodes, --gpus, --protocols, --json: every
# question)
_USES = {
    "sweep": ("--sizes", "--algorithms", "--collective", "--root", "--plot", "--exact",
              "--trace", "--channels", "--skew"),
    "--compare-interconnects": ("--sizes", "--algorithms", "--collective", "--root", "--exact",
                                "--channels"),
    "--architecture ps": ("--sizes", "--model-bytes", "--servers", "--algorithms"),
    "--advise": ("--model-bytes", "--servers", "--algorithms"),
    "--explain": (),
    "--validate": (),
    "--innet-gain": ("--sizes", "--algorithms", "--collective", "--root", "--plot"),
}


def _given(a) -> Dict[str, bool]:
    return {"--sizes": a.sizes is not None, "--model-bytes": a.model_bytes is not None,
            "--servers": a.servers is not None, "--algorithms": a.algorithms is not None,
            "--collective": a.collective not in (None, "allreduce"),
            "--root": a.root is not None, "--plot": a.plot is not None, "--exact": a.exact,
            "--trace": getattr(a, "trace", None) is not None,
            "--channels": getattr(a, "channels", None) is not None,
            "--skew": getattr(a, "skew", 1.0) != 1.0}


def check_arguments(a) -> Optional[str]:
    """Why these options do not go together (None when they do): one question per run, and
    only the options that question uses."""
    asked = [q for q, on in (("--explain", a.explain), ("--validate", a.validate),
                             ("--advise", a.advise),
                             ("--compare-interconnects", a.compare_interconnects),
                             ("--innet-gain", getattr(a, "innet_gain", False)),
                             ("--architecture ps", a.architecture == "ps")) if on]
    if len(asked) > 1:
        return (f"{' and '.join(asked)} are different questions: give one of them per run")
    mode = asked[0] if asked else "sweep"
    given = _given(a)
    if a.collective not in (None, "allreduce") and mode in ("--advise", "--architecture ps"):
        return f"{mode} prices allreduce (a training step's gradients): drop --collective"
    for opt, on in given.items():
        if on and opt not in _USES[mode]:
            what = "a size sweep (no --advise, --architecture ps, --compare-interconnects " \
                   "or --explain)" if mode == "sweep" else mode
            uses = (", ".join(_USES[mode])
                    or "only --topology, --nodes, --gpus, --protocols and --json")
            return f"{opt} does not apply to {what}; it takes {uses}"
    if mode == "--architecture ps" and given["--sizes"] and given["--model-bytes"]:
        return "--architecture ps takes --sizes or --model-bytes, not both"
    return None


def main(a) -> int:
    why = check_arguments(a)
    if why is not None:
        parser = getattr(a, "_sim_parser", None)
        if parser is not None:
            parser.error(why)              # usage and the reason on stderr, exit status 2
        print(f"minicomm sim: {why}", file=sys.stderr)
        return 2
    try:
        return _main(a)
    except (ValueError, FileNotFoundError, ScheduleError) as e:
        print(f"minicomm sim: {e}", file=sys.stderr)
        return 2


def _topology(a) -> Topology:
    topo = get_topology(a.topology)
    nodes = a.nodes
    if a.gpus is not None:
        g = topo.gpus_per_server
        if a.gpus < 1 or a.gpus % g:
            raise ValueError(f"--gpus {a.gpus} is not a multiple of {g} accelerators per server")
        if nodes is not None and nodes * g != a.gpus:
            raise ValueError(f"--gpus {a.gpus} and --nodes {nodes} disagree ({g} per server)")
        nodes = a.gpus // g
    topo = topo.with_servers(nodes) if nodes is not None else topo
    return topo.replace(protocols=a.protocols) if a.protocols else topo


def _algorithms(text: Optional[str], topo: Topology, innet_where_it_runs: bool = False
                ) -> List[str]:
    """The families asked for; 'all' (the default) is FAMILIES, and innet too with
    ``innet_where_it_runs`` when a switch of ``topo`` reduces (NVLS, SHARP)."""
    if text is None or text.strip() == "all":
        algos = list(FAMILIES)
        if innet_where_it_runs and innet_runs_on(topo):
            algos.append("innet")
    else:
        algos = [x.strip() for x in text.split(",") if x.strip()]
        for x in algos:
            if x not in FAMILIES + ("innet", "mesh") + tuple(r.name for r in registered()):
                raise ValueError(f"unknown algorithm {x!r}; choose 'all' or from "
                                 f"{', '.join(FAMILIES)}, or innet (in-network reduction, "
                                 f"where a switch reduces), or mesh (along a full mesh's "
                                 f"dimensions)")
    return algos


def _n(count: int, noun: str) -> str:
    """'1 server', '8 servers'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _cluster(topo: Topology) -> str:
    """The topology in a few words, for summaries."""
    return (f"{_n(topo.servers, 'server')} x {_n(topo.gpus_per_server, 'accelerator')} "
            f"({topo.endpoints} in all, {topo.nics_per_server} x {topo.nic_link.name} NICs "
            f"per server)")


def _main(a) -> int:
    topo = _topology(a)
    a.collective = a.collective or "allreduce"
    a.root = a.root or 0
    if a.collective not in ALL_COLLECTIVES:
        raise ValueError(f"unknown collective {a.collective!r}; choose one of "
                         f"{', '.join(ALL_COLLECTIVES)}")
    if a.validate:
        return _validate(a)
    if a.explain:
        from .explain import explain
        text = explain(topo if (a.nodes or a.gpus) else None)
        print(json.dumps({"explain": text}) if a.json else text)
        return 0
    if a.advise:
        return _advise(a, topo)
    if a.architecture == "ps":
        return _ps(a, topo)
    if a.compare_interconnects:
        return _compare(a, topo)
    if getattr(a, "innet_gain", False):
        return _innet_gain(a, topo)
    sizes = parse_sizes(a.sizes or "1K:1G")
    algos = _algorithms(a.algorithms, topo)
    timeline = None
    if getattr(a, "trace", None):
        # the trace writer (minicomm.trace) is above the simulator: the minicomm command hands
        # its class in (build_parser)
        new_timeline = getattr(a, "new_timeline", None)
        if new_timeline is None:
            raise ValueError("--trace needs the minicomm command (minicomm sim ... --trace FILE)")
        timeline = new_timeline()
    results = sweep(topo, a.collective, sizes, algos, root=a.root, exact=a.exact,
                    timeline=timeline, channels=a.channels, skew=a.skew)
    if a.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(render_table(topo, a.collective, results, algos))
    if a.plot:
        plot(results, algos, a.plot, f"{a.collective} on {topo.name}, {topo.endpoints} ranks")
        if not a.json:
            print(f"wrote {a.plot}")
    if timeline is not None:
        timeline.write(a.trace, topology=topo.name, description=topo.describe())
        if not a.json:
            print(f"wrote {a.trace} ({timeline.calls} calls on {timeline.ranks} ranks, one after "
                  f"another)")
    if not a.json:
        print(sweep_summary(topo, a.collective, results))
    return 0


def sweep(topo: Topology, collective: str, sizes: Sequence[int], algos: Sequence[str],
          root: int = 0, exact: bool = False, timeline=None,
          channels: Optional[int] = None, skew: float = 1.0) -> List[SimResult]:
    """Every size x algorithm, simulated (each call's steps added to ``timeline``, if given;
    ``channels``: the ring's, default the topology's; ``skew``: an uneven collective's blocks,
    ``skewed_counts``)."""
    out = []
    for s in sizes:
        counts = (skewed_counts(collective, s, topo.endpoints, skew)
                  if collective in UNEVEN else None)
        for algo in algos:
            out.append(simulate(collective, algo, topo, nbytes=s, root=root, exact=exact,
                                timeline=timeline, counts=counts,
                                channels=channels if algo in ("ring", "tree") else None))
    return out


def _validate(a) -> int:
    from . import validation
    found = validation.rows()
    if a.json:
        print(json.dumps([{"point": r.point.name, "setup": r.point.setup,
                           "source": r.point.source, "published_busbw": list(r.point.published),
                           "busbw": r.busbw, "algorithm": r.algorithm, "channels": r.channels,
                           "error": r.error} for r in found], indent=1))
        return 0
    print(validation.render_markdown(found))
    worst = max(found, key=lambda r: abs(r.error))
    print("\nSmall messages (time, not busbw; compared, not held to the tolerance):")
    print(validation.render_latency_markdown(validation.latency_rows()))
    sharp = validation.sharp_rows()
    timed = validation.sharp_latency_rows()
    print(f"\nIn-network reduction (SHARP; held to {100 * validation.SHARP_TOLERANCE:.0f}%):")
    print(validation.render_sharp_markdown(sharp, timed))
    worst_sharp = max([abs(r.error) for r in sharp] + [abs(r.error) for r in timed])
    print(f"Summary: {len(found)} published figures; the model is within "
          f"{100 * abs(worst.error):.1f}% of each (worst: {worst.point.name}), geometric-mean "
          f"error {100 * validation.geometric_mean_error(found):.1f}%; "
          f"{len(sharp) + len(timed)} SHARP figures, within {100 * worst_sharp:.1f}%.")
    return 0


def winners(results: Sequence[SimResult]) -> List[Tuple[int, str, float]]:
    """(bytes, best algorithm, its time) per size, in size order."""
    by: Dict[int, List[SimResult]] = {}
    for r in results:
        by.setdefault(r.bytes, []).append(r)
    out = []
    for b in sorted(by):
        best = min(by[b], key=lambda r: (r.time_s, FAMILIES.index(r.algorithm)
                                         if r.algorithm in FAMILIES else 99))
        out.append((b, best.algorithm, best.time_s))
    return out


def crossovers(results: Sequence[SimResult]) -> List[str]:
    w = winners(results)
    lines = []
    for (b0, a0, _), (b1, a1, _) in zip(w, w[1:]):
        if a0 != a1:
            lines.append(f"{a0} -> {a1} between {format_size(b0)} and {format_size(b1)}")
    return lines


def pair_crossovers(results: Sequence[SimResult], a: str, b: str) -> List[str]:
    """Sizes where algorithm b starts (or stops) beating a."""
    t: Dict[Tuple[str, int], float] = {(r.algorithm, r.bytes): r.time_s for r in results}
    sizes = sorted({r.bytes for r in results})
    sizes = [s for s in sizes if (a, s) in t and (b, s) in t]
    out = []
    for s0, s1 in zip(sizes, sizes[1:]):
        w0 = t[(b, s0)] < t[(a, s0)]
        w1 = t[(b, s1)] < t[(a, s1)]
        if w0 != w1:
            out.append(f"{b} {'stops' if w0 else 'starts'} beating {a} between "
                       f"{format_size(s0)} and {format_size(s1)}")
    return out


def _busiest(r: SimResult) -> str:
    """The busiest link of a call in words, with its bytes and how busy it was."""
    return (f"{describe_link(r.busiest_link)}: "
            f"{format_size(r.busiest_link_bytes, size_units(r.bytes))} through it, "
            f"busy {100 * r.busiest_link_utilisation:.0f}% of the call ({format_time(r.time_s)})")


def sweep_summary(topo: Topology, collective: str, results: Sequence[SimResult]) -> str:
    """One line: which algorithm is fastest over which sizes, and by how much at the largest."""
    w = winners(results)
    if not w:
        return f"Summary: no sizes simulated on {_cluster(topo)}."
    runs: List[List] = []
    for b, algo, _ in w:
        if runs and runs[-1][0] == algo:
            runs[-1][2] = b
        else:
            runs.append([algo, b, b])
    if len(runs) == 1:
        algo, lo, hi = runs[0]
        ranges = (f"{algo} is the fastest at every size from {format_size(lo)} to "
                  f"{format_size(hi)}" if lo != hi else f"{algo} is the fastest")
    else:
        ranges = "fastest: " + ", ".join(
            f"{algo} {format_size(lo)}" + (f"-{format_size(hi)}" if hi != lo else "")
            for algo, lo, hi in runs)
    big, best, t_best = w[-1]
    at_big = [r for r in results if r.bytes == big]
    worst = max(at_big, key=lambda r: r.time_s)
    busbw = next(r.busbw for r in at_big if r.algorithm == best)
    tail = (f"; at {format_size(big)} {best} takes {format_time(t_best)} "
            f"(busbw {busbw:.1f} GB/s)")
    if worst.algorithm != best:
        tail += f", {worst.time_s / t_best:.1f}x faster than {worst.algorithm}"
    return f"Summary: {collective} on {_cluster(topo)}: {ranges}{tail}."


def render_table(topo: Topology, collective: str, results: Sequence[SimResult],
                 algos: Sequence[str]) -> str:
    p = results[0].ranks if results else topo.endpoints
    lines = [f"# {topo.describe()}",
             f"# {collective}, {p} ranks, one per accelerator. size: the whole buffer (as "
             f"nccl-tests counts it); count: its float32 elements; time: one call; busbw: "
             f"nccl-tests bus bandwidth, GB/s (1 GB = 1e9 B)"]
    rings = sorted({r.channels for r in results if r.algorithm == "ring"})
    if rings and rings != [1]:
        lines.append(f"# ring: {'/'.join(map(str, rings))} channels (rings at once, each "
                     f"crossing the servers on its own NIC; --channels to change)")
    head = (f"{'size':>8} {'count':>11}"
            + "".join(f" {a + ' time':>13} {'busbw GB/s':>10}" for a in algos))
    lines.append(head + "   winner")
    by: Dict[int, Dict[str, SimResult]] = {}
    for r in results:
        by.setdefault(r.bytes, {})[r.algorithm] = r
    w = {b: a for b, a, _ in winners(results)}
    for b in sorted(by):
        row = by[b]
        cnt = next(iter(row.values())).count
        cells = "".join(f" {format_time(row[a].time_s):>13} {row[a].busbw:10.2f}" if a in row
                        else f" {'-':>13} {'-':>10}" for a in algos)
        lines.append(f"{format_size(b):>8} {cnt:>11}{cells}   {w[b]}")
    cx = crossovers(results)
    lines.append("# winner changes: " + ("; ".join(cx) if cx else "none (one winner throughout)"))
    if "ring" in algos:
        t = {(r.algorithm, r.bytes): r.time_s for r in results}
        for other in algos:
            if other == "ring":
                continue
            cx2 = pair_crossovers(results, "ring", other)
            if cx2:
                lines.extend("# " + x for x in cx2)
                continue
            both = [b for b in sorted(by) if ("ring", b) in t and (other, b) in t]
            if not both:
                continue
            lo, hi = both[0], both[-1]
            verb = "beats" if t[(other, lo)] < t[("ring", lo)] else "loses to"
            lines.append(f"# {other} {verb} ring at every size (ring time / {other} time: "
                         f"{t[('ring', lo)] / t[(other, lo)]:.1f}x at {format_size(lo)}, "
                         f"{t[('ring', hi)] / t[(other, hi)]:.1f}x at {format_size(hi)})")
    last = by[max(by)]
    best = min(last.values(), key=lambda r: r.time_s)
    lines.append(f"# busiest link at {format_size(best.bytes)} ({best.algorithm}): "
                 f"{_busiest(best)}")
    return "\n".join(lines)


def plot(results: Sequence[SimResult], algos: Sequence[str], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'minicomm[plot]')") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo in algos:
        pts = sorted((r.bytes, r.busbw) for r in results if r.algorithm == algo)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=algo)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes, nccl-tests)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ parameter server
def _server_counts(text: Optional[str], nodes: int) -> List[int]:
    if text:
        ks = [int(x) for x in text.split(",") if x.strip()]
        if any(k < 1 for k in ks):
            raise ValueError("--servers must be >= 1")
        return ks
    ks, k = [], 1
    while k <= nodes:
        ks.append(k)
        k *= 2
    return ks


def _step_rows(topo: Topology, model: float, prices) -> List[dict]:
    p = topo.endpoints
    rows = []
    for pr in prices:
        algbw = model / pr.time_s / 1e9 if pr.time_s > 0 else 0.0
        row = {"collective": "allreduce" if pr.architecture == "allreduce" else "ps-step",
               "algorithm": pr.algorithm if pr.architecture == "allreduce"
               else f"{pr.architecture}:{pr.servers}",
               "architecture": pr.architecture, "servers": pr.servers,
               "bytes": int(model), "ranks": p, "time_s": pr.time_s, "algbw": algbw,
               "busbw": algbw * busbw_factor("allreduce", p), "detail": pr.detail}
        if pr.result is not None:
            row.update(busiest_link=pr.result.busiest_link,
                       busiest_link_bytes=pr.result.busiest_link_bytes,
                       network_bytes=pr.result.link_bytes_by_kind.get("nic_out", 0.0))
        rows.append(row)
    return rows


def _ps_legend(topo: Topology) -> str:
    machine_bw = topo.nic_link.bandwidth * topo.nics_per_server
    return (f"# ps:k = a parameter server on k extra machines, each with a worker machine's "
            f"{topo.nics_per_server} NICs ({machine_bw / 1e9:.0f} GB/s); ps-colocated:n = a server "
            f"on each of the n worker machines; intra = reduce-scatter + allgather inside each "
            f"server; push/pull = gradients to the servers and parameters back; closed form = "
            f"BytePS' bandwidth-only estimate of push/pull")


def _step_summary(rows: Sequence[dict], model: float, p: int) -> str:
    best = min(rows, key=lambda r: r["time_s"])
    if best["architecture"] == "allreduce":
        other = [r for r in rows if r["architecture"] != "allreduce"]
        kind = "the best parameter server"
    else:
        other = [r for r in rows if r["architecture"] == "allreduce"]
        kind = "the best allreduce"
    text = (f"for {format_size(model)} of gradients per step on {p} accelerators, "
            f"{best['algorithm']} is the fastest ({format_time(best['time_s'])})")
    if other:
        o = min(other, key=lambda r: r["time_s"])
        text += (f"; {kind}, {o['algorithm']}, takes {format_time(o['time_s'])} "
                 f"({o['time_s'] / best['time_s']:.2f}x)")
    return text


def _ps(a, topo: Topology) -> int:
    models = ([parse_size(a.model_bytes)] if a.model_bytes else parse_sizes(a.sizes or "1G"))
    ks = _server_counts(a.servers, topo.servers)
    algos = _algorithms(a.algorithms, topo)
    rows = []
    for model in models:
        prices = ps_model.price_step(topo, model, ks, algos)
        rows += _step_rows(topo, model, prices)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"# {topo.describe()}")
    print("# one data-parallel step's communication: allreduce over all accelerators vs a "
          "parameter server")
    print("# (PS: intra-server ring reduce-scatter, push/pull between machines with each machine's "
          f"{topo.nics_per_server} NICs, intra-server allgather)")
    print(_ps_legend(topo))
    summaries = []
    for model in models:
        sub = [r for r in rows if r["bytes"] == int(model)]
        print(f"\nmodel {format_size(model)} of gradients:")
        for r in sorted(sub, key=lambda r: r["time_s"]):
            print(f"  {r['algorithm']:>16}  {format_time(r['time_s']):>12}   {r['detail']}")
        best = min(sub, key=lambda r: r["time_s"])
        print(f"  winner: {best['algorithm']}")
        summaries.append(_step_summary(sub, model, topo.endpoints))
    print("Summary: " + "; ".join(summaries) + ".")
    return 0


def _alpha(topo: Topology) -> float:
    """One message's latency between servers: the NIC's plus the switches it crosses."""
    return topo.nic_link.latency + (3 if topo.tiers > 1 else 1) * topo.switch_latency


def why(row: dict, price, topo: Topology, model: float) -> str:
    """Why one priced way of a step takes the time it does, from its numbers: the bytes through
    its network links against the least an allreduce needs (2(n-1)/n·M per machine), and, where
    it needs more, what in its structure adds them (a power of two it does not have, one NIC of
    several, a tree's whole-vector levels)."""
    n, nics, p = topo.servers, topo.nics_per_server, topo.endpoints
    name = row["algorithm"]
    u = size_units(model)                          # every size below derives from M
    least = 2 * (n - 1) / n * model                # bytes out of each machine, at least
    if row["architecture"] == "ps-colocated":
        return (f"{name} sends 2(n-1)/n·M = {format_size(least, u)} out of each machine, the least "
                f"an allreduce can, whatever n is")
    if row["architecture"] == "ps":
        k = row["servers"]
        server, worker = n * model / k, model
        pace = ("its k server machines' links set the pace" if server > worker
                else "the workers' links set the pace")
        return (f"{name}: each of its k = {k} server machines carries n·M/k = "
                f"{format_size(server, u)} each way, each worker M = {format_size(worker, u)}: {pace}")
    r = price.result
    if r is None:
        return f"{name}: not simulated"
    if n == 1:
        return (f"{name}: on one server nothing crosses the network; its busiest link is "
                f"{describe_link(r.busiest_link)}, busy {100 * r.busiest_link_utilisation:.0f}% "
                f"of the call")
    least_nic = least / nics
    total = r.link_bytes_by_kind.get("nic_out", 0.0)
    if name == "innet":
        sent = total / (n * nics)
        return (f"innet reduces in the switches (SHARP): each NIC sends {format_size(sent, u)} "
                f"once and receives the result once, {sent / least_nic:.2f}x the "
                f"2(n-1)/n·M/{nics} = {format_size(least_nic, u)} per NIC any allreduce the "
                f"accelerators reduce themselves needs; its busiest link is "
                f"{describe_link(r.busiest_link)}, busy {100 * r.busiest_link_utilisation:.0f}% "
                f"of the call")
    on_nic = r.busiest_link.startswith("NIC ")
    sent = r.busiest_link_bytes if on_nic else total / (n * nics)
    who = (f"busiest NIC ({describe_link(r.busiest_link)}) sends" if on_nic
           else "NICs send on average")
    ratio = sent / least_nic
    if ratio <= 1.1:
        text = (f"{name} is bandwidth-optimal on the network here: its {who} "
                f"{format_size(sent, u)}, the least any allreduce needs, 2(n-1)/n·M/{nics} = "
                f"{format_size(least_nic, u)} per NIC")
    else:
        text = (f"{name}'s {who} {ratio:.2f}x the least an allreduce needs: {format_size(sent, u)} "
                f"against 2(n-1)/n·M/{nics} = {format_size(least_nic, u)} per NIC")
        q = n if name == "hier" else p
        unit = "servers" if name == "hier" else "ranks"
        if name in ("rhd", "hier") and q & (q - 1):
            p2 = 1 << (q.bit_length() - 1)
            text += (f", because its recursive halving/doubling "
                     f"{'between the servers' if name == 'hier' else 'over all ranks'} needs a "
                     f"power of two: {q} = {p2} + {q - p2}, so {q - p2} {unit} first hand their "
                     f"data to a partner and get the result back, on top of the partners' share")
        elif name == "ring" and on_nic and total > 0 and \
                r.busiest_link_bytes / (total / (n * nics)) >= nics / 2 > 0.5:
            text += (f", because a flat ring leaves each server through one NIC of its {nics}")
        elif name == "tree":
            text += ", because a tree forwards the whole vector at every level"
        elif total > 1.05 * 2 * (n - 1) * model:
            text += (f", because it puts {total / (2 * (n - 1) * model):.2f}x the least bytes on "
                     f"the network")
    bw_time = sent / topo.nic_link.bandwidth
    if r.time_s > 0 and bw_time < 0.3 * r.time_s:
        text += (f"; those bytes take {format_time(bw_time)} of its {format_time(r.time_s)}: "
                 f"per-message latency (α = {format_time(_alpha(topo))} per message between "
                 f"servers) and the intra-server phases take the rest")
    return text


def _winner_at_size(topo: Topology, model: float, n: int, algos) -> tuple:
    """(model size, the winner with no extra machines, its time, a colocated PS's time)."""
    rows = _step_rows(topo, model, ps_model.price_step(topo, model, [n], algos, colocated=True))
    hw = min((r for r in rows if r["architecture"] != "ps"), key=lambda r: r["time_s"])
    ps_n = next(r for r in rows if r["architecture"] == "ps")
    return model, hw["algorithm"], hw["time_s"], ps_n["time_s"]


def _advice_summary(topo: Topology, model: float, best, second, margin, ps_rows) -> str:
    """The one-sentence answer: the winner, its margin, and what extra server machines would do."""
    summary = (f"Summary: for {format_size(model, size_units(model))} of gradients per step on "
               f"{topo.endpoints} accelerators ({_n(topo.servers, 'server')}), use "
               f"{best['algorithm']}: {format_time(best['time_s'])} per step"
               + ((f", {margin:.2f}x faster than {second['algorithm']}" if margin >= 1.02 else
                   f", tied with {second['algorithm']} ({margin:.3f}x)") if second else ""))
    if ps_rows:
        fastest = min(ps_rows, key=lambda r: r["time_s"])
        if fastest["time_s"] < best["time_s"]:
            summary += (f"; with {_n(fastest['servers'], 'extra server machine')} "
                        f"{fastest['algorithm']} takes {format_time(fastest['time_s'])}")
    return summary + "."


def _server_crossover_line(best, ps_rows, k_star: float, k_sim, symbols: str) -> str:
    """Where a separate PS starts to beat the winner: closed form, then the simulated first k."""
    if not (math.isfinite(k_star) and k_star > 0):
        return (f"server-count crossover: none — t_intra + M/B (one worker's push) already "
                f"exceeds t, where {symbols}")
    ks = [r["servers"] for r in ps_rows]
    return (f"server-count crossover: a separate PS beats {best['algorithm']} from "
            f"k = n M / (B (t - t_intra)) = {k_star:.1f} server machines, where {symbols} "
            f"(closed form); "
            + (f"simulated: k = {k_sim} is the first of {ks} that does" if k_sim else
               f"simulated: none of k = {ks} does"))


def _advise(a, topo: Topology) -> int:
    """The seed's selection question, computed: on these accelerators, allreduce (each family) or
    a parameter server (colocated: no extra machines; or k extra server machines) for one step's
    gradients; the winner, by how much, why, and where the answer changes with model size and k."""
    if not a.model_bytes:
        raise ValueError("--advise needs --model-bytes (e.g. 350GB)")
    model = parse_size(a.model_bytes)
    u = size_units(model)                          # sizes derived from M print in its units
    n = topo.servers
    ks = _server_counts(a.servers, n)
    algos = _algorithms(a.algorithms, topo, innet_where_it_runs=True)
    prices = ps_model.price_step(topo, model, ks, algos)
    rows = _step_rows(topo, model, prices)
    price_of = {row["algorithm"]: pr for row, pr in zip(rows, prices)}
    ranked = sorted(rows, key=lambda r: r["time_s"])
    same_hw = [r for r in ranked if r["architecture"] != "ps"]     # no extra machines
    best, second = same_hw[0], (same_hw[1] if len(same_hw) > 1 else None)
    best_ar = min((r for r in rows if r["architecture"] == "allreduce"), key=lambda r: r["time_s"])
    ps_rows = sorted((r for r in rows if r["architecture"] == "ps"), key=lambda r: r["servers"])
    k_sim = next((r["servers"] for r in ps_rows if r["time_s"] < best["time_s"]), None)
    machine_bw = topo.nic_link.bandwidth * topo.nics_per_server
    intra = (ps_model.intra_time(topo, "reduce_scatter", model)
             + ps_model.intra_time(topo, "allgather", model))
    k_star = ps_model.crossover_servers(n, machine_bw, model, best["time_s"] - intra)
    # the answer against model size (same hardware; and with n extra server machines)
    sweep_models = [model * f for f in (1e-6, 1e-4, 1e-2, 1.0)]
    by_size = [_winner_at_size(topo, m, n, algos) for m in sweep_models]
    size_cx = [f"{w0} -> {w1} between {format_size(m0, u)} and {format_size(m1, u)}"
               for (m0, w0, _, _), (m1, w1, _, _) in zip(by_size, by_size[1:]) if w0 != w1]
    # why the winner wins, and why the runner-up and the best of the other kind do not
    explained = [best] + [r for r in (second, best_ar) if r is not None and r is not best]
    reasons = []
    for r in explained:
        if r not in [x for x, _ in reasons]:
            reasons.append((r, why(r, price_of[r["algorithm"]], topo, model)))
    margin = (second["time_s"] / best["time_s"]) if second else None
    summary = _advice_summary(topo, model, best, second, margin, ps_rows)
    out = {"model_bytes": model, "gpus": topo.endpoints, "topology": topo.name,
           "winner": best["algorithm"], "winner_architecture": best["architecture"],
           "winner_time_s": best["time_s"],
           "runner_up": second["algorithm"] if second else None,
           "margin": margin,
           "best_allreduce": best_ar["algorithm"], "best_allreduce_time_s": best_ar["time_s"],
           "best_with_server_machines": ps_rows[-1]["algorithm"] if ps_rows else None,
           "ps_servers_to_match": k_star, "ps_servers_beating_simulated": k_sim,
           "winners_by_model_size": [{"model_bytes": m, "winner": w, "time_s": t,
                                      f"ps_{n}_servers_time_s": tp}
                                     for m, w, t, tp in by_size],
           "why": {r["algorithm"]: text for r, text in reasons},
           "summary": summary[len("Summary: "):],
           "rows": rows}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"# {topo.describe()}")
    print(f"# M = {format_size(model, u)} of gradients per step (GPT-3 175B in fp16: 350 GB), "
          f"{topo.endpoints} accelerators on n = {_n(n, 'machine')}, data parallel")
    print(_ps_legend(topo))
    for r in ranked:
        print(f"  {r['algorithm']:>16}  {format_time(r['time_s']):>12}   {r['detail']}")
    print(f"winner on these {topo.endpoints} accelerators (no extra machines): "
          f"{best['algorithm']} ({best['architecture']}), {format_time(best['time_s'])}"
          + ((f", {margin:.2f}x faster than {second['algorithm']}" if margin >= 1.02 else
              f", a tie with {second['algorithm']} ({margin:.3f}x)") if second else ""))
    for r, text in reasons:
        print(f"why {'it wins' if r is best else 'not ' + r['algorithm']}: {text}")
    if ps_rows:
        fastest = min(ps_rows, key=lambda r: r["time_s"])
        verdict = ("faster" if fastest["time_s"] < best["time_s"] else "slower")
        print(f"with extra server machines: {fastest['algorithm']} "
              f"{format_time(fastest['time_s'])}, "
              f"{max(best['time_s'], fastest['time_s']) / min(best['time_s'], fastest['time_s']):.2f}x "
              f"{verdict} than {best['algorithm']}")
    symbols = (f"n = {_n(n, 'worker machine')}, M = {format_size(model, u)} of gradients, "
               f"B = {machine_bw / 1e9:.0f} GB/s per machine, t = {best['algorithm']}'s "
               f"{format_time(best['time_s'])}, t_intra = {format_time(intra)} inside the servers")
    print(_server_crossover_line(best, ps_rows, k_star, k_sim, symbols))
    print("model-size crossover (no extra machines): "
          + ("; ".join(size_cx) if size_cx else
             f"none between {format_size(sweep_models[0], u)} and {format_size(model, u)}"))
    print("  " + "; ".join(f"{format_size(m, u)}: {w} {format_time(t)} (ps:{n} {format_time(tp)})"
                           for m, w, t, tp in by_size))
    print(summary)
    return 0


def _interconnects(topo: Topology) -> List[Tuple[str, str, float, bool, Topology]]:
    """(label, link preset, switch latency, SHARP on, topology) of every compared setup: each
    of INTERCONNECTS with its switches not reducing and, where a preset's switches reduce on
    that link (``presets.sharp_settings``; the topology's own SHARP figures first), reducing
    (not on full-mesh servers, whose SHARP the model refuses)."""
    out = []
    for label, name, sw in INTERCONNECTS:
        t = topo.replace(nic_link=link(name), switch_latency=sw, name=f"{topo.name}+{name}",
                         sharp=False)
        out.append((label, name, sw, False, t))
        on = (sharp_settings(topo) if topo.sharp and topo.nic_link.name == name
              else sharp_settings(name))
        if on and topo.intra != "fullmesh":   # SHARP on full-mesh servers is not modelled
            out.append((label, name, sw, True, t.replace(name=f"{t.name}+sharp", **on)))
    return out


def _compare(a, topo: Topology) -> int:
    sizes = parse_sizes(a.sizes or "1M,64M,1G")
    algos = _algorithms(a.algorithms, topo)
    setups = _interconnects(topo)
    # innet where a switch reduces (with SHARP, always), nowhere else
    row_algos = {(label, sharp): [x for x in algos if x != "innet" or innet_runs_on(t)]
                 + (["innet"] if sharp and "innet" not in algos else [])
                 for label, _, _, sharp, t in setups}
    columns = algos + sorted({x for v in row_algos.values() for x in v} - set(algos))
    rows = []
    for label, name, sw, sharp, t in setups:
        for s in sizes:
            for algo in row_algos[(label, sharp)]:
                r = simulate(a.collective, algo, t, nbytes=s, root=a.root, exact=a.exact,
                             channels=a.channels if algo in ("ring", "tree") else None)
                d = r.to_dict()
                d["interconnect"] = label
                d["sharp"] = sharp
                d["requested_bytes"] = s
                rows.append(d)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"# {topo.describe()}")
    print(f"# {a.collective} on the same {topo.servers} servers x {topo.gpus_per_server}, with "
          f"each interconnect between them ({topo.nics_per_server} NICs per server); α = the "
          f"latency of one message on the link, paid again at every switch it crosses:")
    for label, name, sw, sharp, t in setups:
        ln = link(name)
        if sharp:
            print(f"#   {label} + SHARP: the same, its leaf and spine switches reducing (innet): "
                  f"{t.sharp_port_bandwidth / 1e9:g} GB/s per NIC port, "
                  f"{t.sharp_latency * 1e6:g} us per reducing switch (illustrative)")
            continue
        print(f"#   {label}: {ln.bandwidth / 1e9:g} GB/s effective of {ln.line_rate / 1e9:g} GB/s "
              f"line rate per NIC, α {ln.latency * 1e6:g} us + {sw * 1e6:g} us per switch"
              f"{'  (illustrative)' if ln.illustrative else ''}"
              + ("" if sharp_settings(name) else "; no modelled switch of it reduces"))
    print(f"{'interconnect':>20} {'size':>8}" + "".join(f" {x + ' time':>13} {'busbw GB/s':>10}"
                                                       for x in columns) + "   best")
    best_of: Dict[Tuple[str, int], dict] = {}
    labels = [label + (" + SHARP" if sharp else "") for label, _, _, sharp, _ in setups]
    for (label, _, _, sharp, _), shown in zip(setups, labels):
        for s in sizes:
            sub = {r["algorithm"]: r for r in rows if r["interconnect"] == label
                   and r["sharp"] == sharp and r["requested_bytes"] == s}
            if not sub:
                continue
            cells = "".join(f" {format_time(sub[x]['time_s']):>13} {sub[x]['busbw']:10.2f}"
                            if x in sub else f" {'-':>13} {'-':>10}" for x in columns)
            best = best_of[(shown, s)] = min(sub.values(), key=lambda r: r["time_s"])
            print(f"{shown:>20} {format_size(s):>8}{cells}   {best['algorithm']} "
                  f"{best['busbw']:.1f} GB/s busbw")
    parts = []
    for s in sizes:
        by = sorted(((best_of[(shown, s)], shown) for shown in labels if (shown, s) in best_of),
                    key=lambda x: x[0]["time_s"])
        (fast, fl), (slow, sl) = by[0], by[-1]
        parts.append(f"at {format_size(s)} {fl} is the fastest ({fast['algorithm']}, "
                     f"{format_time(fast['time_s'])}), {sl} {slow['time_s'] / fast['time_s']:.2f}x "
                     f"slower")
    print(f"Summary: {a.collective} on {topo.servers} servers x {topo.gpus_per_server} "
          f"accelerators ({topo.nics_per_server} NICs per server) with each interconnect: "
          + "; ".join(parts) + ".")
    return 0


# ------------------------------------------------------------------------------ in-network gain
def innet_gain(topo: Topology, collective: str, sizes: Sequence[int], algos: Sequence[str],
               root: int = 0) -> List[dict]:
    """Per size: the fastest of ``algos`` (the accelerators reduce) and innet (the switches
    do), their times and busbw, and the gain (the fastest's time / innet's)."""
    if not innet_runs_on(topo):
        raise ValueError(f"{topo.name}: no switch reduces on {_n(topo.servers, 'server')}: "
                         f"innet needs NVLink SHARP on one server (dgx-h100 --nodes 1) or "
                         f"network.sharp = true across servers (dgx-h100-sharp, dgx-a100-sharp, "
                         f"or a topology file)")
    out = []
    for s in sizes:
        best = min((simulate(collective, x, topo, nbytes=s, root=root) for x in algos
                    if x != "innet"), key=lambda r: r.time_s)
        r = simulate(collective, "innet", topo, nbytes=s, root=root)
        out.append({"topology": topo.name, "collective": collective, "bytes": r.bytes,
                    "requested_bytes": s, "ranks": r.ranks, "best": best.algorithm,
                    "best_time_s": best.time_s, "best_busbw": best.busbw,
                    "innet_time_s": r.time_s, "innet_busbw": r.busbw,
                    "gain": best.time_s / r.time_s if r.time_s > 0 else math.inf})
    return out


def _innet_gain(a, topo: Topology) -> int:
    sizes = parse_sizes(a.sizes or "8:1G")
    algos = [x for x in _algorithms(a.algorithms, topo) if x != "innet"] or list(FAMILIES)
    rows = innet_gain(topo, a.collective, sizes, algos, a.root)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        where = ("its NVSwitch reduces: NVLink SHARP" if topo.servers == 1
                 else "the network's switches reduce: SHARP" + (", and each NVSwitch: NVLS"
                                                                if topo.nvls_bandwidth else ""))
        print(f"# {topo.describe()}")
        print(f"# {a.collective} on {rows[0]['ranks']} ranks: the fastest of {', '.join(algos)} "
              f"(the accelerators reduce) against innet ({where}); gain = its time / innet's; "
              f"busbw in GB/s")
        print(f"{'size':>8} {'without':>8} {'time':>11} {'busbw':>8} {'innet time':>11} "
              f"{'busbw':>8} {'gain':>7}")
        for r in rows:
            print(f"{format_size(r['bytes']):>8} {r['best']:>8} {format_time(r['best_time_s']):>11} "
                  f"{r['best_busbw']:8.1f} {format_time(r['innet_time_s']):>11} "
                  f"{r['innet_busbw']:8.1f} {r['gain']:6.2f}x")
    if a.plot:
        plot_innet_gain([(topo.name, rows)], a.plot)
        if not a.json:
            print(f"wrote {a.plot}")
    if not a.json:
        print(innet_gain_summary(topo, a.collective, rows))
    return 0


def innet_gain_summary(topo: Topology, collective: str, rows: Sequence[dict]) -> str:
    """One line: innet against the fastest family at the smallest and the largest size, and
    the size ranges where innet wins."""
    def at(r: dict) -> str:
        return (f"at {format_size(r['bytes'])} innet takes {format_time(r['innet_time_s'])} "
                f"against {r['best']}'s {format_time(r['best_time_s'])} ({r['gain']:.2f}x")
    lo, hi = rows[0], rows[-1]
    text = f"Summary: in-network reduction on {_cluster(topo)}, {collective}: {at(lo)})"
    if hi is not lo:
        text += (f", {at(hi)}, busbw {hi['innet_busbw']:.1f} against {hi['best_busbw']:.1f} "
                 f"GB/s)")
    spans: List[List[int]] = []
    for i, r in enumerate(rows):
        if r["gain"] > 1:
            if spans and spans[-1][1] == i - 1:
                spans[-1][1] = i
            else:
                spans.append([i, i])
    where = ", ".join(format_size(rows[a]["bytes"]) + (f"-{format_size(rows[b]['bytes'])}"
                                                         if b > a else "") for a, b in spans)
    return text + f"; innet wins {'at ' + where if spans else 'at no size'}."


def plot_innet_gain(series: Sequence[Tuple[str, Sequence[dict]]], path: str) -> None:
    """busbw with and without in-network reduction against size, one panel per topology, and
    the time gain below."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'minicomm[plot]')") from None
    fig, axes = plt.subplots(2, len(series), figsize=(6 * len(series), 6.5), squeeze=False,
                             sharex="col", gridspec_kw={"height_ratios": [3, 2]})
    for col, (title, rows) in enumerate(series):
        x = [r["bytes"] for r in rows]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(x, [r["best_busbw"] for r in rows], marker="o", ms=3,
                 label="fastest without (ring/tree/rhd/hier)")
        top.plot(x, [r["innet_busbw"] for r in rows], marker="o", ms=3, label="innet")
        top.set_ylabel("busbw (GB/s)")
        top.set_title(title)
        top.legend()
        bottom.plot(x, [r["gain"] for r in rows], marker="o", ms=3, color="C2")
        bottom.axhline(1.0, color="grey", lw=0.8)
        bottom.set_yscale("log")
        bottom.set_yticks([0.125, 0.25, 0.5, 1, 2, 4, 8])
        bottom.set_ylim(min(0.8, min(r["gain"] for r in rows) / 1.3),
                        max(1.25, max(r["gain"] for r in rows) * 1.3))
        bottom.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        bottom.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        bottom.set_ylabel("gain: time without / with innet")
        bottom.set_xlabel("size (bytes, nccl-tests)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
