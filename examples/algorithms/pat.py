"""PAT (Parallel Aggregated Trees): NCCL's allgather and reduce_scatter at scale, written only
through minicomm's public API.

Source: NVIDIA, "Memory Efficiency, Faster Initialization, and Cost Estimation with NVIDIA
Collective Communications Library 2.23" (2024); S. Jeaugey, "PAT: a new algorithm for all-gather
and reduce-scatter operations at scale" (2025); NCCL's src/include/collectives.h
(``PatRSAlgorithm``, ``PatAGAlgorithm``) and src/device/prims_simple.h (``patReduce``,
``patCopy``).

Algorithm. P = 2^L is the power of two >= p. Rank y holds the data of rank (y + s) mod p "at
offset s" (allgather: the block of rank y + s; reduce_scatter: the partial sum for rank y + s).
Offsets form a binomial tree: offset s hangs below s - lowbit(s), and the hop from one to the
other goes along dimension d = lg lowbit(s), between ranks 2^d apart. That is Bruck's algorithm
with the dimensions reversed (reduce_scatter: near dimensions first, with the most data, far
ones last with the least; allgather the mirror), so the last steps never send much data far.
Offsets s >= p are skipped, so any p works. What bounds PAT is its buffer: one aggregated
message carries at most A chunks (a chunk: one block's share of the current column, w
elements), A the largest power of two <= P/2 with A * w <= BUFFER. With D = P/A, write
s = h*D + l (h < A, l < D); the offsets of one l form a group whose hop is one message along
dimension lg lowbit(l):

  reduce_scatter (``PatRSAlgorithm``): for l = min(D, p)-1 down to 1 (reversed binomial tree order,
    children before parents) rank y sends the partials of group l to y + lowbit(l) in one
    message, and the receiver reduces them on arrival into its accumulators of group
    l - lowbit(l), seeded with its own input (NCCL's send slot of the next dimension, where
    ``patReduce`` accumulates). Odd groups are leaves: their inputs are packed into a send slot
    (NCCL's phase 0). Then group 0 (offsets h*D) runs the remaining lg A dimensions Bruck-like,
    one message per dimension (NCCL's phases 2 and 3): the partials of h with lowest set bit
    2^j go to y + D*2^j, packed, and are reduced into h - 2^j. Offset 0 is the result.
  allgather (``PatAGAlgorithm``): the same hops backwards: group 0 first, dimension lg P - 1
    down to lg D, then l = 1 .. D-1; blocks go to y - 2^d, packed into a slot when there are
    several, and are unpacked into place in ``out`` on arrival.

With a small block A = P/2 and D = 2: one leaf message of every odd offset, then lg P - 1
Bruck steps: ceil(lg p) steps in all. A larger block makes A smaller and the algorithm longer,
up to p - 1 steps of one chunk each (A = 1, plain reversed binomial tree order; groups l >= p
are then empty and skipped): a slot stays within BUFFER elements whatever p and the size. A
block longer than CHUNK is cut into columns of at most CHUNK elements that run one after the
other (NCCL's loop over ``chunkCount``).

Cost (α-β-γ, n elements per block, C = ceil(n / CHUNK) columns, A and D = P/A as above): every
column takes (min(D, p) - 1) + lg A steps, each sending one message of at most A chunks, so
C((min(D, p) - 1) + lg A) α + (p - 1) n β, plus (p - 1) n γ for reduce_scatter, and up to
(p - 1) n elements packed (δ) into the slots (allgather: and as many unpacked). Small blocks:
ceil(lg p) α + (p - 1) n β, the fewest steps of any allgather; large blocks: P/A - 1 + lg A
steps per column, linear in p (NCCL's own cost model has a linear term too). E.g. p = 1024,
BUFFER = 2^20 elements: n = 256 (a 1 MiB allgather) A = 512, 10 steps; n = 16Ki (64 MiB)
A = 64, 21 steps; n = 256Ki (1 GiB) 2 columns, A = 8, 2 x 130 steps.
``tmp``: reduce_scatter (lg D + 2) A chunks (an accumulator slot per dimension 1 .. lg D - 1,
group 0's, a leaf packing slot, two half slots for group 0's hops), allgather 2A chunks (a send
and a receive slot): at most (lg P + 2) BUFFER elements, however large the call.

Simplifications of NCCL stated: the schedule runs in lockstep, one hop per step (NCCL's hops
are asynchronous, several slots in flight); an aggregated message is one message (NCCL posts it
in postFreq pieces); A is capped at P/2 (NCCL: below p/2) and counted in elements (NCCL: bytes
of its 512 KiB steps, NCCL_STEPS of them in flight); allgather takes its groups in ascending
order (NCCL interleaves them to free its receive slots early: here a block goes to ``out`` on
arrival and is sent from there, so no slot waits). NCCL enables PAT with one rank per node only;
here any placement runs.

Restrictions: allgather and reduce_scatter only; reduce_scatter assumes a commutative op (a
partial meets its contributions in tree order, not rank order).
"""
import minicomm as mc
from minicomm.schedule import IN, OUT, TMP, Chunk, ScheduleBuilder, chunk_bounds

NAME = "pat"
CHUNK = 131072          # elements in one column (NCCL's 512 KiB step of fp32)
BUFFER = 8 * CHUNK      # elements one aggregated message may carry (NCCL_STEPS steps)


def fbs(i):
    """lg of the lowest set bit of i > 0."""
    return (i & -i).bit_length() - 1


def plan(p, n):
    """(P, columns, widest column, A, D) for p ranks and blocks of n elements."""
    P = 1 << (p - 1).bit_length()
    cols = max(1, -(-n // CHUNK))
    w = -(-n // cols)
    A = 1
    while 2 * A <= P // 2 and 2 * A * w <= BUFFER:
        A *= 2
    return P, cols, w, A, P // A


class Slot:
    """A region of ``tmp`` for ``a`` chunks of up to ``w`` elements; chunk h of a column of
    ``width`` elements lies at h*width, so the first cnt chunks are one run."""

    def __init__(self, b, a, w):
        self.base = b.alloc_tmp(a * w)

    def at(self, h, width):
        return Chunk(TMP, self.base + h * width, width)

    def run(self, cnt, width):
        return Chunk(TMP, self.base, cnt * width)


def build(collective, rank, size, count, root, topology):
    b = ScheduleBuilder(collective, NAME, rank, size, count, root)
    p, n = size, count
    if p == 1:
        b.step(b.chunks(IN, 1)[0].copy_to(b.chunks(OUT, 1)[0]))
        return b.build()
    P, cols, w, A, D = plan(p, n)

    def valid(l):
        """How many h have h*D + l < p (a prefix of h)."""
        return -(-(p - l) // D)

    # group 0's Bruck dimensions, j = 0 .. lg A - 1: the h with lowest set bit 2^j
    bruck = [[h for h in range(1, valid(0)) if fbs(h) == j] for j in range(A.bit_length() - 1)]
    if collective == "reduce_scatter":
        _reduce_scatter(b, rank, p, n, cols, w, A, D, valid, bruck)
    elif collective == "allgather":
        _allgather(b, rank, p, n, cols, w, A, D, valid, bruck)
    else:
        raise ValueError(f"{NAME} has no {collective}")
    return b.build()


def _reduce_scatter(b, rank, p, n, cols, w, A, D, valid, bruck):
    dims = fbs(D)                               # Part 1 runs dimensions 0 .. dims-1
    acc = {d: Slot(b, A, w) for d in range(1, dims)}   # one accumulator slot per dimension
    acc0, leaf = Slot(b, A, w), Slot(b, A, w)
    send_slot, recv_slot = Slot(b, A // 2, w), Slot(b, A // 2, w)
    for col_off, cw in chunk_bounds(n, cols):
        def inp(s):                             # my input for the rank at offset s
            return Chunk(IN, ((rank + s) % p) * n + col_off, cw)

        def slot_of(l):
            return acc0 if l == 0 else acc[fbs(l)]

        seeded, pending = set(), []
        for l in range(min(D, p) - 1, 0, -1):   # reversed binomial tree order
            d, cnt = fbs(l), valid(l)
            up, down = l - (1 << d), (rank + (1 << d)) % p
            ops, pending = pending, []
            if l in seeded:                     # a complete accumulator
                send = slot_of(l).run(cnt, cw).send(down)
            elif cnt == 1:                      # leaves: straight from the input
                send = inp(l).send(down)
            else:                               # leaves packed into the send slot
                ops += [inp(h * D + l).copy_to(leaf.at(h, cw)) for h in range(cnt)]
                send = leaf.run(cnt, cw).send(down)
            if up not in seeded:                # first child: seed with my own input
                seeded.add(up)
                ops += [inp(h * D + up).copy_to(slot_of(up).at(h, cw)) for h in range(valid(up))]
            recv = slot_of(up).run(cnt, cw).recv((rank - (1 << d)) % p, reduce=True)
            b.step(*ops, recv, send)
        for j, hs in enumerate(bruck):          # group 0: the far dimensions, Bruck-like
            if not hs:
                continue
            dist = D << j
            ops, pending = pending, []
            if len(hs) == 1:
                send = acc0.at(hs[0], cw).send((rank + dist) % p)
                recv = acc0.at(hs[0] - (1 << j), cw).recv((rank - dist) % p, reduce=True)
            else:
                ops += [acc0.at(h, cw).copy_to(send_slot.at(i, cw)) for i, h in enumerate(hs)]
                send = send_slot.run(len(hs), cw).send((rank + dist) % p)
                recv = recv_slot.run(len(hs), cw).recv((rank - dist) % p)
                pending = [recv_slot.at(i, cw).reduce_into(acc0.at(h - (1 << j), cw))
                           for i, h in enumerate(hs)]
            b.step(*ops, recv, send)
        b.step(*pending, acc0.at(0, cw).copy_to(Chunk(OUT, col_off, cw)))


def _allgather(b, rank, p, n, cols, w, A, D, valid, bruck):
    send_slot, recv_slot = Slot(b, A, w), Slot(b, A, w)
    pending = [b.chunks(IN, 1)[0].copy_to(Chunk(OUT, rank * n, n))]
    for col_off, cw in chunk_bounds(n, cols):
        def block(s):                           # the block of the rank at offset s, in out
            return Chunk(OUT, ((rank + s) % p) * n + col_off, cw)

        def hop(have, get, dist):
            """Send my offsets ``have`` to rank - dist, receive offsets ``get`` from rank + dist
            (one message each way; packed into / unpacked from the slots when several)."""
            nonlocal pending
            ops, pending = pending, []
            to, frm = (rank - dist) % p, (rank + dist) % p
            if len(have) == 1:
                return b.step(*ops, block(get[0]).recv(frm), block(have[0]).send(to))
            ops += [block(s).copy_to(send_slot.at(i, cw)) for i, s in enumerate(have)]
            pending = [recv_slot.at(i, cw).copy_to(block(s)) for i, s in enumerate(get)]
            b.step(*ops, recv_slot.run(len(get), cw).recv(frm),
                   send_slot.run(len(have), cw).send(to))

        for j in reversed(range(len(bruck))):   # group 0 first: far dimensions first
            hs = bruck[j]
            if hs:
                hop([(h - (1 << j)) * D for h in hs], [h * D for h in hs], D << j)
        for l in range(1, min(D, p)):           # then the binomial tree order
            d, cnt = fbs(l), valid(l)
            hop([h * D + l - (1 << d) for h in range(cnt)], [h * D + l for h in range(cnt)],
                1 << d)
    b.step(*pending)


mc.algorithms.register(NAME, build, collectives=("allgather", "reduce_scatter"))
