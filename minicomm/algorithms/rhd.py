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
