"""Parameter-server communication in the simulator: push/pull written as schedules of the IR.

One synchronous training step moves every worker's gradient (M bytes) to k servers and the
updated parameters back (BytePS, OSDI '20, section 3). The model is cut into ``rounds`` rounds;
in round i every worker pushes one shard of M / (rounds * k) bytes to every server at once, and
receives the shards of round i - 1 back (pull), so pushes and pulls overlap on the two
directions of every link, as BytePS pipelines them:

  worker w, step i:  Send(push round i -> every server)   Recv(pull round i-1 <- every server)
  server s, step i:  Recv(push round i <- every worker, reduce)   Send(pull round i-1 -> every worker)

Colocated (``colocated=True``): every one of the n machines is a worker and, for k = n, a server
(the first k machines host the servers): one rank does both roles in one step, and its shard to
itself is a local copy. These schedules run on the same engine as the collectives, on a
machine-level topology (``machine_topology``: one endpoint per machine with the machine's whole
network bandwidth — a DGX's 8 NICs — under the original fat-tree).

Closed forms (BytePS, contention-free, B = per-machine bandwidth, M = model bytes):
  allreduce                2(n-1)M/(nB)
  colocated PS, k = n      2(n-1)M/(nB)       (the same: every machine sends its pushes and serves)
  non-colocated PS         max(M/B, nM/(kB))   (worker links vs server links)
The simulation matches them within 1% (tests/test_sim.py) when α is small against a round and
rounds >= 200 (the pipeline's fill and drain cost one round: relative error ~1/rounds).

A step of a GPU cluster (``price_step``): intra-server reduce-scatter over NVLink (the engine, ring
family), then PS push/pull between machines, then intra-server allgather — versus allreduce of
every family over all accelerators.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..schedule import Recv, Send
from .engine import Program, SimResult, _program, simulate, simulate_program
from .topology import LinkSpec, Topology
from .units import describe_link, format_time

DEFAULT_ROUNDS = 256
MAX_MESSAGES = 1 << 20        # fewer rounds when n * k is large (a round is 2nk messages)


def closed_form_allreduce(n: int, model_bytes: float, bandwidth: float) -> float:
    return 2 * (n - 1) * model_bytes / (n * bandwidth) if n > 1 else 0.0


def closed_form_ps(n: int, k: int, model_bytes: float, bandwidth: float,
                   colocated: bool = False) -> float:
    """BytePS' closed forms (bandwidth-only, contention-free)."""
    if colocated:
        # a server machine's out link carries its pushes to the k-1 other servers and its
        # shard's pulls to the n-1 other workers; a machine without a server pushes M
        return max(1.0, (n + k - 2) / k) * model_bytes / bandwidth if n > 1 else 0.0
    return max(model_bytes / bandwidth, n * model_bytes / (k * bandwidth))


def machine_topology(topo: Topology, machines: int) -> Topology:
    """One endpoint per machine, with the machine's total network bandwidth (all its NICs), under
    the same fat-tree (leaf groups of the same number of servers, same oversubscription); its
    NICs issue messages in parallel (gap / NICs)."""
    nic = topo.nic_link
    nps = topo.nics_per_server
    # the machine's NICs issue messages in parallel: one gap per message over all of them
    total = LinkSpec(f"{nps} x {nic.name}", nic.bandwidth * nps, nic.latency,
                     nic.line_rate * nps, nic.source, nic.illustrative, gap=nic.gap / nps)
    return dataclasses.replace(topo, name=f"{topo.name} (machines)", servers=machines,
                               gpus_per_server=1, nics_per_server=1, rails=False,
                               intra="nvswitch", intra_link=total, nic_link=total,
                               pcie_root_bandwidth=None)


def rounds_for(n: int, k: int, rounds: Optional[int] = None, transfer_s: float = 0.0,
               alpha_s: float = 0.0) -> int:
    """Pipeline rounds: given, or about sqrt(transfer / α) — filling and draining the pipeline
    costs ~transfer / rounds, every round pays α: the sum is smallest there (BytePS tunes its
    partition size for the same reason) — within 1..DEFAULT_ROUNDS and MAX_MESSAGES."""
    if rounds is not None:
        if rounds < 1:
            raise ValueError("rounds must be >= 1")
        return int(rounds)
    best = math.sqrt(transfer_s / alpha_s) if alpha_s > 0 else DEFAULT_ROUNDS
    cap = MAX_MESSAGES // max(1, 2 * n * k)
    return int(max(1, min(DEFAULT_ROUNDS, cap, round(best))))


def ps_schedules(n: int, k: int, shard_count: int, rounds: int,
                 colocated: bool) -> List[List[Tuple]]:
    """Step lists of every rank: workers 0..n-1, then (not colocated) servers n..n+k-1; colocated
    servers are ranks 0..k-1. ``shard_count`` elements per (round, server) shard. A colocated
    rank's step lists its server's pull sends, its worker's push sends, its worker's pull
    receives, its server's push receives: between two ranks the pulls then the pushes, in the
    same order on both sides (FIFO matching pairs a push with a push)."""
    _check(n, k, colocated)
    server = list(range(k)) if colocated else list(range(n, n + k))
    p = n if colocated else n + k
    c = shard_count
    steps: List[List[Tuple]] = [[] for _ in range(p)]
    for r in range(p):
        is_worker, is_server = r < n, r in server
        for i in range(rounds + 1):
            ops = []
            if is_server and i > 0:
                ops += [Send(w, "tmp", 0, c) for w in range(n)]
            if is_worker and i < rounds:
                ops += [Send(s, "in", 0, c) for s in server]
            if is_worker and i > 0:
                ops += [Recv(s, "out", 0, c) for s in server]
            if is_server and i < rounds:
                ops += [Recv(w, "tmp", 0, c, True) for w in range(n)]
            steps[r].append(tuple(ops))
    return steps


def _check(n: int, k: int, colocated: bool) -> None:
    if n < 1 or k < 1:
        raise ValueError("a parameter server needs at least one worker and one server")
    if colocated and k > n:
        raise ValueError(f"{k} colocated servers need at least {k} machines, got {n} workers")


def ps_program(n: int, k: int, shard_count: int, rounds: int, colocated: bool) -> Program:
    """The compiled program of ``ps_schedules`` built with numpy (a step of 1,024 machines has
    millions of messages: the same arrays, without a Python object per op)."""
    _check(n, k, colocated)
    server = np.arange(k) if colocated else np.arange(n, n + k)
    workers = np.arange(n)
    p = n if colocated else n + k
    R = rounds
    steps_per = R + 1
    first = np.arange(p + 1, dtype=np.int64) * steps_per
    sends, recvs = [], []            # per rank: (step, peer, reduce) arrays in op order
    is_server = np.zeros(p, dtype=bool)
    is_server[server] = True
    for r in range(p):
        s_parts, r_parts = [], []
        for i in range(steps_per):
            s_i, r_i = [], []
            if is_server[r] and i > 0:
                s_i.append(workers)
            if r < n and i < R:
                s_i.append(server)
            if r < n and i > 0:
                r_i.append((server, False))
            if is_server[r] and i < R:
                r_i.append((workers, True))
            for x in s_i:
                s_parts.append((np.full(len(x), i), x))
            for x, red in r_i:
                r_parts.append((np.full(len(x), i), x, np.full(len(x), red)))
        sends.append(s_parts)
        recvs.append(r_parts)

    def cat(parts, j):
        return np.concatenate([x[j] for x in parts]) if parts else np.zeros(0, dtype=np.int64)
    ns = np.array([sum(len(x[1]) for x in s) for s in sends])
    nr = np.array([sum(len(x[1]) for x in rr) for rr in recvs])
    s_all = [x for s in sends for x in s]
    r_all = [x for rr in recvs for x in rr]
    s_step = cat(s_all, 0) + np.repeat(first[:-1], ns)
    r_step = cat(r_all, 0) + np.repeat(first[:-1], nr)
    S = p * steps_per
    zeros = np.zeros(S)
    return _program(p, first, zeros, zeros.copy(), np.repeat(np.arange(p), ns), cat(s_all, 1),
                    s_step, np.full(int(ns.sum()), shard_count), np.repeat(np.arange(p), nr),
                    cat(r_all, 1), r_step, np.full(int(nr.sum()), shard_count),
                    cat(r_all, 2).astype(bool))


@dataclass
class PSResult:
    workers: int
    servers: int
    colocated: bool
    model_bytes: float
    time_s: float
    closed_form_s: float
    rounds: int
    busiest_link: str
    sim: SimResult


def simulate_ps(topo: Topology, workers: int, servers: int, model_bytes: float,
                colocated: bool = False, rounds: Optional[int] = None,
                itemsize: int = 4) -> PSResult:
    """Push/pull of one step on ``topo`` taken as machines: ``topo.servers`` must hold the workers
    (and, not colocated, the servers: they are extra machines appended after the workers)."""
    if model_bytes < 0:
        raise ValueError("model size must be >= 0")
    machines = workers if colocated else workers + servers
    mt = machine_topology(topo, machines)
    alpha = mt.nic_link.latency + (3 if mt.tiers > 1 else 1) * mt.switch_latency
    R = rounds_for(workers, servers, rounds,
                   closed_form_ps(workers, servers, model_bytes, mt.nic_link.bandwidth,
                                  colocated), alpha)
    shard = max(1, int(round(model_bytes / itemsize / (R * servers)))) if model_bytes else 0
    prog = ps_program(workers, servers, shard, R, colocated)
    r = simulate_program(prog, mt, itemsize=itemsize, collective="ps",
                         algorithm="ps-colocated" if colocated else "ps")
    moved = shard * itemsize * R * servers
    cf = closed_form_ps(workers, servers, moved, mt.nic_link.bandwidth, colocated)
    return PSResult(workers, servers, colocated, moved, r.time_s, cf, R, r.busiest_link, r)


@dataclass
class StepPrice:
    architecture: str      # "allreduce" | "ps" | "ps-colocated"
    algorithm: str         # family, or "push/pull"
    servers: int           # PS servers (0 for allreduce)
    time_s: float
    detail: str
    result: Optional[SimResult] = None   # allreduce: the simulated call (its links, for reports)


def intra_time(topo: Topology, collective: str, model_bytes: float) -> float:
    """Ring reduce-scatter / allgather of the model inside one server (the engine)."""
    g = topo.gpus_per_server
    if g == 1:
        return 0.0
    one = dataclasses.replace(topo, servers=1)
    count = max(1, int(model_bytes // 4 // g))
    return simulate(collective, "ring", one, count=count).time_s


def price_step(topo: Topology, model_bytes: float, servers: Sequence[int] = (),
               algorithms: Sequence[str] = ("ring", "tree", "rhd", "hier"),
               colocated: bool = True, rounds: Optional[int] = None) -> List[StepPrice]:
    """The communication of one data-parallel step, every way: allreduce per family over all
    accelerators, and PS (intra reduce-scatter + push/pull between machines + intra allgather)
    with each server count (separate server machines) and colocated."""
    out: List[StepPrice] = []
    p = topo.endpoints
    count = max(1, int(model_bytes // 4 // p)) * p      # a multiple of p: rotation applies
    for algo in algorithms:
        if algo == "hier" and (topo.servers == 1 or topo.gpus_per_server == 1):
            continue
        r = simulate("allreduce", algo, topo, count=count)
        out.append(StepPrice("allreduce", algo, 0, r.time_s,
                             f"busbw {r.busbw:.1f} GB/s; busiest link: "
                             f"{describe_link(r.busiest_link)}", r))
    g = topo.gpus_per_server
    rs = intra_time(topo, "reduce_scatter", model_bytes) if g > 1 else 0.0
    ag = intra_time(topo, "allgather", model_bytes) if g > 1 else 0.0
    n = topo.servers
    for k in servers:
        ps = simulate_ps(topo, n, k, model_bytes, colocated=False, rounds=rounds)
        out.append(StepPrice("ps", "push/pull", k, rs + ps.time_s + ag,
                             f"intra {format_time(rs + ag)} + push/pull "
                             f"{format_time(ps.time_s)} (closed form "
                             f"{format_time(ps.closed_form_s)})"))
    if colocated and n > 1:
        ps = simulate_ps(topo, n, n, model_bytes, colocated=True, rounds=rounds)
        out.append(StepPrice("ps-colocated", "push/pull", n, rs + ps.time_s + ag,
                             f"intra {format_time(rs + ag)} + push/pull "
                             f"{format_time(ps.time_s)} (closed form "
                             f"{format_time(ps.closed_form_s)})"))
    return out


def crossover_servers(n: int, machine_bw: float, model_bytes: float, target_s: float) -> float:
    """Server machines a non-colocated PS needs to push/pull in ``target_s`` (closed form):
    nM/(kB) <= target  ->  k >= nM/(B target); inf when even M/B exceeds the target."""
    if model_bytes / machine_bw > target_s:
        return math.inf
    return n * model_bytes / (machine_bw * target_s)
