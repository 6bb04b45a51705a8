"""Measuring links at world start: probes over two-rank communicators, agreed by every rank.

``agree_link_model`` (the launcher's world bootstrap calls it, through the hook
``minicomm.launch.world.set_link_agreement``, on every new world communicator) gives every rank
rank 0's cached or freshly probed ``LinkModel`` and tuned-table entries (package docstring). The
probes run collectives on the world's own transport; they start no process. Why probes fitted
through the simulator, cached per host and agreed: docs/decisions/link-tuning-probes.md.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..communicator import Communicator
from ..cost import DELTA, SINGLE_COPY_MIN, SMALL_BYTES, LinkModel, schedule_time, table_index
from ..settings import env_flag
from ..trace import paused
from .cache import _LINK_FIELDS, _MACHINE_FIELDS, load_links, load_table, save_links

PROBE_BYTES = 1 << 20      # for β: one shm record, so a one-way hop is not pipelined
PROBE_REPS = (30, 10)      # repetitions of the small and the large probes (the minimum counts)
CONTENTION_COPIES = 100    # 1 MiB copies per contention probe (a few ms)
MAX_CONTENTION = 2.0
LOCAL_PROBE_BYTES = 32 << 20
WAKE_PROBE_SLEEP = 2e-3    # long enough for the waiting rank to give up spinning and sleep


# ---------------------------------------------------------------------------------- measuring links
def _probe_min(call, reps: int) -> float:
    call()                                        # warm-up: schedules built, pages touched
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def _probe_model(kind: str, o: float, lat: float, beta: float, gamma: float,
                 delta: float, contention: float) -> LinkModel:
    a = 3 * o + lat
    return LinkModel(a, beta, a, beta, gamma, delta, o, o, 0.0, contention, 0, kind, kind)


def probe_link(pair, kind: str, gamma: float, delta: float, contention: float) -> Dict[str, float]:
    """α, β and o of the link between the two ranks of ``pair`` (a 2-rank communicator; both
    call; rank 0's values count). Each probe is the fastest of ``PROBE_REPS`` calls; every value
    is fitted so that the simulator, run on the very schedules probed, predicts the probe times.

    Three 8-byte calls: rhd allgather (one exchange step), ring allreduce (two exchange steps),
    tree allreduce (two one-way hops): their differences cancel the per-call cost and give o and
    the latency (the prediction is linear in both). Then ``PROBE_BYTES`` through the same rhd
    allgather (both ranks copy at once) and tree allreduce (one copies at a time), less their
    8-byte times: β by least squares (no less than δ/4: a byte is copied in and out). Where the
    transport has a small-message path, an 8-byte tree broadcast run by the executor (the
    path switched off for it) gives ``exec_overhead``, the executor's extra CPU per message op."""
    small = np.zeros(2, dtype=np.float32)
    large = np.zeros(PROBE_BYTES // 4, dtype=np.float32)
    one = _probe_min(lambda: pair.allgather(small, algorithm="rhd"), PROBE_REPS[0])
    two = _probe_min(lambda: pair.allreduce(small, algorithm="ring"), PROBE_REPS[0])
    hops = _probe_min(lambda: pair.allreduce(small, algorithm="tree"), PROBE_REPS[0])
    big_x = _probe_min(lambda: pair.allgather(large, algorithm="rhd"), PROBE_REPS[1])
    big_h = _probe_min(lambda: pair.allreduce(large, algorithm="tree"), PROBE_REPS[1])
    probes = (("allgather", "rhd"), ("allreduce", "ring"), ("allreduce", "tree"))

    def sim(i: int, o: float, lat: float, beta: float = 0.0, count: int = 2,
            g: float = 0.0, d: float = 0.0) -> float:
        return schedule_time(*probes[i], 2, count, (0, 0),
                             _probe_model(kind, o, lat, beta, g, d, contention))

    coef = np.array([[sim(i, 1.0, 0.0) - sim(0, 1.0, 0.0), sim(i, 0.0, 1.0) - sim(0, 0.0, 1.0)]
                     for i in (1, 2)])
    o, lat = np.linalg.lstsq(coef, np.array([two - one, hops - one]), rcond=None)[0]
    o, lat = max(float(o), 0.1e-6), max(float(lat), 0.0)
    n = PROBE_BYTES // 4

    def grow(i: int, beta: float) -> float:       # the probe's growth from 8 bytes to n floats
        return sim(i, o, lat, beta, n, gamma, delta) - sim(i, o, lat, beta, 2, gamma, delta)
    # the growth is linear in β: fit both probes at once
    base = np.array([grow(0, 0.0), grow(2, 0.0)])
    slope = (np.array([grow(0, 1e-9), grow(2, 1e-9)]) - base) / 1e-9
    excess = np.array([big_x - one, big_h - hops]) - base
    beta = float(slope @ excess / (slope @ slope))
    # a fourth 8-byte call through the executor (tree broadcast, with its fingerprint check):
    # what a call run by the executor costs per message op beyond the small-message path
    extra = 0.0
    if kind in SMALL_BYTES:
        pair.small_path = False
        try:
            rooted = _probe_min(lambda: pair.broadcast(small, algorithm="tree"), PROBE_REPS[0])
        finally:
            pair.small_path = True
        m0 = _probe_model(kind, o, lat, 0.0, 0.0, 0.0, contention)

        def bcast(x: float) -> float:
            return schedule_time("broadcast", "tree", 2, 2, (0, 0),
                                 dataclasses.replace(m0, exec_overhead=x), executor=True)
        per = (bcast(1e-6) - bcast(0.0)) / 1e-6
        extra = max(0.0, (rooted - bcast(0.0)) / per) if per > 0 else 0.0
    return {"alpha": 3 * o + lat, "beta": max(beta, delta / 4), "overhead": o,
            "exec_overhead": extra}


def probe_contention(pair, reps: int = 5) -> float:
    """How much two ranks of one host working at once slow each other down (rank 0's value
    counts): rank 0 times ``CONTENTION_COPIES`` copies of 1 MiB alone (rank 1 sleeps in a
    barrier), then both do at the same time; fastest of ``reps`` each; ratio - 1, at least 0."""
    a = np.ones(1 << 18, dtype=np.float32)
    b = np.ones(1 << 18, dtype=np.float32)

    def copies() -> float:
        t = time.perf_counter()
        for _ in range(CONTENTION_COPIES):
            np.copyto(a, b)
        return time.perf_counter() - t
    alone = together = math.inf
    for _ in range(reps):
        pair.barrier(algorithm="rhd")
        if pair.rank == 0:
            alone = min(alone, copies())
        pair.barrier(algorithm="rhd")
        together = min(together, copies())
    return min(MAX_CONTENTION, max(0.0, together / alone - 1)) if pair.rank == 0 else 0.0


def probe_wake(pair, reps: int = 5) -> float:
    """Extra latency of a message to a rank asleep in the kernel (two ranks of one host; rank 0's
    value counts): rank 1 sleeps, stamps the clock, then joins an allgather rank 0 has been
    waiting in; rank 0 compares that stamp (CLOCK_MONOTONIC, shared by the host) with the end of
    its call, less the same call's time against a spinning peer."""
    x = np.zeros(1, dtype=np.float64)
    spinning = _probe_min(lambda: pair.allgather(x, algorithm="rhd"), PROBE_REPS[0])
    delays = []
    for _ in range(reps):
        if pair.rank == 1:
            time.sleep(WAKE_PROBE_SLEEP)
            x[0] = time.perf_counter()
        y = pair.allgather(x, algorithm="rhd")
        delays.append(time.perf_counter() - y[1, 0])
    return max(0.0, min(delays) - spinning)


_local_cache: Dict[str, Tuple[float, float]] = {}

MEMORY_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
MEMORY_PROBE_BYTES = 8 << 20    # bytes each probe moves (small arrays copied repeatedly)


def _timed_copies(nbytes: int, threads: int, op: str, reps: int) -> float:
    """Seconds per byte of ``op`` (np.copyto or an in-place np.add) on float32 arrays of
    ``nbytes``, ``threads`` threads at once (numpy releases the GIL in both, so the threads
    contend for the memory as ranks do; no process is started): the fastest of ``reps`` rounds,
    a round's time that of its slowest thread."""
    import threading
    inner = max(1, MEMORY_PROBE_BYTES // nbytes)
    arrs = [(np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32))
            for _ in range(threads)]
    best = math.inf
    for _ in range(reps):
        start = threading.Barrier(threads)
        took = [0.0] * threads

        def work(i: int) -> None:
            a, b = arrs[i]
            try:
                start.wait(timeout=10.0)
            except threading.BrokenBarrierError:
                return
            t = time.perf_counter()
            for _ in range(inner):
                if op == "copy":
                    np.copyto(a, b)
                else:
                    np.add(a, b, out=a)
            took[i] = time.perf_counter() - t
        ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30.0)
        if all(x > 0 for x in took):
            best = min(best, max(took))
    return best / inner / nbytes


def measure_memory(sizes=MEMORY_SIZES, reps: int = 7) -> Tuple[Tuple[float, ...], ...]:
    """This machine's memory by working set, the rows of ``LinkModel.memory``: (bytes, δ, γ,
    contention) per size, δ = memcpy and γ = in-place add in s per byte of array (one thread),
    contention = how much slower each of two threads copying at once is (δ₂/δ₁ - 1, at least 0:
    the memory bandwidth two ranks share). Estimator: the fastest of ``reps`` rounds for every
    figure (the least disturbed on a shared machine; one- and two-thread rounds alternate), then
    contention smoothed by a 3-point median across sizes (a burst of other work during the
    two-thread rounds of one size reads as contention). About 0.5 s."""
    best: Dict[Tuple[int, str], float] = {}
    for _ in range(reps):
        for nb in sizes:
            for threads, op in ((1, "copy"), (1, "add"), (2, "copy")):
                t = _timed_copies(nb, threads, op, 1)
                best[(nb, f"{op}{threads}")] = min(best.get((nb, f"{op}{threads}"), math.inf), t)
    raw = [min(MAX_CONTENTION, max(0.0, best[(nb, "copy2")] / best[(nb, "copy1")] - 1))
           for nb in sizes]
    smooth = [sorted(raw[max(0, i - 1):i + 2])[len(raw[max(0, i - 1):i + 2]) // 2]
              for i in range(len(raw))]
    return tuple((float(nb), best[(nb, "copy1")], best[(nb, "add1")], c)
                 for nb, c in zip(sizes, smooth))


def measure_local() -> Tuple[float, float]:
    """(γ, δ) of this machine: numpy in-place add and memcpy of 32 MiB (beyond the caches, as
    large messages are), s per byte, fastest of 5."""
    if "gd" not in _local_cache:
        a = np.ones(LOCAL_PROBE_BYTES // 4, dtype=np.float32)
        b = np.ones(LOCAL_PROBE_BYTES // 4, dtype=np.float32)
        g = _probe_min(lambda: np.add(a, b, out=a), 5) / a.nbytes
        d = _probe_min(lambda: np.copyto(a, b), 5) / a.nbytes
        _local_cache["gd"] = (max(g, 1e-12), max(d, 1e-12))
    return _local_cache["gd"]


def _tune_enabled() -> bool:
    return env_flag("MINICOMM_TUNE", True)


_AGREED = ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma", "delta",
           "overhead_intra", "overhead_inter", "wake", "contention", "cores", "exec_overhead")


def agree_link_model(comm, intra: str, inter: str) -> LinkModel:
    """Every rank of a new world communicator calls this (collective). Rank 0's cached or freshly
    probed link parameters, and its tuned-table entries for these transports, become every
    rank's ``LinkModel`` (module doc). Uses only explicit-algorithm collectives, so it does not
    depend on the model it is building."""
    rank, size, topo = comm.rank, comm.size, comm.topology
    near = next((r for r in range(1, size) if topo[r] == topo[0]), None)
    far = next((r for r in range(1, size) if topo[r] != topo[0]), None)
    want = np.array([_tune_enabled() if rank == 0 else 0], dtype=np.int64)
    want = comm.broadcast(want, root=0, algorithm="tree")
    values: Dict[str, float] = {}
    if want[0]:
        with paused():            # the probes time the untraced paths the cache stands for
            values = _measure_links(comm, near, far, intra, inter)
    if rank == 0:
        default = LinkModel.for_transports(intra, inter)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        payload: Dict[str, Any] = {f: values.get(f, getattr(default, f)) for f in _AGREED}
        payload["memory"] = values.get("memory", [])
        # the model prices shm's single-copy reads where rank 0's large sends reach every peer
        # on its node that way (the kernel may forbid them: transports/cma.py); the ranks of
        # one job share a user and a ptrace policy, so rank 0's view stands for every pair
        # from the size the pairs' setup probes chose (shm: cma.choose_min, the largest of
        # rank 0's pairs), else the transport kind's default
        single = comm.caps.single_copy
        peers = set(single.single_copy_peers()) if single is not None else set()
        local = [comm.world_ranks[r] for r in range(1, size) if topo[r] == topo[0]]
        payload["single_copy"] = ((single.single_copy_from() if single is not None else 0)
                                  or SINGLE_COPY_MIN.get(intra, 0)) if all(
            r in peers for r in local) else 0
        payload["cores"] = int(cores or 0)
        payload["table"] = [e for e in load_table() if e["intra"] == intra and e["inter"] == inter]
        data = np.frombuffer(json.dumps(payload).encode(), dtype=np.uint8)
    else:
        data = np.empty(0, dtype=np.uint8)
    n = comm.broadcast(np.array([data.size], dtype=np.int64), root=0, algorithm="tree")
    if rank != 0:
        data = np.empty(int(n[0]), dtype=np.uint8)
    agreed = json.loads(comm.broadcast(data, root=0, algorithm="tree").tobytes().decode())
    m = LinkModel(**{f: agreed[f] for f in _AGREED}, intra=intra, inter=inter,
                  spin=comm.link_model.spin,
                  single_copy=int(agreed["single_copy"]),
                  memory=tuple(tuple(float(x) for x in row) for row in agreed["memory"]),
                  table=table_index(agreed["table"]))
    comm._log(f"links: intra {intra} α {m.alpha_intra * 1e6:.1f} us o "
              f"{m.overhead_intra * 1e6:.1f} us {1e-9 / m.beta_intra:.2f} GB/s; inter {inter} "
              f"α {m.alpha_inter * 1e6:.1f} us o {m.overhead_inter * 1e6:.1f} us "
              f"{1e-9 / m.beta_inter:.2f} GB/s; wake {m.wake * 1e6:.0f} us; {m.cores} cores; "
              f"{len(agreed['table'])} tuned-table entries")
    return m


# Communicator ids of the two-rank probe communicators: the world is 1 and split() ids end in
# the byte 2, so these never meet another communicator's messages.
_PAIR_IDS = (3, 4)


def _pair(comm, peer: int, comm_id: int):
    """The two-rank communicator (world rank 0, ``peer``) over the world's transport. Only the two
    build it: unlike split(), the other ranks take no part."""
    ranks = (0, peer)
    pair = Communicator(comm.transport, ranks.index(comm.rank), 2, world_ranks=ranks,
                        topology=[comm.topology[r] for r in ranks], comm_id=comm_id,
                        timeout=comm.timeout, link_model=comm.link_model, _owner=False)
    pair.small_path = True        # as untraced calls run, even with MINICOMM_TRACE set
    return pair


def _measure_links(comm, near: Optional[int], far: Optional[int], intra: str,
                   inter: str) -> Dict[str, float]:
    """Rank 0's values (LinkModel field names): from its cache, or probed now with the peer of
    each link (the peers learn from rank 0 what to probe). Returns {} on other ranks."""
    rank = comm.rank
    cache = load_links() if rank == 0 else {"links": {}}
    out: Dict[str, Any] = {}
    dirty = False
    if rank == 0 and not ("gamma" in cache and "delta" in cache):
        cache["gamma"], cache["delta"] = measure_local()
    if rank == 0 and "memory" not in cache:
        # δ and γ by working set (~0.5 s, once per machine): what prices shm's copies, as in
        # the calibrated model (minicomm.tuning.calibration)
        cache["memory"], dirty = [list(row) for row in measure_memory()], True
    for peer, kind, side, pair_id in ((near, intra, "intra", _PAIR_IDS[0]),
                                      (far, inter, "inter", _PAIR_IDS[1])):
        if peer is None or rank not in (0, peer):
            continue
        pair = _pair(comm, peer, pair_id)
        # the peer tells rank 0 where it runs: a link to another host has its own cache entry
        host = pair.broadcast_object(socket.gethostname(), root=1)
        local = host == socket.gethostname()
        name = kind if local else f"{kind}>{host}"
        # host-wide values are probed by a pair on this host, the link by its own pair
        todo = [local and "contention" not in cache, cache["links"].get(name) is None,
                local and "wake" not in cache] if rank == 0 else [0, 0, 0]
        todo = pair.broadcast(np.array(todo, dtype=np.int64), root=0, algorithm="tree")
        if todo[0]:
            contention = probe_contention(pair)
            if rank == 0:
                cache["contention"], dirty = contention, True
        if todo[1]:
            got = probe_link(pair, kind, cache.get("gamma", DELTA), cache.get("delta", DELTA),
                             cache.get("contention", 0.0))
            if rank == 0:
                cache["links"][name], dirty = got, True
        if todo[2]:
            wake = probe_wake(pair)
            if rank == 0:
                cache["wake"], dirty = wake, True
        if rank == 0:
            for f in _LINK_FIELDS:
                if f == "exec_overhead":      # the small-message path is an intra-node one
                    if side == "intra":
                        out[f] = cache["links"][name][f]
                    continue
                out[f"{f}_{side}"] = cache["links"][name][f]
        pair.close()
    if rank != 0:
        return {}
    for f in _MACHINE_FIELDS:
        if f in cache:
            out[f] = cache[f]
    # the two-copier contention of the memory rows is not used: a loaded machine's other jobs
    # would read as contention (the calibrated model leaves it out too)
    out["memory"] = [[r[0], r[1], r[2], 0.0] for r in cache["memory"]]
    if dirty:
        try:
            save_links(cache)
        except OSError as e:      # a read-only home must not stop a job: measure again next time
            warnings.warn(f"minicomm: could not write the link cache: {e}", stacklevel=2)
    return out
