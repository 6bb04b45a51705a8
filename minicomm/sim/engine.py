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
    start together (k-1) gaps later) it is a flow of its bytes over the links of its route;
    every link's bandwidth is shared max-min fairly (progressive filling) among the flows
    crossing it at the moment, recomputed whenever a flow starts or ends. With
    ``Topology.protocols = "nccl"`` the α is the hop latency of the message's protocol, its bytes
    grow by the protocol's overhead, and every rank starts after the call's launch latency
    (protocols.py);
  - a send completes when its message is delivered; a receive when its message is delivered, a
    reducing one γ per byte later (``reduce_overlap``: the reduction runs while the data arrives,
    so it ends at max(delivery, arrival start + γ·bytes), and never before T + L + γ·bytes; a
    copy staging its local operand is then part of that kernel: no δ of its own);
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

A program of ``LARGE_PROGRAM_MESSAGES`` messages or more (8 channels of a ring on 512 ranks)
merges instants within ``LARGE_PROGRAM_RESOLUTION`` (1 us) instead of 1 ns: a few percent early
(docs/decisions/simulator-speed.md); ``exact=True`` keeps 1 ns.

innet (in-network reduction): the schedules' switch participants are placed on switch
endpoints (topology.py): a server's NVSwitch (NVLS), and with ``Topology.sharp`` a tree of the
fabric's shape (``fabric_levels``) whose messages between switches run one lane per NIC
(``Program.msg_lane``); the switches' own reductions cost nothing (their ports bound them).

Restrictions: see topology.py (no packet-level effects, ideal ECMP). The time of local ops is
serial per step; several reducing receives of one step reduce in parallel.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..algorithms import CHANNELLED_FAMILIES, family, innet, meshdims, ring
from ..schedule import (
    ALL_COLLECTIVES,
    PREFIX,
    UNEVEN,
    Copy,
    Recv,
    Reduce,
    Schedule,
    Send,
    busbw_factor,
    chunk_bounds,
    servers,
)
from . import protocols
from .host import HostDeadlock, HostLink, HostModel, HostRun  # noqa: F401 (re-exported)
from .timeline import modelled_steps
from .topology import Fabric, Topology, default_placement

SYMMETRY_MIN_RANKS = 32
# Instants closer than this are one event: ranks whose times differ by a few bytes' worth of
# transfer would otherwise each be an event of their own (an error of at most this per event).
RESOLUTION = 1e-9
# Programs this large (a channelled ring on hundreds of ranks) merge instants within a
# microsecond: ranks a switch hop apart desynchronise a ring into an event per rank and step
# otherwise (docs/decisions/simulator-speed.md has the error against RESOLUTION); --exact keeps it.
LARGE_PROGRAM_MESSAGES = 4_000_000
LARGE_PROGRAM_RESOLUTION = 1e-6
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


def skewed_counts(collective: str, nbytes: int, p: int, skew: float = 1.0,
                  itemsize: int = 4, seed: int = 0) -> Tuple[int, ...]:
    """An uneven collective's blocks for ``nbytes`` (allgatherv, gatherv: the whole output;
    scatterv, reduce_scatterv: the whole input; alltoallv: each rank's input), Zipf-skewed:
    block j gets a share (k+1)^-skew, k its place in one seeded order of the ranks (0: equal
    blocks). alltoallv's rows all favour the same destinations: the hot experts of a
    mixture-of-experts layer, whose ranks receive most."""
    order = np.random.default_rng(seed).permutation(p)
    w = np.empty(p)
    w[order] = (np.arange(p) + 1.0) ** -float(skew)
    total = max(0, int(nbytes)) // itemsize
    share = np.floor(w / w.sum() * total).astype(np.int64)
    share[order[0]] += total - int(share.sum())          # the remainder to the hottest
    row = tuple(int(c) for c in share)
    return row * p if collective == "alltoallv" else row


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
    step_staged: np.ndarray = None  # (S,) of step_copy: copies that stage a reducing receive's
                                    # local operand (its region, its step): a fused kernel's
    derived_by: str = "built"     # "built" | "rotation" | "xor" | "channel rotation"
    calls: int = 1                # calls back to back (``repeat_program``): rank r's steps are
                                  # ``calls`` equal runs, each one call
    build_s: float = 0.0
    msg_lane: Optional[np.ndarray] = None    # (M,) the NIC a message between SHARP switches
                                             # takes (``Fabric.routes_gaps``); None: lane 0
    msg_delay: Optional[np.ndarray] = None   # (M,) s a message starts after its route's
                                             # latency (several SHARP operations); None: 0

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
    staged: np.ndarray

    def same_as(self, o: "_RankArrays") -> bool:
        return (self.nsteps == o.nsteps and all(
            np.array_equal(getattr(self, f), getattr(o, f))
            for f in ("copy", "reduce", "s_step", "s_peer", "s_count", "r_step", "r_peer",
                      "r_count", "r_reduce", "staged")))

    def mapped(self, fn) -> "_RankArrays":
        return _RankArrays(self.nsteps, self.copy, self.reduce, self.s_step, fn(self.s_peer),
                           self.s_count, self.r_step, fn(self.r_peer), self.r_count,
                           self.r_reduce, self.staged)


def _rank_arrays(steps: Sequence[Sequence[Any]], p: int, rank: int) -> _RankArrays:
    n = len(steps)
    copy = np.zeros(n, dtype=np.int64)
    red = np.zeros(n, dtype=np.int64)
    staged = np.zeros(n, dtype=np.int64)
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
                if any(type(q) is Recv and q.reduce and (q.buf, q.offset, q.count)
                       == (o.dst, o.dst_offset, o.count) for q in st):
                    staged[k] += o.count
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
                       r[:, 3].astype(bool), staged)


def _assemble(ranks: Sequence[_RankArrays], p: int) -> Program:
    nsteps = np.array([a.nsteps for a in ranks], dtype=np.int64)
    first = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(nsteps, out=first[1:])
    ns = np.array([len(a.s_step) for a in ranks], dtype=np.int64)
    nr = np.array([len(a.r_step) for a in ranks], dtype=np.int64)
    cat = lambda f: np.concatenate([getattr(a, f) for a in ranks]) if ranks else np.zeros(0)  # noqa: E731
    prog = _program(p, first, cat("copy"), cat("reduce"),
                    np.repeat(np.arange(p), ns), cat("s_peer"), cat("s_step") + np.repeat(first[:-1], ns),
                    cat("s_count"), np.repeat(np.arange(p), nr), cat("r_peer"),
                    cat("r_step") + np.repeat(first[:-1], nr), cat("r_count"), cat("r_reduce"))
    prog.step_staged = cat("staged").astype(np.float64)
    return prog


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
    out.step_staged = tile(_staged(prog), calls)[order]
    out.derived_by = prog.derived_by
    out.calls = prog.calls * calls
    return out


def guarded_program(prog: Program, count: int) -> Program:
    """``prog`` with the communicator's lazy call check around it (rooted collectives): every
    rank first sends ``count`` elements to every other rank (its call's fingerprint, eager),
    runs the call, and ends by receiving every other rank's fingerprint
    (communicator/fingerprints.py ``_post_fingerprints``: the data moves at once; the call
    returns when all have arrived)."""
    p = prog.size
    if p < 2:
        return prog
    nsteps = np.diff(prog.rank_first)
    first = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(nsteps + 2, out=first[1:])
    moved = first[prog.step_rank] + 1 + (np.arange(prog.steps) - prog.rank_first[prog.step_rank])
    S = int(first[-1])
    copy, red, staged = np.zeros(S), np.zeros(S), np.zeros(S)
    copy[moved], red[moved], staged[moved] = prog.step_copy, prog.step_reduce, _staged(prog)
    a, b = np.nonzero(~np.eye(p, dtype=bool))        # fingerprint a -> b, every ordered pair
    M = prog.messages
    out = _matched(p, first, copy, red, np.concatenate([a, prog.msg_src]),
                   np.concatenate([b, prog.msg_dst]),
                   np.concatenate([np.full(len(a), float(count)), prog.msg_count]),
                   np.concatenate([np.zeros(len(a), bool), prog.msg_reduce]),
                   np.concatenate([first[a], moved[prog.msg_send_step]]),
                   np.concatenate([first[b + 1] - 1, moved[prog.msg_recv_step]]),
                   np.concatenate([np.arange(len(a)) + M, _recv_rank(prog)]))
    out.step_staged = staged
    out.derived_by = prog.derived_by
    out.calls = prog.calls
    return out


def _staged(prog: Program) -> np.ndarray:
    return np.zeros(prog.steps) if prog.step_staged is None else prog.step_staged


_programs: "OrderedDict[Tuple, Program]" = OrderedDict()


def _merged(parts: Sequence[_RankArrays]) -> _RankArrays:
    """One rank's channels as one schedule: step s is every channel's step s, channel by
    channel (ring.py's channels), so messages keep (step, channel) order."""
    n = max(a.nsteps for a in parts)
    copy, red, staged = (np.zeros(n, np.int64) for _ in range(3))
    for a in parts:
        copy[:a.nsteps] += a.copy
        red[:a.nsteps] += a.reduce
        staged[:a.nsteps] += a.staged
    cat = lambda f: np.concatenate([getattr(a, f) for a in parts])  # noqa: E731
    s_step, r_step = cat("s_step"), cat("r_step")
    so, ro = np.argsort(s_step, kind="stable"), np.argsort(r_step, kind="stable")
    return _RankArrays(n, copy, red, s_step[so], cat("s_peer")[so], cat("s_count")[so],
                       r_step[ro], cat("r_peer")[ro], cat("r_count")[ro], cat("r_reduce")[ro],
                       staged)


def _rotated_ring(collective: str, p: int, count: int, flat: Tuple[int, ...]
                  ) -> Optional[Callable[[int], "_RankArrays"]]:
    """Rank v's arrays of the 1-channel ring from rank 0's real schedule: every peer rotated by
    v and, where chunks differ in length (count not a multiple of p), every message and copy
    carrying chunk (c + v) mod p's length instead of chunk c's (a ring message carries one
    chunk, found by its offset). Checked against the real schedules of a sample of ranks; None
    when they differ."""
    sched = ring.build(collective, 0, p, count, 0, flat)
    zero = _rank_arrays(sched.steps, p, 0)
    bounds = chunk_bounds(count, p)
    lengths = np.array([n for _, n in bounds], dtype=np.int64)
    chunk_at = {o: c for c, (o, n) in enumerate(bounds) if n}
    uneven = collective == "allreduce" and lengths.min() != lengths.max()
    if uneven:
        if lengths.min() == 0:
            return None
        ops = [(k, o) for k, st in enumerate(sched.steps) for o in st]
        try:
            s_chunk = np.array([chunk_at[o.offset] for _, o in ops if type(o) is Send])
            r_chunk = np.array([chunk_at[o.offset] for _, o in ops if type(o) is Recv])
            c_step = np.array([k for k, o in ops if type(o) is Copy], dtype=np.int64)
            c_chunk = np.array([chunk_at[o.dst_offset] for _, o in ops if type(o) is Copy])
        except KeyError:
            return None
        if len(set(c_step.tolist())) != len(c_step) or zero.reduce.any():
            return None

    def rank(v: int) -> _RankArrays:
        a = zero.mapped(lambda x: (x + v) % p)
        if not uneven:
            return a
        copy = np.zeros(a.nsteps, np.int64)
        copy[c_step] = lengths[(c_chunk + v) % p]
        staged = np.where(a.staged > 0, copy, 0)
        return _RankArrays(a.nsteps, copy, a.reduce, a.s_step, a.s_peer,
                           lengths[(s_chunk + v) % p], a.r_step, a.r_peer,
                           lengths[(r_chunk + v) % p], a.r_reduce, staged)

    for v in _symmetric_samples(p):
        if not rank(v).same_as(_rank_arrays(ring.build(collective, v, p, count, 0, flat).steps,
                                            p, v)):
            return None
    return rank


def _channelled_ring(collective: str, p: int, count: int, node_map: Tuple[int, ...],
                     channels: int) -> Optional[Program]:
    """The program of a channelled ring built from one real schedule per channel part: each
    channel is the 1-channel ring over its order, and that ring is rank-symmetric (rank v's
    schedule is rank 0's with every peer rotated by v, checked on a sample), so rank r of
    channel c is rank 0's arrays with peer x -> order_c[(x + v) % p], v = r's place in order_c.
    None when a part's ring is not symmetric (the caller builds every rank)."""
    orders = ring.channel_orders(node_map, channels)
    flat = (0,) * p
    parts = [part for _, part in chunk_bounds(count, channels)]
    base: Dict[int, Callable[[int], _RankArrays]] = {}
    for part in parts:
        if part not in base:
            base[part] = _rotated_ring(collective, p, part, flat)
            if base[part] is None:
                return None
    places = [np.argsort(order) for order in orders]
    real = [np.asarray(order, dtype=np.int64) for order in orders]
    ranks = []
    for r in range(p):
        ranks.append(_merged([base[part](int(places[c][r])).mapped(lambda x, c=c: real[c][x])
                              for c, part in enumerate(parts)]))
    prog = _assemble(ranks, p)
    prog.derived_by = "channel rotation"
    return prog


def program_for(collective: str, algorithm: str, p: int, count: int, root: int = 0,
                node_map: Optional[Tuple[int, ...]] = None, exact: bool = False,
                channels: int = 1, counts: Tuple[int, ...] = ()) -> Program:
    """The compiled schedules of one call (cached); ``channels``: ring's (ring.py) or tree's
    (tree.py: the double binary tree); ``counts``: an uneven collective's blocks
    (schedule.py's doc; every rank's schedule is built, no symmetry shortcut)."""
    if collective not in ALL_COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of "
                         f"{', '.join(ALL_COLLECTIVES)}")
    if p < 1:
        raise ValueError(f"world size must be >= 1, got {p}")
    if not 0 <= root < p:
        raise ValueError(f"root {root} outside 0..{p - 1}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    node_map = tuple(node_map) if node_map is not None else (0,) * p
    if len(node_map) != p:
        raise ValueError(f"node map names {len(node_map)} ranks, not {p}")
    fam = family(algorithm)       # raises ValueError for an unknown algorithm
    if channels != 1 and fam not in CHANNELLED_FAMILIES:
        raise ValueError(f"channels={channels}: only the ring and tree families take channels")
    v = collective in UNEVEN or collective in PREFIX
    channels = (fam.used_channels(collective, p, count, channels)
                if fam in CHANNELLED_FAMILIES and not v else 1)
    counts = tuple(counts)
    key = (collective, algorithm, p, count, root, node_map, exact, channels, counts)
    prog = _programs.get(key)
    if prog is not None:
        _programs.move_to_end(key)
        return prog

    def build(r: int) -> Schedule:
        if v:
            s = fam.build_v(collective, r, p, count, root, node_map, counts)
        elif channels > 1:
            s = fam.build(collective, r, p, count, root, node_map, channels)
        else:
            s = fam.build(collective, r, p, count, root, node_map)
        if s.algorithm != algorithm or s.collective != collective:
            raise ScheduleError(f"{algorithm}.build returned a {s.algorithm} {s.collective} schedule")
        return s

    t0 = time.perf_counter()
    prog = None
    if not exact and channels > 1 and fam is ring and p >= SYMMETRY_MIN_RANKS:
        prog = _channelled_ring(collective, p, count, node_map, channels)
    elif not exact and not v and p >= SYMMETRY_MIN_RANKS:
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
    channels: int = 1             # the rings of a channelled ring (ring.py)
    link_bytes_by_kind: Dict[str, float] = field(default_factory=dict, repr=False)
    rank_end: Optional[np.ndarray] = field(default=None, repr=False)

    def to_dict(self) -> Dict[str, Any]:
        return {"collective": self.collective, "algorithm": self.algorithm, "bytes": self.bytes,
                "ranks": self.ranks, "time_s": self.time_s, "algbw": self.algbw,
                "busbw": self.busbw, "count": self.count, "topology": self.topology,
                "busiest_link": self.busiest_link,
                "busiest_link_bytes": self.busiest_link_bytes,
                "busiest_link_utilisation": self.busiest_link_utilisation,
                "messages": self.messages, "steps": self.steps, "channels": self.channels}


@dataclass
class RunStats:
    time_s: float
    rank_end: np.ndarray
    link_bytes: np.ndarray
    events: int
    delivered: np.ndarray         # (M,) delivery time of every message
    step_start: Optional[np.ndarray] = None   # (S,) when each step started (run_program)
    step_end: Optional[np.ndarray] = None     # (S,) when it ended
    step_local: Optional[np.ndarray] = None   # (S,) the time of its local ops


# ---------------------------------------------------------------------------- the event loop
def _ranges(lo: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """Concatenation of arange(lo[i], lo[i] + cnt[i])."""
    tot = int(cnt.sum())
    if tot == 0:
        return np.zeros(0, dtype=np.int64)
    off = np.repeat(lo - np.concatenate(([0], np.cumsum(cnt)[:-1])), cnt)
    return np.arange(tot, dtype=np.int64) + off


def max_min_rates(links: np.ndarray, capacity: np.ndarray,
                  flows: Optional[np.ndarray] = None) -> np.ndarray:
    """Max-min fair rates of flows over links (progressive filling: the flows whose fair share
    on their tightest link is the smallest are fixed at it, their bandwidth removed, repeat).
    ``links`` is (F, H) of link ids; entries equal to ``len(capacity) - 1`` are padding (that
    last link must have infinite capacity). A flow crossing no finite link gets rate inf.
    ``flows``: how many flows take each row's route (default one each; flows on one route get
    one rate, so a row stands for all of them); the rate returned is each flow's."""
    F = links.shape[0]
    rate = np.full(F, math.inf)
    if F == 0:
        return rate
    nlinks = len(capacity)
    H = links.shape[1]
    cap = capacity.copy()
    open_links = links
    open_idx = np.arange(F)
    open_flows = None if flows is None else np.repeat(np.asarray(flows, dtype=float), H)
    while True:
        cnt = np.bincount(open_links.ravel(), weights=open_flows, minlength=nlinks)
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
        w = None if open_flows is None else open_flows.reshape(-1, H)[sel].ravel()
        cap -= np.bincount(open_links[sel].ravel(), weights=w, minlength=nlinks) * m
        np.maximum(cap, 0.0, out=cap)
        open_links, open_idx = open_links[~sel], open_idx[~sel]
        if open_flows is not None:
            open_flows = open_flows.reshape(-1, H)[~sel].ravel()
    return rate


# ``run_program``'s optional hook: (rank, step, kind, peer, count, reduce) for every op of a step
# as the step starts; kind is "copy" / "reduce" (the step's local elements, peer -1), "recv" or
# "send". The engine's programs keep no buffer names or offsets, so none are reported.
StepTrace = Callable[[int, int, str, int, int, bool], None]


def run_program(prog: Program, topo: Topology, placement: np.ndarray, itemsize: int = 4,
                fabric: Optional[Fabric] = None, resolution: float = RESOLUTION,
                trace: Optional[StepTrace] = None, algorithm: str = "") -> RunStats:
    """Time the program on the topology (module docstring); rank r runs on accelerator
    ``placement[r]``. Instants less than ``resolution`` seconds apart are handled as one event
    (so a flow may end, and a step start, up to that much early). ``trace``: see
    ``StepTrace`` (the conformance test compares it with the other interpreters).
    ``algorithm``: the family, which picks the protocol table's rows (protocols.py)."""
    fab = fabric or Fabric(topo)
    p = prog.size
    placement = np.asarray(placement, dtype=np.int64)
    if placement.shape != (p,):
        raise ValueError(f"placement names {placement.size} ranks, not {p}")
    if p and (placement.min() < 0 or placement.max() >= fab.endpoint_ids):
        raise ValueError(f"placement outside the {topo.endpoints} accelerators of {topo.name}")
    loop = _EventLoop(prog, topo, fab, placement, itemsize, resolution, trace, algorithm)
    while True:
        loop.events += 1
        loop.start_steps()
        loop.start_flows()
        if not loop.advance_clock():
            break
        loop.deliver()
    if loop.alive:
        stuck = np.nonzero(loop.cur < loop.last)[0][:8]
        raise ScheduleError(f"the schedules deadlock: ranks {stuck.tolist()} wait for messages "
                            f"that are never sent (or for each other)")
    return RunStats(float(loop.rank_end.max()) if p else 0.0, loop.rank_end,
                    loop.link_bytes[:loop.nl], loop.events, loop.delivered,
                    loop.start, loop.end, loop.local)


class _EventLoop:
    """``run_program``'s state, per step and per message in numpy arrays, and its four phases
    per event: steps due start, flows whose latency is over start, the clock moves to the next
    instant, flows that finished deliver. Pending flows have not finished their latency yet;
    active flows share links, their bytes left valid at ``t_ref`` (when the rates last
    changed)."""

    def __init__(self, prog: Program, topo: Topology, fab: Fabric, placement: np.ndarray,
                 itemsize: int, resolution: float, trace: Optional[StepTrace],
                 algorithm: str = ""):
        self.prog, self.resolution, self.trace = prog, resolution, trace
        p, S, M = prog.size, prog.steps, prog.messages
        self.overlap = topo.reduce_overlap
        self.nbytes = prog.msg_count * itemsize
        self.g_msg = np.where(prog.msg_reduce, self.nbytes * topo.gamma, 0.0)
        copied = prog.step_copy - (_staged(prog) if topo.reduce_overlap else 0.0)
        self.local = (copied * topo.delta + prog.step_reduce * topo.gamma) * itemsize
        self.step_g = np.zeros(S)
        if M:
            np.maximum.at(self.step_g, prog.msg_recv_step, self.g_msg)
        self.remaining = (np.bincount(prog.msg_send_step, minlength=S)
                          + np.bincount(prog.msg_recv_step, minlength=S))
        # routes: one per distinct (src, dst) accelerator pair; padding is the extra last link
        self.nl = nl = len(fab)
        self.cap = np.concatenate((fab.capacity, [math.inf]))
        E = fab.endpoint_ids
        key = placement[prog.msg_src] * E + placement[prog.msg_dst]
        lanes = prog.msg_lane
        L = int(lanes.max()) + 1 if lanes is not None and lanes.size else 1
        if L > 1:      # a route per (pair, lane); each lane issues its own messages
            key = key * L + lanes
        pairs, msg_pair = np.unique(key, return_inverse=True)
        pair_links, self.pair_lat, self.pair_gap = fab.routes_gaps(
            pairs // L // E, pairs // L % E, pairs % L)
        self.src_of = placement[prog.msg_src] * L + (lanes if L > 1 else 0)
        self.gapped = bool(self.pair_gap.any())
        self.width = width = (max(1, int((pair_links >= 0).sum(axis=1).max()))
                              if len(pairs) else 1)
        self.pair_links = np.where(pair_links[:, :width] >= 0, pair_links[:, :width], nl)
        self.msg_pair = msg_pair.reshape(-1)
        self.msg_lat = self.pair_lat[self.msg_pair]
        if prog.msg_delay is not None:
            self.msg_lat = self.msg_lat + prog.msg_delay
        self.launch = 0.0
        if topo.protocols == "nccl" and M and algorithm != "innet":
            self._price_protocols(topo, placement, algorithm)
        self.latest = np.full(S, -math.inf)          # latest completion of a step's ops so far
        self.start = np.full(S, math.nan)
        self.end = np.full(S, math.nan)
        self.cur = prog.rank_first[:-1].copy()
        self.last = prog.rank_first[1:]
        self.next_start = np.where(self.cur < self.last, self.launch, math.inf)
        self.rank_end = np.zeros(p)
        self.alive = int((self.cur < self.last).sum())
        self.delivered = np.full(M, math.inf)
        self.arrival_start = np.full(M, math.inf)
        # rendezvous: a message moves once its sender has sent and its receiver has posted the
        # receive (the receiver's buffer, or NCCL's credits, are there); eager: once it is sent
        self.rendezvous = topo.rendezvous
        self.send_ready = np.full(M, math.nan)
        self.recv_ready = np.full(M, math.nan) if self.rendezvous else np.zeros(M)
        self.link_bytes = np.zeros(nl + 1)
        self.pend_id, self.pend_t = np.zeros(0, dtype=np.int64), np.zeros(0)
        self.act_id = np.zeros(0, dtype=np.int64)
        self.act_left, self.act_rate, self.act_fin = np.zeros(0), np.zeros(0), np.zeros(0)
        self.t_ref = self.now = 0.0
        self.dirty = False
        self.events = 0

    def _price_protocols(self, topo: Topology, placement: np.ndarray, algorithm: str) -> None:
        """NCCL's protocols (protocols.py): each message's latency (the protocol's hop latency,
        end to end, in place of the route's α) and wire bytes, and the call's launch latency."""
        g = topo.gpus_per_server
        src, dst = placement[self.prog.msg_src], placement[self.prog.msg_dst]
        cross = src // g != dst // g
        moves = src != dst
        lat, wire, self.launch = protocols.price(
            algorithm, topo.intra, cross[moves], self.nbytes[moves].astype(float),
            np.where(cross, topo.nic_link.bandwidth, topo.intra_link.bandwidth)[moves],
            len(np.unique(placement // g)) > 1)
        self.msg_lat[moves] = lat
        self.nbytes = self.nbytes.astype(float)
        self.nbytes[moves] = wire

    def horizon(self) -> float:
        """Instants up to this one are handled as now (one event)."""
        return self.now * (1 + 1e-12) + self.resolution

    def left_now(self) -> np.ndarray:
        dt = self.now - self.t_ref
        if dt <= 0:
            return self.act_left
        left = self.act_left - self.act_rate * dt
        left[~(self.act_rate < math.inf)] = 0.0
        return np.maximum(left, 0.0, out=left)

    def complete(self, steps: np.ndarray) -> None:
        """Steps whose ops all completed end; their ranks' next steps become due."""
        if steps.size == 0:
            return
        end = np.maximum(self.start[steps] + self.local[steps] + self.step_g[steps],
                         self.latest[steps])
        self.end[steps] = end
        r = self.prog.step_rank[steps]
        nxt = steps + 1
        more = nxt < self.last[r]
        self.cur[r[more]] = nxt[more]
        self.next_start[r[more]] = end[more]
        self.rank_end[r[~more]] = end[~more]
        self.alive -= int((~more).sum())

    def start_steps(self) -> None:
        """Phase 1: steps due now start (a step with nothing left to wait for ends at once)."""
        prog, rendezvous = self.prog, self.rendezvous
        ptr, rptr, send_ready, recv_ready = prog.send_ptr, prog.recv_ptr, self.send_ready, \
            self.recv_ready
        while self.alive:
            due = np.nonzero(self.next_start <= self.horizon())[0]
            if due.size == 0:
                break
            s = self.cur[due]
            t0 = self.next_start[due]
            self.next_start[due] = math.inf
            self.start[s] = t0
            posted = t0 + self.local[s]
            cnt = ptr[s + 1] - ptr[s]
            rcnt = rptr[s + 1] - rptr[s]
            sids = _ranges(ptr[s], cnt)
            rids = prog.recv_order[_ranges(rptr[s], rcnt)]
            if self.trace is not None:
                self.trace_started(s, sids, rids)
            go_ids = []
            if cnt.any():
                send_ready[sids] = np.repeat(posted, cnt)
                go_ids.append(sids if not rendezvous else sids[~np.isnan(recv_ready[sids])])
            if rendezvous and rcnt.any():
                recv_ready[rids] = np.repeat(posted, rcnt)
                go_ids.append(rids[~np.isnan(send_ready[rids])])
            ids = np.concatenate(go_ids) if go_ids else np.zeros(0, dtype=np.int64)
            if ids.size:
                t_go = (np.maximum(send_ready[ids], recv_ready[ids]) if rendezvous
                        else send_ready[ids]) + self.msg_lat[ids]
                if self.gapped:
                    # a sender issues the k messages it starts at once one gap apart; they start
                    # together when the last is issued (one event, not k)
                    srcs = self.src_of[ids]
                    k_of = np.bincount(srcs)[srcs]
                    t_go = t_go + self.pair_gap[self.msg_pair[ids]] * (k_of - 1)
                self.pend_id = np.concatenate((self.pend_id, ids))
                self.pend_t = np.concatenate((self.pend_t, t_go))
            ready = s[self.remaining[s] == 0]
            if ready.size:
                self.complete(ready)

    def trace_started(self, steps: np.ndarray, sids: np.ndarray, rids: np.ndarray) -> None:
        """Report the ops of ``steps`` (just started; ``sids`` / ``rids``: the messages they
        send / receive, step by step) to ``trace``, step by step."""
        prog, trace = self.prog, self.trace
        si = ri = 0
        for s in steps.tolist():
            r = int(prog.step_rank[s])
            k = s - int(prog.rank_first[r])
            if prog.step_copy[s]:
                trace(r, k, "copy", -1, int(prog.step_copy[s]), False)
            if prog.step_reduce[s]:
                trace(r, k, "reduce", -1, int(prog.step_reduce[s]), False)
            for m in rids[ri:ri + prog.recv_ptr[s + 1] - prog.recv_ptr[s]].tolist():
                trace(r, k, "recv", int(prog.msg_src[m]), int(prog.msg_count[m]),
                      bool(prog.msg_reduce[m]))
            ri += prog.recv_ptr[s + 1] - prog.recv_ptr[s]
            for m in sids[si:si + prog.send_ptr[s + 1] - prog.send_ptr[s]].tolist():
                trace(r, k, "send", int(prog.msg_dst[m]), int(prog.msg_count[m]), False)
            si += prog.send_ptr[s + 1] - prog.send_ptr[s]

    def start_flows(self) -> None:
        """Phase 2: flows whose latency is over start to move bytes; rates are recomputed when
        the set of active flows changed."""
        if self.pend_id.size:
            go = self.pend_t <= self.horizon()
            if go.any():
                ids = self.pend_id[go]
                links = self.pair_links[self.msg_pair[ids]]
                self.arrival_start[ids] = self.pend_t[go]
                self.link_bytes += np.bincount(
                    links.ravel(), weights=np.repeat(self.nbytes[ids], self.width),
                    minlength=self.nl + 1)
                self.act_left = np.concatenate((self.left_now(), self.nbytes[ids]))
                self.act_rate = np.concatenate((self.act_rate, np.zeros(len(ids))))
                self.t_ref = self.now
                self.act_id = np.concatenate((self.act_id, ids))
                keep = ~go
                self.pend_id, self.pend_t = self.pend_id[keep], self.pend_t[keep]
                self.dirty = True
        if self.dirty:
            self.act_left, self.t_ref = self.left_now(), self.now
            # flows between one pair share a route, so one rate: solve per route
            routes, flow_route = np.unique(self.msg_pair[self.act_id], return_inverse=True)
            self.act_rate = max_min_rates(self.pair_links[routes], self.cap,
                                          np.bincount(flow_route.reshape(-1)))[flow_route]
            self.act_fin = self.now + self.act_left / self.act_rate
            self.dirty = False

    def advance_clock(self) -> bool:
        """Phase 3: move to the next instant anything happens; False when nothing will."""
        t_next = math.inf
        if self.alive:
            t_next = float(self.next_start.min())
        if self.pend_t.size:
            t_next = min(t_next, float(self.pend_t.min()))
        if self.act_fin.size:
            t_next = min(t_next, float(self.act_fin.min()))
        if not t_next < math.inf:
            return False
        if t_next > self.now:
            self.now = t_next
        return True

    def deliver(self) -> None:
        """Phase 4: flows that finished deliver; the steps they complete end."""
        if not self.act_fin.size:
            return
        now = self.now
        fin = self.act_fin <= self.horizon()
        if not fin.any():
            return
        ids = self.act_id[fin]
        self.delivered[ids] = now
        ss, rs = self.prog.msg_send_step[ids], self.prog.msg_recv_step[ids]
        np.maximum.at(self.latest, ss, now)
        if self.overlap:
            done = np.maximum(now, self.arrival_start[ids] + self.g_msg[ids])
        else:
            done = now + self.g_msg[ids]
        np.maximum.at(self.latest, rs, done)
        np.subtract.at(self.remaining, ss, 1)
        np.subtract.at(self.remaining, rs, 1)
        keep = ~fin
        self.act_left = self.left_now()[keep]
        self.t_ref = now
        self.act_id = self.act_id[keep]
        self.act_rate, self.act_fin = self.act_rate[keep], self.act_fin[keep]
        self.dirty = True
        cand = np.concatenate((ss, rs))
        cand = cand[self.remaining[cand] == 0]
        cand = cand[~np.isnan(self.start[cand])]
        if cand.size:
            self.complete(np.unique(cand))


# ---------------------------------------------------------------------------- host processes
def run_host(prog: Program, node_of: Sequence[Any], hm: HostModel, itemsize: int = 4,
             executor: bool = False) -> RunStats:
    """Time the program as processes on the CPU cores of their nodes (``node_of[r]``: rank r's
    node): the host machine of host.py (``HostRun``; its docstring has the timing rules), which
    ``algorithm="auto"`` prices minicomm's own transports on. ``executor``: the call runs
    through the executor rather than the small-message path. A cycle of waits raises
    ``ScheduleError``."""
    try:
        run = HostRun(prog, node_of, hm, itemsize, executor).run()
    except HostDeadlock as e:
        raise ScheduleError(str(e)) from e
    return RunStats(run.time_s, np.array(run.rank_end), np.zeros(0), run.events,
                    np.array(run.last_visible))


# ---------------------------------------------------------------------------- entry points
def _by_kind(fab: Fabric, link_bytes: np.ndarray) -> Dict[str, float]:
    tot = np.bincount(fab.kind_of, weights=link_bytes, minlength=len(fab.kinds))
    return {k: float(tot[i]) for i, k in enumerate(fab.kinds)}


def _result(collective, algorithm, topo, fab, p, count, itemsize, prog, stats, wall,
            nbytes=None):
    if nbytes is None:
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


def default_channels(algorithm: str, topo: Topology) -> int:
    """A ring's default channels: one per NIC of a server, as NCCL's. Every other family runs on
    one; the tree's double binary tree is asked for with channels (two per NIC is NCCL's), since
    at 1,024 ranks its pipelined program is millions of messages, a minute per call."""
    return topo.channels if algorithm == "ring" else 1


def simulate(collective: str, algorithm: str, topo: Topology, nbytes: Optional[int] = None,
             *, count: Optional[int] = None, ranks: Optional[int] = None, root: int = 0,
             itemsize: int = 4, placement: Optional[Sequence[int]] = None,
             exact: bool = False, timeline: Optional[Any] = None,
             channels: Optional[int] = None, counts: Optional[Sequence[int]] = None
             ) -> SimResult:
    """Predict one call of ``collective`` with family ``algorithm`` on ``topo``.

    ``nbytes`` is the nccl-tests size (the whole buffer, see ``count_for_bytes``), or give the
    per-rank block ``count``; ``ranks`` defaults to every accelerator of the topology (or the
    length of ``placement``). ``hier`` gets the node map of the placement, and so does a
    channelled ring and tree: ``channels`` (default ``default_channels``: one ring per NIC, as
    NCCL's; one tree). ``mesh`` (algorithms/meshdims.py, not a runtime family) runs along the
    topology's full-mesh dimensions (``Topology.mesh_shape``). ``timeline``: the
    call's modelled steps go to ``timeline.add`` (``minicomm.trace.SimulatedTrace``: the
    simulator hands it ``timeline.modelled_steps`` and imports nothing of it). ``counts``: an
    uneven collective's blocks (their sum is the call's count; its size, the bytes a rank
    moves on average: the total over p, the matrix's over p for alltoallv)."""
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
    size = None
    if collective in UNEVEN:
        if counts is None:
            raise TypeError(f"{collective} needs counts (its blocks)")
        counts = tuple(int(c) for c in counts)
        count = sum(counts)
        size = count * itemsize // (1 if collective in ("allgatherv", "gatherv") else p)
    if count is None:
        if nbytes is None:
            raise TypeError("give nbytes or count")
        count = count_for_bytes(collective, int(nbytes), p, itemsize)
    node_map = tuple(int(e) // topo.gpus_per_server for e in pl)
    if algorithm == "innet":
        return _simulate_innet(collective, topo, pl, node_map, int(count), root, itemsize,
                               timeline, t0)
    if algorithm == "mesh":
        return _simulate_mesh(collective, topo, pl, node_map, int(count), root, itemsize,
                              timeline, t0)
    if channels is None:
        channels = default_channels(algorithm, topo)
    prog = program_for(collective, algorithm, p, int(count), root, node_map, exact, channels,
                       tuple(counts or ()))
    fab = Fabric(topo)
    coarse = not exact and prog.messages >= LARGE_PROGRAM_MESSAGES
    stats = run_program(prog, topo, pl, itemsize, fab,
                        LARGE_PROGRAM_RESOLUTION if coarse else RESOLUTION, algorithm=algorithm)
    res = _result(collective, algorithm, topo, fab, p, int(count), itemsize, prog, stats,
                  time.perf_counter() - t0, size)
    fam = family(algorithm)
    if fam in CHANNELLED_FAMILIES and collective not in UNEVEN and collective not in PREFIX:
        res.channels = fam.used_channels(collective, p, int(count), channels)
    if timeline is not None:
        timeline.add(collective, algorithm, int(count), itemsize, stats.time_s,
                     modelled_steps(prog, stats, itemsize))
    return res


def innet_runs_on(topo: Topology, n_servers: Optional[int] = None) -> bool:
    """Whether a switch reduces for ``innet`` on ``n_servers`` of ``topo``'s servers (default
    all): the NVSwitch (NVLS) on one server, the network's switches (SHARP) across servers."""
    n = topo.servers if n_servers is None else n_servers
    return bool(topo.sharp) if n > 1 else bool(topo.nvls_bandwidth)


def _simulate_innet(collective: str, topo: Topology, pl: np.ndarray, node_map: Tuple[int, ...],
                    count: int, root: int, itemsize: int, timeline, t0: float) -> SimResult:
    """innet where switches reduce: on one server its NVSwitch (NVLink SHARP) is every switch
    participant; across servers the aggregation tree has the fabric's shape (``_sharp_program``:
    SHARP's leaf and spine switches, topology.py)."""
    p = len(pl)
    fab = Fabric(topo)
    if len(set(node_map)) > 1:
        if not topo.sharp:
            raise ValueError(f"{topo.name}: innet across servers needs network switches that "
                             f"reduce (SHARP): set network.sharp = true in a topology file, or "
                             f"place the ranks on one server")
        prog, placement = _sharp_program(collective, topo, fab, pl, node_map, count, root,
                                         itemsize)
    else:
        if not topo.nvls_bandwidth:
            raise ValueError(f"{topo.name}: no switch reduces, so innet cannot run here (set "
                             f"intra.nvls_GBps, NVLink SHARP, in a topology file)")
        scheds = innet.build_all(collective, p, count, root, node_map)
        prog = _switch_program(scheds, p)
        server = node_map[0] if node_map else 0
        placement = np.concatenate((pl, np.full(prog.size - p, topo.endpoints + server,
                                                dtype=np.int64)))
    stats = run_program(prog, topo, placement, itemsize, fab, algorithm="innet")
    res = _result(collective, "innet", topo, fab, p, count, itemsize, prog, stats,
                  time.perf_counter() - t0)
    if timeline is not None:
        timeline.add(collective, "innet", count, itemsize, stats.time_s,
                     modelled_steps(prog, stats, itemsize))
    return res


def _switch_program(scheds: Sequence[Schedule], p: int) -> Program:
    """The program of innet's participants (ranks, then switches), the switches' local ops
    free: a switch reduces at its ports' rate, not an accelerator's γ."""
    P = len(scheds)
    prog = _assemble([_rank_arrays(s.steps, P, r) for r, s in enumerate(scheds)], P)
    switch_steps = slice(int(prog.rank_first[p]), int(prog.rank_first[P]))
    for f in (prog.step_copy, prog.step_reduce, prog.step_staged):
        f[switch_steps] = 0
    return prog


def _runs_of(values: Sequence[int]) -> Tuple[Tuple[int, ...], List[int]]:
    """(lengths, value) of each run of equal consecutive values."""
    lengths: List[int] = []
    firsts: List[int] = []
    for v in values:
        if firsts and firsts[-1] == v:
            lengths[-1] += 1
        else:
            lengths.append(1)
            firsts.append(v)
    return tuple(lengths), firsts


def fabric_levels(topo: Topology, node_map: Tuple[int, ...]) -> Tuple[Tuple[int, ...], ...]:
    """innet's ``levels`` (``innet.switch_tree``) that make its tree the fabric's: the servers'
    switches grouped by leaf group, those by pod (tiers 3), all under the top switch."""
    order = [node_map[ranks[0]] for ranks in servers(node_map)]
    sizes, leaf_groups = _runs_of([s // topo.leaf_servers for s in order])
    levels = [sizes]
    if topo.tiers >= 3:
        sizes, pods = _runs_of([grp // topo.pod_groups for grp in leaf_groups])
        levels += [sizes, (len(pods),)]
    elif topo.tiers == 2:
        levels.append((len(leaf_groups),))
    return tuple(levels)


def _sharp_program(collective: str, topo: Topology, fab: Fabric, pl: np.ndarray,
                   node_map: Tuple[int, ...], count: int, root: int, itemsize: int
                   ) -> Tuple[Program, np.ndarray]:
    """innet across servers on SHARP: the fabric-shaped tree's program and placement. Every
    message between switches is cut into one per NIC of a server (lane k: NIC k, and its
    rail's leaf), and one a server sends into the network of more than ``sharp_max_bytes``
    (per lane) is ceil(bytes / sharp_max_bytes) SHARP operations, paced by the slower of the
    NIC issuing them (its issue gap apart) and the reducing switch taking them (one per
    ``sharp_latency``): the message starts (operations - 1) paces late (``Program.msg_delay``)."""
    p = len(pl)
    levels = fabric_levels(topo, node_map)
    tree = innet.switch_tree(p, node_map, innet.RADIX, levels)
    prog = _switch_program(innet.build_all(collective, p, count, root, node_map,
                                           levels=levels), p)
    switch_ids = []
    for j in range(p, tree.participants):
        server = node_map[tree.ranks_under[j][0]]
        group = server // topo.leaf_servers
        switch_ids.append({1: topo.endpoints + server, 2: fab.leaf_switch0 + group,
                           3: fab.spine_switch0 + group // topo.pod_groups}.get(
                               tree.height[j], fab.core_switch))
    placement = np.concatenate((pl, np.asarray(switch_ids, dtype=np.int64)))
    between = (prog.msg_src >= p) & (prog.msg_dst >= p)
    prog = _split_lanes(prog, between, topo.nics_per_server)
    if topo.sharp_max_bytes:
        into = (np.asarray(tree.height)[prog.msg_src] == 1) & (prog.msg_dst >= p)
        ops = np.ceil(prog.msg_count * itemsize / topo.sharp_max_bytes)
        pace = max(topo.nic_link.gap, topo.sharp_latency)
        prog.msg_delay = np.where(into, np.maximum(ops - 1, 0) * pace, 0.0)
    return prog, placement


def _split_lanes(prog: Program, split: np.ndarray, lanes: int) -> Program:
    """``prog`` with every message of ``split`` cut into ``lanes`` equal messages, lane k
    (``Program.msg_lane``) k; each keeps its steps, and the receive order keeps the lanes of a
    message together."""
    reps = np.where(split, lanes, 1)
    if lanes == 1 or not split.any():
        prog.msg_lane = np.zeros(prog.messages, dtype=np.int64)
        return prog
    start = np.concatenate(([0], np.cumsum(reps)[:-1]))
    lane = np.arange(int(reps.sum())) - np.repeat(start, reps)
    rep = lambda a: np.repeat(a, reps)  # noqa: E731
    S = prog.steps

    def ptr(steps: np.ndarray) -> np.ndarray:
        out = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(np.bincount(steps, minlength=S), out=out[1:])
        return out
    send_step, recv_step = rep(prog.msg_send_step), rep(prog.msg_recv_step)
    return dataclasses.replace(
        prog, msg_src=rep(prog.msg_src), msg_dst=rep(prog.msg_dst),
        msg_count=rep(prog.msg_count) / rep(reps), msg_reduce=rep(prog.msg_reduce),
        msg_send_step=send_step, msg_recv_step=recv_step, send_ptr=ptr(send_step),
        recv_order=_ranges(start[prog.recv_order], reps[prog.recv_order]),
        recv_ptr=ptr(recv_step), msg_lane=lane.astype(np.int64))


def mesh_orders(topo: Topology) -> Tuple[Tuple[int, ...], ...]:
    """The mesh schedules' dimension order per part on ``topo``: the dimensions by an
    accelerator's bandwidth in them, fastest first (a reduce-scatter's largest step on the
    fastest links), and those of equal bandwidth rotated among themselves, one part per
    rotation, so that they carry data at once (meshdims.py: equal dimensions, k parts)."""
    dims = topo.mesh_shape
    bw = [per * (d - 1) for per, d in zip(topo.mesh_port_bandwidth(), dims)]
    groups: List[List[int]] = []
    for dim in sorted(range(len(dims)), key=lambda i: -bw[i]):
        if groups and math.isclose(bw[groups[-1][0]], bw[dim], rel_tol=1e-9):
            groups[-1].append(dim)
        else:
            groups.append([dim])
    parts = max(len(grp) for grp in groups)
    return tuple(tuple(grp[(c + s) % len(grp)] for grp in groups for s in range(len(grp)))
                 for c in range(parts))


def _simulate_mesh(collective: str, topo: Topology, pl: np.ndarray, node_map: Tuple[int, ...],
                   count: int, root: int, itemsize: int, timeline, t0: float) -> SimResult:
    """mesh (algorithms/meshdims.py) along ``topo.mesh_shape``: built here, every rank, since it
    is not a family ``program_for`` knows (its dimensions come from the topology)."""
    p, dims, orders = len(pl), topo.mesh_shape, mesh_orders(topo)
    key = (collective, "mesh", p, count, root, node_map, dims, orders)
    prog = _programs.get(key)
    if prog is None:
        build0 = time.perf_counter()
        scheds = meshdims.build_all(collective, p, count, root, node_map, dims, orders=orders)
        prog = _assemble([_rank_arrays(s.steps, p, r) for r, s in enumerate(scheds)], p)
        prog.build_s = time.perf_counter() - build0
        _programs[key] = prog
        while len(_programs) > PROGRAM_CACHE_SIZE:
            _programs.popitem(last=False)
    fab = Fabric(topo)
    stats = run_program(prog, topo, pl, itemsize, fab, algorithm="mesh")
    res = _result(collective, "mesh", topo, fab, p, count, itemsize, prog, stats,
                  time.perf_counter() - t0)
    if timeline is not None:
        timeline.add(collective, "mesh", count, itemsize, stats.time_s,
                     modelled_steps(prog, stats, itemsize))
    return res


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
