"""NCCL's double binary tree allreduce, written only through minicomm's public API.

Source: P. Sanders, J. Speck, J. L. Träff, "Two-tree algorithms for full bandwidth broadcast,
reduction and scan", Parallel Computing 35(12), 2009; NVIDIA's NCCL 2.4 ("Massively Scale Your
Deep Learning Training with NCCL 2.4", 2019), which runs allreduce on two such trees.

Algorithm: tree A is the in-order binary tree over the ranks (position v = rank + 1; the parent
of v doubles its lowest set bit b, going to v + b, or to v - b when bit 2b of v is set or v + b
is past p; the root is the largest power of two <= p). Its leaves are the odd positions, the even
ranks, half of them. Tree B is A with every rank moved: mirrored (r -> p-1-r) for even p, shifted
(r -> r+1 mod p) for odd p, so B's leaves are A's inner ranks (for odd p rank 0 is a leaf of
both: the one unavoidable exception). The vector is cut in two halves: half 0 is reduced up tree
A and broadcast down it, half 1 likewise on tree B, at the same time. Each half is cut into
S = clamp(half // MIN_CHUNK, 1, MAX_CHUNKS) chunks that stream up and down at once, on a global
clock: a rank at depth d receives chunk t from its children (reduced on arrival, into ``out``
seeded with its ``in``) at slot t + D - d and sends it up at the next slot; it receives chunk t
from its parent at slot t + D + d and passes it down at the next slot (D: the tree's depth; the
root turns a chunk round one slot after it is complete). Every Send meets its Recv in the same
slot, so a rank never waits out of turn; the two trees share slots (rank r is inner in one, a
leaf in the other, so its links carry both).

Cost (α-β-γ, n elements, half m = n/2 per tree, D = floor(lg p) the depth, S chunks per
half): S + 2D - 1 communicating steps. In one step a rank sends at most 4 chunks of m/S
(inner in one tree: one up, two down; a leaf in the other: one up) and receives as many, so
about (S + 2D - 1)(α + (2n/S)β) + nγ; in all every rank sends and receives about 2n, as a ring
does, in O(lg p) + S steps instead of 2(p-1). E.g. 1 GiB of float32: m = 2^27, S = 64.

Restrictions: allreduce only; a commutative op (children's chunks are reduced as they arrive).
The trees are over ranks, in rank order (``topology`` is not used): NCCL builds them over nodes
with a chain inside each node; minicomm's built-in ``tree`` family with channels does that.
"""
import minicomm as mc
from minicomm.schedule import IN, OUT, Chunk, ScheduleBuilder, chunk_bounds, concurrent

NAME = "dbtree"
MIN_CHUNK = 32768      # elements: no pipeline chunk is shorter (unless the half is)
MAX_CHUNKS = 64        # a half is cut into at most this many chunks


def inorder_tree(p):
    """Parent rank of each rank in tree A (-1: the root)."""
    parent = []
    for v in range(1, p + 1):
        b = v & -v
        up = (v ^ b) | (b << 1)
        if up > p:
            up = v ^ b
        parent.append(up - 1)          # up == 0: the root
    return parent


def tree_parents(p, which):
    """Parent rank of each rank in tree A (which=0) or its complement B (which=1)."""
    a = inorder_tree(p)
    if which == 0 or p == 1:
        return a
    move = (lambda r: (r + 1) % p) if p % 2 else (lambda r: p - 1 - r)
    b = [-1] * p
    for r, up in enumerate(a):
        b[move(r)] = -1 if up < 0 else move(up)
    return b


def shape(parents):
    """(children of each rank, depth of each rank, the largest depth)."""
    p = len(parents)
    children = [[] for _ in range(p)]
    for r, up in enumerate(parents):
        if up >= 0:
            children[up].append(r)
    depth = [0] * p
    todo = [r for r, up in enumerate(parents) if up < 0]
    while todo:
        r = todo.pop()
        for kid in children[r]:
            depth[kid] = depth[r] + 1
            todo.append(kid)
    return children, depth, max(depth)


def build(collective, rank, size, count, root, topology):
    b = ScheduleBuilder(collective, NAME, rank, size, count, root)
    src, dst = b.chunks(IN, 1)[0], b.chunks(OUT, 1)[0]
    if size == 1:
        b.step(src.copy_to(dst))
        return b.build()
    placed = []                        # (slot, ops), tree 0's before tree 1's in every slot
    for which, (base, m) in enumerate(chunk_bounds(count, 2)):
        parents = tree_parents(size, which)
        children, depths, D = shape(parents)
        up, kids, d = parents[rank], children[rank], depths[rank]
        mine_in, mine_out = Chunk(IN, base, m), Chunk(OUT, base, m)
        pieces = max(1, min(MAX_CHUNKS, m // MIN_CHUNK))
        if kids:                       # an inner rank reduces its children's chunks into out
            placed.append((0, (mine_in.copy_to(mine_out),)))
        for t, (ins, outs) in enumerate(zip(mine_in.split(pieces), mine_out.split(pieces))):
            placed += [(t + D - d, (outs.recv(kid, reduce=True),)) for kid in kids]
            if up >= 0:
                placed.append((t + D - d + 1, ((outs if kids else ins).send(up),)))
                placed.append((t + D + d, (outs.recv(up),)))
            placed += [(t + D + d + 1, (outs.send(kid),)) for kid in kids]
    for ops in concurrent(placed):
        b.step(*ops)
    return b.build()


mc.algorithms.register(NAME, build, collectives=("allreduce",))
