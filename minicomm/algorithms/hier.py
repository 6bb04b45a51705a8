"""Hierarchical family: intra-node phase, inter-node phase among one rank per node, intra-node phase.

Every phase is a flat schedule built by ``build_schedule`` for the sub-group (a node, the node
leaders, or the ranks sharing a local index) and translated by ``embed``; phases run one after the
other, the groups of one phase in parallel. Flat families per phase:

- INTRA = "ring": inside a node α is small (shared memory, NVLink) and ring is bandwidth optimal,
  talking only to neighbours, so no link or memory port is shared by two messages at once.
- INTER = "rhd": between nodes α dominates; recursive halving/doubling takes O(lg m) rounds
  (alltoall aside) with the bandwidth term of a ring (Rabenseifner), so it wins on the slow hop.

The node map ``topology`` may be anything: uneven nodes, non-contiguous ranks, nodes of one rank.
Nodes are ordered by their lowest rank; a node's ranks are in rank order (local index i). The
leader of a node is its lowest rank, except that the root's node is led by the root (so rooted
data never takes an extra hop). One node: the INTRA schedule alone; one rank per node: the INTER
schedule alone. Below, m nodes, L ranks per node (Lmax the largest node), n = ``count``, and
T_f(coll, q, x) the cost of family f's ``coll`` on q ranks with count x (see ring.py / rhd.py).
Node-sized blocks exchanged between leaders are padded to Lmax blocks when nodes are uneven; pad
elements that take part in a reduction are filled with copies of real data (no arithmetic on
uninitialised memory), other pad elements are never read into a result.

broadcast: INTER broadcast among leaders, then INTRA broadcast from each leader.
  T_rhd(broadcast, m, n) + T_ring(broadcast, L, n).
reduce: INTRA reduce to each leader, then INTER reduce among leaders to the root.
  T_ring(reduce, L, n) + T_rhd(reduce, m, n).
allreduce, equal nodes: INTRA reduce-scatter (shard c = ⌈n/L⌉, the vector padded to L*c when L
  does not divide n), INTER allreduce of shard i among the m ranks of local index i (all shards in
  parallel), INTRA allgather. T_ring(reduce_scatter, L, c) + T_rhd(allreduce, m, c) +
  T_ring(allgather, L, c) ≈ 2(L-1)α_intra + 2((L-1)/L)nβ_intra + T_rhd(allreduce, m, n/L).
  Pipelined when S = min(PIPELINE_MAX_SEGMENTS, ⌊√(2n / PIPELINE_MIN_SEGMENT)⌋) > 1 (S depends on
  n alone; S = 1, the schedule above, below 2·PIPELINE_MIN_SEGMENT elements; a segment is never
  shorter than about PIPELINE_MIN_SEGMENT): the vector is cut into S segments of whole multiples
  of L elements (the remainder, and so any padding, on the last) and segment j runs the three
  phases above in slots j, j+1, j+2, so in one slot segment j's reduce-scatter, segment j-1's
  inter-node allreduce and segment j-2's allgather share steps and the intra-node and inter-node
  links work at once. Segments use disjoint parts of in, out and tmp. Every phase is placed by its
  lockstep rounds (the Send and Recv of a message get one round, each rank's rounds increase:
  rhd's fold-out ranks get gaps), and a slot is Λ = max(L-1, R) steps on every rank, R the most
  rounds of the INTER allreduce over the shard groups; so every message sits at the same merged
  step on both of its sides, merged streams match in FIFO order (in a step, segments in order) and
  a step never waits on a peer that is out of step. Steps empty on a rank are dropped.
  With B_intra = 2((L-1)/L)nβ_intra and B_inter the bandwidth term of T_rhd(allreduce, m, n/L):
  T ≈ (S+2)Λα + (1 + 2/S)·B, where B lies between max(B_intra, B_inter) (per-step work of the two
  levels balanced) and B_intra + B_inter (the unpipelined figure); the α term grows with S and the
  fill/drain share 2/S falls, so the best S grows as √n, which is the rule above.
allreduce, uneven nodes (shards would differ in number per node): INTRA reduce to the leader, INTER
  allreduce among leaders, INTRA broadcast. T_ring(reduce, L, n) + T_rhd(allreduce, m, n) +
  T_ring(broadcast, L, n).
allgather: INTRA gather to the leader, INTER allgather of node blocks (Lmax*n) among leaders, the
  leader puts blocks in rank order (a local permutation, skipped when nodes are consecutive rank
  ranges of equal size), INTRA broadcast of p*n.
  T_ring(gather, L, n) + T_rhd(allgather, m, Lmax*n) + T_ring(broadcast, L, p*n).
reduce_scatter, equal nodes: the input is permuted so that segment i holds the blocks of the ranks
  of local index i (node order; skipped when rank = i*m + node), INTRA reduce-scatter of segments
  (m*n), INTER reduce-scatter of n among the ranks of local index i.
  T_ring(reduce_scatter, L, m*n) + T_rhd(reduce_scatter, m, n).
reduce_scatter, uneven nodes: INTRA reduce of p*n to the leader, INTER reduce-scatter of node
  blocks (Lmax*n, permuted and padded) among leaders, INTRA scatter.
  T_ring(reduce, L, p*n) + T_rhd(reduce_scatter, m, Lmax*n) + T_ring(scatter, L, n).
gather: INTRA gather to the leader, INTER gather of node blocks (Lmax*n) to the root, which puts
  blocks in rank order (skipped for consecutive equal nodes).
  T_ring(gather, L, n) + T_rhd(gather, m, Lmax*n).
scatter: the reverse: the root puts blocks in node order, INTER scatter of node blocks, INTRA
  scatter. T_rhd(scatter, m, Lmax*n) + T_ring(scatter, L, n).
alltoall: INTRA gather of every member's whole input (p*n) to the leader, the leader packs, for
  each destination node, an Lmax x Lmax matrix of n-blocks (destination member major), INTER
  alltoall of Lmax²n among leaders, the leader unpacks each member's p blocks in source order,
  INTRA scatter of p*n. T_ring(gather, L, p*n) + T_rhd(alltoall, m, Lmax²n) + T_ring(scatter, L,
  p*n). Aggregation trades bandwidth and leader memory (L*p*n) for m-1 instead of p-1 messages
  crossing the network per rank.
barrier: INTRA gather of zero-length messages to the leader (the leader learns its node entered),
  INTER barrier among leaders, INTRA broadcast of zero-length messages (release).
  T_ring(gather, L, 0) + T_rhd(barrier, m) + T_ring(broadcast, L, 0).

Uneven blocks (``build_v``; c_r elements for rank r in rank order, T their sum, N_k the sum over
node k's ranks; T_f(coll, q, x) with x a list of blocks) and prefixes. Sub-phases are the
families' ``build_v`` schedules; node blocks need no padding (uneven blocks are the norm here).
"Node order": node k's N_k elements after those of nodes 0..k-1, its ranks' blocks in rank order
inside; it is rank order when every node is a run of consecutive ranks (sizes free), and a leader
permutes T elements locally otherwise. One node, or one rank per node: the flat schedule alone.
allgatherv: INTRA gatherv to the leader, INTER allgatherv of the node blocks N_k among leaders,
  the leader's permutation to rank order, INTRA broadcast of T.
  T_ring(gatherv, L, c) + T_rhd(allgatherv, m, N) + T_ring(broadcast, L, T).
gatherv: INTRA gatherv to the leader, INTER gatherv of node blocks to the root (straight into
  ``out`` when node order is rank order), which permutes. T_ring(gatherv, L, c) +
  T_rhd(gatherv, m, N).
scatterv: the reverse: the root permutes to node order, INTER scatterv of node blocks, INTRA
  scatterv. T_rhd(scatterv, m, N) + T_ring(scatterv, L, c).
reduce_scatterv, equal nodes: the input is permuted so that segment i holds the blocks of the
  ranks of local index i (node order; skipped when rank = i*m + node), INTRA reduce_scatterv of
  the segments (S_i = their sum), INTER reduce_scatterv of c among the ranks of local index i.
  T_ring(reduce_scatterv, L, S) + T_rhd(reduce_scatterv, m, c of the local index's ranks).
reduce_scatterv, uneven nodes: INTRA reduce of T to the leader, its permutation to node order,
  INTER reduce_scatterv of node blocks among leaders, INTRA scatterv.
  T_ring(reduce, L, T) + T_rhd(reduce_scatterv, m, N) + T_ring(scatterv, L, c).
alltoallv: INTRA gatherv of every member's whole input (S_r = Σ_j C[r][j]) to the leader, which
  packs what node k sends node j (for each member d of j, for each member s of k, C[s][d]), INTER
  alltoallv of the node matrix M[k][j] = Σ_{s∈k, d∈j} C[s][d] among leaders, the leader unpacks
  each member's blocks by source rank, INTRA scatterv of R_d = Σ_i C[i][d].
  T_ring(gatherv, L, S) + T_rhd(alltoallv, m, M) + T_ring(scatterv, L, R): m-1 instead of p-1
  messages crossing the network per rank, for leader memory and two intra-node hops.
scan, exscan: when every node is a run of consecutive ranks: INTRA scan (exscan) in the node;
  the node's last rank holds its node total (exscan: forms it, its prefix op its input); INTER
  exscan of the totals among the nodes' last ranks; on nodes k > 0 INTRA broadcast of that
  exclusive node prefix from the last rank and a local reduce of it into ``out`` (exscan's local
  index 0 copies it). T_ring(scan, L, n) + T_rhd(exscan, m, n) + T_ring(broadcast, L, n) + nγ.
  Nodes that interleave in rank order (e.g. (0, 1, 0, 1)) do not split a prefix into node
  prefixes: the flat INTER scan (exscan) on all ranks, T_rhd(scan, p, n).

Communicating steps of a rank = the sum of the comm steps of the phases it takes part in (the
pipelined allreduce aside: at most (S+2)Λ).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import isqrt
from typing import Dict, List, Sequence, Tuple

from ..schedule import (
    IN,
    OUT,
    ROOTED,
    TMP,
    Copy,
    Recv,
    Reduce,
    Schedule,
    ScheduleBuilder,
    Send,
    Step,
    Topology,
    chunk_bounds,
    concurrent,
    embed,
    servers,
)
from . import rhd, ring

INTRA = "ring"
INTER = "rhd"

# Pipelined allreduce (module doc): S = min(PIPELINE_MAX_SEGMENTS, ⌊√(2n / PIPELINE_MIN_SEGMENT)⌋)
# segments; a segment of a pipelined call never has fewer than PIPELINE_MIN_SEGMENT elements.
PIPELINE_MIN_SEGMENT = 4 * 1024 * 1024
PIPELINE_MAX_SEGMENTS = 8

Region = Tuple[str, int]   # (buffer, offset)


@dataclass(frozen=True)
class NodeMap:
    """The node structure of a topology: nodes ordered by lowest rank, ranks in rank order."""
    nodes: Tuple[Tuple[int, ...], ...]
    node_of: Tuple[int, ...]       # node index of every rank
    local_of: Tuple[int, ...]      # index of every rank inside its node
    lmax: int                      # size of the largest node
    equal: bool                    # all nodes have the same size
    blocked: bool                  # node k is ranks k*L .. k*L+L-1 (rank order = node order)
    cyclic: bool                   # rank = local index * m + node index

    @property
    def m(self) -> int:
        return len(self.nodes)


@lru_cache(maxsize=256)
def node_map(topology: Topology) -> NodeMap:
    nodes = servers(topology)
    node_of, local_of = [0] * len(topology), [0] * len(topology)
    for k, g in enumerate(nodes):
        for i, r in enumerate(g):
            node_of[r], local_of[r] = k, i
    m, lmax = len(nodes), max(len(g) for g in nodes)
    equal = all(len(g) == lmax for g in nodes)
    blocked = equal and all(g == tuple(range(k * lmax, (k + 1) * lmax)) for k, g in enumerate(nodes))
    cyclic = equal and all(g == tuple(range(k, len(topology), m)) for k, g in enumerate(nodes))
    return NodeMap(nodes, tuple(node_of), tuple(local_of), lmax, equal, blocked, cyclic)


def build(collective: str, rank: int, size: int, count: int, root: int, topology) -> Schedule:
    if len(topology) != size:
        raise ValueError(f"topology names {len(topology)} ranks, world size is {size}")
    nm = node_map(tuple(topology))
    b = ScheduleBuilder(collective, "hier", rank, size, count, root)
    if nm.m == 1 or nm.m == size:
        # One node, or one rank per node: only one level exists, so one flat phase is the whole.
        _phase(b, collective, INTRA if nm.m == 1 else INTER, range(size), rank, count, root,
               (IN, 0), (OUT, 0))
    else:
        _BUILDERS[collective](b, _Place(nm, rank, root, collective in ROOTED), count)
    return b.build()


class _Place:
    """Where one rank sits: its node, local index, node leaders and the root's node."""

    def __init__(self, nm: NodeMap, rank: int, root: int, rooted: bool):
        self.nm, self.rank = nm, rank
        self.k, self.i = nm.node_of[rank], nm.local_of[rank]
        self.node = nm.nodes[self.k]
        self.root_node = nm.node_of[root] if rooted else 0
        self.leaders = [g[0] for g in nm.nodes]
        if rooted:
            self.leaders[self.root_node] = root
        self.lead = nm.local_of[self.leaders[self.k]]   # leader's index inside this node
        self.is_leader = self.i == self.lead
        self.is_root = rooted and rank == root


def _phase(b: ScheduleBuilder, coll: str, fam: str, group: Sequence[int], sub_rank: int,
           count: int, sub_root: int, inb: Region, outb: Region) -> None:
    """Append the flat ``fam`` schedule of ``coll`` for ``group`` (this rank is group[sub_rank]),
    its ``in`` and ``out`` at the given regions, its scratch in a fresh part of ``tmp``."""
    b.extend(_embedded(b, coll, fam, group, sub_rank, count, sub_root, inb, outb))


def _embedded(b: ScheduleBuilder, coll: str, fam: str, group: Sequence[int], sub_rank: int,
              count: int, sub_root: int, inb: Region, outb: Region) -> List[Step]:
    """The steps ``_phase`` appends, returned instead (its scratch is allocated all the same)."""
    sub = _flat(coll, fam, sub_rank, len(group), count, sub_root)
    return embed(sub, group, {IN: inb, OUT: outb, TMP: (TMP, b.alloc_tmp(sub.tmp_count))})


_FLAT = {"ring": ring, "rhd": rhd}      # INTRA and INTER (the registry imports this module)


@lru_cache(maxsize=4096)
def _flat(coll: str, fam: str, rank: int, size: int, count: int, root: int) -> Schedule:
    return _FLAT[fam].build(coll, rank, size, count, root, (0,) * size)


@lru_cache(maxsize=1024)
def _rounds(coll: str, fam: str, size: int, count: int, root: int) -> Tuple[Tuple[int, ...], ...]:
    """The lockstep round of every step of every sub-rank of a flat schedule.

    Rounds increase along each rank's steps, and a message's Send and Recv get the same round.
    Placing every step at its round makes each message sit at one merged step on both of its
    sides, so merged streams are matched in the same order and wait on nothing out of step (a
    short rank, such as an rhd fold-out, gets gaps where its partner works alone).
    """
    scheds = [_flat(coll, fam, r, size, count, root) for r in range(size)]
    rounds = [list(range(len(s.steps))) for s in scheds]
    sends: Dict[Tuple[int, int], List[int]] = {}
    recvs: Dict[Tuple[int, int], List[int]] = {}
    for r, sched in enumerate(scheds):
        for k, st in enumerate(sched.steps):
            for o in st:
                if isinstance(o, Send):
                    sends.setdefault((r, o.peer), []).append(k)
                elif isinstance(o, Recv):
                    recvs.setdefault((o.peer, r), []).append(k)
    pairs = [(a, ka, b, kb) for (a, b), ks in sends.items() for ka, kb in zip(ks, recvs[a, b])]
    # Each pass only raises rounds, which are bounded for a deadlock-free schedule.
    limit = sum(len(s.steps) for s in scheds) + 1
    changed = True
    while changed:
        changed = False
        for a, ka, b, kb in pairs:
            top = max(rounds[a][ka], rounds[b][kb])
            if rounds[a][ka] != top or rounds[b][kb] != top:
                rounds[a][ka] = rounds[b][kb] = top
                changed = True
        for rr in rounds:
            for k in range(1, len(rr)):
                if rr[k] <= rr[k - 1]:
                    rr[k] = rr[k - 1] + 1
                    changed = True
            if rr and rr[-1] > limit:
                raise RuntimeError(f"{fam} {coll} on {size} ranks has no lockstep rounds")
    return tuple(tuple(rr) for rr in rounds)


def _span(coll: str, fam: str, size: int, count: int, root: int = 0) -> int:
    """Rounds the flat schedule takes on its slowest sub-rank."""
    return max((rr[-1] + 1 for rr in _rounds(coll, fam, size, count, root) if rr), default=0)


def _copies(src: str, dst: str, moves, n: int) -> List[Copy]:
    """Copy ops for n-element blocks ``(src_offset, dst_offset)``, adjacent blocks merged."""
    ops: List[List[int]] = []
    for so, do in moves:
        if ops and ops[-1][0] + ops[-1][2] == so and ops[-1][1] + ops[-1][2] == do:
            ops[-1][2] += n
        else:
            ops.append([so, do, n])
    return [Copy(src, so, dst, do, ln) for so, do, ln in ops]


def _node_blocks(nm: NodeMap, n: int):
    """(rank's block offset in rank order, its offset in node order padded to lmax) per rank."""
    return ((r * n, (k * nm.lmax + i) * n) for k, g in enumerate(nm.nodes) for i, r in enumerate(g))


def _broadcast(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    if pl.is_leader:
        # The root keeps its own data where it is; other leaders stage what they receive in tmp.
        got = (OUT, 0) if pl.is_root else (TMP, b.alloc_tmp(n))
        _phase(b, "broadcast", INTER, pl.leaders, pl.k, n, pl.root_node, (IN, 0), got)
        src = (IN, 0) if pl.is_root else got
    else:
        src = (IN, 0)   # not read: only the sub-root reads its input
    _phase(b, "broadcast", INTRA, pl.node, pl.i, n, pl.lead, src, (OUT, 0))


def _reduce(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    # Non-root ranks may use ``out`` as scratch, so only the root needs a staging buffer.
    part = (TMP, b.alloc_tmp(n)) if pl.is_root else (OUT, 0)
    _phase(b, "reduce", INTRA, pl.node, pl.i, n, pl.lead, (IN, 0), part)
    if pl.is_leader:
        res = (OUT, 0) if pl.is_root else (TMP, b.alloc_tmp(n))
        _phase(b, "reduce", INTER, pl.leaders, pl.k, n, pl.root_node, part, res)


def _allreduce(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    nm = pl.nm
    if not nm.equal:
        # ``out`` is scratch until the final broadcast overwrites all of it.
        _phase(b, "reduce", INTRA, pl.node, pl.i, n, pl.lead, (IN, 0), (OUT, 0))
        src = (IN, 0)
        if pl.is_leader:
            src = (TMP, b.alloc_tmp(n))
            _phase(b, "allreduce", INTER, pl.leaders, pl.k, n, 0, (OUT, 0), src)
        _phase(b, "broadcast", INTRA, pl.node, pl.i, n, pl.lead, src, (OUT, 0))
        return
    if pipeline_segments(n) > 1:
        _allreduce_pipelined(b, pl, n)
        return
    L = nm.lmax
    c = -(-n // L)
    padded = L * c
    vec = (IN, 0)
    if padded != n:
        vec = (TMP, b.alloc_tmp(padded))
        fill = [Copy(IN, 0, TMP, vec[1], n)]
        for off in range(n, padded, n):   # pad with real values: they are reduced, then dropped
            fill.append(Copy(IN, 0, TMP, vec[1] + off, min(n, padded - off)))
        b.step(*fill)
    shard, total = (TMP, b.alloc_tmp(c)), (TMP, b.alloc_tmp(c))
    _phase(b, "reduce_scatter", INTRA, pl.node, pl.i, c, 0, vec, shard)
    peers = [g[pl.i] for g in nm.nodes]   # the ranks holding the same shard on every node
    real = max(0, min(c, n - pl.i * c))   # the pad tail of the last shards need not cross nodes
    _phase(b, "allreduce", INTER, peers, pl.k, real, 0, shard, total)
    res = (OUT, 0) if padded == n else (TMP, b.alloc_tmp(padded))
    _phase(b, "allgather", INTRA, pl.node, pl.i, c, 0, total, res)
    if padded != n:
        b.step(Copy(TMP, res[1], OUT, 0, n))


def pipeline_segments(count: int) -> int:
    """Segments of the pipelined equal-nodes allreduce of ``count`` elements (module doc)."""
    # The α cost grows with S and the fill/drain share of the bandwidth cost falls as 1/S: their
    # sum is least near S ∝ √n.
    return max(1, min(PIPELINE_MAX_SEGMENTS, isqrt(2 * count // max(1, PIPELINE_MIN_SEGMENT))))


def _segment_bounds(n: int, L: int, segments: int) -> List[Tuple[int, int]]:
    """(offset, length) of each segment: multiples of L elements, the remainder on the last, so
    that only the last segment can need padding."""
    bounds = [(L * off, L * ln) for off, ln in chunk_bounds(n // L, segments)]
    off, ln = bounds[-1]
    bounds[-1] = (off, ln + n % L)
    return bounds


def _allreduce_pipelined(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    """Equal-nodes allreduce in segments: segment j's reduce-scatter, inter-node allreduce and
    allgather run in slots j, j+1, j+2, so the three phases of consecutive segments overlap."""
    nm, L, m = pl.nm, pl.nm.lmax, pl.nm.m
    bounds = _segment_bounds(n, L, pipeline_segments(n))
    shards = [-(-ln // L) for _, ln in bounds]
    reals = [[max(0, min(c, ln - i * c)) for i in range(L)] for c, (_, ln) in zip(shards, bounds)]
    # One slot length for every rank of the world: every rank merges at the same step indices.
    slot = max([_span("reduce_scatter", INTRA, L, c) for c in set(shards)]
               + [_span("allgather", INTRA, L, c) for c in set(shards)]
               + [_span("allreduce", INTER, m, x) for row in reals for x in set(row)])
    placed: List[Tuple[int, Step]] = []        # segment by segment: concurrent keeps that order

    peers = [g[pl.i] for g in nm.nodes]   # the ranks holding the same shard on every node
    for j, ((off, ln), c) in enumerate(zip(bounds, shards)):
        padded = L * c
        vec = (IN, off)
        if padded != ln:
            vec = (TMP, b.alloc_tmp(padded))
            # Pad with real values: they are reduced, then dropped. Local ops run first in a step.
            placed.append((j * slot, (Copy(IN, off, TMP, vec[1], ln),)))
            for po in range(ln, padded, ln):
                placed.append((j * slot, (Copy(IN, off, TMP, vec[1] + po, min(ln, padded - po)),)))
        shard, total = (TMP, b.alloc_tmp(c)), (TMP, b.alloc_tmp(c))
        res = (OUT, off) if padded == ln else (TMP, b.alloc_tmp(padded))
        phases = (("reduce_scatter", INTRA, pl.node, pl.i, c, vec, shard),
                  ("allreduce", INTER, peers, pl.k, reals[j][pl.i], shard, total),
                  ("allgather", INTRA, pl.node, pl.i, c, total, res))
        for q, (coll, fam, group, me, cnt, src, dst) in enumerate(phases):
            steps = _embedded(b, coll, fam, group, me, cnt, 0, src, dst)
            rounds = _rounds(coll, fam, len(group), cnt, 0)[me]
            placed += [((j + q) * slot + rnd, st) for st, rnd in zip(steps, rounds)]
        if padded != ln:
            placed.append(((j + 3) * slot, (Copy(TMP, res[1], OUT, off, ln),)))
    b.extend(concurrent(placed))     # steps empty on this rank are dropped


def _allgather(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    nm, p = pl.nm, len(pl.nm.node_of)
    blk = nm.lmax * n
    if pl.is_leader:
        mine = (TMP, b.alloc_tmp(blk))
        _phase(b, "gather", INTRA, pl.node, pl.i, n, pl.lead, (IN, 0), mine)
        ordered = (TMP, b.alloc_tmp(p * n))
        every = ordered if nm.blocked else (TMP, b.alloc_tmp(nm.m * blk))
        _phase(b, "allgather", INTER, pl.leaders, pl.k, blk, 0, mine, every)
        if not nm.blocked:
            b.step(*_copies(TMP, TMP, ((every[1] + s, ordered[1] + d)
                                       for d, s in _node_blocks(nm, n)), n))
        src = ordered
    else:
        _phase(b, "gather", INTRA, pl.node, pl.i, n, pl.lead, (IN, 0), (OUT, 0))   # out: scratch
        src = (IN, 0)   # not read
    _phase(b, "broadcast", INTRA, pl.node, pl.i, p * n, pl.lead, src, (OUT, 0))


def _reduce_scatter(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    nm, p, m = pl.nm, len(pl.nm.node_of), pl.nm.m
    if nm.equal:
        vec = (IN, 0)
        if not nm.cyclic:
            # Segment i = the blocks of the ranks of local index i, in node order.
            vec = (TMP, b.alloc_tmp(p * n))
            b.step(*_copies(IN, TMP, sorted(
                (r * n, vec[1] + (nm.local_of[r] * m + nm.node_of[r]) * n) for r in range(p)), n))
        seg = (TMP, b.alloc_tmp(m * n))
        _phase(b, "reduce_scatter", INTRA, pl.node, pl.i, m * n, 0, vec, seg)
        peers = [g[pl.i] for g in nm.nodes]
        _phase(b, "reduce_scatter", INTER, peers, pl.k, n, 0, seg, (OUT, 0))
        return
    blk = nm.lmax * n
    whole = (TMP, b.alloc_tmp(p * n))
    _phase(b, "reduce", INTRA, pl.node, pl.i, p * n, pl.lead, (IN, 0), whole)
    src = (IN, 0)   # not read
    if pl.is_leader:
        padded = b.alloc_tmp(nm.m * blk)
        moves = [(whole[1] + s, padded + d) for s, d in _node_blocks(nm, n)]
        # Pad blocks are reduced too: give them real values (the node's first block).
        moves += [(whole[1] + g[0] * n, padded + (k * nm.lmax + i) * n)
                  for k, g in enumerate(nm.nodes) for i in range(len(g), nm.lmax)]
        b.step(*_copies(TMP, TMP, sorted(moves, key=lambda mv: mv[1]), n))
        src = (TMP, b.alloc_tmp(blk))
        _phase(b, "reduce_scatter", INTER, pl.leaders, pl.k, blk, 0, (TMP, padded), src)
    _phase(b, "scatter", INTRA, pl.node, pl.i, n, pl.lead, src, (OUT, 0))


def _gather(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    nm = pl.nm
    blk = nm.lmax * n
    if not pl.is_leader:
        _phase(b, "gather", INTRA, pl.node, pl.i, n, pl.lead, (IN, 0), (OUT, 0))   # out: scratch
        return
    mine = (TMP, b.alloc_tmp(blk))
    _phase(b, "gather", INTRA, pl.node, pl.i, n, pl.lead, (IN, 0), mine)
    direct = pl.is_root and nm.blocked
    every = (OUT, 0) if direct else (TMP, b.alloc_tmp(nm.m * blk))
    _phase(b, "gather", INTER, pl.leaders, pl.k, blk, pl.root_node, mine, every)
    if pl.is_root and not direct:
        b.step(*_copies(TMP, OUT, sorted((every[1] + s, d) for d, s in _node_blocks(nm, n)), n))


def _scatter(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    nm = pl.nm
    blk = nm.lmax * n
    src = (IN, 0)   # on non-roots never read
    if pl.is_leader:
        if pl.is_root and not nm.blocked:
            src = (TMP, b.alloc_tmp(nm.m * blk))
            b.step(*_copies(IN, TMP, ((s, src[1] + d) for s, d in _node_blocks(nm, n)), n))
        mine = (TMP, b.alloc_tmp(blk))
        _phase(b, "scatter", INTER, pl.leaders, pl.k, blk, pl.root_node, src, mine)
        src = mine
    _phase(b, "scatter", INTRA, pl.node, pl.i, n, pl.lead, src, (OUT, 0))


def _alltoall(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    nm, p, lmax = pl.nm, len(pl.nm.node_of), pl.nm.lmax
    L = len(pl.node)
    rows = (TMP, b.alloc_tmp(L * p * n))   # member i's whole input at rows + i*p*n
    _phase(b, "gather", INTRA, pl.node, pl.i, p * n, pl.lead, (IN, 0), rows)
    src = (IN, 0)   # not read
    if pl.is_leader:
        pair = lmax * lmax * n   # what one node sends another: [dest member][source member]
        send, recv = b.alloc_tmp(nm.m * pair), b.alloc_tmp(nm.m * pair)
        b.step(*_copies(TMP, TMP, (
            (rows[1] + (i * p + d) * n, send + j * pair + (di * lmax + i) * n)
            for j, dg in enumerate(nm.nodes) for di, d in enumerate(dg) for i in range(L)), n))
        _phase(b, "alltoall", INTER, pl.leaders, pl.k, pair, 0, (TMP, send), (TMP, recv))
        src = (TMP, b.alloc_tmp(L * p * n))   # member di's output at src + di*p*n
        b.step(*_copies(TMP, TMP, (
            (recv + k * pair + (di * lmax + i) * n, src[1] + (di * p + s) * n)
            for di in range(L) for k, sg in enumerate(nm.nodes) for i, s in enumerate(sg)), n))
    _phase(b, "scatter", INTRA, pl.node, pl.i, p * n, pl.lead, src, (OUT, 0))


def _barrier(b: ScheduleBuilder, pl: _Place, n: int) -> None:
    _phase(b, "gather", INTRA, pl.node, pl.i, 0, 0, (IN, 0), (OUT, 0))
    if pl.is_leader:
        _phase(b, "barrier", INTER, pl.leaders, pl.k, 0, 0, (IN, 0), (OUT, 0))
    _phase(b, "broadcast", INTRA, pl.node, pl.i, 0, 0, (IN, 0), (OUT, 0))


_BUILDERS = {"broadcast": _broadcast, "reduce": _reduce, "allreduce": _allreduce,
             "allgather": _allgather, "reduce_scatter": _reduce_scatter, "gather": _gather,
             "scatter": _scatter, "alltoall": _alltoall, "barrier": _barrier}


# ------------------------------------------------------------------ uneven blocks and prefixes
def build_v(collective: str, rank: int, size: int, count: int, root: int, topology,
            counts: Tuple[int, ...]) -> Schedule:
    """The uneven collectives and the prefix reductions (module doc)."""
    if len(topology) != size:
        raise ValueError(f"topology names {len(topology)} ranks, world size is {size}")
    nm = node_map(tuple(topology))
    counts = tuple(counts)
    b = ScheduleBuilder(collective, "hier", rank, size, count, root, counts)
    if nm.m == 1 or nm.m == size:
        _phase_v(b, collective, INTRA if nm.m == 1 else INTER, range(size), rank, root, counts,
                 (IN, 0), (OUT, 0), count)
    elif collective in ("scan", "exscan") and not _consecutive(nm):
        # Nodes interleave in rank order: a prefix does not split into node prefixes.
        _phase_v(b, collective, INTER, range(size), rank, 0, (), (IN, 0), (OUT, 0), count)
    else:
        _V_BUILDERS[collective](b, _Place(nm, rank, root, collective in ROOTED), count, counts)
    return b.build()


def _phase_v(b: ScheduleBuilder, coll: str, fam: str, group: Sequence[int], sub_rank: int,
             sub_root: int, counts: Sequence[int], inb: Region, outb: Region,
             count: int = 0) -> None:
    """``_phase`` for the uneven and prefix collectives: ``counts`` are the group's (in group
    order), ``count`` their sum (a prefix call: its n, with no ``counts``)."""
    counts = tuple(counts)
    if counts:
        count = sum(counts)
    sub = _flat_v(coll, fam, sub_rank, len(group), count, sub_root, counts)
    b.extend(embed(sub, group, {IN: inb, OUT: outb, TMP: (TMP, b.alloc_tmp(sub.tmp_count))}))


@lru_cache(maxsize=4096)
def _flat_v(coll: str, fam: str, rank: int, size: int, count: int, root: int,
            counts: Tuple[int, ...]) -> Schedule:
    return _FLAT[fam].build_v(coll, rank, size, count, root, (0,) * size, counts)


def _consecutive(nm: NodeMap) -> bool:
    """Every node is a run of consecutive ranks (node order = rank order), sizes free."""
    return [r for g in nm.nodes for r in g] == list(range(len(nm.node_of)))


def _totals(nm: NodeMap, counts: Sequence[int]) -> List[int]:
    """Elements of each node's blocks."""
    return [sum(counts[r] for r in g) for g in nm.nodes]


def _moves_v(src: str, dst: str, moves) -> List[Copy]:
    """Copy ops for blocks ``(src_offset, dst_offset, length)``, adjacent blocks merged and empty
    ones dropped."""
    ops: List[List[int]] = []
    for so, do, ln in moves:
        if not ln:
            continue
        if ops and ops[-1][0] + ops[-1][2] == so and ops[-1][1] + ops[-1][2] == do:
            ops[-1][2] += ln
        else:
            ops.append([so, do, ln])
    return [Copy(src, so, dst, do, ln) for so, do, ln in ops]


def _node_order_v(nm: NodeMap, counts: Sequence[int]):
    """(rank's block offset in rank order, its offset in node order, its length) per rank, in
    node order (node order: the nodes' blocks one after the other, no padding)."""
    rank_off = [0] * len(counts)
    for r in range(1, len(counts)):
        rank_off[r] = rank_off[r - 1] + counts[r - 1]
    off = 0
    for g in nm.nodes:
        for r in g:
            yield rank_off[r], off, counts[r]
            off += counts[r]


def _allgatherv(b: ScheduleBuilder, pl: _Place, total: int, counts: Tuple[int, ...]) -> None:
    nm = pl.nm
    mine_counts = [counts[r] for r in pl.node]
    if pl.is_leader:
        tot = _totals(nm, counts)
        mine = (TMP, b.alloc_tmp(tot[pl.k]))
        _phase_v(b, "gatherv", INTRA, pl.node, pl.i, pl.lead, mine_counts, (IN, 0), mine)
        ordered = (TMP, b.alloc_tmp(total))
        direct = _consecutive(nm)
        every = ordered if direct else (TMP, b.alloc_tmp(total))
        _phase_v(b, "allgatherv", INTER, pl.leaders, pl.k, 0, tot, mine, every)
        if not direct:
            b.step(*_moves_v(TMP, TMP, sorted((every[1] + s, ordered[1] + d, ln)
                                              for d, s, ln in _node_order_v(nm, counts))))
        src = ordered
    else:
        _phase_v(b, "gatherv", INTRA, pl.node, pl.i, pl.lead, mine_counts, (IN, 0),
                 (OUT, 0))   # out: scratch
        src = (IN, 0)   # not read
    _phase(b, "broadcast", INTRA, pl.node, pl.i, total, pl.lead, src, (OUT, 0))


def _gatherv(b: ScheduleBuilder, pl: _Place, total: int, counts: Tuple[int, ...]) -> None:
    nm = pl.nm
    mine_counts = [counts[r] for r in pl.node]
    if not pl.is_leader:
        _phase_v(b, "gatherv", INTRA, pl.node, pl.i, pl.lead, mine_counts, (IN, 0),
                 (OUT, 0))   # out: scratch
        return
    tot = _totals(nm, counts)
    mine = (TMP, b.alloc_tmp(tot[pl.k]))
    _phase_v(b, "gatherv", INTRA, pl.node, pl.i, pl.lead, mine_counts, (IN, 0), mine)
    direct = pl.is_root and _consecutive(nm)
    every = (OUT, 0) if direct else (TMP, b.alloc_tmp(total))
    _phase_v(b, "gatherv", INTER, pl.leaders, pl.k, pl.root_node, tot, mine, every)
    if pl.is_root and not direct:
        b.step(*_moves_v(TMP, OUT, sorted((every[1] + s, d, ln)
                                          for d, s, ln in _node_order_v(nm, counts))))


def _scatterv(b: ScheduleBuilder, pl: _Place, total: int, counts: Tuple[int, ...]) -> None:
    nm = pl.nm
    src = (IN, 0)   # on non-roots never read
    if pl.is_leader:
        tot = _totals(nm, counts)
        if pl.is_root and not _consecutive(nm):
            src = (TMP, b.alloc_tmp(total))
            b.step(*_moves_v(IN, TMP, ((s, src[1] + d, ln)
                                       for s, d, ln in _node_order_v(nm, counts))))
        mine = (TMP, b.alloc_tmp(tot[pl.k]))
        _phase_v(b, "scatterv", INTER, pl.leaders, pl.k, pl.root_node, tot, src, mine)
        src = mine
    _phase_v(b, "scatterv", INTRA, pl.node, pl.i, pl.lead, [counts[r] for r in pl.node], src,
             (OUT, 0))


def _reduce_scatterv(b: ScheduleBuilder, pl: _Place, total: int,
                     counts: Tuple[int, ...]) -> None:
    nm = pl.nm
    if nm.equal:
        # Segment i = the blocks of the ranks of local index i, in node order.
        seg_counts = [sum(counts[g[i]] for g in nm.nodes) for i in range(nm.lmax)]
        vec = (IN, 0)
        if not nm.cyclic:
            vec = (TMP, b.alloc_tmp(total))
            at = _starts(counts)
            moves, off = [], vec[1]
            for i in range(nm.lmax):
                for g in nm.nodes:
                    moves.append((at[g[i]], off, counts[g[i]]))
                    off += counts[g[i]]
            b.step(*_moves_v(IN, TMP, sorted(moves)))
        seg = (TMP, b.alloc_tmp(seg_counts[pl.i]))
        _phase_v(b, "reduce_scatterv", INTRA, pl.node, pl.i, 0, seg_counts, vec, seg)
        peers = [g[pl.i] for g in nm.nodes]
        _phase_v(b, "reduce_scatterv", INTER, peers, pl.k, 0, [counts[q] for q in peers], seg,
                 (OUT, 0))
        return
    # Uneven nodes: reduce the whole input to the leader, reduce-scatter node blocks among the
    # leaders (uneven blocks need no padding), scatter inside the node.
    whole = (TMP, b.alloc_tmp(total))
    _phase(b, "reduce", INTRA, pl.node, pl.i, total, pl.lead, (IN, 0), whole)
    src = (IN, 0)   # not read
    if pl.is_leader:
        tot = _totals(nm, counts)
        blocks = whole
        if not _consecutive(nm):
            blocks = (TMP, b.alloc_tmp(total))
            b.step(*_moves_v(TMP, TMP, ((whole[1] + s, blocks[1] + d, ln)
                                        for s, d, ln in _node_order_v(nm, counts))))
        src = (TMP, b.alloc_tmp(tot[pl.k]))
        _phase_v(b, "reduce_scatterv", INTER, pl.leaders, pl.k, 0, tot, blocks, src)
    _phase_v(b, "scatterv", INTRA, pl.node, pl.i, pl.lead, [counts[r] for r in pl.node], src,
             (OUT, 0))


def _alltoallv(b: ScheduleBuilder, pl: _Place, total: int, counts: Tuple[int, ...]) -> None:
    nm, p = pl.nm, len(pl.nm.node_of)
    C = [counts[i * p:(i + 1) * p] for i in range(p)]
    sent = [_starts(row) for row in C]                                    # in of rank s, by dest
    got = [_starts([C[s][d] for s in range(p)]) for d in range(p)]        # out of rank d, by src
    node = pl.node
    # The leader gathers every member's whole input: member i's at rows + in_at[i].
    in_at = _starts([sent[s][p] for s in node])
    rows = (TMP, b.alloc_tmp(in_at[-1]))
    _phase_v(b, "gatherv", INTRA, node, pl.i, pl.lead, [sent[s][p] for s in node], (IN, 0), rows)
    src = (IN, 0)   # not read
    if pl.is_leader:
        # What node k sends node j: for each member d of j, for each member s of k, C[s][d].
        M = [[sum(C[s][d] for s in gk for d in gj) for gj in nm.nodes] for gk in nm.nodes]
        k = pl.k
        send = b.alloc_tmp(sum(M[k]))
        recv = b.alloc_tmp(sum(M[j][k] for j in range(nm.m)))
        moves, off = [], send
        for gj in nm.nodes:
            for d in gj:
                for i, s in enumerate(node):
                    moves.append((rows[1] + in_at[i] + sent[s][d], off, C[s][d]))
                    off += C[s][d]
        b.step(*_moves_v(TMP, TMP, moves))
        _phase_v(b, "alltoallv", INTER, pl.leaders, k, 0, [x for row in M for x in row],
                 (TMP, send), (TMP, recv))
        # Member d's output at src + out_at[di], its blocks by source rank.
        out_at = _starts([got[d][p] for d in node])
        src = (TMP, b.alloc_tmp(out_at[-1]))
        moves, off = [], recv
        for gk in nm.nodes:
            for di, d in enumerate(node):
                for s in gk:
                    moves.append((off, src[1] + out_at[di] + got[d][s], C[s][d]))
                    off += C[s][d]
        b.step(*_moves_v(TMP, TMP, sorted(moves, key=lambda mv: mv[1])))
    _phase_v(b, "scatterv", INTRA, node, pl.i, pl.lead, [got[d][p] for d in node], src,
             (OUT, 0))


def _prefix(b: ScheduleBuilder, pl: _Place, n: int, inclusive: bool) -> None:
    """scan / exscan over nodes of consecutive ranks (module doc): INTRA prefix in the node, INTER
    exscan of node totals among the nodes' last ranks, INTRA broadcast of it from the last rank
    and a local reduce (node 0 has nothing to add)."""
    nm = pl.nm
    last = len(pl.node) - 1
    lasts = [g[-1] for g in nm.nodes]
    _phase_v(b, "scan" if inclusive else "exscan", INTRA, pl.node, pl.i, 0, (), (IN, 0),
             (OUT, 0), n)
    before = (TMP, b.alloc_tmp(n)) if pl.k > 0 else (IN, 0)   # the nodes before this one
    if pl.i == last:
        total: Region = (OUT, 0) if inclusive else (IN, 0)
        if not inclusive and last > 0:     # the node's total: its exclusive prefix op own input
            total = (TMP, b.alloc_tmp(n))
            b.step(Copy(OUT, 0, TMP, total[1], n), Reduce(IN, 0, TMP, total[1], n))
        ex = (TMP, b.alloc_tmp(n))         # scratch on node 0 (rank 0's exscan is undefined)
        _phase_v(b, "exscan", INTER, lasts, pl.k, 0, (), total, ex, n)
        src = ex
    else:
        src = (IN, 0)   # not read
    if pl.k == 0:
        return
    _phase(b, "broadcast", INTRA, pl.node, pl.i, n, last, src, before)
    if inclusive or pl.i > 0:
        b.step(Reduce(before[0], before[1], OUT, 0, n))
    else:                                  # local index 0 has no node prefix of its own
        b.step(Copy(before[0], before[1], OUT, 0, n))


def _scan(b: ScheduleBuilder, pl: _Place, n: int, counts: Tuple[int, ...]) -> None:
    _prefix(b, pl, n, True)


def _exscan(b: ScheduleBuilder, pl: _Place, n: int, counts: Tuple[int, ...]) -> None:
    _prefix(b, pl, n, False)


def _starts(counts: Sequence[int]) -> List[int]:
    """Start offsets of consecutive blocks of ``counts``, plus the end (their sum)."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


_V_BUILDERS = {"allgatherv": _allgatherv, "gatherv": _gatherv, "scatterv": _scatterv,
               "reduce_scatterv": _reduce_scatterv, "alltoallv": _alltoallv, "scan": _scan,
               "exscan": _exscan}
