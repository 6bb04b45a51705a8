"""Recursive halving / doubling: log-depth collectives built from pairwise exchanges.

Notation: p ranks, n the collective's vector (for per-rank-block collectives, n = the block
count), p' the largest power of two <= p, r = p - p', lg = log2, [x] = 1 if x else 0.

Non-powers of two, the fold (MPICH): the first 2r ranks pair up (2i, 2i+1); each odd one hands
its input to (or reduces it into) its even partner and sits out; the p' survivors run the
power-of-two algorithm as participants 0..p'-1; at the end each odd rank gets its result back
from its partner. Rooted collectives fold on ranks relative to the root, so the root always
participates (as participant 0) and never waits on a fold-out.

broadcast: van de Geijn — binomial scatter of the vector in p' chunks from the root, then a
  recursive-doubling allgather (rank XOR 2^k) of the chunks among the p' participants; fold-out
  only (the odd ranks get the whole vector from their partner at the end).
  2 lg p' + [p≠p'] steps; (2 lg p' + [p≠p'])α + (2(p'-1)/p' + [p≠p'])nβ.
reduce: Rabenseifner — recursive-halving reduce-scatter over p' chunks, then binomial gather of
  the reduced chunks to the root; fold-in only (the root is participant 0).
  2 lg p' + [p≠p'] steps; (2 lg p' + [p≠p'])α + (2(p'-1)/p' + [p≠p'])nβ + ((p'-1)/p' + [p≠p'])nγ.
allreduce: n >= ALLREDUCE_SMALL_COUNT and n >= p': Rabenseifner — recursive-halving
  reduce-scatter then recursive-doubling allgather; 2 lg p' + 2[p≠p'] steps;
  (2 lg p' + 2[p≠p'])α + (2(p'-1)/p' + 2[p≠p'])nβ + ((p'-1)/p' + [p≠p'])nγ.
  Otherwise recursive doubling: exchange the whole vector with rank XOR 2^k and reduce;
  lg p' + 2[p≠p'] steps; (lg p' + 2[p≠p'])α + (lg p' + 2[p≠p'])nβ + (lg p' + [p≠p'])nγ.
  Both fold non-powers of two. Every rank ends with bitwise the same result (each chunk is
  reduced at one place, or both partners combine the same two operands).
allgather: recursive doubling (rank XOR 2^k, the held range doubles) when p is a power of two;
  otherwise dissemination distances: in round k receive from rank+2^k the min(2^k, p-2^k) blocks
  it holds (Bruck's allgather, blocks kept at their final places so no rotation is needed).
  ⌈lg p⌉ steps; ⌈lg p⌉α + (p-1)nβ.
reduce_scatter: recursive halving over the p' participants' block ranges (a surviving even rank
  carries its odd partner's block too); fold: the odd rank reduces its whole input into its
  partner first and receives its reduced block at the end.
  lg p' + 2[p≠p'] steps; (lg p' + 2[p≠p'])α + ((p'-1)/p' + [p≠p'])pnβ + n[p≠p']β
  + ((p'-1)/p' + [p≠p'])pnγ.
gather: binomial by blocks (relative to the root): in round k a rank whose relative rank has
  lowest set bit 2^k sends the blocks of its subtree to rank - 2^k. Blocks are kept at their
  final places in ``out`` (non-roots use it as scratch). ⌈lg p⌉ steps; ⌈lg p⌉α + (p-1)nβ.
scatter: the reverse binomial tree by blocks; an inner rank keeps its subtree's blocks in ``tmp``.
  ⌈lg p⌉ steps; ⌈lg p⌉α + (p-1)nβ.
alltoall: pairwise exchange, one partner per step, sending and receiving with it at once:
  partner = rank XOR k, k = 1..p-1 when p is a power of two; otherwise partner = (k - rank) mod p
  for k = 0..p-1, skipping the one k where that is the rank itself (each k pairs ranks as a
  matching, so all ranks walk the same global order). p-1 steps per rank (p rounds when p is not
  a power of two); (p-1)α + (p-1)nβ.
barrier: dissemination — in round k send a zero-count message to rank + 2^k and receive one from
  rank - 2^k. ⌈lg p⌉ steps; ⌈lg p⌉α.

Uneven blocks (``build_v``; c_j elements for rank j, T their sum, c the largest; any p, any root,
blocks of 0 travel as zero-length messages) and prefixes. A step lasts as long as the largest
message of its round: m_k below; Σ_k m_k is ((p-1)/p)T for equal blocks and up to (rounds)·c
when one block dominates, since recursive doubling / halving moves a block in every round.
allgatherv: allgather's recursive doubling (p a power of two) or dissemination distances over the
  blocks of ``counts``, each kept at its place in ``out``; a message is a run of consecutive
  ranks' blocks (two runs where it wraps past p). ⌈lg p⌉ steps; ⌈lg p⌉α + Σ_k m_k β; rank r
  receives T - c_r elements in all.
reduce_scatterv: reduce_scatter's fold and recursive halving, the halves split at participants'
  block boundaries (a surviving even rank carries its odd partner's block). lg p' + 2[p≠p']
  steps; (lg p' + 2[p≠p'])α + Σ_k m_k(β + γ) + [p≠p'](T + c_r)β + [p≠p']Tγ.
gatherv: gather's binomial tree by blocks relative to the root, a subtree's blocks a run of
  consecutive real blocks (two where they wrap past p). ⌈lg p⌉ steps; ⌈lg p⌉α + (T - c_root)β
  at the root.
scatterv: scatter's reverse binomial tree by blocks; an inner rank keeps its subtree's blocks
  (relative order) in ``tmp``. ⌈lg p⌉ steps; ⌈lg p⌉α + (T - c_root)β at the root.
alltoallv: alltoall's pairwise exchange (the same partners) sending C[r][q] and receiving
  C[q][r]. p-1 steps (p rounds when p is not a power of two);
  (p-1)α + Σ_q max(C[r][q], C[q][r])β at rank r.
scan: recursive doubling (Hillis-Steele): in round k (d = 2^k < p) rank r sends its running
  total, the reduction of in_{r-d+1..r} (clipped at 0), to r+d and receives r-d's, which it
  reduces into its own; that total is the prefix itself (``out``). A received total lands in
  ``tmp`` (the same step sends ``out``) and is reduced at the start of the next step; the first
  one is reduced into ``out`` on arrival. ⌈lg p⌉ steps; ⌈lg p⌉(α + nβ + nγ).
exscan: the same rounds, the prefix (``out``, in_0..in_{r-1}) and the running total (prefix op
  in_r, in ``tmp``) kept apart: the first message is the prefix, each later one is reduced into
  both (into the total only while it is still to be sent); rank 0 sends its input.
  ⌈lg p⌉ steps; ⌈lg p⌉(α + nβ) + (2⌈lg p⌉ - 1)nγ at most.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

from ..schedule import (
    IN,
    OUT,
    TMP,
    Copy,
    Op,
    Recv,
    Reduce,
    Schedule,
    ScheduleBuilder,
    Send,
    chunk_bounds,
)

ALGORITHM = "rhd"

# Below this many elements allreduce is latency-bound: exchanging the whole vector in lg p' steps
# beats Rabenseifner's 2 lg p' steps (MPICH switches at 2 KiB; elements here, dtype-agnostic).
ALLREDUCE_SMALL_COUNT = 1024


def build(collective: str, rank: int, size: int, count: int, root: int, topology) -> Schedule:
    b = ScheduleBuilder(collective, ALGORITHM, rank, size, count, root)
    if size == 1:
        # Every buffer is n elements at p = 1 (barrier: 0); nothing to communicate.
        if collective != "barrier":
            b.step(Copy(IN, 0, OUT, 0, count))
        return b.build()
    _BUILDERS[collective](b)
    return b.build()


# ----------------------------------------------------------------------------------- helpers

def _ceil_lg(p: int) -> int:
    return (p - 1).bit_length()


def _pow2_floor(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _is_pow2(p: int) -> bool:
    return p & (p - 1) == 0


def _lowbit(x: int) -> int:
    return x & -x


def _prefix(bounds: Sequence[Tuple[int, int]], total: int) -> List[int]:
    """Start offsets of consecutive blocks, plus the end: block i is [s[i], s[i+1])."""
    return [off for off, _ in bounds] + [total]


def _wrapped(lo: int, cnt: int, p: int) -> List[Tuple[int, int]]:
    """Blocks lo, lo+1, ..., lo+cnt-1 (mod p) as at most two non-wrapping ranges [a, b)."""
    end = lo + cnt
    return [(lo, end)] if end <= p else [(lo, p), (0, end - p)]


class _Fold:
    """The MPICH fold of virtual ranks 0..p-1 onto p' participants (see the module docstring)."""

    def __init__(self, vrank: int, p: int):
        self.p2 = _pow2_floor(p)
        self.rem = p - self.p2
        self.folded = vrank < 2 * self.rem          # one of a folding pair
        self.extra = self.folded and vrank % 2 == 1  # the pair's odd rank: sits out
        self.part = vrank // 2 if self.folded else vrank - self.rem   # participant index

    def vrank(self, part: int) -> int:
        return 2 * part if part < self.rem else part + self.rem


def _halving(b: ScheduleBuilder, f: _Fold, peer_of: Callable[[int], int], starts: List[int],
             acc: str, base: int, from_in: bool) -> None:
    """Recursive-halving reduce-scatter among the p' participants.

    Participant i ends owning acc[base+starts[i] : base+starts[i+1]] reduced over every
    participant. ``acc`` is laid out like ``in`` shifted by ``base``; while ``from_in`` (nothing
    received yet) the half given away is sent straight from ``in`` and only the kept half is
    copied, saving a full copy of the input.
    """
    me, lo, hi, d = f.part, 0, f.p2, f.p2 // 2
    while d:
        peer = peer_of(me ^ d)
        mid = lo + d
        keep, give = ((mid, hi), (lo, mid)) if me & d else ((lo, mid), (mid, hi))
        ko, kn = starts[keep[0]], starts[keep[1]] - starts[keep[0]]
        go, gn = starts[give[0]], starts[give[1]] - starts[give[0]]
        ops: List[Op] = []
        if from_in:
            ops.append(Copy(IN, ko, acc, base + ko, kn))
            ops.append(Send(peer, IN, go, gn))
        else:
            ops.append(Send(peer, acc, base + go, gn))
        ops.append(Recv(peer, acc, base + ko, kn, True))
        b.step(*ops)
        from_in = False
        lo, hi = keep
        d >>= 1


def _allgather(b: ScheduleBuilder, me: int, p: int, peer_of: Callable[[int], int],
               starts: List[int], lead: List[Op]) -> None:
    """Allgather of blocks 0..p-1 of ``out`` (block i = out[starts[i]:starts[i+1]]) among
    participants 0..p-1, participant i holding block i on entry."""
    def msgs(kind, peer, lo, cnt):
        return [kind(peer, OUT, starts[a], starts[e] - starts[a]) for a, e in _wrapped(lo, cnt, p)]

    d = 1
    if _is_pow2(p):
        while d < p:
            mine = me & ~(d - 1)
            peer = peer_of(me ^ d)
            b.step(*lead, *msgs(Send, peer, mine, d), *msgs(Recv, peer, mine ^ d, d))
            lead, d = [], d * 2
    else:
        while d < p:
            cnt = min(d, p - d)
            b.step(*lead, *msgs(Send, peer_of((me - d) % p), me, cnt),
                   *msgs(Recv, peer_of((me + d) % p), (me + d) % p, cnt))
            lead, d = [], d * 2


# ------------------------------------------------------------------------------- collectives

def _broadcast(b: ScheduleBuilder) -> None:
    p, n, root = b.size, b.count, b.root
    f = _Fold((b.rank - root) % p, p)
    real = lambda part: (f.vrank(part) + root) % p
    if f.extra:
        b.step(Recv((b.rank - 1) % p, OUT, 0, n))
        return
    starts = _prefix(chunk_bounds(n, f.p2), n)
    # Binomial scatter: chunk i ends on participant i; a participant receives its subtree's
    # chunks [me, me + lowbit(me)) from its parent, then hands halves of them to its children.
    me = f.part
    if me == 0:
        lead: List[Op] = [Copy(IN, 0, OUT, 0, n)]
        d = f.p2 // 2
    else:
        d = _lowbit(me)
        b.step(Recv(real(me - d), OUT, starts[me], starts[me + d] - starts[me]))
        lead, d = [], d // 2
    while d:
        b.step(*lead, Send(real(me + d), OUT, starts[me + d], starts[me + 2 * d] - starts[me + d]))
        lead, d = [], d // 2
    _allgather(b, me, f.p2, real, starts, lead)
    if f.folded:
        b.step(Send((b.rank + 1) % p, OUT, 0, n))


def _reduce(b: ScheduleBuilder) -> None:
    p, n, root = b.size, b.count, b.root
    f = _Fold((b.rank - root) % p, p)
    real = lambda part: (f.vrank(part) + root) % p
    if f.extra:
        b.step(Send((b.rank - 1) % p, IN, 0, n))
        return
    from_in = True
    if f.folded:
        b.step(Copy(IN, 0, OUT, 0, n), Recv((b.rank + 1) % p, OUT, 0, n, True))
        from_in = False
    starts = _prefix(chunk_bounds(n, f.p2), n)
    _halving(b, f, real, starts, OUT, 0, from_in)
    # Binomial gather of the reduced chunks to participant 0 (the root): at distance d a
    # participant holds chunks [me, me + d) and either sends them down or receives the next d.
    me, d = f.part, 1
    while d < f.p2:
        if me & d:
            b.step(Send(real(me - d), OUT, starts[me], starts[me + d] - starts[me]))
            return
        b.step(Recv(real(me + d), OUT, starts[me + d], starts[me + 2 * d] - starts[me + d]))
        d *= 2


def _allreduce(b: ScheduleBuilder) -> None:
    p, n, rank = b.size, b.count, b.rank
    f = _Fold(rank, p)
    if f.extra:
        b.step(Send(rank - 1, IN, 0, n))
        b.step(Recv(rank - 1, OUT, 0, n))
        return
    lead: List[Op] = []
    from_in = True
    if f.folded:
        b.step(Copy(IN, 0, OUT, 0, n), Recv(rank + 1, OUT, 0, n, True))
        from_in = False
    if n < ALLREDUCE_SMALL_COUNT or n < f.p2:
        # Recursive doubling. The first exchange sends `in` itself, so the partner's vector is
        # reduced straight into `out` (a copy of `in`) as it arrives; later ones send the
        # running `out`, so the partner's vector lands in tmp (a Recv may not write what the
        # same step's Send reads) and is reduced at the start of the next step.
        d = 1
        if from_in and f.p2 > 1:
            peer = f.vrank(f.part ^ 1)
            b.step(Copy(IN, 0, OUT, 0, n), Send(peer, IN, 0, n), Recv(peer, OUT, 0, n, True))
            d = 2
        elif from_in:
            lead.append(Copy(IN, 0, OUT, 0, n))
        tmp = b.alloc_tmp(n) if d < f.p2 else 0
        while d < f.p2:
            peer = f.vrank(f.part ^ d)
            b.step(*lead, Send(peer, OUT, 0, n), Recv(peer, TMP, tmp, n))
            lead = [Reduce(TMP, tmp, OUT, 0, n)]
            d *= 2
    else:
        starts = _prefix(chunk_bounds(n, f.p2), n)
        _halving(b, f, f.vrank, starts, OUT, 0, from_in)
        _allgather(b, f.part, f.p2, f.vrank, starts, [])
    if f.folded:
        b.step(*lead, Send(rank + 1, OUT, 0, n))
    elif lead:
        b.step(*lead)


def _allgather_coll(b: ScheduleBuilder) -> None:
    p, n, rank = b.size, b.count, b.rank
    starts = [i * n for i in range(p + 1)]
    _allgather(b, rank, p, lambda i: i, starts, [Copy(IN, 0, OUT, rank * n, n)])


def _reduce_scatter(b: ScheduleBuilder) -> None:
    p, n, rank = b.size, b.count, b.rank
    f = _Fold(rank, p)
    if f.extra:
        b.step(Send(rank - 1, IN, 0, p * n))
        b.step(Recv(rank - 1, OUT, 0, n))
        return
    acc = b.alloc_tmp(p * n)
    from_in = True
    if f.folded:
        b.step(Copy(IN, 0, TMP, acc, p * n), Recv(rank + 1, TMP, acc, p * n, True))
        from_in = False
    # Participant i owns the blocks of the ranks it stands for: [vrank(i), vrank(i+1)).
    starts = [f.vrank(i) * n for i in range(f.p2)] + [p * n]
    _halving(b, f, f.vrank, starts, TMP, acc, from_in)
    mine = Copy(TMP, acc + rank * n, OUT, 0, n)
    if f.folded:
        b.step(mine, Send(rank + 1, TMP, acc + (rank + 1) * n, n))
    else:
        b.step(mine)


def _gather(b: ScheduleBuilder) -> None:
    p, n, root = b.size, b.count, b.root
    vr = (b.rank - root) % p
    real = lambda v: (v + root) % p
    starts = [i * n for i in range(p + 1)]

    def msgs(kind, peer, lo, cnt):   # relative blocks [lo, lo+cnt), placed at their real blocks
        return [kind(peer, OUT, starts[a], starts[e] - starts[a])
                for a, e in _wrapped(real(lo), cnt, p)]

    subtree = min(_lowbit(vr), p - vr) if vr else p
    if subtree == 1:   # a leaf sends its own block straight from ``in``
        b.step(Send(real(vr - _lowbit(vr)), IN, 0, n))
        return
    lead: List[Op] = [Copy(IN, 0, OUT, b.rank * n, n)]
    d = 1
    while d < p:
        if vr & d:
            b.step(*msgs(Send, real(vr - d), vr, min(d, p - vr)))
            return
        if vr + d < p:
            b.step(*lead, *msgs(Recv, real(vr + d), vr + d, min(d, p - vr - d)))
            lead = []
        d *= 2


def _scatter(b: ScheduleBuilder) -> None:
    p, n, root = b.size, b.count, b.root
    vr = (b.rank - root) % p
    real = lambda v: (v + root) % p

    if vr == 0:
        # The root sends straight from ``in`` (real block order).
        def place(rel):
            return IN, real(rel) * n
        lead: List[Op] = [Copy(IN, root * n, OUT, 0, n)]
        d = 1 << (_ceil_lg(p) - 1)
    else:
        parent = real(vr - _lowbit(vr))
        subtree = min(_lowbit(vr), p - vr)
        if subtree == 1:
            b.step(Recv(parent, OUT, 0, n))
            return
        # An inner rank keeps its subtree's blocks in relative order in tmp.
        tmp = b.alloc_tmp(subtree * n)

        def place(rel):
            return TMP, tmp + (rel - vr) * n
        b.step(*_scatter_msgs(Recv, parent, vr, subtree, p, root, n, place))
        lead = [Copy(TMP, tmp, OUT, 0, n)]
        d = _lowbit(vr) // 2
    while d:
        if vr + d < p:
            b.step(*lead, *_scatter_msgs(Send, real(vr + d), vr + d, min(d, p - vr - d),
                                         p, root, n, place))
            lead = []
        d //= 2


def _scatter_msgs(kind, peer, lo, cnt, p, root, n, place):
    """Messages for relative blocks [lo, lo+cnt), split where their real blocks wrap past p so
    that the root (real order) and the receiver (relative order) cut the same pieces."""
    ops = []
    for a, e in _wrapped((lo + root) % p, cnt, p):
        buf, off = place((a - root) % p)
        ops.append(kind(peer, buf, off, (e - a) * n))
    return ops


def _alltoall(b: ScheduleBuilder) -> None:
    p, n, rank = b.size, b.count, b.rank
    lead: List[Op] = [Copy(IN, rank * n, OUT, rank * n, n)]
    if _is_pow2(p):
        partners = [rank ^ k for k in range(1, p)]
    else:
        partners = [q for q in ((k - rank) % p for k in range(p)) if q != rank]
    for q in partners:
        b.step(*lead, Send(q, IN, q * n, n), Recv(q, OUT, q * n, n))
        lead = []


def _barrier(b: ScheduleBuilder) -> None:
    p, rank, d = b.size, b.rank, 1
    while d < p:
        b.step(Send((rank + d) % p, OUT, 0, 0), Recv((rank - d) % p, OUT, 0, 0))
        d *= 2


_BUILDERS = {
    "broadcast": _broadcast, "reduce": _reduce, "allreduce": _allreduce,
    "allgather": _allgather_coll, "reduce_scatter": _reduce_scatter, "gather": _gather,
    "scatter": _scatter, "alltoall": _alltoall, "barrier": _barrier,
}


# ------------------------------------------------------------------ uneven blocks and prefixes

def build_v(collective: str, rank: int, size: int, count: int, root: int, topology,
            counts: Tuple[int, ...]) -> Schedule:
    """The uneven collectives and the prefix reductions (module doc)."""
    b = ScheduleBuilder(collective, ALGORITHM, rank, size, count, root, counts)
    if size == 1:
        # in and out are the whole call (T, or n); exscan's rank 0 result is undefined.
        if collective != "exscan":
            b.step(Copy(IN, 0, OUT, 0, count))
        return b.build()
    _V_BUILDERS[collective](b, tuple(counts))
    return b.build()


def _starts_v(counts: Sequence[int]) -> List[int]:
    """Start offsets of the blocks of ``counts`` in rank order, plus the end (T)."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return starts


def _allgatherv(b: ScheduleBuilder, counts: Tuple[int, ...]) -> None:
    rank, p = b.rank, b.size
    starts = _starts_v(counts)
    _allgather(b, rank, p, lambda i: i, starts, [Copy(IN, 0, OUT, starts[rank], counts[rank])])


def _reduce_scatterv(b: ScheduleBuilder, counts: Tuple[int, ...]) -> None:
    p, rank, total = b.size, b.rank, b.count
    starts = _starts_v(counts)
    f = _Fold(rank, p)
    if f.extra:
        b.step(Send(rank - 1, IN, 0, total))
        b.step(Recv(rank - 1, OUT, 0, counts[rank]))
        return
    acc = b.alloc_tmp(total)
    from_in = True
    if f.folded:
        b.step(Copy(IN, 0, TMP, acc, total), Recv(rank + 1, TMP, acc, total, True))
        from_in = False
    # Participant i owns the blocks of the ranks it stands for: [vrank(i), vrank(i+1)).
    owned = [starts[f.vrank(i)] for i in range(f.p2)] + [total]
    _halving(b, f, f.vrank, owned, TMP, acc, from_in)
    mine = Copy(TMP, acc + starts[rank], OUT, 0, counts[rank])
    if f.folded:
        b.step(mine, Send(rank + 1, TMP, acc + starts[rank + 1], counts[rank + 1]))
    else:
        b.step(mine)


def _gatherv(b: ScheduleBuilder, counts: Tuple[int, ...]) -> None:
    p, root, rank = b.size, b.root, b.rank
    vr = (rank - root) % p
    real = lambda v: (v + root) % p
    starts = _starts_v(counts)

    def msgs(kind, peer, lo, cnt):   # relative blocks [lo, lo+cnt), placed at their real blocks
        return [kind(peer, OUT, starts[a], starts[e] - starts[a])
                for a, e in _wrapped(real(lo), cnt, p)]

    subtree = min(_lowbit(vr), p - vr) if vr else p
    if subtree == 1:   # a leaf sends its own block straight from ``in``
        b.step(Send(real(vr - _lowbit(vr)), IN, 0, counts[rank]))
        return
    lead: List[Op] = [Copy(IN, 0, OUT, starts[rank], counts[rank])]
    d = 1
    while d < p:
        if vr & d:
            b.step(*lead, *msgs(Send, real(vr - d), vr, min(d, p - vr)))
            return
        if vr + d < p:
            b.step(*lead, *msgs(Recv, real(vr + d), vr + d, min(d, p - vr - d)))
            lead = []
        d *= 2


def _scatterv(b: ScheduleBuilder, counts: Tuple[int, ...]) -> None:
    p, root, rank = b.size, b.root, b.rank
    vr = (rank - root) % p
    real = lambda v: (v + root) % p
    starts = _starts_v(counts)

    if vr == 0:
        # The root sends straight from ``in`` (real block order).
        def place(rel):
            return IN, starts[real(rel)]
        lead: List[Op] = [Copy(IN, starts[root], OUT, 0, counts[root])]
        d = 1 << (_ceil_lg(p) - 1)
    else:
        parent = real(vr - _lowbit(vr))
        subtree = min(_lowbit(vr), p - vr)
        if subtree == 1:
            b.step(Recv(parent, OUT, 0, counts[rank]))
            return
        # An inner rank keeps its subtree's blocks in relative order in tmp.
        rel_starts = [0]
        for v in range(vr, vr + subtree):
            rel_starts.append(rel_starts[-1] + counts[real(v)])
        tmp = b.alloc_tmp(rel_starts[-1])

        def place(rel):
            return TMP, tmp + rel_starts[rel - vr]
        b.step(*_scatterv_msgs(Recv, parent, vr, subtree, p, root, starts, place))
        lead = [Copy(TMP, tmp, OUT, 0, counts[rank])]
        d = _lowbit(vr) // 2
    while d:
        if vr + d < p:
            b.step(*lead, *_scatterv_msgs(Send, real(vr + d), vr + d, min(d, p - vr - d),
                                          p, root, starts, place))
            lead = []
        d //= 2


def _scatterv_msgs(kind, peer, lo, cnt, p, root, starts, place):
    """``_scatter_msgs`` with uneven blocks: relative blocks [lo, lo+cnt), split where their real
    blocks wrap past p; a piece is as long as the real blocks it covers."""
    ops = []
    for a, e in _wrapped((lo + root) % p, cnt, p):
        buf, off = place((a - root) % p)
        ops.append(kind(peer, buf, off, starts[e] - starts[a]))
    return ops


def _alltoallv(b: ScheduleBuilder, counts: Tuple[int, ...]) -> None:
    p, rank = b.size, b.rank
    rows = [counts[i * p:(i + 1) * p] for i in range(p)]
    sent = _starts_v(rows[rank])                          # in: blocks by destination
    got = _starts_v([rows[i][rank] for i in range(p)])    # out: blocks by source
    lead: List[Op] = [Copy(IN, sent[rank], OUT, got[rank], rows[rank][rank])]
    if _is_pow2(p):
        partners = [rank ^ k for k in range(1, p)]
    else:
        partners = [q for q in ((k - rank) % p for k in range(p)) if q != rank]
    for q in partners:
        b.step(*lead, Send(q, IN, sent[q], rows[rank][q]), Recv(q, OUT, got[q], rows[q][rank]))
        lead = []


def _prefix_doubling(b: ScheduleBuilder, inclusive: bool) -> None:
    """scan / exscan by recursive doubling (Hillis-Steele; module doc). In round k (d = 2^k)
    rank r sends its running total x (in_{r-2d+1..r} after the round, clipped at 0) to r+d and
    receives r-d's into tmp; what it received is reduced into x and into the prefix at the start
    of its next step. scan: x is the prefix itself, in ``out``. exscan: the prefix (``out``,
    in_{..r-1}) and x = prefix op in_r (``tmp``) are kept apart."""
    p, r, n = b.size, b.rank, b.count
    got = b.alloc_tmp(n) if r >= 2 else 0   # a message of round >= 1 (ranks 2.. receive one)
    x: Tuple[str, int] = (IN, 0)            # where the running total lies
    lead: List[Op] = [Copy(IN, 0, OUT, 0, n)] if inclusive else []
    d = 1
    while d < p:
        ops: List[Op] = list(lead)
        lead = []
        sends = r + d < p
        if sends:
            ops.append(Send(r + d, x[0], x[1], n))
        if r >= d:
            if d == 1:
                # The first message lands in out at once (no Send of this step reads out).
                ops.append(Recv(r - 1, OUT, 0, n, inclusive))
                if inclusive:
                    x = (OUT, 0)
            else:
                ops.append(Recv(r - d, TMP, got, n))
                lead.append(Reduce(TMP, got, OUT, 0, n))
                if not inclusive and r + 2 * d < p:   # x is sent again
                    lead.append(Reduce(TMP, got, TMP, x[1], n))
        b.step(*ops)
        if not inclusive and d == 1 and r >= 1 and r + 2 < p:
            # x = in_{r-1} op in_r, formed before the next Send reads it
            xo = b.alloc_tmp(n)
            lead += [Copy(IN, 0, TMP, xo, n), Reduce(OUT, 0, TMP, xo, n)]
            x = (TMP, xo)
        d *= 2
    if lead:
        b.step(*lead)


def _scan(b: ScheduleBuilder, counts: Tuple[int, ...]) -> None:
    _prefix_doubling(b, True)


def _exscan(b: ScheduleBuilder, counts: Tuple[int, ...]) -> None:
    _prefix_doubling(b, False)


_V_BUILDERS = {"allgatherv": _allgatherv, "gatherv": _gatherv, "scatterv": _scatterv,
               "reduce_scatterv": _reduce_scatterv, "alltoallv": _alltoallv, "scan": _scan,
               "exscan": _exscan}
