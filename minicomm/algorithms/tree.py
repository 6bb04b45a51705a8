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
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..schedule import IN, OUT, TMP, Copy, Op, Recv, Schedule, ScheduleBuilder, Send, Topology

ALGORITHM = "tree"

Steps = List[List[Op]]


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
          topology: Topology) -> Schedule:
    b = ScheduleBuilder(collective, ALGORITHM, rank, size, count, root)
    p, n = size, count
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
