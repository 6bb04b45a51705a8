"""``minicomm bench pushpull``: the parameter server's push+pull next to an allreduce and raw p2p.

    minicomm bench pushpull                 # 16 MiB model, 2 servers + 2 workers, shm
    minicomm bench pushpull --sizes 4M --iters 30 --json out.json

One job of ``servers + workers`` ranks (``mc.spawn``) measures, in rounds (``--batches``, default
5) that interleave the four so load that comes and goes on a shared machine hits all alike, each
with the ranks not involved idle at a barrier:

  1. p2p: a ping-pong of the model between rank 0 (a server) and rank ``servers`` (a worker):
     bandwidth = 2·M / round trip (both directions, like a push then a pull); then the same with
     every server paired with a worker at once (``p2p_pairs``), the load a PS step puts on them;
  2. allreduce of the same M bytes over all ranks (``algorithm="auto"``), time per call of the
     slowest rank: the decentralised way to do the same step;
  3. PS: ``ps.start`` with BSP SGD; each worker times ``pushpull`` of the whole model (M bytes
     pushed, M pulled, into ``out=`` like the rows above); goodput = 2·M / time per step, the
     slowest worker.

Reported: times, bandwidths (GB/s = 1e9 B/s), and ``ratio`` = PS goodput / p2p bandwidth (the
issue's target: >= 0.5). Bytes per step: 2M per worker; each server's link 2M·W/k; the ring
allreduce 2M(n-1)/n per rank. Each figure: the median over rounds of the median of ``--iters``
calls (default 10) after 2 warm-up calls.

Reading the ratio: in a PS step all ``servers + workers`` processes copy at once (every byte is
copied into shared memory by its sender and out by its receiver, plus the servers' sum and
update), where the single-pair ping-pong has two processes busy and the rest asleep. With fewer
cores than ranks they share the cores, and the ratio to the ping-pong of every pair at once
(``vs pairs``: as many busy processes as the PS step) is the like-for-like one.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from .. import ps

GB = 1e9


def _median_max(comm, samples: List[float]) -> float:
    """The median of this rank's samples, then the maximum over ranks."""
    mine = np.array([float(np.median(samples)) if samples else 0.0])
    return float(comm.allreduce(mine, op="max")[0])


def _pingpong(comm, peer: int, x: np.ndarray, y: np.ndarray, iters: int, warmup: int,
              leader: bool) -> List[float]:
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        if leader:
            comm.send(x, peer, tag=7)
            comm.recv(peer, tag=7, out=y)
        else:
            comm.recv(peer, tag=7, out=y)
            comm.send(y, peer, tag=7)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _round(comm, model, buf, servers: int, iters: int, warmup: int) -> Dict[str, float]:
    """One round of every measurement; each is the median of ``iters`` calls."""
    workers = comm.size - servers
    out = {}
    comm.barrier()
    t = []
    if comm.rank in (0, servers):
        t = _pingpong(comm, servers - comm.rank, model, buf, iters, warmup, comm.rank == 0)
    out["p2p_s"] = _median_max(comm, t)
    pairs = min(servers, workers)
    t = []
    if comm.rank < pairs:
        t = _pingpong(comm, comm.rank + servers, model, buf, iters, warmup, True)
    elif servers <= comm.rank < servers + pairs:
        t = _pingpong(comm, comm.rank - servers, model, buf, iters, warmup, False)
    out["p2p_pairs_s"] = _median_max(comm, t)
    t = []
    for i in range(warmup + iters):
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce(model, out=buf)
        if i >= warmup:
            t.append(time.perf_counter() - t0)
    out["allreduce_s"] = _median_max(comm, t)
    t = []
    kv = ps.start(comm, num_servers=servers, staleness=0, optimizer=ps.SGD(lr=1e-6))
    if kv is not None:
        kv.init({"model": model})
        grad = {"model": np.full(model.size, 1e-3, np.float32)}
        into = {"model": buf}        # out=, as the p2p and allreduce rows: no allocation timed
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            kv.pushpull(grad, out=into)
            if i >= warmup:
                t.append(time.perf_counter() - t0)
        kv.close()
    out["pushpull_s"] = _median_max(comm, t)        # servers contribute 0: the slowest worker
    return out


def rank_main(comm, nbytes: int, servers: int, iters: int, warmup: int,
              rounds: int = 3) -> Optional[Dict]:
    n = comm.size
    workers = n - servers
    if workers < 1 or servers < 1:
        raise ValueError(f"pushpull needs servers >= 1 and workers >= 1, got {servers} of {n}")
    count = max(1, nbytes // 4)
    model = np.full(count, 0.5, np.float32)
    buf = np.empty_like(model)
    # Rounds interleave the measurements, so load that comes and goes on a shared machine
    # hits all of them alike; each figure is the median over rounds.
    rows = [_round(comm, model, buf, servers, iters, warmup) for _ in range(rounds)]
    out: Dict = {"bytes": count * 4, "servers": servers, "workers": workers, "rounds": rounds,
                 "iters": iters, "p2p_pairs": min(servers, workers)}
    for k in rows[0]:
        out[k] = float(np.median([r[k] for r in rows]))
        out[k + "_rounds"] = [r[k] for r in rows]
    return out if comm.rank == 0 else None


def summarize(results: List[Optional[Dict]]) -> Dict:
    base = dict(results[0])
    m = base["bytes"]
    base["p2p_GBps"] = 2 * m / base["p2p_s"] / GB
    base["p2p_pairs_GBps"] = 2 * m / base["p2p_pairs_s"] / GB
    base["allreduce_algbw_GBps"] = m / base["allreduce_s"] / GB
    base["pushpull_goodput_GBps"] = 2 * m / base["pushpull_s"] / GB
    base["ratio"] = base["pushpull_goodput_GBps"] / base["p2p_GBps"]
    base["ratio_vs_pairs"] = base["pushpull_goodput_GBps"] / base["p2p_pairs_GBps"]
    base["ratio_vs_allreduce"] = base["allreduce_s"] / base["pushpull_s"]
    return base


def format_report(s: Dict, transport: str) -> str:
    m, k, w = s["bytes"], s["servers"], s["workers"]
    mib = m / (1 << 20)
    lines = [
        f"# minicomm bench pushpull: {mib:g} MiB model, {k} servers + {w} workers, "
        f"transport {transport}",
        f"{'what':<44}{'time':>12}{'GB/s':>10}",
        f"{'p2p ping-pong rank 0 <-> %d (2M / round trip)' % k:<44}"
        f"{s['p2p_s'] * 1e3:>10.2f}ms{s['p2p_GBps']:>10.2f}",
        f"{'p2p ping-pong, %d pairs at once' % s['p2p_pairs']:<44}"
        f"{s['p2p_pairs_s'] * 1e3:>10.2f}ms{s['p2p_pairs_GBps']:>10.2f}",
        f"{'allreduce over %d ranks (algbw = M / time)' % (k + w):<44}"
        f"{s['allreduce_s'] * 1e3:>10.2f}ms{s['allreduce_algbw_GBps']:>10.2f}",
        f"{'ps pushpull per worker (goodput = 2M / time)':<44}"
        f"{s['pushpull_s'] * 1e3:>10.2f}ms{s['pushpull_goodput_GBps']:>10.2f}",
        f"ratio: ps goodput / p2p bandwidth = {s['ratio']:.2f} (target >= 0.5); "
        f"vs {s['p2p_pairs']} pairs at once {s['ratio_vs_pairs']:.2f}; "
        f"allreduce time / pushpull time = {s['ratio_vs_allreduce']:.2f}",
        f"bytes per step: {2 * mib:g} MiB per worker, {2 * mib * w / k:g} MiB per server link "
        f"(2M·W/k), ring allreduce {2 * mib * (k + w - 1) / (k + w):.3g} MiB per rank",
    ]
    return "\n".join(lines)


def run(nbytes: int = 16 << 20, servers: int = 2, workers: int = 2, transport: str = "auto",
        iters: int = 10, warmup: int = 2, timeout: Optional[float] = None,
        rounds: int = 3) -> Dict:
    from ..launch import spawn
    results = spawn(rank_main, servers + workers, args=(nbytes, servers, iters, warmup, rounds),
                    transport=transport, timeout=timeout)
    return summarize(results)


def main_from_cli(a) -> int:
    from .benchspec import BenchError, parse_size
    try:
        nbytes = parse_size(a.sizes) if a.sizes else 16 << 20
    except ValueError as e:
        print(f"minicomm bench pushpull: {e}", file=sys.stderr)
        return 2
    servers = a.servers
    workers = (a.nranks - servers) if a.nranks else 2
    if servers < 1 or workers < 1:
        print("minicomm bench pushpull: needs --servers >= 1 and -n > --servers",
              file=sys.stderr)
        return 2
    try:
        s = run(nbytes, servers, workers, a.transport, a.iters or 10, min(a.warmup, 2), a.timeout,
                max(1, a.batches))
    except BenchError as e:
        print(f"minicomm bench pushpull: {e}", file=sys.stderr)
        return 2
    print(format_report(s, a.transport))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(s, transport=a.transport), f, indent=1)
    return 0
