"""``minicomm sim``: predict collectives (and the parameter server) on a modelled cluster.

    minicomm sim --topology dgx-h100 --nodes 128 --collective allreduce --sizes 1K:1G --algorithms all
    minicomm sim --topology my.toml --sizes 1M,64M,1G --algorithms ring,hier --json
    minicomm sim --topology dgx-h100 --nodes 16 --sizes 1K:1G --plot busbw.png
    minicomm sim --explain
    minicomm sim --architecture ps --servers 8 --topology dgx-h100 --nodes 16 --model-bytes 1G
    minicomm sim --advise --model-bytes 350G --gpus 1024 --topology dgx-h100
    minicomm sim --compare-interconnects --topology dgx-h100 --nodes 16 --sizes 1G

Sizes (``--sizes``) are nccl-tests sizes (the whole buffer, see ``minicomm bench``): a range
``A:B`` (x2 steps) or a comma list; each a plain byte count or with K/M/G (powers of 1024).
``--model-bytes`` counts decimal units (350G = 350e9 B, the GPT-3 fp16 figure; "GiB" for
powers of 1024). The table prints time and busbw per algorithm and the winner per size, then the
sizes where the winner changes. ``--json`` prints a JSON list of objects instead, each with at
least collective, algorithm, bytes, ranks, time_s, algbw, busbw (GB/s = 1e9 B/s).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from ..algorithms import FAMILIES
from ..schedule import COLLECTIVES
from . import ps_model
from .engine import ScheduleError, SimResult, busbw_factor, simulate
from .presets import INTERCONNECTS, get_topology, link, topologies
from .topology import Topology

_SUFFIX = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?)(I?B?)\s*$",
                     re.IGNORECASE)


def parse_size(text: str, decimal: bool = False) -> int:
    """'4096' -> 4096, '4K' -> 4096, '1G' -> 2**30 (decimal: '350G' -> 350e9; 'GiB' always
    binary, 'GB' decimal when decimal=True)."""
    m = _SUFFIX.match(str(text))
    if not m:
        raise ValueError(f"size {text!r}: expected a number with an optional K, M, G or T suffix")
    num, unit, tail = float(m.group(1)), m.group(2).upper(), m.group(3).upper()
    binary = (not decimal) or tail.startswith("I")
    mult = {"": 1, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    value = num * ((1024 if binary else 1000) ** mult) if unit else num
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def parse_sizes(text: str) -> List[int]:
    """'1K:1G' (x2 steps, both ends included) or '1K,64M,1G'."""
    text = str(text).strip()
    if ":" in text:
        lo_s, _, hi_s = text.partition(":")
        lo, hi = parse_size(lo_s), parse_size(hi_s)
        if lo <= 0 or hi < lo:
            raise ValueError(f"size range {text!r}: need 0 < start <= end")
        out = []
        s = lo
        while s <= hi:
            out.append(s)
            s *= 2
        return out
    out = [parse_size(x) for x in text.split(",") if x.strip()]
    if not out:
        raise ValueError("no sizes given")
    return out


def _fmt_bytes(n: float) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{int(n // div)}{unit}"
    return f"{int(n)}"


def _fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", default="dgx-h100",
                   help=f"a preset ({', '.join(sorted(topologies()))}) or a .toml / .json file")
    p.add_argument("--nodes", type=int, default=None, help="servers (default: the preset's)")
    p.add_argument("--collective", default="allreduce",
                   help=f"one of {', '.join(COLLECTIVES)}")
    p.add_argument("--sizes", default=None, help="A:B (x2 steps) or a comma list (default 1K:1G)")
    p.add_argument("--algorithms", default="all",
                   help=f"'all' or a comma list of {', '.join(FAMILIES)}")
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print a JSON list of rows instead")
    p.add_argument("--plot", metavar="FILE", help="draw busbw vs size per algorithm (matplotlib)")
    p.add_argument("--explain", action="store_true",
                   help="the GPT-3 traffic arithmetic (flat ring vs hier, the 89.6 TB figure)")
    p.add_argument("--architecture", choices=("allreduce", "ps"), default="allreduce",
                   help="ps: price a training step's communication with a parameter server too")
    p.add_argument("--servers", default=None,
                   help="PS server machines: K or a comma list (default: 1,2,4,... up to nodes)")
    p.add_argument("--advise", action="store_true",
                   help="which architecture / algorithm wins for --model-bytes on --gpus")
    p.add_argument("--model-bytes", default=None, help="gradient bytes per step (350G = 350e9)")
    p.add_argument("--gpus", type=int, default=None, help="accelerators (sets --nodes)")
    p.add_argument("--compare-interconnects", action="store_true",
                   help="the same collective with IB NDR, RoCEv2 and UB between the servers")
    p.add_argument("--exact", action="store_true",
                   help="build every rank's schedule (no rank-symmetry shortcut)")


def main(a) -> int:
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
    return topo.with_servers(nodes) if nodes is not None else topo


def _algorithms(text: str, topo: Topology) -> List[str]:
    if text.strip() == "all":
        algos = list(FAMILIES)
    else:
        algos = [x.strip() for x in text.split(",") if x.strip()]
        for x in algos:
            if x not in FAMILIES:
                raise ValueError(f"unknown algorithm {x!r}; choose 'all' or from "
                                 f"{', '.join(FAMILIES)}")
    return algos


def _main(a) -> int:
    topo = _topology(a)
    if a.collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {a.collective!r}; choose one of {', '.join(COLLECTIVES)}")
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
    sizes = parse_sizes(a.sizes or "1K:1G")
    algos = _algorithms(a.algorithms, topo)
    results = sweep(topo, a.collective, sizes, algos, root=a.root, exact=a.exact)
    if a.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(render_table(topo, a.collective, results, algos))
    if a.plot:
        plot(results, algos, a.plot, f"{a.collective} on {topo.name}, {topo.endpoints} ranks")
        if not a.json:
            print(f"wrote {a.plot}")
    return 0


def sweep(topo: Topology, collective: str, sizes: Sequence[int], algos: Sequence[str],
          root: int = 0, exact: bool = False) -> List[SimResult]:
    out = []
    for s in sizes:
        for algo in algos:
            out.append(simulate(collective, algo, topo, nbytes=s, root=root, exact=exact))
    return out


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
            lines.append(f"{a0} -> {a1} between {_fmt_bytes(b0)} and {_fmt_bytes(b1)}")
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
                       f"{_fmt_bytes(s0)} and {_fmt_bytes(s1)}")
    return out


def render_table(topo: Topology, collective: str, results: Sequence[SimResult],
                 algos: Sequence[str]) -> str:
    p = results[0].ranks if results else topo.endpoints
    lines = [f"# {topo.describe()}",
             f"# {collective}, {p} ranks; time and busbw (GB/s) per algorithm, nccl-tests sizes"]
    head = f"{'size':>8} {'count':>11}" + "".join(f" {a + ' time':>13} {'busbw':>7}" for a in algos)
    lines.append(head + "   winner")
    by: Dict[int, Dict[str, SimResult]] = {}
    for r in results:
        by.setdefault(r.bytes, {})[r.algorithm] = r
    w = {b: a for b, a, _ in winners(results)}
    for b in sorted(by):
        row = by[b]
        cnt = next(iter(row.values())).count
        cells = "".join(f" {_fmt_time(row[a].time_s):>13} {row[a].busbw:7.2f}" if a in row
                        else f" {'-':>13} {'-':>7}" for a in algos)
        lines.append(f"{_fmt_bytes(b):>8} {cnt:>11}{cells}   {w[b]}")
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
            lines.append(f"# {other} {verb} ring at every size ({t[('ring', lo)] / t[(other, lo)]:.1f}x "
                         f"at {_fmt_bytes(lo)}, {t[('ring', hi)] / t[(other, hi)]:.1f}x at "
                         f"{_fmt_bytes(hi)})")
    last = by[max(by)]
    best = min(last.values(), key=lambda r: r.time_s)
    lines.append(f"# busiest link at {_fmt_bytes(best.bytes)} ({best.algorithm}): "
                 f"{best.busiest_link}, {100 * best.busiest_link_utilisation:.0f}% busy")
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
        rows.append({"collective": "allreduce" if pr.architecture == "allreduce" else "ps-step",
                     "algorithm": pr.algorithm if pr.architecture == "allreduce"
                     else f"{pr.architecture}:{pr.servers}",
                     "architecture": pr.architecture, "servers": pr.servers,
                     "bytes": int(model), "ranks": p, "time_s": pr.time_s, "algbw": algbw,
                     "busbw": algbw * busbw_factor("allreduce", p), "detail": pr.detail})
    return rows


def _ps(a, topo: Topology) -> int:
    models = ([parse_size(a.model_bytes, decimal=True)] if a.model_bytes
              else parse_sizes(a.sizes or "1G"))
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
          f"{topo.nics_per_server} NICs, intra allgather; servers = separate machines with the "
          "same bandwidth; ps-colocated: a server on every machine)")
    for model in models:
        sub = [r for r in rows if r["bytes"] == int(model)]
        print(f"\nmodel {model / 1e9:g} GB:")
        for r in sorted(sub, key=lambda r: r["time_s"]):
            print(f"  {r['algorithm']:>16}  {_fmt_time(r['time_s']):>12}   {r['detail']}")
        best = min(sub, key=lambda r: r["time_s"])
        print(f"  winner: {best['algorithm']}")
    return 0


def _advise(a, topo: Topology) -> int:
    """The seed's selection question, computed: on these accelerators, allreduce (each family) or
    a parameter server (colocated: no extra machines; or k extra server machines) for one step's
    gradients; the winner, by how much, and where the answer changes with model size and k."""
    if not a.model_bytes:
        raise ValueError("--advise needs --model-bytes (e.g. 350G)")
    model = parse_size(a.model_bytes, decimal=True)
    n = topo.servers
    ks = _server_counts(a.servers, n)
    rows = _step_rows(topo, model, ps_model.price_step(topo, model, ks))
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
    by_size = []
    for m in sweep_models:
        pr = _step_rows(topo, m, ps_model.price_step(topo, m, [n], colocated=True))
        hw = min((r for r in pr if r["architecture"] != "ps"), key=lambda r: r["time_s"])
        ps_n = next(r for r in pr if r["architecture"] == "ps")
        by_size.append((m, hw["algorithm"], hw["time_s"], ps_n["time_s"]))
    size_cx = [f"{w0} -> {w1} between {m0 / 1e9:.3g} GB and {m1 / 1e9:.3g} GB"
               for (m0, w0, _, _), (m1, w1, _, _) in zip(by_size, by_size[1:]) if w0 != w1]
    out = {"model_bytes": model, "gpus": topo.endpoints, "topology": topo.name,
           "winner": best["algorithm"], "winner_architecture": best["architecture"],
           "winner_time_s": best["time_s"],
           "runner_up": second["algorithm"] if second else None,
           "margin": (second["time_s"] / best["time_s"]) if second else None,
           "best_allreduce": best_ar["algorithm"], "best_allreduce_time_s": best_ar["time_s"],
           "best_with_server_machines": ps_rows[-1]["algorithm"] if ps_rows else None,
           "ps_servers_to_match": k_star, "ps_servers_beating_simulated": k_sim,
           "winners_by_model_size": [{"model_bytes": m, "winner": w, "time_s": t,
                                      f"ps_{n}_servers_time_s": tp}
                                     for m, w, t, tp in by_size],
           "rows": rows}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"# {topo.describe()}")
    print(f"# {model / 1e9:g} GB of gradients per step (GPT-3 175B fp16: 350 GB), "
          f"{topo.endpoints} accelerators, data parallel; ps:k = k extra server machines of "
          f"{machine_bw / 1e9:.0f} GB/s each (a worker machine's NICs, BytePS' assumption)")
    for r in ranked:
        print(f"  {r['algorithm']:>16}  {_fmt_time(r['time_s']):>12}   {r['detail']}")
    print(f"winner on these {topo.endpoints} accelerators (no extra machines): "
          f"{best['algorithm']} ({best['architecture']}), {_fmt_time(best['time_s'])}"
          + ((f", {second['time_s'] / best['time_s']:.2f}x faster than {second['algorithm']}"
              if second['time_s'] / best['time_s'] >= 1.02 else
              f", a tie with {second['algorithm']} ({second['time_s'] / best['time_s']:.3f}x: "
              f"both move 2(n-1)/n M per machine)") if second else ""))
    if ps_rows:
        fastest = min(ps_rows, key=lambda r: r["time_s"])
        verdict = ("faster" if fastest["time_s"] < best["time_s"] else "slower")
        print(f"with extra server machines: {fastest['algorithm']} {_fmt_time(fastest['time_s'])}, "
              f"{max(best['time_s'], fastest['time_s']) / min(best['time_s'], fastest['time_s']):.2f}x "
              f"{verdict} than {best['algorithm']}")
    if math.isfinite(k_star) and k_star > 0:
        print(f"server-count crossover: a separate PS beats {best['algorithm']} from k = n M / "
              f"(B (t - t_intra)) = {k_star:.1f} server machines for {n} workers (closed form); "
              + (f"simulated: k = {k_sim} is the first of {[r['servers'] for r in ps_rows]} "
                 f"that does" if k_sim else
                 f"simulated: none of k = {[r['servers'] for r in ps_rows]} does"))
    else:
        print(f"server-count crossover: none — intra-server phases plus one worker's push M/B "
              f"already exceed {best['algorithm']}")
    print("model-size crossover (no extra machines): "
          + ("; ".join(size_cx) if size_cx else
             f"none between {sweep_models[0] / 1e9:.3g} GB and {model / 1e9:g} GB"))
    print("  " + "; ".join(f"{m / 1e9:.3g} GB: {w} {_fmt_time(t)} (ps:{n} {_fmt_time(tp)})"
                           for m, w, t, tp in by_size))
    return 0


def _compare(a, topo: Topology) -> int:
    sizes = parse_sizes(a.sizes or "1M,64M,1G")
    algos = _algorithms(a.algorithms, topo)
    rows = []
    for label, name, sw in INTERCONNECTS:
        t = topo.replace(nic_link=link(name), switch_latency=sw, name=f"{topo.name}+{name}")
        for s in sizes:
            for algo in algos:
                r = simulate(a.collective, algo, t, nbytes=s, root=a.root, exact=a.exact)
                d = r.to_dict()
                d["interconnect"] = label
                d["requested_bytes"] = s
                rows.append(d)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"# {topo.describe()}")
    print(f"# {a.collective} on the same {topo.servers} servers x {topo.gpus_per_server}, with "
          f"each interconnect between them ({topo.nics_per_server} NICs per server):")
    for label, name, sw in INTERCONNECTS:
        ln = link(name)
        print(f"#   {label}: {ln.bandwidth / 1e9:g} GB/s effective of {ln.line_rate / 1e9:g} line, "
              f"α {ln.latency * 1e6:g} us + {sw * 1e6:g} us per switch"
              f"{'  (illustrative)' if ln.illustrative else ''}")
    print(f"{'interconnect':>14} {'size':>6}" + "".join(f" {x + ' time':>13} {'busbw':>7}"
                                                     for x in algos) + "   best")
    for label, _, _ in INTERCONNECTS:
        for s in sizes:
            sub = {r["algorithm"]: r for r in rows if r["interconnect"] == label
                   and r["requested_bytes"] == s}
            cells = "".join(f" {_fmt_time(sub[x]['time_s']):>13} {sub[x]['busbw']:7.2f}"
                            if x in sub else f" {'-':>13} {'-':>7}" for x in algos)
            best = min(sub.values(), key=lambda r: r["time_s"])
            print(f"{label:>14} {_fmt_bytes(s):>6}{cells}   {best['algorithm']} "
                  f"{best['busbw']:.1f} GB/s")
    return 0
