"""Ring family: every message goes to the right neighbour (rank+1) and comes from the left one.

Costs in the MPICH style: p ranks, α latency per message, β time per element, γ time per element
reduced. n is the whole vector for broadcast / reduce / allreduce and the per-rank block
(``count``) for the other collectives. Any p >= 1, any root, any count >= 0: chunks are split by
``chunk_bounds`` (sizes differ by at most one, some empty when count < p) and empty chunks still
travel as zero-length messages, so one code path serves every count.

broadcast: pipelined chain root -> root+1 -> ... -> root-1. The vector is cut into
  S = max(1, ceil(n / SEGMENT)) segments; a middle rank forwards segment k while receiving k+1.
  p+S-2 rounds (each rank takes at most S+1 steps); (p+S-2)(α + (n/S)β), i.e. about
  (p-1)α + nβ for large n.
reduce: ring reduce-scatter (rank r ends with chunk r reduced), then the chunks are passed along
  the chain root+1 -> ... -> root-1 -> root (gather). 2(p-1) steps;
  2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ.
allreduce: ring reduce-scatter then ring allgather of the reduced chunks. 2(p-1) steps;
  2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ.
allgather: ring; at step s rank r forwards block r-s. p-1 steps; (p-1)α + (p-1)nβ.
reduce_scatter: ring with the chunk rotation chosen so rank r finishes with block r; partial sums
  are received straight onto a copy of the local block (reduce on arrival) in two alternating
  scratch blocks. p-1 steps; (p-1)α + (p-1)nβ + (p-1)nγ.
gather: pass-along toward the root: each rank sends its own block, then forwards what it receives
  from the left. p-1 steps; (p-1)α + (p-1)nβ.
scatter: the reverse: the root sends the block of the farthest rank first, each rank forwards
  what is not its own through two alternating scratch blocks. p-1 steps; (p-1)α + (p-1)nβ.
alltoall: pairwise shifts: at step k = 1..p-1 rank r sends block r+k to rank r+k and receives
  block r-k from rank r-k. p-1 steps; (p-1)α + (p-1)nβ.
barrier: a zero-length token goes from rank 0 round the ring back to rank 0 (then everyone has
  entered), and round again to release rank 1..p-2 (rank p-1 already learnt it on the first
  round). 2p-2 rounds, at most 4 steps per rank; (2p-2)α.

Uneven blocks (``build_v``; c_j elements for rank j, T their sum, c the largest) and prefixes:
allgatherv, gatherv, scatterv, reduce_scatterv: the rings and chains above over blocks of
  c_j; every step is as long as its longest message: (p-1)α + (p-1)cβ (reduce_scatterv + (p-1)cγ).
alltoallv: the pairwise shifts with C[r][r+k] sent and C[r-k][r] received at step k;
  (p-1)α + Σ_k max(C[r][r+k], C[r-k][r])β at rank r.
scan: a pipelined chain 0 -> 1 -> ... -> p-1 in S segments (as broadcast): rank r receives
  in_0..in_{r-1}'s prefix, reduces its own into it and forwards it. (p+S-2)(α + (n/S)(β+γ)).
exscan: the same chain; rank r keeps what it receives (the exclusive prefix) in ``out`` and
  forwards it reduced with its own through ``tmp``; rank 0 sends its input. Same cost.

Channels (``channels`` = k > 1; allreduce, allgather and reduce_scatter, whose every step sends
and receives one chunk on both sides): NCCL's multi-ring. The data is split into k parts (each
block's elements, for the blocked collectives), part c runs the 1-channel ring above over its
own ring order (``channel_orders``), and step s of the call is step s of every channel, so the
k rings move at once. A channel's order visits each node's ranks cyclically from a different
entry point, so it leaves node i from the local rank it enters node i+1 at: the node boundary
is crossed rail-aligned, on a different NIC per channel. Same steps as one ring; each message
n/k: 2(p-1)α + 2((p-1)/p)nβ for allreduce when the k rings use disjoint inter-node links (β is
then the per-node NIC total's), k messages per step per rank. The other collectives ignore k.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from ..schedule import (
    IN,
    OUT,
    TMP,
    Copy,
    Recv,
    Reduce,
    Schedule,
    ScheduleBuilder,
    Send,
    blocks_of,
    chunk_bounds,
    concurrent,
    matrix_of,
    servers,
)

# Broadcast segment size in elements: large enough to amortise α, small enough to pipeline.
SEGMENT = 32768

Region = Tuple[str, int]   # (buffer, offset)


CHANNELLED = frozenset({"allreduce", "allgather", "reduce_scatter"})


def build(collective: str, rank: int, size: int, count: int, root: int, topology,
          channels: int = 1) -> Schedule:
    b = ScheduleBuilder(collective, "ring", rank, size, count, root)
    k = used_channels(collective, size, count, channels)
    if k == 1:
        _BUILDERS[collective](b, rank, size, count, root)
    else:
        _channelled(b, collective, rank, size, count, channel_orders(tuple(topology), k))
    return b.build()


def used_channels(collective: str, size: int, count: int, channels: int) -> int:
    """The channels a call runs on: ``channels`` where the collective takes them (module doc),
    but no more than leave every channel an element per rank (as NCCL runs small calls on fewer
    channels), else 1."""
    if not isinstance(channels, int) or isinstance(channels, bool) or channels < 1:
        raise ValueError(f"channels must be an integer >= 1, got {channels!r}")
    if collective not in CHANNELLED or size == 1:
        return 1
    return max(1, min(channels, count // size))


def channel_orders(topology: Tuple[int, ...], channels: int) -> List[List[int]]:
    """Each channel's ring order (ranks): nodes in order of their lowest rank, and inside node i
    (ranks in rank order, L of them) channel c enters at local index (c*L//k - i) mod L and
    goes up cyclically, leaving from the local index the next node is entered at."""
    nodes = servers(topology)
    orders = []
    for c in range(channels):
        order = []
        for i, ranks in enumerate(nodes):
            L = len(ranks)
            entry = (c * L // channels - i) % L
            order += [ranks[(entry + t) % L] for t in range(L)]
        orders.append(order)
    return orders


def _channelled(b: ScheduleBuilder, collective: str, rank: int, p: int, n: int,
                orders: List[List[int]]) -> None:
    """Channel c runs the 1-channel ring on part c of every block over ``orders[c]``; the
    call's step s is every channel's step s, in channel order (module doc)."""
    placed = []
    for c, (lo, part) in enumerate(chunk_bounds(n, len(orders))):
        order = orders[c]
        sub = ScheduleBuilder(collective, "ring", order.index(rank), p, part, 0)
        _BUILDERS[collective](sub, sub.rank, p, part, 0)
        tmp = b.alloc_tmp(sub.tmp_count)
        placed += [(s, tuple(_to_channel(o, order, n, part, lo, tmp, collective) for o in st))
                   for s, st in enumerate(sub.steps)]
    b.extend(concurrent(placed))


def _to_channel(op, order: List[int], n: int, part: int, lo: int, tmp: int, collective: str):
    """One op of a channel's ring, in the call's ranks and buffers: a region of a blocked
    buffer (in of reduce_scatter, out of allgather) lies in one block of ``part`` elements, the
    block of the rank at that place of the channel's order, elements lo.. of the call's block;
    tmp is the channel's own region."""
    blocked = {"allgather": OUT, "reduce_scatter": IN}.get(collective)

    def where(buf: str, off: int, count: int) -> Tuple[str, int]:
        if buf == TMP:
            return buf, tmp + off
        if buf != blocked:
            return buf, lo + off
        if count == 0:                # carries only ordering: any place in the buffer
            return buf, 0
        block = off // part
        if (off + count - 1) // part != block:
            raise AssertionError(f"a channel region crosses a block: {op!r}")
        return buf, order[block] * n + lo + off - block * part     # block j is rank order[j]'s

    if isinstance(op, (Send, Recv)):
        buf, off = where(op.buf, op.offset, op.count)
        if isinstance(op, Send):
            return Send(order[op.peer], buf, off, op.count)
        return Recv(order[op.peer], buf, off, op.count, op.reduce)
    sb, so = where(op.src, op.src_offset, op.count)
    db, do = where(op.dst, op.dst_offset, op.count)
    return type(op)(sb, so, db, do, op.count)


def _reduce_scatter_ring(b: ScheduleBuilder, rank: int, p: int, length: Callable[[int], int],
                         in_off: Callable[[int], int], acc: Callable[[int, int], Region]) -> None:
    """Ring reduce-scatter over p chunks: rank r ends with chunk r fully reduced.

    Chunk c starts at rank c+1 and moves right, so at step s rank r receives chunk r-2-s and
    forwards the chunk it received the step before (its own raw chunk r-1 at step 0).
    ``acc(c, s)`` is where the chunk received at step s accumulates: the local contribution is
    copied there first so the partial sum is reduced straight on arrival.
    """
    right, left = (rank + 1) % p, (rank - 1) % p
    sent: Region = (IN, in_off((rank - 1) % p))
    for s in range(p - 1):
        out_chunk, in_chunk = (rank - 1 - s) % p, (rank - 2 - s) % p
        buf, off = acc(in_chunk, s)
        n = length(in_chunk)
        b.step(Copy(IN, in_off(in_chunk), buf, off, n),
               Send(right, sent[0], sent[1], length(out_chunk)),
               Recv(left, buf, off, n, True))
        sent = (buf, off)


def _allgather_ring(b: ScheduleBuilder, rank: int, p: int, blocks: List[Tuple[int, int]],
                    first: Tuple = ()) -> None:
    """Ring allgather in ``out``: rank r holds blocks[r]; at step s it forwards block r-s."""
    right, left = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):
        so, sn = blocks[(rank - s) % p]
        ro, rn = blocks[(rank - s - 1) % p]
        b.step(*(first if s == 0 else ()), Send(right, OUT, so, sn), Recv(left, OUT, ro, rn))


def _gather_chain(b: ScheduleBuilder, rank: int, p: int, root: int,
                  blocks: List[Tuple[int, int]], own: Region) -> None:
    """Pass-along gather into ``out`` toward root along root+1 -> ... -> root-1 -> root.

    The rank at distance i after the root sends its own block (from ``own``) at step 0 and at
    step k forwards the block of distance i-k, received at step k-1; the root receives the block
    of distance p-1-k at step k. Every block lands at blocks[its rank] in ``out``.
    """
    right, left = (rank + 1) % p, (rank - 1) % p
    rel = (rank - root) % p
    if rel == 0:
        for k in range(p - 1):
            bo, bn = blocks[(root + p - 1 - k) % p]
            b.step(Recv(left, OUT, bo, bn))
        return
    for k in range(rel):
        src: Region = own if k == 0 else (OUT, blocks[(root + rel - k) % p][0])
        ops = [Send(right, src[0], src[1], blocks[(root + rel - k) % p][1])]
        if k <= rel - 2:
            ro, rn = blocks[(root + rel - 1 - k) % p]
            ops.append(Recv(left, OUT, ro, rn))
        b.step(*ops)


def _broadcast(b, rank, p, n, root):
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return
    right, left = (rank + 1) % p, (rank - 1) % p
    rel = (rank - root) % p
    segs = chunk_bounds(n, max(1, -(-n // SEGMENT)))
    if rel == 0:
        for k, (o, ln) in enumerate(segs):
            b.step(*((Copy(IN, 0, OUT, 0, n),) if k == 0 else ()), Send(right, IN, o, ln))
        return
    forwards = rel < p - 1
    # Step k receives segment k and forwards segment k-1: the chain pipelines segment by segment.
    for k in range(len(segs) + forwards):
        ops = []
        if forwards and k > 0:
            ops.append(Send(right, OUT, *segs[k - 1]))
        if k < len(segs):
            ops.append(Recv(left, OUT, *segs[k]))
        b.step(*ops)


def _vector_reduce_scatter(b, rank, p, n) -> List[Tuple[int, int]]:
    """Reduce-scatter phase of reduce/allreduce: partial sums accumulate in ``out`` in place."""
    ch = chunk_bounds(n, p)
    _reduce_scatter_ring(b, rank, p, lambda c: ch[c][1], lambda c: ch[c][0],
                         lambda c, s: (OUT, ch[c][0]))
    return ch


def _reduce(b, rank, p, n, root):
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return
    ch = _vector_reduce_scatter(b, rank, p, n)
    _gather_chain(b, rank, p, root, ch, (OUT, ch[rank][0]))


def _allreduce(b, rank, p, n, root):
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return
    ch = _vector_reduce_scatter(b, rank, p, n)
    _allgather_ring(b, rank, p, ch)


def _allgather(b, rank, p, n, root):
    blocks = [(j * n, n) for j in range(p)]
    own = (Copy(IN, 0, OUT, rank * n, n),)
    if p == 1:
        b.step(*own)
        return
    _allgather_ring(b, rank, p, blocks, own)


def _reduce_scatter(b, rank, p, n, root):
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return
    # Chunks received before the last are forwarded the next step: two scratch blocks alternate
    # so a step never receives into the block it sends from.
    slots = b.alloc_tmp(min(2, p - 2) * n)

    def acc(c, s):
        return (OUT, 0) if s == p - 2 else (TMP, slots + (s % 2) * n)

    _reduce_scatter_ring(b, rank, p, lambda c: n, lambda c: c * n, acc)


def _gather(b, rank, p, n, root):
    blocks = [(j * n, n) for j in range(p)]
    if (rank - root) % p == 0:
        b.step(Copy(IN, 0, OUT, root * n, n))
    if p > 1:
        _gather_chain(b, rank, p, root, blocks, (IN, 0))


def _scatter(b, rank, p, n, root):
    right, left = (rank + 1) % p, (rank - 1) % p
    rel = (rank - root) % p
    if rel == 0:
        b.step(Copy(IN, root * n, OUT, 0, n))
        for k in range(p - 1):   # farthest block first, so the chain pipelines
            b.step(Send(right, IN, (root + p - 1 - k) % p * n, n))
        return
    # Global step t: receive the block for distance p-2-t+rel (own block last, at t = p-2) and
    # forward the block received at t-1. Forwarded blocks alternate between two scratch blocks.
    forwarded = p - 1 - rel
    slots = b.alloc_tmp(min(2, forwarded) * n)
    for j in range(forwarded + 1):
        ops = []
        if j > 0:
            ops.append(Send(right, TMP, slots + (j - 1) % 2 * n, n))
        ops.append(Recv(left, TMP, slots + j % 2 * n, n) if j < forwarded else Recv(left, OUT, 0, n))
        b.step(*ops)


def _alltoall(b, rank, p, n, root):
    b.step(Copy(IN, rank * n, OUT, rank * n, n))
    for k in range(1, p):
        dst, src = (rank + k) % p, (rank - k) % p
        b.step(Send(dst, IN, dst * n, n), Recv(src, OUT, src * n, n))


def _barrier(b, rank, p, n, root):
    if p == 1:
        return
    right, left = (rank + 1) % p, (rank - 1) % p
    token_out, token_in = Send(right, OUT, 0, 0), Recv(left, OUT, 0, 0)
    if rank == 0:
        steps = [token_out, token_in, token_out] if p > 2 else [token_out, token_in]
    elif rank == p - 1:
        steps = [token_in, token_out]
    elif rank == p - 2:
        steps = [token_in, token_out, token_in]
    else:
        steps = [token_in, token_out, token_in, token_out]
    for op in steps:
        b.step(op)


_BUILDERS = {
    "broadcast": _broadcast, "reduce": _reduce, "allreduce": _allreduce,
    "allgather": _allgather, "reduce_scatter": _reduce_scatter, "gather": _gather,
    "scatter": _scatter, "alltoall": _alltoall, "barrier": _barrier,
}


# ------------------------------------------------------------------ uneven blocks and prefixes
def build_v(collective: str, rank: int, size: int, count: int, root: int, topology,
            counts: Tuple[int, ...]) -> Schedule:
    """The uneven collectives and the prefix reductions (module doc)."""
    b = ScheduleBuilder(collective, "ring", rank, size, count, root, counts)
    _V_BUILDERS[collective](b, rank, size, count, root, counts)
    return b.build()


def _allgatherv(b, rank, p, total, root, counts):
    blocks = blocks_of(counts)
    own = (Copy(IN, 0, OUT, blocks[rank][0], counts[rank]),)
    if p == 1:
        b.step(*own)
        return
    _allgather_ring(b, rank, p, blocks, own)


def _gatherv(b, rank, p, total, root, counts):
    blocks = blocks_of(counts)
    if rank == root:
        b.step(Copy(IN, 0, OUT, blocks[root][0], counts[root]))
    if p > 1:
        _gather_chain(b, rank, p, root, blocks, (IN, 0))


def _scatterv(b, rank, p, total, root, counts):
    blocks = blocks_of(counts)
    right, left = (rank + 1) % p, (rank - 1) % p
    rel = (rank - root) % p
    if rel == 0:
        b.step(Copy(IN, blocks[root][0], OUT, 0, counts[root]))
        for k in range(p - 1):   # farthest block first, so the chain pipelines
            b.step(Send(right, IN, *blocks[(root + p - 1 - k) % p]))
        return
    # message j is the block of distance p-1-j (own block last); forwarded ones alternate
    # between two scratch slots as long as the largest of them
    forwarded = p - 1 - rel
    size = [counts[(root + p - 1 - j) % p] for j in range(forwarded + 1)]
    width = max(size[:forwarded], default=0)
    slots = b.alloc_tmp(min(2, forwarded) * width)
    for j in range(forwarded + 1):
        ops = []
        if j > 0:
            ops.append(Send(right, TMP, slots + (j - 1) % 2 * width, size[j - 1]))
        ops.append(Recv(left, TMP, slots + j % 2 * width, size[j]) if j < forwarded
                   else Recv(left, OUT, 0, size[j]))
        b.step(*ops)


def _reduce_scatterv(b, rank, p, total, root, counts):
    blocks = blocks_of(counts)
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, counts[0]))
        return
    width = max(counts)
    slots = b.alloc_tmp(min(2, p - 2) * width)

    def acc(c, s):
        return (OUT, 0) if s == p - 2 else (TMP, slots + (s % 2) * width)

    _reduce_scatter_ring(b, rank, p, lambda c: counts[c], lambda c: blocks[c][0], acc)


def _alltoallv(b, rank, p, total, root, counts):
    rows = matrix_of(counts, p)
    sent = blocks_of(rows[rank])
    got = blocks_of([rows[i][rank] for i in range(p)])
    b.step(Copy(IN, sent[rank][0], OUT, got[rank][0], rows[rank][rank]))
    for k in range(1, p):
        dst, src = (rank + k) % p, (rank - k) % p
        b.step(Send(dst, IN, *sent[dst]), Recv(src, OUT, *got[src]))


def _prefix_chain(b, rank, p, n, inclusive: bool) -> None:
    """scan / exscan: the pipelined chain of the module doc."""
    segs = chunk_bounds(n, max(1, -(-n // SEGMENT)))
    if rank == 0:
        for k, (o, ln) in enumerate(segs):
            first = (Copy(IN, 0, OUT, 0, n),) if k == 0 and inclusive else ()
            if p > 1:
                b.step(*first, Send(1, IN, o, ln))
            else:
                b.step(*first)
        return
    last = rank == p - 1
    fwd = b.alloc_tmp(n) if not inclusive and not last else 0
    for k in range(len(segs) + 1):
        ops = []
        if k > 0:
            o, ln = segs[k - 1]
            if inclusive:       # out holds the prefix of 0..rank-1; add this rank's
                ops.append(Reduce(IN, o, OUT, o, ln))
                if not last:
                    ops.append(Send(rank + 1, OUT, o, ln))
            elif not last:      # out keeps the exclusive prefix; forward it with ours added
                ops += [Copy(OUT, o, TMP, fwd + o, ln), Reduce(IN, o, TMP, fwd + o, ln),
                        Send(rank + 1, TMP, fwd + o, ln)]
        if k < len(segs):
            ops.append(Recv(rank - 1, OUT, *segs[k]))
        b.step(*ops)


def _scan(b, rank, p, n, root, counts):
    _prefix_chain(b, rank, p, n, True)


def _exscan(b, rank, p, n, root, counts):
    _prefix_chain(b, rank, p, n, False)


_V_BUILDERS = {"allgatherv": _allgatherv, "gatherv": _gatherv, "scatterv": _scatterv,
               "reduce_scatterv": _reduce_scatterv, "alltoallv": _alltoallv, "scan": _scan,
               "exscan": _exscan}
