"""Algorithm families: pure schedule generators, one module per family.

Every family module exposes

    build(collective, rank, size, count, root, topology) -> minicomm.schedule.Schedule

for all nine collectives (broadcast, reduce, allreduce, allgather, reduce_scatter, gather,
scatter, alltoall, barrier), any world size >= 1, any root, any count >= 0. ``topology`` is the
node id of every rank (a tuple of length ``size``); flat families ignore it, ``hier`` uses it,
and so do a channelled ``ring`` (its rail-aligned orders) and a channelled ``tree`` (its
servers). ``channels``: ring's channel count (ring.py's doc), or tree's, whose allreduce on k > 1
channels is NCCL's double binary tree (tree.py's doc); rhd and hier take one channel. And

    build_v(collective, rank, size, count, root, topology, counts) -> Schedule

for the uneven collectives (allgatherv, gatherv, scatterv, alltoallv, reduce_scatterv: blocks of
``counts`` elements, any of them 0) and the prefix reductions (scan, exscan); schedule.py's doc
gives their buffers.

``build_schedule`` is the cached entry point the communicator, the verifier CLI and the simulator
use: one schedule per key (collective, algorithm, rank, size, count, root, topology, channels,
counts).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

from ..schedule import ALL_COLLECTIVES, PREFIX, UNEVEN, Schedule
from . import hier, rhd, ring, tree

FAMILIES = ("ring", "tree", "rhd", "hier")
_MODULES = {"ring": ring, "tree": tree, "rhd": rhd, "hier": hier}
CHANNELLED_FAMILIES = (ring, tree)


def family(name: str):
    """The module of family ``name`` (its ``build`` makes one rank's schedule, uncached)."""
    try:
        return _MODULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(FAMILIES)} "
                         f"or 'auto'") from None


@lru_cache(maxsize=4096)
def build_schedule(collective: str, algorithm: str, rank: int, size: int, count: int,
                   root: int = 0, topology: Optional[Tuple[int, ...]] = None,
                   channels: int = 1, counts: Tuple[int, ...] = ()) -> Schedule:
    if collective not in ALL_COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}")
    if topology is None:
        topology = (0,) * size
    module = family(algorithm)
    if channels != 1 and module not in CHANNELLED_FAMILIES:
        raise ValueError(f"channels={channels}: only the ring and tree families take channels")
    if collective in UNEVEN or collective in PREFIX:
        check_counts(collective, size, count, counts)
        sched = module.build_v(collective, rank, size, count, root, tuple(topology),
                               tuple(counts))
    elif channels != 1:
        sched = module.build(collective, rank, size, count, root, tuple(topology), channels)
    else:
        sched = module.build(collective, rank, size, count, root, tuple(topology))
    if sched.algorithm != algorithm or sched.collective != collective:
        raise RuntimeError(f"{algorithm}.build returned a {sched.algorithm} {sched.collective} schedule")
    return sched


def check_counts(collective: str, size: int, count: int, counts: Tuple[int, ...]) -> None:
    """A ValueError unless ``counts`` fits the uneven ``collective`` (schedule.py's doc): p
    entries (alltoallv: p x p), none negative, ``count`` their sum; prefix calls take none."""
    want = 0 if collective in PREFIX else size * size if collective == "alltoallv" else size
    if len(counts) != want or any(c < 0 for c in counts) or (want and sum(counts) != count):
        raise ValueError(f"{collective}: counts {list(counts)[:8]} do not fit a world of {size} "
                         f"with {count} elements in all")


def build_all(collective: str, algorithm: str, size: int, count: int, root: int = 0,
              topology: Optional[Tuple[int, ...]] = None, channels: int = 1,
              counts: Tuple[int, ...] = ()):
    """The schedules of every rank of one call (what the verifier and simulator consume)."""
    return [build_schedule(collective, algorithm, r, size, count, root, topology, channels,
                           tuple(counts)) for r in range(size)]
