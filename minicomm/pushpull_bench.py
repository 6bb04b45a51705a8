"""``minicomm bench pushpull``: the parameter server's push+pull next to an allreduce and raw p2p.

    minicomm bench pushpull                 # 16 MiB model, 2 servers + 2 workers, shm
    minicomm bench pushpull --sizes 4M --iters 30 --json out.json

One job of ``servers + workers`` ranks (``mc.spawn``, or the ranks of ``minicomm run``) measures,
in this order and with the other ranks idle at a barrier:

  1. p2p: a ping-pong of the model between rank 0 (a server) and rank ``servers`` (a worker):
     bandwidth = 2·M / round trip (both directions, like a push then a pull); then the same with
     every server paired with a worker at once (``p2p_pairs``), the load a PS step puts on them;
  2. allreduce of the same M bytes over all ranks (``algorithm="auto"``), time per call of the
     slowest rank: the decentralised way to do the same step;
  3. PS: ``ps.start`` with BSP SGD; each worker times ``pushpull`` of the whole model (M bytes
     pushed, M pulled); goodput = 2·M / time per step, the median over steps, slowest worker.

Reported: times, bandwidths (GB/s = 1e9 B/s), and ``ratio`` = PS goodput / p2p bandwidth (the
issue's target: >= 0.5). Bytes per step: 2M per worker; each server's link 2M·W/k; the ring
allreduce 2M(n-1)/n per rank. Timing is the median of ``--iters`` calls after ``--warmup``.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Dict, List, Optional

import numpy as np

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


def rank_main(comm, nbytes: int, servers: int, iters: int, warmup: int) -> Optional[Dict]:
    from . import ps
    n = comm.size
    workers = n - servers
    if workers < 1 or servers < 1:
        raise ValueError(f"pushpull needs servers >= 1 and workers >= 1, got {servers} of {n}")
    count = max(1, nbytes // 4)
    model = np.full(count, 0.5, np.float32)
    buf = np.empty_like(model)
    out: Dict = {"bytes": count * 4, "servers": servers, "workers": workers}

    # 1. p2p: one pair, then every server with a worker at once
    comm.barrier()
    t = []
    if comm.rank in (0, servers):
        t = _pingpong(comm, servers - comm.rank, model, buf, iters, warmup, comm.rank == 0)
    one = _median_max(comm, t)
    comm.barrier()
    pairs = min(servers, workers)
    t = []
    if comm.rank < pairs:
        t = _pingpong(comm, comm.rank + servers, model, buf, iters, warmup, True)
    elif servers <= comm.rank < servers + pairs:
        t = _pingpong(comm, comm.rank - servers, model, buf, iters, warmup, False)
    both = _median_max(comm, t)
    out["p2p_s"], out["p2p_pairs_s"], out["p2p_pairs"] = one, both, pairs

    # 2. allreduce of the same bytes over every rank
    times = []
    for i in range(warmup + iters):
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce(model, out=buf)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    out["allreduce_s"] = _median_max(comm, times)
    comm.barrier()

    # 3. the parameter server: BSP, SGD, the whole model in every pushpull
    kv = ps.start(comm, num_servers=servers, staleness=0, optimizer=ps.SGD(lr=1e-6))
    if kv is None:
        return None
    kv.init({"model": model})
    grad = np.full(count, 1e-3, np.float32)
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        kv.pushpull({"model": grad})
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    kv.close()
    out["pushpull_s"] = float(np.median(times))
    return out


def summarize(results: List[Optional[Dict]]) -> Dict:
    rows = [r for r in results if r is not None]
    base = dict(rows[0])
    base["pushpull_s"] = max(r["pushpull_s"] for r in rows)       # the slowest worker
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
        iters: int = 20, warmup: int = 3, timeout: Optional[float] = None) -> Dict:
    from .launch import spawn
    results = spawn(rank_main, servers + workers, args=(nbytes, servers, iters, warmup),
                    transport=transport, timeout=timeout)
    return summarize(results)


def main_from_cli(a) -> int:
    from .bench import BenchError, parse_size
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
        s = run(nbytes, servers, workers, a.transport, a.iters or 20, a.warmup, a.timeout)
    except BenchError as e:
        print(f"minicomm bench pushpull: {e}", file=sys.stderr)
        return 2
    print(format_report(s, a.transport))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(s, transport=a.transport), f, indent=1)
    return 0
