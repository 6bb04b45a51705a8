"""Timing every algorithm on a live world: the tuned table's entries (``minicomm bench --tune``).

``time_algorithms`` and ``measure_table`` on a Communicator are collectives; ``measure_table``
given ``mc.spawn`` keyword arguments starts the ranks itself. Method: the package docstring.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Sequence

import numpy as np

from ..algorithms import FAMILIES


def _call(comm, collective: str, nbytes: int):
    """A zero-argument function doing one float32 call of ``collective`` with ``algorithm=``."""
    n = max(1, nbytes // 4)
    p = comm.size
    if collective == "barrier":
        return lambda algo: comm.barrier(algorithm=algo)
    if collective in ("reduce_scatter", "alltoall", "scatter"):
        x = np.ones((p, n), dtype=np.float32)
        out = np.empty(n if collective != "alltoall" else (p, n), dtype=np.float32)
    else:
        x = np.ones(n, dtype=np.float32)
        out = np.empty((p, n) if collective in ("allgather", "gather") else n, dtype=np.float32)
    fn = getattr(comm, collective)
    if collective in ("reduce", "gather"):
        mine = out if comm.rank == 0 else None
        return lambda algo: fn(x, root=0, algorithm=algo, out=mine)
    if collective in ("broadcast", "scatter"):
        return lambda algo: fn(x, root=0, algorithm=algo, out=out)
    return lambda algo: fn(x, algorithm=algo, out=out)


def time_algorithms(comm, collective: str, nbytes: int, algorithms: Sequence[str] = FAMILIES,
                    batch_seconds: float = 0.02, batches: int = 5,
                    max_iters: int = 1000) -> Dict[str, float]:
    """Median seconds per call of each algorithm (the slowest rank per batch); collective: every
    rank calls it and gets the same numbers."""
    call = _call(comm, collective, nbytes)
    est = np.zeros(len(algorithms))
    for i, algo in enumerate(algorithms):
        call(algo)                                     # warm-up
        t = time.perf_counter()
        call(algo)
        est[i] = time.perf_counter() - t
    est = comm.allreduce(est, op="max", algorithm="rhd")
    iters = [int(min(max_iters, max(1, batch_seconds / max(e, 1e-9)))) for e in est]
    times = np.zeros((len(algorithms), batches))
    for i, algo in enumerate(algorithms):
        for _ in range(iters[i]):   # an untimed batch: ranks that just started run cold
            call(algo)
    for j in range(batches):
        for i, algo in enumerate(algorithms):
            comm.barrier(algorithm="rhd")
            t = time.perf_counter()
            for _ in range(iters[i]):
                call(algo)
            times[i, j] = (time.perf_counter() - t) / iters[i]
    times = comm.allreduce(times, op="max", algorithm="rhd")
    return {algo: float(statistics.median(times[i])) for i, algo in enumerate(algorithms)}


def measure_table(target, collectives: Sequence[str], sizes: Sequence[int],
                  algorithms: Sequence[str] = FAMILIES, batch_seconds: float = 0.02,
                  batches: int = 5, max_iters: int = 1000) -> List[Dict[str, Any]]:
    """Time every algorithm per (collective, size) on ``target`` (a Communicator, or spawn
    keyword arguments); returns table entries (module doc)."""
    if isinstance(target, dict):
        from ..launch import spawn
        kw = dict(target)
        world = kw.pop("world_size")
        return spawn(measure_table, world, args=(collectives, sizes, algorithms, batch_seconds,
                                                 batches, max_iters), **kw)[0]
    comm = target
    m = comm.link_model
    entries = []
    for coll in collectives:
        for nbytes in ([0] if coll == "barrier" else sorted({max(1, s // 4) * 4 for s in sizes})):
            secs = time_algorithms(comm, coll, nbytes, algorithms, batch_seconds, batches,
                                   max_iters)
            entries.append({"collective": coll, "world": comm.size,
                            "topology": list(comm.topology), "intra": m.intra, "inter": m.inter,
                            "bytes": nbytes, "seconds": secs,
                            "best": min((a for a in secs if a in FAMILIES),
                                        key=lambda a: (secs[a], FAMILIES.index(a)))})
    return entries
