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
from typing import Callable, Dict, Optional, Tuple

from ..schedule import ALL_COLLECTIVES, COLLECTIVES, PREFIX, UNEVEN, Schedule
from . import hier, rhd, ring, tree

FAMILIES = ("ring", "tree", "rhd", "hier")
_MODULES = {"ring": ring, "tree": tree, "rhd": rhd, "hier": hier}
CHANNELLED_FAMILIES = (ring, tree)


def family(name: str):
    """The module of family ``name`` (its ``build`` makes one rank's schedule, uncached), or a
    registered algorithm (``register``)."""
    try:
        return _MODULES[name] if name in _MODULES else _REGISTERED[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(names())} "
                         f"or 'auto'") from None


# ------------------------------------------------------------------ user-written algorithms
class ScheduleError(ValueError):
    """A registered algorithm's schedule is wrong: the message gives the first counter-example
    (world size, rank, step and what is wrong)."""


class Registered:
    """A user's algorithm: its ``build`` (the families' signature), the collectives it has,
    whether ``auto`` may choose it. Schedules it returns are checked like the families'."""

    def __init__(self, name: str, build, collectives: Tuple[str, ...], auto: bool):
        self.name, self._build, self.collectives, self.auto = name, build, collectives, auto

    def build(self, collective: str, rank: int, size: int, count: int, root: int,
              topology) -> Schedule:
        if collective not in self.collectives:
            raise ValueError(f"algorithm {self.name!r} has no {collective}: it was registered "
                             f"for {', '.join(self.collectives)}")
        sched = self._build(collective, rank, size, count, root, topology)
        if not isinstance(sched, Schedule):
            raise ScheduleError(f"{self.name}: build returned {type(sched).__name__}, not a "
                                f"minicomm.schedule.Schedule")
        return sched

    def __reduce__(self):          # cloudpickle carries it to spawned ranks (launch/local.py)
        return (Registered, (self.name, self._build, self.collectives, self.auto))


_REGISTERED: Dict[str, Registered] = {}
_prover: Optional[Callable[[str, Tuple[str, ...], int], None]] = None
VERIFY_MAX_WORLD = 8           # register(verify=True) proves world sizes 1..this


def set_prover(prove: Optional[Callable[[str, Tuple[str, ...], int], None]]) -> None:
    """Install what ``register(verify=True)`` proves with: ``prove(name, collectives,
    max_world)`` raises the verifier's error with the first counter-example. The verifier is a
    layer above this one; ``minicomm/__init__.py`` (the composition root) plugs it in."""
    global _prover
    _prover = prove


def register(name: str, build, collectives=None, verify: bool = False,
             auto: bool = False) -> None:
    """Make ``build`` an algorithm every communicator, the verifier and the simulator can use.

    Args:
        name (str): The algorithm's name (``algorithm=name``); one already taken is refused.
        build (Callable): ``build(collective, rank, size, count, root, topology) -> Schedule``,
            one rank's schedule (minicomm.schedule's format).
        collectives (Sequence[str] | None): The collectives it has (None: every collective).
        verify (bool): Prove it for every world size up to 8 first; a wrong schedule is refused
            with ``ScheduleError`` naming the first counter-example.
        auto (bool): Let ``algorithm="auto"`` consider it.

    Raises:
        ValueError: A taken name or an unknown collective. ScheduleError: ``verify=True`` and
            the schedules are wrong.

    Examples:
        >>> import minicomm as mc
        >>> "ring" in mc.algorithms.names()
        True
    """
    if not isinstance(name, str) or not name or name in ("auto", "innet") or name in _MODULES \
            or name in _REGISTERED:
        raise ValueError(f"algorithm name {name!r} is taken (or not a name): "
                         f"{', '.join(names())} and 'auto' are")
    if not callable(build):
        raise TypeError(f"register: build must be callable, got {type(build).__name__}")
    colls = tuple(COLLECTIVES if collectives is None else collectives)
    bad = [c for c in colls if c not in COLLECTIVES]
    if bad or not colls:
        raise ValueError(f"register: unknown collectives {bad or '(none)'}; choose from "
                         f"{', '.join(COLLECTIVES)}")
    _REGISTERED[name] = Registered(name, build, colls, bool(auto))
    build_schedule.cache_clear()
    if verify:
        if _prover is None:
            del _REGISTERED[name]
            raise RuntimeError("register(verify=True) needs the verifier: import minicomm")
        try:
            _prover(name, colls, VERIFY_MAX_WORLD)
        except Exception as e:
            del _REGISTERED[name]
            build_schedule.cache_clear()
            raise ScheduleError(f"algorithm {name!r} refused: {e}") from None


def _check_registered(alg: Registered, s: Schedule, collective: str, rank: int, size: int,
                      count: int, root: int) -> None:
    """A user's schedule is for the call asked and well formed (the verifier's structure
    check, ``_checker``: buffers, offsets, peers), or a ScheduleError that names the op."""
    want = (alg.name, collective, rank, size, count, root)
    got = (s.algorithm, s.collective, s.rank, s.size, s.count, s.root)
    if got != want:
        raise ScheduleError(f"{alg.name}: build returned the schedule of another call: "
                            f"{s.summary()} (asked: {collective} rank {rank}/{size} "
                            f"count={count} root={root}; its algorithm must be {alg.name!r})")
    if _checker is not None:
        try:
            _checker(s, size)
        except Exception as e:
            raise ScheduleError(f"{alg.name} p={size}: {e}") from None


_checker: Optional[Callable[[Schedule, int], None]] = None


def set_checker(check: Optional[Callable[[Schedule, int], None]]) -> None:
    """Install the structure check every registered schedule passes before it runs
    (the verifier's; the composition root plugs it in, as ``set_prover``)."""
    global _checker
    _checker = check


def adopt(algs) -> None:
    """Register, as they are, algorithms registered in another process (``mc.spawn`` hands
    the parent's to every rank)."""
    for a in algs:
        _REGISTERED.setdefault(a.name, a)
    build_schedule.cache_clear()


def unregister(name: str) -> None:
    """Forget a registered algorithm (tests, notebooks); the built-in families stay."""
    _REGISTERED.pop(name, None)
    build_schedule.cache_clear()


def names() -> Tuple[str, ...]:
    """The built-in families, innet and the registered algorithms."""
    return FAMILIES + ("innet",) + tuple(_REGISTERED)


def registered(auto_only: bool = False) -> Tuple[Registered, ...]:
    """The registered algorithms (``auto_only``: those ``auto`` may choose)."""
    return tuple(r for r in _REGISTERED.values() if r.auto or not auto_only)


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
    if isinstance(module, Registered):
        _check_registered(module, sched, collective, rank, size, count, root)
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
