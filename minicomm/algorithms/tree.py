"""Tree family: binomial trees (and Bruck's algorithm for all-to-all).

Every tree is the binomial tree over relative ranks v = (rank - root) mod p: the parent of v > 0
is v minus its lowest set bit, and the subtree of v is the contiguous relative range
[v, v + min(lowbit(v), p - v)). Any p >= 1 works unchanged (a non-power of two simply prunes the
tree); L = ceil(lg p) below. Costs in the MPICH style: α per message, β per element sent, γ per
element reduced; n is the per-rank block (``count``).

broadcast: binomial tree, the root sends to the farthest subtree first. L steps;
    L(α + nβ).

reduce: binomial tree, children's partial results are reduced on arrival into ``out`` (non-root
    ``out`` is scratch; leaves send ``in`` directly). Assumes a commutative op. L steps;
    L(α + nβ + nγ).

allreduce: binomial reduce to rank 0, then binomial broadcast from rank 0. 2L steps;
    2Lα + 2Lnβ + Lnγ.

allgather: binomial gather to rank 0 (each subtree's blocks sit at their final place in ``out``,
    so nothing wraps), then binomial broadcast of the whole p·n vector. 2L steps;
    2Lα + (p-1)nβ + Lpnβ.

reduce_scatter: binomial reduce of the whole p·n vector to rank 0 (accumulated in ``tmp``), then
    binomial scatter of the blocks from rank 0. 2L steps; 2Lα + Lpnβ + (p-1)nβ + Lpnγ.

gather: binomial; a subtree sends its blocks as one message, in relative order. Non-root ranks
    stage them in ``out``; the root receives straight into place, except for the one subtree whose
    absolute block range wraps past p-1, which it receives into ``tmp`` and copies in two pieces.
    L steps; Lα + (p-1)nβ.

scatter: the mirror of gather: the root sends each subtree its blocks (packing the wrapping range
    into ``tmp`` first), inner ranks stage their subtree's blocks in ``tmp``, leaves receive into
    ``out``. L steps; Lα + (p-1)nβ.

alltoall: Bruck. Logical block i of rank r is the data for rank r+i; step k sends every block
    whose index has bit k set to rank r+2^k (packed into ``tmp``, received into ``tmp``, unpacked
    at the start of the next step). Block i is kept at out[(r-i) mod p], so the final inverse
    rotation is free and the initial rotation is a single pass of p block copies; packing goes by
    runs of 2^k blocks (one or two copies each). L steps; Lα + L·ceil(p/2)nβ (at most), plus
    about 3pn local copies.

barrier: zero-count messages up the binomial tree to rank 0 (gather), then down it (release).
    2L steps; 2Lα.

Uneven blocks (``build_v``; c_j elements for rank j, T their sum, any of them 0; any p, any
root) and prefixes. With every c_j = n the first four build exactly the schedules above.
gatherv: the binomial gather above with each subtree's blocks (a run of relative ranks, so one
    message of their total) staged in relative order at out[0:]; the root receives straight into
    place, except a subtree whose blocks wrap past rank p-1 with elements on both sides, which
    arrives in ``tmp`` and is copied in two pieces. L steps; Lα + (T - c_root)β.
scatterv: the mirror (the binomial scatter above): the root sends each subtree its blocks as one
    message (packing a wrapping range into ``tmp``), inner ranks stage theirs in ``tmp``.
    L steps; Lα + (T - c_root)β.
allgatherv: gatherv to rank 0 with every block at its final place in ``out``, then binomial
    broadcast of all T elements. 2L steps; 2Lα + (T - c_0)β + LTβ.
reduce_scatterv: binomial reduce of the whole T-vector to rank 0 (in ``tmp``), then scatterv of
    its blocks from rank 0. 2L steps; 2Lα + LTβ + (T - c_0)β + LTγ. Assumes a commutative op.
alltoallv: Bruck with uneven blocks. Slot i of rank r before step k holds the block from rank
    s = r - (i mod 2^k) to rank s + i, C[s][s+i] elements, so every rank sizes every message
    from the matrix; step k sends the slots whose i has bit k set to rank r+2^k in one message
    (packed into ``tmp`` unless they already lie in one run; zero-size messages still go).
    Each message arrives in a region of ``tmp`` of its own, where a block waits for its next
    hop; a block on its last hop (i < 2^(k+1)) is copied to its place in ``out``. No rotations:
    besides the packing, each block is copied once, to its place in ``out``. L steps;
    Lα + Σ_k m_k β, m_k = Σ_{i: bit k} C[r-(i mod 2^k)][r-(i mod 2^k)+i] (the step-k message;
    the block C[s][t] makes popcount((t-s) mod p) hops; even blocks: at most L·ceil(p/2)nβ).
    ``tmp``: Σ_k (what arrives at step k) + the largest packed message.
scan: recursive doubling by shifts (Hillis–Steele; the shifts of Bruck above): at step k
    rank r sends its partial, in_{r-2^k+1} op .. op in_r, to rank r+2^k and reduces the one
    from rank r-2^k into it (on arrival once it has nothing more to send; else through ``tmp``
    at the start of the next step). Chosen over the binomial up-down
    sweep (2L steps) for its L steps at no more than n per message. L steps;
    L(α + nβ + nγ). Assumes a commutative op.
exscan: the same shifts; out keeps the exclusive prefix (rank r-1's input at step 0, then
    in_{r-2^k+1} .. in_{r-1}) and a partial in ``tmp``, out op in_r, is what is sent on, so a
    rank that sends and receives reduces each arrival twice. Rank 0 only sends (its out is
    undefined). L steps; L(α + nβ) + (2L-1)nγ. Assumes a commutative op.

Channels (``channels`` = k > 1; allreduce only): NCCL's double binary tree. The servers (the
``topology``'s nodes, N of them) form two complementary binary trees: A, the in-order tree
(``_inorder_tree``, whose leaves are its odd positions), and B, A with every server moved one
place on (N odd) or mirrored (N even), so that A's leaves are inner servers of B. Channel c
reduces and broadcasts the c-th of k parts of the vector over tree A (c even) or B (c odd).
Inside a server the channel is a chain (NCCL's intra-node tree) from the local rank facing the
channel's NIC: channels 2q and 2q+1 enter and leave every server at local rank q*L//ceil(k/2),
so each NIC carries one channel of each tree (on one server, channel c's chain starts at local
rank c*L//k, so the chains share the reducing). Each part is cut into
S = min(TREE_MAX_CHUNKS, part // TREE_MIN_CHUNK) chunks (at least 1) that stream up the chain and
tree, reduced on the way, and down again from the root, up and down at once: on a global clock
every rank at depth d receives chunk t from below at t + D - d and from above at t + D + d (D:
the largest depth), so every Send meets its Recv in the same step and nothing waits out of turn.
Depth D <= L - 1 + ceil(lg(N + 1)); with part m = n/k, (S + 2D + 1)(α + (m/S)β) + mγ per
channel, and each server's NICs carry about 2n each way in all: on N = 2 servers half what a
ring's do, which is why a 2-server tree's busbw can pass the ring's network bound. Assumes a
commutative op.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

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
    Topology,
    blocks_of,
    chunk_bounds,
    concurrent,
    matrix_of,
    servers,
)

ALGORITHM = "tree"

Steps = List[List[Op]]


# Double binary tree chunks (module doc): a chunk is never shorter than TREE_MIN_CHUNK elements,
# and a channel's part is cut into at most TREE_MAX_CHUNKS of them.
TREE_MIN_CHUNK = 32768
TREE_MAX_CHUNKS = 64


def _ceil_lg(p: int) -> int:
    return (p - 1).bit_length()


def _span(v: int, p: int) -> int:
    """lowbit(v); for the root, a power of two >= p (its subtree is everything)."""
    return v & -v if v else 1 << _ceil_lg(p)


def _subtree(v: int, p: int) -> int:
    return min(_span(v, p), p - v)


def _children(v: int, p: int) -> List[Tuple[int, int]]:
    """(relative child, its subtree size), nearest first (the order children finish gathering)."""
    out, m, span = [], 1, _span(v, p)
    while m < span and v + m < p:
        out.append((v + m, _subtree(v + m, p)))
        m <<= 1
    return out


def _same_rank(u: int) -> int:
    """Peer map of the trees rooted at rank 0, where relative and absolute ranks coincide."""
    return u


def _parent(v: int) -> int:
    return v - (v & -v)


def _emit(b: ScheduleBuilder, steps: Steps, pre: Sequence[Op] = ()) -> None:
    """Append steps, running the local ops ``pre`` at the start of the first one."""
    if not steps:
        b.step(*pre)
        return
    b.step(*pre, *steps[0])
    for s in steps[1:]:
        b.step(*s)


# --- tree phases, in relative ranks; ``peer`` maps a relative rank to an absolute one ---------

def _bcast_down(v: int, p: int, peer, buf: str, off: int, cnt: int,
                root_buf: Optional[str] = None) -> Steps:
    """Receive buf[off:off+cnt] from the parent, then forward it, farthest subtree first (the
    root sends from ``root_buf`` when given)."""
    steps: Steps = []
    src = buf
    if v:
        steps.append([Recv(peer(_parent(v)), buf, off, cnt)])
    elif root_buf is not None:
        src = root_buf
    for c, _ in reversed(_children(v, p)):
        steps.append([Send(peer(c), src, off, cnt)])
    return steps


def _reduce_up(v: int, p: int, peer, acc: str, acc_off: int, cnt: int) -> Steps:
    """Reduce children's partial results into acc[acc_off:] (seeded from ``in``), then send it
    up. A leaf sends its ``in`` directly."""
    kids = _children(v, p)
    steps: Steps = [[Recv(peer(c), acc, acc_off, cnt, True)] for c, _ in kids]
    if kids:
        steps[0].insert(0, Copy(IN, 0, acc, acc_off, cnt))
    if v:
        steps.append([Send(peer(_parent(v)), acc if kids else IN, acc_off if kids else 0, cnt)])
    return steps


def _gather_up(v: int, p: int, n: int, peer, base: int) -> Steps:
    """Collect the subtree's blocks in relative order at out[base:], then send them up (v > 0)."""
    kids = _children(v, p)
    if not kids:
        return [[Send(peer(_parent(v)), IN, 0, n)]]
    steps: Steps = [[Recv(peer(c), OUT, base + (c - v) * n, s * n)] for c, s in kids]
    steps[0].insert(0, Copy(IN, 0, OUT, base, n))
    steps.append([Send(peer(_parent(v)), OUT, base, _subtree(v, p) * n)])
    return steps


def _scatter_down(v: int, p: int, n: int, peer, buf: str, base: int) -> Steps:
    """Receive the subtree's blocks (relative order) at buf[base:] and pass each child its part;
    keep block v in ``out``. A leaf receives its block straight into ``out``. v > 0."""
    kids = _children(v, p)
    up = peer(_parent(v))
    if not kids:
        return [[Recv(up, OUT, 0, n)]]
    steps: Steps = [[Recv(up, buf, base, _subtree(v, p) * n)]]
    steps += [[Send(peer(c), buf, base + (c - v) * n, s * n)] for c, s in reversed(kids)]
    steps[1].insert(0, Copy(buf, base, OUT, 0, n))
    return steps


# --- collectives -------------------------------------------------------------------------------

def _broadcast(b, v, p, n, peer):
    pre = [Copy(IN, 0, OUT, 0, n)] if v == 0 else []
    _emit(b, _bcast_down(v, p, peer, OUT, 0, n, root_buf=IN), pre=pre)


def _reduce(b, v, p, n, peer):
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return
    _emit(b, _reduce_up(v, p, peer, OUT, 0, n))


def _allreduce(b, r, p, n):
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return
    _emit(b, _reduce_up(r, p, _same_rank, OUT, 0, n) + _bcast_down(r, p, _same_rank, OUT, 0, n))


def _allgather(b, r, p, n):
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return
    if r == 0:   # the root gathers straight into place: rank j's block lands at out[j*n]
        up: Steps = [[Recv(c, OUT, c * n, s * n)] for c, s in _children(0, p)]
        up[0].insert(0, Copy(IN, 0, OUT, 0, n))
    else:
        up = _gather_up(r, p, n, _same_rank, r * n)
    _emit(b, up + _bcast_down(r, p, _same_rank, OUT, 0, p * n))


def _reduce_scatter(b, r, p, n):
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return
    kids = _children(r, p)
    acc = b.alloc_tmp(p * n) if kids else 0   # leaves neither accumulate nor forward blocks
    steps = _reduce_up(r, p, _same_rank, TMP, acc, p * n)
    if r == 0:
        down: Steps = [[Send(c, TMP, acc + c * n, s * n)] for c, s in reversed(kids)]
        down[0].insert(0, Copy(TMP, acc, OUT, 0, n))
    else:
        down = _scatter_down(r, p, n, _same_rank, TMP, acc + r * n)
    _emit(b, steps + down)


def _gather(b, v, p, n, root, peer):
    if v:
        _emit(b, _gather_up(v, p, n, peer, 0))
        return
    # Root: subtree c holds absolute blocks root+c .. root+c+s-1 (mod p); at most one range wraps.
    steps: Steps = []
    fixup: List[Op] = []
    for c, s in _children(0, p):
        a = (c + root) % p
        if a + s <= p:
            steps.append([Recv(peer(c), OUT, a * n, s * n)])
        else:
            t = b.alloc_tmp(s * n)
            head = p - a
            steps.append([Recv(peer(c), TMP, t, s * n)])
            fixup = [Copy(TMP, t, OUT, a * n, head * n),
                     Copy(TMP, t + head * n, OUT, 0, (s - head) * n)]
    _emit(b, steps, pre=[Copy(IN, 0, OUT, root * n, n)])
    b.step(*fixup)


def _scatter(b, v, p, n, root, peer):
    if v:
        staging = b.alloc_tmp(_subtree(v, p) * n) if _children(v, p) else 0   # leaves: none
        _emit(b, _scatter_down(v, p, n, peer, TMP, staging))
        return
    pack: List[Op] = [Copy(IN, root * n, OUT, 0, n)]
    steps: Steps = []
    for c, s in reversed(_children(0, p)):
        a = (c + root) % p
        if a + s <= p:
            steps.append([Send(peer(c), IN, a * n, s * n)])
        else:   # the wrapping range is packed into tmp in relative order
            t = b.alloc_tmp(s * n)
            head = p - a
            pack += [Copy(IN, a * n, TMP, t, head * n),
                     Copy(IN, 0, TMP, t + head * n, (s - head) * n)]
            steps.append([Send(peer(c), TMP, t, s * n)])
    _emit(b, steps, pre=pack)


def _alltoall(b, r, p, n):
    # Logical block i (data for rank r+i) lives at out[(r-i) mod p]: after the exchanges block i
    # holds the data from rank r-i, which is exactly where out wants it.
    b.step(*[Copy(IN, ((r + i) % p) * n, OUT, ((r - i) % p) * n, n) for i in range(p)])
    if p == 1:
        return
    most = max(_bit_count(p, 1 << k) for k in range(_ceil_lg(p)))
    send_t, recv_t = b.alloc_tmp(most * n), b.alloc_tmp(most * n)
    unpack: List[Op] = []
    for k in range(_ceil_lg(p)):
        d = 1 << k
        # Both sides walk the runs in the same order: sender position q <-> receiver q + d.
        pieces = _run_pieces(r, p, n, d)
        total = _bit_count(p, d) * n
        pack = [Copy(OUT, ring, TMP, send_t + lin, c) for ring, lin, c in pieces]
        b.step(*unpack, *pack, Recv((r - d) % p, TMP, recv_t, total),
               Send((r + d) % p, TMP, send_t, total))
        unpack = [Copy(TMP, recv_t + lin, OUT, ring, c) for ring, lin, c in pieces]
    b.step(*unpack)


def _bit_count(p: int, d: int) -> int:
    """How many i in [0, p) have bit d set."""
    return (p // (2 * d)) * d + max(0, p % (2 * d) - d)


def _run_pieces(r: int, p: int, n: int, d: int):
    """The blocks of rank r with bit d set, as contiguous pieces (offset in out, offset in the
    packed message, count), in elements.
    Logical run [a, a+ln) sits at out positions r-a-ln+1 .. r-a (mod p); a run that wraps past
    position p-1 gives two pieces."""
    out, a, pos = [], d, 0
    while a < p:
        ln = min(d, p - a)
        q = (r - a - ln + 1) % p
        head = min(ln, p - q)
        out.append((q * n, pos, head * n))
        if ln > head:
            out.append((0, pos + head * n, (ln - head) * n))
        pos += ln * n
        a += 2 * d
    return out


def _barrier(b, r, p):
    up: Steps = [[Recv(c, OUT, 0, 0)] for c, _ in _children(r, p)]
    if r:
        up.append([Send(_parent(r), OUT, 0, 0)])
    _emit(b, up + _bcast_down(r, p, _same_rank, OUT, 0, 0))


def build(collective: str, rank: int, size: int, count: int, root: int,
          topology: Topology, channels: int = 1) -> Schedule:
    b = ScheduleBuilder(collective, ALGORITHM, rank, size, count, root)
    p, n = size, count
    if used_channels(collective, size, count, channels) > 1:
        _double_tree_allreduce(b, rank, p, n, tuple(topology), channels)
        return b.build()
    v = (rank - root) % p

    def peer(u: int) -> int:
        return (u + root) % p

    if collective == "broadcast":
        _broadcast(b, v, p, n, peer)
    elif collective == "reduce":
        _reduce(b, v, p, n, peer)
    elif collective == "allreduce":
        _allreduce(b, rank, p, n)
    elif collective == "allgather":
        _allgather(b, rank, p, n)
    elif collective == "reduce_scatter":
        _reduce_scatter(b, rank, p, n)
    elif collective == "gather":
        _gather(b, v, p, n, root, peer)
    elif collective == "scatter":
        _scatter(b, v, p, n, root, peer)
    elif collective == "alltoall":
        _alltoall(b, rank, p, n)
    elif collective == "barrier":
        _barrier(b, rank, p)
    else:
        raise ValueError(f"unknown collective {collective!r}")
    return b.build()


# --- NCCL's double binary tree (module doc, Channels) --------------------------------------------

def used_channels(collective: str, size: int, count: int, channels: int) -> int:
    """The channels a call runs on: ``channels`` for allreduce (no more than leave every channel
    an element), else 1; one channel is the binomial tree."""
    if not isinstance(channels, int) or isinstance(channels, bool) or channels < 1:
        raise ValueError(f"channels must be an integer >= 1, got {channels!r}")
    if collective != "allreduce" or size == 1:
        return 1
    return max(1, min(channels, count))


def _inorder_tree(n: int) -> List[int]:
    """Parent of each of n in-order positions (-1: the root). Position i is v = i + 1; v's parent
    doubles its lowest set bit b, stepping to v + b or v - b (v - b when v + b is past n), so
    the odd positions, half of them, are the leaves; the root is the largest power of two <= n."""
    parent = []
    for v in range(1, n + 1):
        b = v & -v
        up = (v ^ b) | (b << 1)
        if up > n:
            up = v ^ b
        parent.append(up - 1)          # up == 0: the root
    return parent


def double_tree(n: int, which: int) -> List[int]:
    """Parent of each of n servers in tree A (which=0) or its complement B (which=1)."""
    a = _inorder_tree(n)
    if which == 0 or n == 1:
        return a
    move = (lambda i: (i + 1) % n) if n % 2 else (lambda i: n - 1 - i)
    b = [-1] * n
    for i, up in enumerate(a):
        b[move(i)] = -1 if up < 0 else move(up)
    return b


@lru_cache(maxsize=256)
def channel_tree(topology: Tuple[int, ...], k: int, c: int):
    """Channel c's tree over the ranks: (parent, children, depth, largest depth). The chain
    inside each server runs from the channel's entry rank; its head joins its server's parent
    server's head (-1: the root)."""
    nodes = servers(topology)
    pairs = -(-k // 2)
    heads, parent = [], [-1] * len(topology)
    for ranks in nodes:
        L = len(ranks)
        # across servers both trees of a pair leave by one NIC; on one, every chain its own head
        entry = (c // 2) * L // pairs if len(nodes) > 1 else c * L // k
        chain = [ranks[(entry + t) % L] for t in range(L)]
        for up, r in zip(chain, chain[1:]):
            parent[r] = up
        heads.append(chain[0])
    for i, up in enumerate(double_tree(len(nodes), c % 2)):
        if up >= 0:
            parent[heads[i]] = heads[up]
    children: List[List[int]] = [[] for _ in topology]
    for r, up in enumerate(parent):
        if up >= 0:
            children[up].append(r)
    depth = [0] * len(topology)
    todo = [r for r, up in enumerate(parent) if up < 0]
    while todo:                       # breadth first from the root
        r = todo.pop()
        for kid in children[r]:
            depth[kid] = depth[r] + 1
            todo.append(kid)
    return tuple(parent), tuple(map(tuple, children)), tuple(depth), max(depth)


def _double_tree_allreduce(b: ScheduleBuilder, rank: int, p: int, n: int,
                           topology: Tuple[int, ...], channels: int) -> None:
    k = used_channels("allreduce", p, n, channels)
    placed: List[Tuple[int, Tuple[Op, ...]]] = []
    for c, (base, part) in enumerate(chunk_bounds(n, k)):
        parents, children, depths, D = channel_tree(topology, k, c)
        up, kids, d = parents[rank], children[rank], depths[rank]
        chunks = [(base + o, m) for o, m in
                  chunk_bounds(part, max(1, min(TREE_MAX_CHUNKS, part // TREE_MIN_CHUNK)))]
        if kids:
            placed.append((0, (Copy(IN, base, OUT, base, part),)))
        src = OUT if kids else IN
        for t, (off, m) in enumerate(chunks):
            placed += [(t + D - d, (Recv(kid, OUT, off, m, True),)) for kid in kids]
            if up >= 0:
                placed.append((t + D - d + 1, (Send(up, src, off, m),)))
                placed.append((t + D + d, (Recv(up, OUT, off, m),)))
            placed += [(t + D + d + 1, (Send(kid, OUT, off, m),)) for kid in kids]
    for st in concurrent(placed):
        b.step(*st)


# --- uneven blocks and prefixes (module doc) ----------------------------------------------------

def build_v(collective: str, rank: int, size: int, count: int, root: int, topology: Topology,
            counts: Tuple[int, ...]) -> Schedule:
    """The uneven collectives and the prefix reductions (module doc)."""
    b = ScheduleBuilder(collective, ALGORITHM, rank, size, count, root, counts)
    p = size
    if collective in ("gatherv", "scatterv"):
        (_gatherv if collective == "gatherv" else _scatterv)(b, rank, p, root, counts)
    elif collective == "allgatherv":
        _allgatherv(b, rank, p, counts)
    elif collective == "reduce_scatterv":
        _reduce_scatterv(b, rank, p, counts)
    elif collective == "alltoallv":
        _alltoallv(b, rank, p, counts)
    elif collective == "scan":
        _scan(b, rank, p, count)
    elif collective == "exscan":
        _exscan(b, rank, p, count)
    else:
        raise ValueError(f"unknown collective {collective!r}")
    return b.build()


def _virtual_offsets(counts: Sequence[int], root: int) -> List[int]:
    """Prefix sums of the blocks in relative order (relative rank u is rank u + root): the
    blocks of relative ranks [u, w) span vo[w] - vo[u] elements, vo[u] from relative rank 0's."""
    p, vo = len(counts), [0]
    for u in range(p):
        vo.append(vo[-1] + counts[(u + root) % p])
    return vo


def _gatherv_up(v: int, p: int, vo: Sequence[int], peer, base: int) -> Steps:
    """``_gather_up`` with uneven blocks: the subtree's blocks in relative order at out[base:],
    then sent up as one message (v > 0); a leaf sends its ``in``."""
    kids = _children(v, p)
    up = peer(_parent(v))
    if not kids:
        return [[Send(up, IN, 0, vo[v + 1] - vo[v])]]
    steps: Steps = [[Recv(peer(c), OUT, base + vo[c] - vo[v], vo[c + s] - vo[c])]
                    for c, s in kids]
    steps[0].insert(0, Copy(IN, 0, OUT, base, vo[v + 1] - vo[v]))
    steps.append([Send(up, OUT, base, vo[v + _subtree(v, p)] - vo[v])])
    return steps


def _scatterv_down(v: int, p: int, vo: Sequence[int], peer, buf: str, base: int) -> Steps:
    """``_scatter_down`` with uneven blocks: receive the subtree's blocks (relative order) at
    buf[base:], keep block v in ``out``, pass each child its part (v > 0; a leaf receives its
    block straight into ``out``)."""
    kids = _children(v, p)
    up = peer(_parent(v))
    if not kids:
        return [[Recv(up, OUT, 0, vo[v + 1] - vo[v])]]
    steps: Steps = [[Recv(up, buf, base, vo[v + _subtree(v, p)] - vo[v])]]
    steps += [[Send(peer(c), buf, base + vo[c] - vo[v], vo[c + s] - vo[c])]
              for c, s in reversed(kids)]
    steps[1].insert(0, Copy(buf, base, OUT, 0, vo[v + 1] - vo[v]))
    return steps


def _root_ranges(p: int, root: int, counts: Sequence[int], vo: Sequence[int]):
    """For each child c of the root (nearest first): (c, its subtree's elements, where they lie
    in the rank-ordered T-vector: [(offset, count)], one piece, or two when the subtree's ranks
    wrap past p-1 with elements on both sides)."""
    total = vo[p]
    out = []
    for c, s in _children(0, p):
        a, m = (c + root) % p, vo[c + s] - vo[c]
        start = sum(counts[:a])
        head = total - start                       # the elements of ranks a .. p-1
        if a + s <= p or m <= head:                # contiguous (maybe by empty blocks)
            out.append((c, m, [(start, m)]))
        elif head == 0:
            out.append((c, m, [(0, m)]))
        else:
            out.append((c, m, [(start, head), (0, m - head)]))
    return out


def _gatherv(b, rank, p, root, counts):
    v = (rank - root) % p
    vo = _virtual_offsets(counts, root)

    def peer(u: int) -> int:
        return (u + root) % p

    if v:
        _emit(b, _gatherv_up(v, p, vo, peer, 0))
        return
    steps: Steps = []
    fixup: List[Op] = []
    for c, m, pieces in _root_ranges(p, root, counts, vo):
        if len(pieces) == 1:
            steps.append([Recv(peer(c), OUT, pieces[0][0], m)])
        else:   # the wrapping range arrives in relative order in tmp, then goes in two pieces
            t = b.alloc_tmp(m)
            (a_off, head), (_, tail) = pieces
            steps.append([Recv(peer(c), TMP, t, m)])
            fixup = [Copy(TMP, t, OUT, a_off, head), Copy(TMP, t + head, OUT, 0, tail)]
    _emit(b, steps, pre=[Copy(IN, 0, OUT, sum(counts[:root]), counts[root])])
    b.step(*fixup)


def _scatterv(b, rank, p, root, counts):
    v = (rank - root) % p
    vo = _virtual_offsets(counts, root)

    def peer(u: int) -> int:
        return (u + root) % p

    if v:
        kids = _children(v, p)
        staging = b.alloc_tmp(vo[v + _subtree(v, p)] - vo[v]) if kids else 0
        _emit(b, _scatterv_down(v, p, vo, peer, TMP, staging))
        return
    pack: List[Op] = [Copy(IN, sum(counts[:root]), OUT, 0, counts[root])]
    steps: Steps = []
    for c, m, pieces in reversed(_root_ranges(p, root, counts, vo)):
        if len(pieces) == 1:
            steps.append([Send(peer(c), IN, pieces[0][0], m)])
        else:   # the wrapping range is packed into tmp in relative order
            t = b.alloc_tmp(m)
            (a_off, head), (_, tail) = pieces
            pack += [Copy(IN, a_off, TMP, t, head), Copy(IN, 0, TMP, t + head, tail)]
            steps.append([Send(peer(c), TMP, t, m)])
    _emit(b, steps, pre=pack)


def _allgatherv(b, r, p, counts):
    total = sum(counts)
    vo = _virtual_offsets(counts, 0)   # root 0: relative = absolute, vo = the block offsets
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, total))
        return
    if r == 0:   # blocks land at their final places; non-roots stage theirs there too
        up: Steps = [[Recv(c, OUT, vo[c], vo[c + s] - vo[c])] for c, s in _children(0, p)]
        up[0].insert(0, Copy(IN, 0, OUT, 0, counts[0]))
    else:
        up = _gatherv_up(r, p, vo, _same_rank, vo[r])
    _emit(b, up + _bcast_down(r, p, _same_rank, OUT, 0, total))


def _reduce_scatterv(b, r, p, counts):
    total = sum(counts)
    vo = _virtual_offsets(counts, 0)
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, total))
        return
    kids = _children(r, p)
    acc = b.alloc_tmp(total) if kids else 0   # leaves neither accumulate nor forward blocks
    steps = _reduce_up(r, p, _same_rank, TMP, acc, total)
    if r == 0:
        down: Steps = [[Send(c, TMP, acc + vo[c], vo[c + s] - vo[c])] for c, s in reversed(kids)]
        down[0].insert(0, Copy(TMP, acc, OUT, 0, counts[0]))
    else:
        down = _scatterv_down(r, p, vo, _same_rank, TMP, acc + vo[r])
    _emit(b, steps + down)


def _alltoallv(b, r, p, counts):
    """Bruck with uneven blocks (module doc). Slot i of rank x before step k holds the block
    from rank s = x - (i mod 2^k) to rank s + i, C[s][s+i] elements, so every rank sizes every
    message from the matrix."""
    rows = matrix_of(counts, p)
    sent = blocks_of(rows[r])
    got = blocks_of([rows[i][r] for i in range(p)])
    own = Copy(IN, sent[r][0], OUT, got[r][0], rows[r][r])
    if p == 1:
        b.step(own)
        return

    def size(x: int, k: int, i: int) -> int:
        s = (x - i % (1 << k)) % p
        return rows[s][(s + i) % p]

    lg = _ceil_lg(p)
    slots = [[i for i in range(1 << k, p) if i >> k & 1] for k in range(lg)]
    incoming = [[size((r - (1 << k)) % p, k, i) for i in slots[k]] for k in range(lg)]
    # every message arrives in a region of its own (a piece may wait there several steps), and
    # pieces that are not one contiguous run already are packed into send_t, allocated last
    recv_at = [b.alloc_tmp(sum(m)) for m in incoming]
    send_t = b.tmp_count
    packed = 0
    where = {i: (IN, sent[(r + i) % p][0]) for i in range(1, p)}   # slot i's current piece
    steps: List[List[Op]] = []
    unpack: List[Op] = [own]
    for k in range(lg):
        d = 1 << k
        pieces = [(*where[i], size(r, k, i)) for i in slots[k]]
        total = sum(c for _, _, c in pieces)
        run = [pc for pc in pieces if pc[2]]
        if all(a[0] == z[0] and a[1] + a[2] == z[1] for a, z in zip(run, run[1:])):
            pack: List[Op] = []        # one contiguous run (or nothing): sent where it lies
            src = run[0][:2] if run else (TMP, send_t)
        else:
            pack, pos = [], 0
            for buf, off, c in pieces:
                pack.append(Copy(buf, off, TMP, send_t + pos, c))
                pos += c
            src, packed = (TMP, send_t), max(packed, total)
        steps.append([*unpack, *pack, Recv((r - d) % p, TMP, recv_at[k], sum(incoming[k])),
                      Send((r + d) % p, src[0], src[1], total)])
        unpack, pos = [], recv_at[k]
        for i, c in zip(slots[k], incoming[k]):
            if i < 2 * d:      # its last hop: the block from rank r-i, to its place in out
                unpack.append(Copy(TMP, pos, OUT, got[(r - i) % p][0], c))
            else:
                where[i] = (TMP, pos)
            pos += c
    steps.append(unpack)
    b.alloc_tmp(packed)
    for st in steps:
        b.step(*st)


def _scan(b, r, p, n):
    """Inclusive prefix by shifts of 2^k (module doc): out holds in_{r-2^k+1} .. in_r."""
    pending: List[Op] = [Copy(IN, 0, OUT, 0, n)]
    x = b.alloc_tmp(n) if 0 < r < p - 1 else 0   # only a rank that sends and receives needs it
    for k in range(_ceil_lg(p)):
        d = 1 << k
        ops: List[Op] = pending
        pending = []
        if r + d < p:
            ops.append(Send(r + d, OUT, 0, n))
            if r >= d:     # out is being sent: the partial waits in tmp for the next step
                ops.append(Recv(r - d, TMP, x, n))
                pending = [Reduce(TMP, x, OUT, 0, n)]
        elif r >= d:       # nothing more to send: reduce on arrival
            ops.append(Recv(r - d, OUT, 0, n, True))
        b.step(*ops)
    b.step(*pending)


def _exscan(b, r, p, n):
    """Exclusive prefix by shifts of 2^k (module doc): out (the exclusive prefix) holds
    in_{r-2^k+1} .. in_{r-1}, and the partial P sent on holds in_r too. Rank 0 only sends."""
    if r == 0:
        for k in range(_ceil_lg(p)):
            if 1 << k < p:
                b.step(Send(1 << k, IN, 0, n))
        return
    sends_later = r + 2 < p                     # P is needed from step 1 on
    part = b.alloc_tmp(n) if sends_later else 0
    x = b.alloc_tmp(n) if sends_later and r >= 2 else 0
    pending: List[Op] = []
    for k in range(_ceil_lg(p)):
        d = 1 << k
        ops: List[Op] = pending
        pending = []
        if k == 0:
            ops.append(Recv(r - 1, OUT, 0, n))  # out = in_{r-1}
            if r + 1 < p:
                ops.append(Send(r + 1, IN, 0, n))
            b.step(*ops)
            continue
        if k == 1 and r + d < p:
            ops += [Copy(IN, 0, TMP, part, n), Reduce(OUT, 0, TMP, part, n)]
        if r + d < p:
            ops.append(Send(r + d, TMP, part, n))
            if r >= d:
                ops.append(Recv(r - d, TMP, x, n))
                pending = [Reduce(TMP, x, OUT, 0, n)]
                if r + 2 * d < p:
                    pending.append(Reduce(TMP, x, TMP, part, n))
        elif r >= d:
            ops.append(Recv(r - d, OUT, 0, n, True))
        b.step(*ops)
    b.step(*pending)
