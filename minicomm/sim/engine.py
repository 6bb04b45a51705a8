"""Simulator engine: runs the schedules of every rank as flows on a modelled network.

Input: the real schedules (``minicomm.algorithms``, or any list of ``Schedule`` / step lists), a
``Topology`` and where each rank sits (``placement``: rank -> accelerator, default rank r on
accelerator r). Output: ``SimResult`` — predicted time, algbw / busbw (nccl-tests conventions,
GB/s = 1e9 B/s, busbw = algbw x ``busbw_factor``), the busiest link.

Timing rules (what a step costs), per rank, steps in order:
  - a step starts when the rank's previous step ended; its local ops take δ per copied byte and
    γ per reduced byte (``Copy`` / ``Reduce``), T + L;
  - then its receives are posted and its sends issued. A message moves once both its send is
    issued and its receive posted (rendezvous, as NCCL's credits and MPI's large-message protocol
    do; ``Topology.rendezvous=False``: eager, as soon as it is sent): after the route's latency α
    (topology.py; a sender starting k messages at once issues them one ``gap`` apart, and they
    start together (k-1) gaps later) it is a flow of its bytes over the links of its route; every link's bandwidth
    is shared max-min fairly (progressive filling) among the flows crossing it at the moment,
    recomputed whenever a flow starts or ends;
  - a send completes when its message is delivered; a receive when its message is delivered, a
    reducing one γ per byte later (``reduce_overlap``: the reduction runs while the data arrives,
    so it ends at max(delivery, arrival start + γ·bytes), and never before T + L + γ·bytes);
  - the step ends when all of its sends and receives completed; the call ends with its last rank.
Messages between one ordered pair match in FIFO order (checked: an unmatched send or receive, or a
count mismatch, raises ``ScheduleError``; a cycle of waits raises it too).

With one switch and equal links this is exactly the α-β-γ model of the MPICH-style cost formulas
(every message α + bytes/B, reductions γ per byte after arrival), which the tests check.

Speed. The state is kept per rank and per message in numpy arrays and every event handles all
ranks and flows that are due at that instant at once: a step that all p ranks take together (a
ring step) is one batch, so 1,024 ranks cost little more than 8. Schedules are compiled once per
(collective, algorithm, ranks, count, root, node map) into flat arrays (cached). Building 1,024
ring schedules takes tens of seconds (each has O(p) steps), so for p >= ``SYMMETRY_MIN_RANKS`` the
engine first tries rank symmetry: it builds rank 0's real schedule and, when the schedules of a
spread sample of ranks are exactly rank 0's with every peer rotated (peer + r mod p) or XORed
(peer ^ r), derives the others that way. ``exact=True`` builds every rank (the tests check that
both give identical programs).

Restrictions: see topology.py (no packet-level effects, ideal ECMP). The time of local ops is
serial per step; several reducing receives of one step reduce in parallel.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..algorithms import family
from ..schedule import COLLECTIVES, Copy, Recv, Reduce, Schedule, Send, busbw_factor
from .topology import Fabric, Topology, default_placement

SYMMETRY_MIN_RANKS = 32
# Instants closer than this are one event: ranks whose times differ by a few bytes' worth of
# transfer would otherwise each be an event of their own (an error of at most this per event).
RESOLUTION = 1e-9
PROGRAM_CACHE_SIZE = 16
BLOCKED = ("allgather", "gather", "reduce_scatter", "scatter", "alltoall")


class ScheduleError(ValueError):
    """Schedules that cannot run: unmatched or mismatched messages, or a cycle of waits."""


def count_for_bytes(collective: str, nbytes: int, p: int, itemsize: int = 4) -> int:
    """Per-rank block count for an nccl-tests size (the whole buffer: the vector for broadcast /
    reduce / allreduce, the output for allgather / gather, the input for reduce_scatter /
    scatter / alltoall)."""
    if nbytes < 0:
        raise ValueError(f"size {nbytes} is negative")
    if collective == "barrier" or nbytes == 0:
        return 0
    per = nbytes // itemsize // (p if collective in BLOCKED else 1)
    return max(1, per)


def bytes_for_count(collective: str, count: int, p: int, itemsize: int = 4) -> int:
    return count * itemsize * (p if collective in BLOCKED else 1)


# ---------------------------------------------------------------------------- compiled programs
@dataclass
class Program:
    """The timing-relevant content of one call's schedules (every rank), as flat arrays.
    Steps are numbered rank-major; messages are sorted by the step that sends them."""
    size: int
    rank_first: np.ndarray        # (p+1,) CSR: steps of rank r are rank_first[r]:rank_first[r+1]
    step_rank: np.ndarray         # (S,)
    step_copy: np.ndarray         # (S,) elements copied by local Copy ops
    step_reduce: np.ndarray       # (S,) elements reduced by local Reduce ops
    msg_src: np.ndarray           # (M,) ranks
    msg_dst: np.ndarray
    msg_count: np.ndarray         # (M,) elements
    msg_reduce: np.ndarray        # (M,) bool: received with reduce=True
    msg_send_step: np.ndarray     # (M,) global step ids
    msg_recv_step: np.ndarray
    send_ptr: np.ndarray          # (S+1,) CSR: messages sent by step s
    recv_order: np.ndarray = None  # (M,) message ids in receive-op order (by step, op order)
    recv_ptr: np.ndarray = None    # (S+1,) CSR into recv_order: messages received by step s
    derived_by: str = "built"     # "built" | "rotation" | "xor"
    calls: int = 1                # calls back to back (``repeat_program``): rank r's steps are
                                  # ``calls`` equal runs, each one call
    build_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.step_rank)

    @property
    def messages(self) -> int:
        return len(self.msg_src)


@dataclass
class _RankArrays:
    nsteps: int
    copy: np.ndarray
    reduce: np.ndarray
    s_step: np.ndarray
    s_peer: np.ndarray
    s_count: np.ndarray
    r_step: np.ndarray
    r_peer: np.ndarray
    r_count: np.ndarray
    r_reduce: np.ndarray

    def same_as(self, o: "_RankArrays") -> bool:
        return (self.nsteps == o.nsteps and all(
            np.array_equal(getattr(self, f), getattr(o, f))
            for f in ("copy", "reduce", "s_step", "s_peer", "s_count", "r_step", "r_peer",
                      "r_count", "r_reduce")))

    def mapped(self, fn) -> "_RankArrays":
        return _RankArrays(self.nsteps, self.copy, self.reduce, self.s_step, fn(self.s_peer),
                           self.s_count, self.r_step, fn(self.r_peer), self.r_count,
                           self.r_reduce)


def _rank_arrays(steps: Sequence[Sequence[Any]], p: int, rank: int) -> _RankArrays:
    n = len(steps)
    copy = np.zeros(n, dtype=np.int64)
    red = np.zeros(n, dtype=np.int64)
    sends: List[Tuple[int, int, int]] = []
    recvs: List[Tuple[int, int, int, bool]] = []
    for k, st in enumerate(steps):
        for o in st:
            t = type(o)
            if t is Send:
                sends.append((k, o.peer, o.count))
            elif t is Recv:
                recvs.append((k, o.peer, o.count, o.reduce))
            elif t is Copy:
                copy[k] += o.count
            elif t is Reduce:
                red[k] += o.count
            else:
                raise ScheduleError(f"rank {rank} step {k}: unknown op {o!r}")
    s = np.array(sends, dtype=np.int64).reshape(-1, 3)
    r = np.array(recvs, dtype=np.int64).reshape(-1, 4)
    for peers in (s[:, 1], r[:, 1]):
        if peers.size and (peers.min() < 0 or peers.max() >= p):
            raise ScheduleError(f"rank {rank}: a peer outside 0..{p - 1}")
    return _RankArrays(n, copy, red, s[:, 0], s[:, 1], s[:, 2], r[:, 0], r[:, 1], r[:, 2],
                       r[:, 3].astype(bool))


def _assemble(ranks: Sequence[_RankArrays], p: int) -> Program:
    nsteps = np.array([a.nsteps for a in ranks], dtype=np.int64)
    first = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(nsteps, out=first[1:])
    ns = np.array([len(a.s_step) for a in ranks], dtype=np.int64)
    nr = np.array([len(a.r_step) for a in ranks], dtype=np.int64)
    cat = lambda f: np.concatenate([getattr(a, f) for a in ranks]) if ranks else np.zeros(0)  # noqa: E731
    return _program(p, first, cat("copy"), cat("reduce"),
                    np.repeat(np.arange(p), ns), cat("s_peer"), cat("s_step") + np.repeat(first[:-1], ns),
                    cat("s_count"), np.repeat(np.arange(p), nr), cat("r_peer"),
                    cat("r_step") + np.repeat(first[:-1], nr), cat("r_count"), cat("r_reduce"))


def _program(p, first, copy, red, s_rank, s_peer, s_step, s_count, r_rank, r_peer, r_step,
             r_count, r_reduce) -> Program:
    """FIFO-match sends to receives per ordered pair and lay the messages out by send step."""
    key_s = s_rank.astype(np.int64) * p + s_peer
    key_r = r_peer.astype(np.int64) * p + r_rank
    os_ = np.argsort(key_s, kind="stable")
    or_ = np.argsort(key_r, kind="stable")
    ks, kr = key_s[os_], key_r[or_]
    if len(ks) != len(kr) or not np.array_equal(ks, kr):
        n = min(len(ks), len(kr))
        bad = np.nonzero(ks[:n] != kr[:n])[0]
        i = int(bad[0]) if bad.size else n
        k = int(ks[i]) if i < len(ks) else int(kr[i])
        raise ScheduleError(f"unmatched message between rank {k // p} and rank {k % p}: "
                            f"{int((key_s == k).sum())} sends, {int((key_r == k).sum())} receives")
    sc, rc = s_count[os_], r_count[or_]
    if not np.array_equal(sc, rc):
        i = int(np.nonzero(sc != rc)[0][0])
        k = int(ks[i])
        raise ScheduleError(f"rank {k // p} -> rank {k % p}: a send of {int(sc[i])} elements "
                            f"matched with a receive of {int(rc[i])}")
    # messages in the order of their sends (by step, then op order within a step); receives
    # keep their op order too (``recv_order``)
    pos = np.empty(len(os_), dtype=np.int64)
    pos[os_] = np.arange(len(os_))
    o_r = or_[pos]                                   # the receive op matched to send i
    return _matched(p, first, copy, red, s_rank, s_peer, s_count, r_reduce[o_r],
                    s_step.astype(np.int64), r_step[o_r].astype(np.int64), o_r)


def compile_schedules(scheds: Sequence[Any]) -> Program:
    """Program of explicit per-rank schedules (``Schedule`` objects or lists of steps)."""
    p = len(scheds)
    ranks = [_rank_arrays(s.steps if isinstance(s, Schedule) else s, p, r)
             for r, s in enumerate(scheds)]
    return _assemble(ranks, p)


def _symmetric_samples(m: int) -> List[int]:
    picks = {1, 2, 3, m // 2, m // 2 + 1, m - 2, m - 1, (m * 5) // 7, (m * 3) // 11 + 1}
    return sorted(k for k in picks if 0 < k < m)


def _block_maps(m: int, b: int):
    """Symmetries of blocks of b consecutive ranks (b = 1: ranks; b = g: servers): block index
    rotated (k + j mod m) or, for m a power of two, XORed (k ^ j); the place inside a block kept."""
    out = [("rotation", lambda j: (lambda x: ((x // b + j) % m) * b + x % b))]
    if m & (m - 1) == 0:
        out.append(("xor", lambda j: (lambda x: ((x // b) ^ j) * b + x % b)))
    return out


def _equal_blocks(node_map: Tuple[int, ...]) -> int:
    """g when the node map is servers of g consecutive ranks each (all equal), else 0."""
    p = len(node_map)
    g = node_map.count(node_map[0])
    if not 1 < g < p or p % g:
        return 0
    for r in range(p):
        if node_map[r] != node_map[r - r % g] or (r % g == 0 and r and node_map[r] == node_map[r - 1]):
            return 0
    return g


def _try_symmetry(build, p: int, node_map: Tuple[int, ...]) -> Optional[Program]:
    """A program derived from the real schedules of the first block by a symmetry (rank-level,
    or server-level when servers are equal blocks of consecutive ranks), when the real schedules
    of a spread sample of blocks are exactly what the symmetry predicts; None otherwise."""
    g = _equal_blocks(node_map)
    blocks = [1] + ([g] if g else [])
    built: Dict[int, _RankArrays] = {}

    def arrays(r: int) -> _RankArrays:
        if r not in built:
            built[r] = _rank_arrays(build(r).steps, p, r)
        return built[r]

    for b in blocks:
        m = p // b
        for name, mk in _block_maps(m, b):
            if all(arrays(i).mapped(mk(j)).same_as(arrays(j * b + i))
                   for j in _symmetric_samples(m) for i in range(b)):
                ranks = [arrays(r) if r < b else arrays(r % b).mapped(mk(r // b))
                         for r in range(p)]
                prog = _assemble(ranks, p)
                prog.derived_by = name if b == 1 else f"server {name}"
                return prog
    return None


def _matched(p: int, first: np.ndarray, copy: np.ndarray, red: np.ndarray, src: np.ndarray,
             dst: np.ndarray, count: np.ndarray, reduce: np.ndarray, send_step: np.ndarray,
             recv_step: np.ndarray, recv_key: np.ndarray) -> Program:
    """A Program of messages already matched to their receives (no FIFO matching): message i
    goes from ``src[i]`` (sent by step ``send_step[i]``, messages given in op order) to
    ``dst[i]`` (received by ``recv_step[i]``; receives of one step in ``recv_key`` order)."""
    so = np.argsort(send_step, kind="stable")
    src, dst, count, reduce = src[so], dst[so], count[so], reduce[so]
    send_step, recv_step, recv_key = send_step[so], recv_step[so], recv_key[so]
    S = int(first[-1])
    ptr = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(np.bincount(send_step, minlength=S), out=ptr[1:])
    recv_order = np.lexsort((recv_key, recv_step)).astype(np.int64)
    rptr = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(np.bincount(recv_step, minlength=S), out=rptr[1:])
    return Program(size=p, rank_first=first,
                   step_rank=np.repeat(np.arange(p, dtype=np.int64), np.diff(first)),
                   step_copy=copy.astype(np.float64), step_reduce=red.astype(np.float64),
                   msg_src=src.astype(np.int64), msg_dst=dst.astype(np.int64),
                   msg_count=count.astype(np.float64), msg_reduce=reduce.astype(bool),
                   msg_send_step=send_step.astype(np.int64),
                   msg_recv_step=recv_step.astype(np.int64), send_ptr=ptr,
                   recv_order=recv_order, recv_ptr=rptr)


def _recv_rank(prog: Program) -> np.ndarray:
    """Every message's position in its program's receive-op order."""
    pos = np.empty(prog.messages, dtype=np.int64)
    pos[prog.recv_order] = np.arange(prog.messages)
    return pos


def repeat_program(prog: Program, calls: int) -> Program:
    """The program of ``calls`` copies of ``prog`` run back to back by every rank (rank r's steps
    of call 1, then of call 2, ...; call k's messages meet call k's receives)."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    if calls == 1:
        return prog
    p = prog.size
    nsteps = np.diff(prog.rank_first)
    first = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(nsteps * calls, out=first[1:])
    # step s of rank r in call c -> first[r] + c * nsteps[r] + (s - rank_first[r])
    local = np.arange(prog.steps) - prog.rank_first[prog.step_rank]

    def new_step(steps: np.ndarray, c: int) -> np.ndarray:
        r = prog.step_rank[steps]
        return first[r] + c * nsteps[r] + local[steps]
    order = np.argsort(np.concatenate([new_step(np.arange(prog.steps), c)
                                       for c in range(calls)]), kind="stable")
    cat, tile, M = np.concatenate, np.tile, prog.messages
    out = _matched(p, first, tile(prog.step_copy, calls)[order],
                   tile(prog.step_reduce, calls)[order], tile(prog.msg_src, calls),
                   tile(prog.msg_dst, calls), tile(prog.msg_count, calls),
                   tile(prog.msg_reduce, calls),
                   cat([new_step(prog.msg_send_step, c) for c in range(calls)]),
                   cat([new_step(prog.msg_recv_step, c) for c in range(calls)]),
                   cat([_recv_rank(prog) + c * M for c in range(calls)]))
    out.derived_by = prog.derived_by
    out.calls = prog.calls * calls
    return out


def guarded_program(prog: Program, count: int) -> Program:
    """``prog`` with the communicator's lazy call check around it (rooted collectives): every
    rank first sends ``count`` elements to every other rank (its call's fingerprint, eager),
    runs the call, and ends by receiving every other rank's fingerprint (communicator.py
    ``_post_fingerprints``: the data moves at once; the call returns when all have arrived)."""
    p = prog.size
    if p < 2:
        return prog
    nsteps = np.diff(prog.rank_first)
    first = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(nsteps + 2, out=first[1:])
    moved = first[prog.step_rank] + 1 + (np.arange(prog.steps) - prog.rank_first[prog.step_rank])
    S = int(first[-1])
    copy, red = np.zeros(S), np.zeros(S)
    copy[moved], red[moved] = prog.step_copy, prog.step_reduce
    a, b = np.nonzero(~np.eye(p, dtype=bool))        # fingerprint a -> b, every ordered pair
    M = prog.messages
    out = _matched(p, first, copy, red, np.concatenate([a, prog.msg_src]),
                   np.concatenate([b, prog.msg_dst]),
                   np.concatenate([np.full(len(a), float(count)), prog.msg_count]),
                   np.concatenate([np.zeros(len(a), bool), prog.msg_reduce]),
                   np.concatenate([first[a], moved[prog.msg_send_step]]),
                   np.concatenate([first[b + 1] - 1, moved[prog.msg_recv_step]]),
                   np.concatenate([np.arange(len(a)) + M, _recv_rank(prog)]))
    out.derived_by = prog.derived_by
    out.calls = prog.calls
    return out


_programs: "OrderedDict[Tuple, Program]" = OrderedDict()


def program_for(collective: str, algorithm: str, p: int, count: int, root: int = 0,
                node_map: Optional[Tuple[int, ...]] = None, exact: bool = False) -> Program:
    """The compiled schedules of one call (cached)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if p < 1:
        raise ValueError(f"world size must be >= 1, got {p}")
    if not 0 <= root < p:
        raise ValueError(f"root {root} outside 0..{p - 1}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    node_map = tuple(node_map) if node_map is not None else (0,) * p
    if len(node_map) != p:
        raise ValueError(f"node map names {len(node_map)} ranks, not {p}")
    key = (collective, algorithm, p, count, root, node_map, exact)
    prog = _programs.get(key)
    if prog is not None:
        _programs.move_to_end(key)
        return prog
    fam = family(algorithm)       # raises ValueError for an unknown algorithm

    def build(r: int) -> Schedule:
        s = fam.build(collective, r, p, count, root, node_map)
        if s.algorithm != algorithm or s.collective != collective:
            raise ScheduleError(f"{algorithm}.build returned a {s.algorithm} {s.collective} schedule")
        return s

    t0 = time.perf_counter()
    prog = None
    if not exact and p >= SYMMETRY_MIN_RANKS:
        prog = _try_symmetry(build, p, node_map)
    if prog is None:
        prog = _assemble([_rank_arrays(build(r).steps, p, r) for r in range(p)], p)
    prog.build_s = time.perf_counter() - t0
    _programs[key] = prog
    while len(_programs) > PROGRAM_CACHE_SIZE:
        _programs.popitem(last=False)
    return prog


# ---------------------------------------------------------------------------- results
@dataclass
class SimResult:
    collective: str
    algorithm: str
    ranks: int
    bytes: int
    time_s: float
    algbw: float                  # GB/s
    busbw: float                  # GB/s
    busiest_link: str
    busiest_link_bytes: float
    busiest_link_utilisation: float   # busy time / call time
    count: int = 0
    messages: int = 0
    steps: int = 0
    topology: str = ""
    events: int = 0
    wall_s: float = 0.0
    derived_by: str = "built"
    link_bytes_by_kind: Dict[str, float] = field(default_factory=dict, repr=False)
    rank_end: Optional[np.ndarray] = field(default=None, repr=False)

    def to_dict(self) -> Dict[str, Any]:
        return {"collective": self.collective, "algorithm": self.algorithm, "bytes": self.bytes,
                "ranks": self.ranks, "time_s": self.time_s, "algbw": self.algbw,
                "busbw": self.busbw, "count": self.count, "topology": self.topology,
                "busiest_link": self.busiest_link,
                "busiest_link_bytes": self.busiest_link_bytes,
                "busiest_link_utilisation": self.busiest_link_utilisation,
                "messages": self.messages, "steps": self.steps}


@dataclass
class RunStats:
    time_s: float
    rank_end: np.ndarray
    link_bytes: np.ndarray
    events: int
    delivered: np.ndarray         # (M,) delivery time of every message


# ---------------------------------------------------------------------------- the event loop
def _ranges(lo: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """Concatenation of arange(lo[i], lo[i] + cnt[i])."""
    tot = int(cnt.sum())
    if tot == 0:
        return np.zeros(0, dtype=np.int64)
    off = np.repeat(lo - np.concatenate(([0], np.cumsum(cnt)[:-1])), cnt)
    return np.arange(tot, dtype=np.int64) + off


def max_min_rates(links: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows over links (progressive filling: the flows whose fair share
    on their tightest link is the smallest are fixed at it, their bandwidth removed, repeat).
    ``links`` is (F, H) of link ids; entries equal to ``len(capacity) - 1`` are padding (that
    last link must have infinite capacity). A flow crossing no finite link gets rate inf."""
    F = links.shape[0]
    rate = np.full(F, math.inf)
    if F == 0:
        return rate
    nlinks = len(capacity)
    cap = capacity.copy()
    open_links = links
    open_idx = np.arange(F)
    while True:
        cnt = np.bincount(open_links.ravel(), minlength=nlinks)
        share = np.full(nlinks, math.inf)
        np.divide(cap, cnt, out=share, where=cnt > 0)
        share[-1] = math.inf
        fshare = share[open_links].min(axis=1)
        m = fshare.min()
        if not m < math.inf:
            break                                   # the rest cross only unlimited links
        sel = fshare <= m * (1 + 1e-9)
        rate[open_idx[sel]] = m
        if sel.all():
            break
        cap -= np.bincount(open_links[sel].ravel(), minlength=nlinks) * m
        np.maximum(cap, 0.0, out=cap)
        open_links, open_idx = open_links[~sel], open_idx[~sel]
    return rate


def run_program(prog: Program, topo: Topology, placement: np.ndarray, itemsize: int = 4,
                fabric: Optional[Fabric] = None, resolution: float = RESOLUTION) -> RunStats:
    """Time the program on the topology (module docstring); rank r runs on accelerator
    ``placement[r]``. Instants less than ``resolution`` seconds apart are handled as one event
    (so a flow may end, and a step start, up to that much early)."""
    fab = fabric or Fabric(topo)
    p = prog.size
    placement = np.asarray(placement, dtype=np.int64)
    if placement.shape != (p,):
        raise ValueError(f"placement names {placement.size} ranks, not {p}")
    if p and (placement.min() < 0 or placement.max() >= topo.endpoints):
        raise ValueError(f"placement outside the {topo.endpoints} accelerators of {topo.name}")
    gamma, delta, overlap = topo.gamma, topo.delta, topo.reduce_overlap
    S, M = prog.steps, prog.messages
    send_step, recv_step, ptr = prog.msg_send_step, prog.msg_recv_step, prog.send_ptr
    nbytes = prog.msg_count * itemsize
    g_msg = np.where(prog.msg_reduce, nbytes * gamma, 0.0)
    local = (prog.step_copy * delta + prog.step_reduce * gamma) * itemsize
    step_g = np.zeros(S)
    if M:
        np.maximum.at(step_g, recv_step, g_msg)
    remaining = np.bincount(send_step, minlength=S) + np.bincount(recv_step, minlength=S)
    # routes: one per distinct (src, dst) accelerator pair; padding is the extra last link
    nl = len(fab)
    cap = np.concatenate((fab.capacity, [math.inf]))
    E = topo.endpoints
    pair_key = placement[prog.msg_src] * E + placement[prog.msg_dst]
    pairs, msg_pair = np.unique(pair_key, return_inverse=True)
    pair_links, pair_lat, pair_gap = fab.routes_gaps(pairs // E, pairs % E)
    src_of = placement[prog.msg_src]
    gapped = bool(pair_gap.any())
    width = max(1, int((pair_links >= 0).sum(axis=1).max())) if len(pairs) else 1
    pair_links = np.where(pair_links[:, :width] >= 0, pair_links[:, :width], nl)
    msg_pair = msg_pair.reshape(-1)

    latest = np.full(S, -math.inf)          # latest completion of a step's ops so far
    start = np.full(S, math.nan)
    cur = prog.rank_first[:-1].copy()
    last = prog.rank_first[1:]
    next_start = np.where(cur < last, 0.0, math.inf)
    rank_end = np.zeros(p)
    alive = int((cur < last).sum())
    delivered = np.full(M, math.inf)
    arrival_start = np.full(M, math.inf)
    # rendezvous: a message moves once its sender has sent and its receiver has posted the
    # receive (the receiver's buffer, or NCCL's credits, are there); eager: once it is sent
    rendezvous = topo.rendezvous
    send_ready = np.full(M, math.nan)
    recv_ready = np.full(M, math.nan) if rendezvous else np.zeros(M)
    by_recv, rptr = prog.recv_order, prog.recv_ptr
    link_bytes = np.zeros(nl + 1)
    # pending flows (latency not over yet) and active flows (sharing links); an active flow's
    # bytes left are valid at t_ref, the last time the rates changed
    pend_id = np.zeros(0, dtype=np.int64)
    pend_t = np.zeros(0)
    act_id = np.zeros(0, dtype=np.int64)
    act_links = np.zeros((0, width), dtype=np.int64)
    act_left = np.zeros(0)
    act_rate = np.zeros(0)
    act_fin = np.zeros(0)
    t_ref = 0.0
    dirty = False
    now = 0.0
    events = 0

    def complete(steps: np.ndarray) -> None:
        nonlocal alive
        if steps.size == 0:
            return
        end = np.maximum(start[steps] + local[steps] + step_g[steps], latest[steps])
        r = prog.step_rank[steps]
        nxt = steps + 1
        more = nxt < last[r]
        cur[r[more]] = nxt[more]
        next_start[r[more]] = end[more]
        rank_end[r[~more]] = end[~more]
        alive -= int((~more).sum())

    def left_now() -> np.ndarray:
        dt = now - t_ref
        if dt <= 0:
            return act_left
        left = act_left - act_rate * dt
        left[~(act_rate < math.inf)] = 0.0
        return np.maximum(left, 0.0, out=left)

    while True:
        events += 1
        horizon = now * (1 + 1e-12) + resolution     # instants this close are one event
        # 1. steps due now start (a step with nothing left to wait for ends at once)
        while alive:
            due = np.nonzero(next_start <= horizon)[0]
            if due.size == 0:
                break
            s = cur[due]
            t0 = next_start[due]
            next_start[due] = math.inf
            start[s] = t0
            posted = t0 + local[s]
            cnt = ptr[s + 1] - ptr[s]
            go_ids = []
            if cnt.any():
                ids = _ranges(ptr[s], cnt)
                send_ready[ids] = np.repeat(posted, cnt)
                go_ids.append(ids if not rendezvous else ids[~np.isnan(recv_ready[ids])])
            if rendezvous:
                rcnt = rptr[s + 1] - rptr[s]
                if rcnt.any():
                    rids = by_recv[_ranges(rptr[s], rcnt)]
                    recv_ready[rids] = np.repeat(posted, rcnt)
                    go_ids.append(rids[~np.isnan(send_ready[rids])])
            ids = np.concatenate(go_ids) if go_ids else np.zeros(0, dtype=np.int64)
            if ids.size:
                t_go = (np.maximum(send_ready[ids], recv_ready[ids]) if rendezvous
                        else send_ready[ids]) + pair_lat[msg_pair[ids]]
                if gapped:
                    # a sender issues the k messages it starts at once one gap apart; they start
                    # together when the last is issued (one event, not k)
                    srcs = src_of[ids]
                    k_of = np.bincount(srcs)[srcs]
                    t_go = t_go + pair_gap[msg_pair[ids]] * (k_of - 1)
                pend_id = np.concatenate((pend_id, ids))
                pend_t = np.concatenate((pend_t, t_go))
            ready = s[remaining[s] == 0]
            if ready.size:
                complete(ready)
        # 2. flows whose latency is over start to move bytes
        if pend_id.size:
            go = pend_t <= horizon
            if go.any():
                ids = pend_id[go]
                links = pair_links[msg_pair[ids]]
                arrival_start[ids] = pend_t[go]
                link_bytes += np.bincount(links.ravel(), weights=np.repeat(nbytes[ids], width),
                                          minlength=nl + 1)
                act_left = np.concatenate((left_now(), nbytes[ids]))
                act_rate = np.concatenate((act_rate, np.zeros(len(ids))))
                t_ref = now
                act_id = np.concatenate((act_id, ids))
                act_links = np.concatenate((act_links, links))
                keep = ~go
                pend_id, pend_t = pend_id[keep], pend_t[keep]
                dirty = True
        if dirty:
            act_left, t_ref = left_now(), now
            act_rate = max_min_rates(act_links, cap)
            act_fin = now + act_left / act_rate
            dirty = False
        # 3. the next instant anything happens
        t_next = math.inf
        if alive:
            t_next = float(next_start.min())
        if pend_t.size:
            t_next = min(t_next, float(pend_t.min()))
        if act_fin.size:
            t_next = min(t_next, float(act_fin.min()))
        if not t_next < math.inf:
            break
        if t_next > now:
            now = t_next
        # 4. deliveries
        if act_fin.size:
            fin = act_fin <= now * (1 + 1e-12) + resolution
            if fin.any():
                ids = act_id[fin]
                delivered[ids] = now
                ss, rs = send_step[ids], recv_step[ids]
                np.maximum.at(latest, ss, now)
                if overlap:
                    done = np.maximum(now, arrival_start[ids] + g_msg[ids])
                else:
                    done = now + g_msg[ids]
                np.maximum.at(latest, rs, done)
                np.subtract.at(remaining, ss, 1)
                np.subtract.at(remaining, rs, 1)
                keep = ~fin
                act_left = left_now()[keep]
                t_ref = now
                act_id, act_links = act_id[keep], act_links[keep]
                act_rate, act_fin = act_rate[keep], act_fin[keep]
                dirty = True
                cand = np.concatenate((ss, rs))
                cand = cand[remaining[cand] == 0]
                cand = cand[~np.isnan(start[cand])]
                if cand.size:
                    complete(np.unique(cand))
    if alive:
        stuck = np.nonzero(cur < last)[0][:8]
        raise ScheduleError(f"the schedules deadlock: ranks {stuck.tolist()} wait for messages "
                            f"that are never sent (or for each other)")
    return RunStats(float(rank_end.max()) if p else 0.0, rank_end, link_bytes[:nl], events,
                    delivered)


# ---------------------------------------------------------------------------- host processes
@dataclass(frozen=True)
class HostLink:
    """A link class between processes of minicomm's own transports: α is a whole exchange step
    (3 message ops + latency), β s/byte (the sender copies in β/2, the receiver out β/2), o the
    CPU per message op, ``chunk`` the piece a receiver sees at once (shm records; a socket's
    stream)."""
    alpha: float
    beta: float
    overhead: float
    chunk: int


@dataclass(frozen=True)
class HostModel:
    """The machine of ``run_host``: ranks are processes on the CPU cores of their node."""
    intra: HostLink
    inter: HostLink
    gamma: float            # in-place add, s per byte of array
    delta: float            # memcpy, s per byte
    wake: float = 0.0       # extra latency of a message to a rank asleep in the kernel
    contention: float = 0.0  # k ranks working at once on a node each run 1 + c(k-1) slower
    cores: int = 0          # cores of a node (0: as many as ranks, no sharing)
    spin: float = 50e-6     # a waiting rank spins this long, then sleeps ...
    spin_shared: float = 0.0  # ... or this long on a node whose ranks outnumber its cores,
    yield_share: float = 1.0  # yielding between polls: such a spinner holds this much of a core
    spin_rate: float = 0.0  # ... or, with a core to itself, as long as the largest message it
    spin_max: float = 0.0   # waits for takes at this many bytes/s, at most spin_max (0: spin)
    sharing_loss: float = 1.0   # work on a shared core runs at share / (1 + loss (1 - share))
    balance: float = math.inf   # a piece of work this long (CPU s) runs at the cores' fair
                                # share, a shorter one at the busiest core's pace (run_host)
    call_overhead: float = 0.0  # CPU of a rank at the start of every call (argument checks,
                                # plan lookup, sequence tags: the communicator's Python)
    background: float = 0.0     # runnable threads besides the ranks, per rank of a node (its
                                # transport's helpers, other jobs), sharing the node's cores
    # single copy (shm over cross-memory attach): an intra-node message of at least this many
    # bytes of a call that reduces nothing is read by its receiver straight from the sender's
    # buffer, ``single_beta`` s/byte, the sender paying only o (0: never)
    single_min: int = 0
    single_beta: float = 0.0
    # extra CPU per intra-node message op of a call that runs through the executor (request
    # objects, matching queues) instead of the small-message path (``run_host(executor=True)``)
    exec_overhead: float = 0.0
    # on a node whose ranks outnumber its cores, this fraction of an intra-node message's
    # latency is its sender's CPU instead of time in flight (a loopback socket's kernel work
    # runs on the node's cores, which other ranks then wait for)
    latency_cpu: float = 0.0


def run_host(prog: Program, node_of: Sequence[Any], hm: HostModel, itemsize: int = 4,
             executor: bool = False) -> RunStats:
    """Time the program as processes on CPUs (the cost model ``algorithm="auto"`` uses for
    minicomm's own transports). Each rank works on a CPU or waits, and runs its steps as the
    executor does: local ops (Copy δ, Reduce γ per byte) and posting its receives (o each); its
    sends, eager (shm rings and socket buffers take them): o plus the copy-in, β/2 per byte, the
    message visible to its receiver ``lat`` = α - 3o after its first piece is in (``chunk``:
    small messages are store-and-forward, large ones pipelined) and complete ``lat`` after its
    last; then its receives in arrival order: o plus the copy-out, β/2 per byte (a reducing
    receive max(β/2, γ): it reduces straight out of the landing memory), the last piece no
    earlier than the sender copied it in. A waiting rank spins for ``spin``, then sleeps: the
    message that wakes it costs ``wake`` more when the rank has a core to itself (such a rank
    spins longer for a large message: its bytes at ``spin_rate``, up to ``spin_max``). On a node
    whose ranks outnumber its cores a rank spins ``spin_shared`` instead (when set), yielding its
    core between polls, and holds ``yield_share`` of a core meanwhile: a long piece of work
    beside it hardly slows down, a short one still waits for its turn on the core (the busiest
    core's pace below counts the spinner). A node's ranks
    share its ``cores`` (processor sharing among working and spinning ranks: a piece of work
    shorter than ``balance`` at the busiest core's pace, ceil(ranks / cores) to a core, a longer
    one at the fair share, ranks / cores; work on a shared core is ``sharing_loss`` less
    efficient; k ranks working at once slow each other down by 1 + contention (k - 1));
    ``background`` other runnable threads per rank share the cores too (a loaded machine). Every call (``prog.calls`` of them back to back) costs each rank
    ``call_overhead`` of CPU at its start; ``executor``: the call runs through the executor,
    each intra-node message op costing ``exec_overhead`` more. On a node whose ranks outnumber
    its cores, ``latency_cpu`` of an intra-node message's latency is its sender's CPU. Single
    copy (``single_min``): in a call that reduces nothing, an intra-node message that large
    costs its sender o and its receiver o plus ``single_beta`` per byte, readable as soon as it is posted; the sender's step ends only
    once it has been read (its buffer is in use until then). The last rank's end is the time
    of all calls."""
    p = prog.size
    if len(node_of) != p:
        raise ValueError(f"node map names {len(node_of)} ranks, not {p}")
    g, d = hm.gamma, hm.delta
    links = []
    for hl in (hm.intra, hm.inter):
        lat = max(0.0, hl.alpha - 3 * hl.overhead)
        # a call run by the executor (not the small-message path) costs more per message op
        o = hl.overhead + (hm.exec_overhead if executor and hl is hm.intra else 0.0)
        links.append((o, lat, hl.beta / 2, hl.beta / 2, hl.chunk))
    # link class 2: the single-copy read (the sender publishes its buffer's address; the whole
    # message is readable at once, so ``chunk`` is unbounded)
    links.append((links[0][0], links[0][1], 0.0, hm.single_beta, 1 << 62))
    single = hm.single_min > 0 and not (prog.msg_reduce.any() or prog.step_reduce.any())
    nodes: Dict[Any, int] = {}
    for t in node_of:
        nodes[t] = nodes.get(t, 0) + 1
    cores = {n: (min(hm.cores, k) if hm.cores and not hm.background else hm.cores or k)
             for n, k in nodes.items()}
    shared = {n: (hm.cores or k) < k for n, k in nodes.items()}
    M = prog.messages
    src, dst = prog.msg_src.tolist(), prog.msg_dst.tolist()
    mbytes = (prog.msg_count * itemsize).tolist()
    mlink = [(2 if single and nb >= hm.single_min else 0) if node_of[a] == node_of[b] else 1
             for a, b, nb in zip(src, dst, mbytes)]
    mreduce = prog.msg_reduce.tolist()
    lat_cpu = [hm.latency_cpu * links[k][1] if k != 1 and shared[node_of[a]] else 0.0
               for a, k in zip(src, mlink)]     # latency the sender spends on a core
    first = [math.inf] * M          # when the message's first piece / last piece is visible
    last = [math.inf] * M
    exists = [False] * M            # its sender has begun the step that sends it
    read = [math.inf] * M           # when its receiver has it all (a single-copy send ends then)
    held: List[List[int]] = [[] for _ in range(p)]   # the step's single-copy sends, unread
    send_ptr, recv_ptr = prog.send_ptr.tolist(), prog.recv_ptr.tolist()
    recv_order = prog.recv_order.tolist()
    copy_b = (prog.step_copy * itemsize).tolist()
    red_b = (prog.step_reduce * itemsize).tolist()
    rank_first = prog.rank_first.tolist()
    per_call = [max(1, (rank_first[r + 1] - rank_first[r]) // max(1, prog.calls))
                for r in range(p)]
    step = [rank_first[r] - 1 for r in range(p)]
    todo: List[List[Tuple[str, Any, Any]]] = [[] for _ in range(p)]
    recvs: List[List[int]] = [[] for _ in range(p)]       # message ids, in op order
    cpu = [0.0] * p
    piece = [0.0] * p                    # CPU length of the work item in progress
    mark: List[Any] = [None] * p
    waiting: List[Any] = [None] * p     # None, ("first", None): any receive, ("last", message)
    wait_since = [0.0] * p
    wake_at: List[Optional[float]] = [None] * p
    # how long a wait spins before the rank sleeps, and how much of a core the spin holds: on a
    # node whose ranks outnumber its cores the engine polls with sched_yield between passes
    yielding = [bool(hm.spin_shared) and shared[node_of[r]] for r in range(p)]
    spin_of = [hm.spin_shared if yielding[r] else hm.spin for r in range(p)]
    spin_hold = [hm.yield_share if yielding[r] else 1.0 for r in range(p)]
    long_spin = hm.spin_rate > 0 and hm.spin_max > hm.spin

    def wait_for(r: int, state, nbytes: float) -> None:
        waiting[r], wait_since[r] = state, now
        if long_spin and not shared[node_of[r]]:
            spin_of[r] = min(hm.spin_max, max(hm.spin, nbytes / hm.spin_rate))
    done = [False] * p
    end = [0.0] * p
    now = 0.0
    events = 0

    def begin_step(r: int) -> None:
        step[r] += 1
        s = step[r]
        if s >= rank_first[r + 1]:
            done[r], end[r] = True, now
            return
        work = copy_b[s] * d + red_b[s] * g
        if (s - rank_first[r]) % per_call[r] == 0:
            work += hm.call_overhead
        for m in recv_order[recv_ptr[s]:recv_ptr[s + 1]]:
            work += links[mlink[m]][0]
            recvs[r].append(m)
        items: List[Tuple[str, Any, Any]] = [("cpu", work, None)]
        for m in range(send_ptr[s], send_ptr[s + 1]):
            o, lat, bs, br, chunk = links[mlink[m]]
            exists[m] = True
            if mlink[m] == 2:
                held[r].append(m)
            head = min(mbytes[m], chunk) * bs
            items.append(("cpu", o + head + lat_cpu[m], ("first", m)))
            items.append(("cpu", mbytes[m] * bs - head, ("last", m)))
        todo[r] = items
        advance(r)

    def advance(r: int) -> None:
        while True:
            if todo[r]:
                kind, what, stamp = todo[r].pop(0)
                if kind == "cpu":
                    if what > 0:
                        cpu[r] = piece[r] = what
                        mark[r] = stamp
                        return
                    finish(stamp)
                    continue
                if last[what] > now:             # the sender's final piece is not in yet
                    wait_for(r, ("last", what), mbytes[what])
                    return
                continue
            ready = [(first[m], i, m) for i, m in enumerate(recvs[r])
                     if exists[m] and first[m] <= now]
            if ready:
                _, i, m = min(ready, key=lambda x: (x[0], x[1]))
                recvs[r].pop(i)
                o, lat, bs, br, chunk = links[mlink[m]]
                per = max(br, g) if mreduce[m] else br
                tail = min(mbytes[m], chunk) * per
                todo[r] = [("cpu", o + mbytes[m] * per - tail, None), ("last", m, None),
                           ("cpu", tail, ("read", m))]
                continue
            if recvs[r]:
                wait_for(r, ("first", None), max(mbytes[m] for m in recvs[r]))
                return
            while held[r] and read[held[r][-1]] <= now:
                held[r].pop()
            if held[r]:                  # a single-copy send completes once it has been read
                wait_for(r, ("read", held[r][-1]), mbytes[held[r][-1]])
                return
            begin_step(r)
            return

    def finish(stamp: Any) -> None:
        if stamp is not None:
            field_, m = stamp
            if field_ == "read":
                read[m] = now
                return
            (first if field_ == "first" else last)[m] = now + links[mlink[m]][1] - lat_cpu[m]

    def satisfied(r: int) -> bool:
        kind, m = waiting[r]
        if kind == "last":
            return last[m] <= now
        if kind == "read":
            return read[m] <= now
        return any(exists[x] and first[x] <= now for x in recvs[r])

    def pending_times(r: int):
        kind, m = waiting[r]
        if kind == "last":
            yield last[m]
            return
        if kind == "read":
            yield read[m]
            return
        for x in recvs[r]:
            if exists[x]:
                yield first[x]

    for r in range(p):
        begin_step(r)
    while not all(done):
        events += 1
        moved = True
        while moved:                     # wake every rank whose message has arrived
            moved = False
            for r in range(p):
                if done[r] or waiting[r] is None or not satisfied(r):
                    continue
                if wake_at[r] is None and now - wait_since[r] > spin_of[r] \
                        and not shared[node_of[r]] and hm.wake > 0:
                    wake_at[r] = now + hm.wake   # it fell asleep: the kernel wakes it
                if wake_at[r] is not None and wake_at[r] > now:
                    continue
                wake_at[r], waiting[r] = None, None
                advance(r)
                moved = True
        if all(done):
            break
        busy = dict.fromkeys(nodes, 0.0)     # working or spinning: they hold a core
        working = dict.fromkeys(nodes, 0)
        for r in range(p):
            if done[r]:
                continue
            if waiting[r] is None:
                working[node_of[r]] += 1
                busy[node_of[r]] += 1
            elif wake_at[r] is None and now - wait_since[r] <= spin_of[r]:
                busy[node_of[r]] += spin_hold[r]
        pinned, spread = {}, {}
        for n in nodes:
            # A short piece of work runs at the busiest core's pace: ceil(busy / cores) ranks
            # time-slice it (the scheduler places whole processes; 3 ranks on 2 cores run two
            # to a core). A long one at the fair share, busy / cores to a core: over its length
            # the kernel moves the ranks between cores (wake-up placement, load balancing).
            # Other runnable threads take their share of every core either way.
            slow = 1 + hm.contention * max(0, min(working[n], cores[n]) - 1)
            others = hm.background * nodes[n] / cores[n]
            # (busy counts a yielding spinner as a fraction of a rank: round before the ceil)
            for rates, per_core in ((pinned, math.ceil(round(busy[n] / cores[n], 9))),
                                    (spread, busy[n] / cores[n])):
                share = min(1.0, 1.0 / (per_core + others)) if busy[n] else 1.0
                rates[n] = share / (1 + hm.sharing_loss * (1 - share)) / slow
        rate = [(spread if piece[r] >= hm.balance else pinned)[node_of[r]] for r in range(p)]
        nxt = math.inf
        for r in range(p):
            if done[r]:
                continue
            if waiting[r] is None:
                nxt = min(nxt, now + cpu[r] / rate[r])
                continue
            if wake_at[r] is not None:
                nxt = min(nxt, wake_at[r])
                continue
            if now - wait_since[r] <= spin_of[r]:
                nxt = min(nxt, wait_since[r] + spin_of[r] * (1 + 1e-9) + 1e-12)
            for t in pending_times(r):
                if t > now:
                    nxt = min(nxt, t)
        if nxt == math.inf:
            stuck = [r for r in range(p) if not done[r]][:8]
            raise ScheduleError(f"the schedules deadlock: ranks {stuck} wait for messages that "
                                f"are never sent")
        for r in range(p):
            if not done[r] and waiting[r] is None:
                cpu[r] -= (nxt - now) * rate[r]
        now = nxt
        for r in range(p):
            if not done[r] and waiting[r] is None and cpu[r] <= 1e-15:
                stamp, mark[r] = mark[r], None
                finish(stamp)
                advance(r)
    return RunStats(max(end) if p else 0.0, np.array(end), np.zeros(0), events,
                    np.array(last))


# ---------------------------------------------------------------------------- entry points
def _by_kind(fab: Fabric, link_bytes: np.ndarray) -> Dict[str, float]:
    tot = np.bincount(fab.kind_of, weights=link_bytes, minlength=len(fab.kinds))
    return {k: float(tot[i]) for i, k in enumerate(fab.kinds)}


def _result(collective, algorithm, topo, fab, p, count, itemsize, prog, stats, wall):
    nbytes = bytes_for_count(collective, count, p, itemsize)
    t = stats.time_s
    algbw = nbytes / t / 1e9 if t > 0 else 0.0
    busy = stats.link_bytes / fab.capacity
    if busy.size and busy.max() > 0:
        i = int(np.argmax(busy))
        name, lb, util = fab.name(i), float(stats.link_bytes[i]), float(busy[i] / t) if t else 0.0
    else:
        name, lb, util = "-", 0.0, 0.0
    return SimResult(collective, algorithm, p, nbytes, t, algbw,
                     algbw * busbw_factor(collective, p), name, lb, util, count=count,
                     messages=prog.messages, steps=prog.steps, topology=topo.name,
                     events=stats.events, wall_s=wall, derived_by=prog.derived_by,
                     link_bytes_by_kind=_by_kind(fab, stats.link_bytes), rank_end=stats.rank_end)


def simulate(collective: str, algorithm: str, topo: Topology, nbytes: Optional[int] = None,
             *, count: Optional[int] = None, ranks: Optional[int] = None, root: int = 0,
             itemsize: int = 4, placement: Optional[Sequence[int]] = None,
             exact: bool = False) -> SimResult:
    """Predict one call of ``collective`` with family ``algorithm`` on ``topo``.

    ``nbytes`` is the nccl-tests size (the whole buffer, see ``count_for_bytes``), or give the
    per-rank block ``count``; ``ranks`` defaults to every accelerator of the topology (or the
    length of ``placement``). ``hier`` gets the node map of the placement."""
    t0 = time.perf_counter()
    if placement is None:
        pl = default_placement(topo, ranks)
    else:
        pl = np.asarray(placement, dtype=np.int64)
        if ranks is not None and len(pl) != ranks:
            raise ValueError(f"placement names {len(pl)} ranks, not {ranks}")
        if len(np.unique(pl)) != len(pl):
            raise ValueError("placement puts two ranks on one accelerator")
    p = len(pl)
    if count is None:
        if nbytes is None:
            raise TypeError("give nbytes or count")
        count = count_for_bytes(collective, int(nbytes), p, itemsize)
    prog = program_for(collective, algorithm, p, int(count), root,
                       tuple(int(e) // topo.gpus_per_server for e in pl), exact)
    fab = Fabric(topo)
    stats = run_program(prog, topo, pl, itemsize, fab)
    return _result(collective, algorithm, topo, fab, p, int(count), itemsize, prog, stats,
                   time.perf_counter() - t0)


def simulate_schedules(scheds: Sequence[Any], topo: Topology,
                       placement: Optional[Sequence[int]] = None, itemsize: int = 4,
                       collective: str = "custom", algorithm: str = "custom") -> SimResult:
    """Predict explicit per-rank schedules (``Schedule`` objects or lists of steps)."""
    return simulate_program(compile_schedules(scheds), topo, placement, itemsize, collective,
                            algorithm)


def simulate_program(prog: Program, topo: Topology, placement: Optional[Sequence[int]] = None,
                     itemsize: int = 4, collective: str = "custom",
                     algorithm: str = "custom") -> SimResult:
    """Predict a compiled program (``bytes`` of the result: all bytes its messages carry)."""
    t0 = time.perf_counter()
    p = prog.size
    pl = default_placement(topo, p) if placement is None else np.asarray(placement, np.int64)
    fab = Fabric(topo)
    stats = run_program(prog, topo, pl, itemsize, fab)
    t = stats.time_s
    busy = stats.link_bytes / fab.capacity
    i = int(np.argmax(busy)) if busy.size else 0
    moved = float((prog.msg_count * itemsize).sum())
    return SimResult(collective, algorithm, p, int(moved), t, 0.0, 0.0,
                     fab.name(i) if busy.size and busy[i] > 0 else "-",
                     float(stats.link_bytes[i]) if busy.size else 0.0,
                     float(busy[i] / t) if t and busy.size else 0.0,
                     messages=prog.messages, steps=prog.steps, topology=topo.name,
                     events=stats.events, wall_s=time.perf_counter() - t0,
                     link_bytes_by_kind=_by_kind(fab, stats.link_bytes), rank_end=stats.rank_end)
