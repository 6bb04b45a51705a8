"""Soak test: ``minicomm bench --soak 10m`` — mixed traffic for a long time, every result checked.

Each round (all ranks draw the same random choices from ``seed`` and the round number) runs a
few collectives of random size, collective, algorithm and dtype, a point-to-point ring exchange,
and every few rounds a parameter-server phase (``ps.start`` with one server, the workers push
and pull random-sized keys, then close it). Every result is compared with a numpy reference
each rank computes locally from the inputs' closed form (integer-valued data: sums are exact).

Reported per rank: ops done, wrong results (must be 0), resident memory (``/proc/self/statm``)
and open file descriptors (``/proc/self/fd``) after a warm-up and at the end, sampled about every
duration / 20 (printed, and in ``--json``). The verdict on growth: descriptors must not grow at
all. Resident memory first fills bounded caches (schedules and plans per size class and root,
scratch buffers): it "grows" only when the end exceeds the first half's high-water mark by more
than max(16 MiB, 10 %).

Not in CI by default (the quick test runs ``--soak 10s``). Linux only (``/proc``).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

FAMILIES = ("auto", "ring", "tree", "rhd")
COLLS = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather", "scatter",
         "alltoall", "barrier")
DTYPES = (np.float64, np.float32, np.int64, np.int32)
RSS_SLACK_BYTES = 16 << 20
RSS_SLACK_FRACTION = 0.10
PS_EVERY = 10                 # rounds between parameter-server phases


def parse_duration(text: str) -> float:
    """'10m', '30s', '1h', '90' (seconds) -> seconds > 0; ValueError naming --soak."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m:
        raise ValueError(f"--soak {text!r}: expected a duration such as 10s, 10m or 1h")
    v = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if v <= 0:
        raise ValueError(f"--soak {text!r}: the duration must be > 0")
    return v


def resources() -> Dict[str, int]:
    """This process's resident bytes and open descriptors, from /proc."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return {"rss": resident_pages * os.sysconf("SC_PAGE_SIZE"),
            "fds": len(os.listdir("/proc/self/fd"))}


def _data(rank: int, rnd: int, shape, dtype) -> np.ndarray:
    """The input rank ``rank`` contributes in round ``rnd``: small integers (exact in every
    dtype), different per rank and element."""
    n = int(np.prod(shape)) if len(shape) else 1
    base = (np.arange(n, dtype=np.int64) * 7 + rank * 13 + rnd * 3) % 23
    return base.reshape(shape).astype(dtype)


def _check_collective(comm, rng, rnd: int) -> int:
    """One random collective; returns 1 if its result is wrong."""
    p, r = comm.size, comm.rank
    coll = COLLS[rng.integers(len(COLLS))]
    algo = FAMILIES[rng.integers(len(FAMILIES))]
    if comm.num_nodes > 1 and rng.random() < 0.25:
        algo = "hier"
    dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
    # sizes: mostly small, sometimes up to ~1 MiB; 0 now and then
    n = int(rng.choice([0, 1, 3, 17, 256, 1000, 4096, 1 << 15, 1 << 17]))
    root = int(rng.integers(p))
    mine = _data(r, rnd, (n,), dtype)
    every = np.stack([_data(q, rnd, (n,), dtype) for q in range(p)])
    if coll == "allreduce":
        got, want = comm.allreduce(mine, algorithm=algo), every.sum(0, dtype=dtype)
    elif coll == "broadcast":
        got, want = comm.broadcast(mine, root=root, algorithm=algo), every[root]
    elif coll == "reduce":
        got = comm.reduce(mine, root=root, algorithm=algo)
        want = every.sum(0, dtype=dtype) if r == root else None
    elif coll == "allgather":
        got, want = comm.allgather(mine, algorithm=algo), every
    elif coll == "gather":
        got = comm.gather(mine, root=root, algorithm=algo)
        want = every if r == root else None
    elif coll in ("reduce_scatter", "scatter", "alltoall"):
        blocks = np.stack([_data(r * p + j, rnd, (n,), dtype) for j in range(p)])
        if coll == "reduce_scatter":
            got = comm.reduce_scatter(blocks, algorithm=algo)
            want = sum((_data(q * p + r, rnd, (n,), dtype) for q in range(p)),
                       np.zeros(n, dtype)).astype(dtype)
        elif coll == "scatter":
            root_blocks = np.stack([_data(root * p + j, rnd, (n,), dtype) for j in range(p)])
            got = comm.scatter(root_blocks if r == root else None, root=root, algorithm=algo)
            want = root_blocks[r]
        else:
            got = comm.alltoall(blocks, algorithm=algo)
            want = np.stack([_data(q * p + r, rnd, (n,), dtype) for q in range(p)])
    else:
        comm.barrier(algorithm=algo)
        return 0
    if want is None:
        return int(got is not None)
    return int(got is None or got.dtype != want.dtype or not np.array_equal(got, want))


def _check_p2p(comm, rng, rnd: int) -> int:
    """A ring exchange: send to rank+1, receive from rank-1 (isend, then recv)."""
    p, r = comm.size, comm.rank
    n = int(rng.choice([0, 1, 100, 5000, 1 << 16]))
    tag = int(rng.integers(1000))
    w = comm.isend(_data(r, rnd, (n,), np.float64), (r + 1) % p, tag=tag)
    got = comm.recv((r - 1) % p, tag=tag)
    w.wait()
    return int(not np.array_equal(got, _data((r - 1) % p, rnd, (n,), np.float64)))


def _check_ps(comm, rng, rnd: int) -> int:
    """One parameter-server phase: rank 0 serves; the workers init, push and pull (sync SGD
    with lr 1: after k pushes w = w0 - sum over pushes of the workers' mean gradient)."""
    from .. import ps
    n = int(rng.choice([1, 10, 1000, 50000]))
    pushes = int(rng.integers(1, 4))
    kv = ps.start(comm, num_servers=1, staleness=0, optimizer=ps.SGD(lr=1.0))
    if kv is None:
        return 0
    workers = comm.size - 1
    me = comm.rank - 1
    w0 = _data(0, rnd, (n,), np.float64)
    kv.init({"w": w0})
    want = w0.copy()
    wrong = 0
    for k in range(pushes):
        kv.push({"w": _data(me, rnd + k, (n,), np.float64)})
        mean = sum(_data(j, rnd + k, (n,), np.float64) for j in range(workers)) / workers
        want = want - mean
        got = kv.pull(["w"])["w"]
        wrong += int(not np.allclose(got, want, rtol=0, atol=1e-9))
    kv.close()
    return wrong


def soak_rank(comm, duration: float, seed: int) -> Dict[str, Any]:
    """One rank's soak loop (run by ``soak`` on every rank)."""
    ops = wrong = rounds = 0
    start = None
    samples = []                  # (seconds, rss, fds) about every duration / 20
    t0 = time.monotonic()
    next_sample = 0.0
    while True:
        # rank 0 decides when to stop, so every rank runs the same rounds
        stop = comm.broadcast(np.array([time.monotonic() - t0 >= duration], dtype=np.int8),
                              root=0, algorithm="tree")
        if stop[0]:
            break
        rng = np.random.default_rng([seed, rounds])
        for _ in range(4):
            wrong += _check_collective(comm, rng, rounds)
            ops += 1
        wrong += _check_p2p(comm, rng, rounds)
        ops += 1
        if comm.size > 1 and rounds % PS_EVERY == PS_EVERY - 1:
            wrong += _check_ps(comm, rng, rounds)
            ops += 1
        rounds += 1
        now = time.monotonic() - t0
        if now >= next_sample:
            r = resources()
            samples.append((round(now, 1), r["rss"], r["fds"]))
            next_sample = now + duration / 20
        if start is None and rounds >= PS_EVERY and time.monotonic() - t0 >= duration / 10:
            start = resources()     # after a warm-up: caches, plans, first PS phase
    end = resources()
    return {"rank": comm.rank, "rounds": rounds, "ops": ops, "wrong": wrong,
            "start": start or end, "end": end, "seconds": time.monotonic() - t0,
            "samples": samples}


def _half_way_rss(row: Dict[str, Any]) -> int:
    """The highest RSS of the first half of the run: bounded caches (schedules, plans, scratch
    buffers of each size class) fill early and then stay; a leak keeps growing after it."""
    samples = row.get("samples") or []
    if len(samples) < 4:
        return row["start"]["rss"]
    half = samples[-1][0] / 2
    return max([rss for t, rss, _ in samples if t <= half] + [row["start"]["rss"]])


def verdict(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Descriptors: end must not exceed start (after the warm-up). Memory: the end may exceed
    the first half's high-water mark by allocator noise only, max(16 MiB, 10 %)."""
    grows = []
    for row in rows:
        s, e = row["start"], row["end"]
        if e["fds"] > s["fds"]:
            grows.append(f"rank {row['rank']}: open fds {s['fds']} -> {e['fds']}")
        mid = _half_way_rss(row)
        if e["rss"] - mid > max(RSS_SLACK_BYTES, RSS_SLACK_FRACTION * mid):
            grows.append(f"rank {row['rank']}: RSS {mid >> 20} MiB at half time -> "
                         f"{e['rss'] >> 20} MiB at the end")
    return {"errors": sum(r["wrong"] for r in rows), "ops": sum(r["ops"] for r in rows),
            "growth": grows, "ok": not grows and not sum(r["wrong"] for r in rows)}


def soak(duration: float, nranks: int = 3, transport: str = "auto", nodes: int = 1,
         seed: int = 0, timeout: Optional[float] = None) -> Dict[str, Any]:
    """Run the soak on ``nranks`` fresh processes; returns rows per rank and the verdict."""
    from ..launch import spawn
    if not 2 <= nranks:
        raise ValueError(f"--soak needs at least 2 ranks, got {nranks}")
    rows = spawn(soak_rank, nranks, args=(duration, seed), transport=transport, nodes=nodes,
                 timeout=timeout or 120.0)
    return {"duration_s": duration, "ranks": nranks, "transport": transport, "nodes": nodes,
            "seed": seed, "load_avg": os.getloadavg(), "rows": rows, "verdict": verdict(rows)}


def format_report(rep: Dict[str, Any]) -> str:
    v = rep["verdict"]
    lines = [f"# minicomm soak: {rep['duration_s']:.0f} s, {rep['ranks']} ranks, transport "
             f"{rep['transport']}, nodes {rep['nodes']}, seed {rep['seed']}, load average "
             f"{' '.join(f'{x:.1f}' for x in rep['load_avg'])}",
             f"{'rank':>4} {'rounds':>7} {'ops':>7} {'wrong':>5} {'RSS start':>10} "
             f"{'RSS end':>10} {'fds start':>9} {'fds end':>7}"]
    for r in rep["rows"]:
        lines.append(f"{r['rank']:>4} {r['rounds']:>7} {r['ops']:>7} {r['wrong']:>5} "
                     f"{r['start']['rss'] / 2**20:>8.1f}Mi {r['end']['rss'] / 2**20:>8.1f}Mi "
                     f"{r['start']['fds']:>9} {r['end']['fds']:>7}")
    for r in rep["rows"]:
        trace = " ".join(f"{s:.0f}s:{rss / 2**20:.0f}" for s, rss, _ in r.get("samples", []))
        lines.append(f"# rank {r['rank']} RSS MiB over time: {trace}")
    lines.append(f"# ops {v['ops']}, errors {v['errors']}; growth: "
                 f"{'; '.join(v['growth']) if v['growth'] else 'none (flat)'}; "
                 f"verdict: {'PASS' if v['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main_from_cli(a) -> int:
    try:
        duration = parse_duration(a.soak)
    except ValueError as e:
        print(f"minicomm bench: {e}", file=sys.stderr)
        return 2
    rep = soak(duration, nranks=a.nranks or 3, transport=a.transport, nodes=a.nodes,
               seed=a.soak_seed, timeout=a.timeout)
    print(format_report(rep), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["verdict"]["ok"] else 1
