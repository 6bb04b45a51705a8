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
    Schedule,
    ScheduleBuilder,
    Send,
    chunk_bounds,
    concurrent,
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
