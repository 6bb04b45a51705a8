"""innet family: in-network reduction. Switches that receive, reduce and multicast: NVIDIA SHARP
across an InfiniBand fat-tree, NVLink SHARP (NVLS) inside an NVSwitch server.

Participants. Ranks 0..p-1, then the switches of an aggregation tree, numbered p, p+1, ...
(``switch_tree``): a leaf switch per server of ``topology`` (per ``radix`` consecutive ranks
when every rank is on one server), and above them switches of ``radix`` children each, up to
one root switch; H levels. A switch has no ``in`` or ``out``, only ``tmp``, and its schedule is
verified like a rank's: one that counts a child twice or misses one fails the same checks.

Clock. A participant at height h (ranks 0, leaf switches 1, the root switch H) handles chunk t
at fixed steps: it sends it up at t + h (a switch has received its children's at t + h - 1 and
reduces them in that step), the root sends it down at t + H, and height h receives it from above
at t + 2H - h - 1 and forwards it at t + 2H - h. Every Send meets its Recv in the same step, so
chunks pipeline and nothing waits out of turn.

Chunks. Allreduce, reduce and broadcast cut the vector into S = min(MAX_CHUNKS,
floor(sqrt((2H-1) n / CHUNK_SCALE))) chunks (at least 1) that pipeline through the switches,
as the double binary
tree's do. A switch keeps a slot per child (``tmp``: children x n).

Costs (α per message hop, β per element through an endpoint's link, no γ at the endpoints: the
switches reduce):

allreduce: up, each rank sends its chunk and each switch sends the sum of its children's; down,
    the root multicasts the result, each switch forwards it, each rank receives it into
    ``out``. An endpoint sends n and receives n once, where a ring sends and receives
    2((p-1)/p)n: (S + 2H - 1)(α + (n/S)β).
reduce: up as allreduce; down only along the path to the root rank. (S + 2H - 1)(α + (n/S)β).
broadcast: the root rank's chunks go up its path to the root switch, which multicasts them to
    every rank (the root copies ``in`` to ``out`` itself). (S + 2H - 1)(α + (n/S)β).
barrier: allreduce of nothing: zero-count messages up and down. 2Hα.
allgather (multicast, as NVLS): up, each rank sends its block and a switch gathers its
    children's (a subtree's blocks go as one message per run of consecutive ranks); the root
    multicasts all p blocks down. An endpoint sends n and receives pn: 2Hα + pnβ.
reduce_scatter: up, each rank sends its p blocks and each switch the sum of its children's;
    down, a switch sends each child only its subtree's blocks, and a rank receives its own.
    An endpoint sends pn and receives n: 2Hα + pnβ.
gather, scatter, alltoall: not in-network (a switch neither reduces nor multicasts there).

Restrictions: assumes a commutative op; one aggregation tree per call.
"""
from __future__ import annotations

from functools import lru_cache
from math import isqrt
from typing import List, NamedTuple, Sequence, Tuple

from ..schedule import (
    IN,
    OUT,
    TMP,
    Copy,
    Op,
    Recv,
    Reduce,
    Schedule,
    Send,
    buffer_counts,
    chunk_bounds,
    concurrent,
    servers,
)

ALGORITHM = "innet"
COLLECTIVES = ("allreduce", "reduce", "broadcast", "barrier", "allgather", "reduce_scatter")
RADIX = 8                 # children per switch above the leaves (and ranks per leaf on one server)
# Pipelining: the lock-step pipeline takes (S + 2H - 1)(α + (n/S)β), least at
# S = sqrt((2H-1)nβ / α); CHUNK_SCALE stands for α/β in elements (a few µs of latency against
# hundreds of GB/s), and a call has at most MAX_CHUNKS chunks.
CHUNK_SCALE = 1 << 16
MAX_CHUNKS = 64

Placed = List[Tuple[int, Tuple[Op, ...]]]


class SwitchTree(NamedTuple):
    """The aggregation tree over ranks 0..size-1 and switches size..participants-1."""
    size: int
    parent: Tuple[int, ...]              # per participant; -1 for the root switch
    children: Tuple[Tuple[int, ...], ...]
    height: Tuple[int, ...]              # ranks 0, leaf switches 1, ...
    levels: int                          # H, the root switch's height
    ranks_under: Tuple[Tuple[int, ...], ...]   # the ranks of each participant's subtree, sorted

    @property
    def participants(self) -> int:
        return len(self.parent)


@lru_cache(maxsize=256)
def switch_tree(size: int, topology: Tuple[int, ...], radix: int = RADIX,
                levels: Tuple[Tuple[int, ...], ...] = ()) -> SwitchTree:
    """The aggregation tree (module doc): a leaf switch per server, then ``radix`` per parent.
    ``levels``: a fabric's shape instead of ``radix`` (the simulator's SHARP fat-tree): for each
    level above the leaf switches, the sizes of its consecutive groups of children (the servers
    under each network leaf switch, then the leaves under each spine, ...); ``radix`` above."""
    if radix < 2:
        raise ValueError(f"radix must be >= 2, got {radix}")
    nodes = servers(topology)
    groups = (nodes if len(nodes) > 1
              else [range(i, min(i + radix, size)) for i in range(0, size, radix)])
    parent, children, height = [-1] * size, [()] * size, [0] * size
    level = []
    for group in groups:
        s = len(parent)
        parent.append(-1)
        children.append(tuple(group))
        height.append(1)
        for r in group:
            parent[r] = s
        level.append(s)
    h = 1
    while len(level) > 1:
        h += 1
        nxt = []
        for i, j in _spans(len(level), radix, levels[h - 2] if h - 2 < len(levels) else ()):
            s = len(parent)
            parent.append(-1)
            children.append(tuple(level[i:j]))
            height.append(h)
            for c in level[i:j]:
                parent[c] = s
            nxt.append(s)
        level = nxt
    under: List[Tuple[int, ...]] = [(r,) for r in range(size)]
    for s in range(size, len(parent)):
        under.append(tuple(sorted(r for c in children[s] for r in under[c])))
    return SwitchTree(size, tuple(parent), tuple(children), tuple(height), h, tuple(under))


def _spans(n: int, radix: int, sizes: Tuple[int, ...]) -> List[Tuple[int, int]]:
    """[start, end) of each group of a level of n switches: ``sizes`` consecutive, else radix."""
    if not sizes:
        return [(i, min(i + radix, n)) for i in range(0, n, radix)]
    if sum(sizes) != n or min(sizes) < 1:
        raise ValueError(f"levels: groups of {list(sizes)} do not cover the {n} switches below")
    ends = [sum(sizes[:k + 1]) for k in range(len(sizes))]
    return list(zip([0] + ends[:-1], ends))


def participants(size: int, topology: Sequence[int],
                 levels: Tuple[Tuple[int, ...], ...] = ()) -> int:
    """Ranks and switches of a call on ``size`` ranks placed on ``topology``."""
    return switch_tree(size, tuple(topology), levels=levels).participants


def _runs(ranks: Sequence[int]) -> List[Tuple[int, int]]:
    """(first, length) of each run of consecutive ranks."""
    out: List[Tuple[int, int]] = []
    for r in ranks:
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out


def chunks(count: int, levels: int = 1) -> List[Tuple[int, int]]:
    """(offset, length) of each chunk of a call of ``count`` elements through ``levels`` of
    switches (module doc)."""
    return chunk_bounds(count, max(1, min(MAX_CHUNKS,
                                          isqrt((2 * levels - 1) * count // CHUNK_SCALE))))


def build(collective: str, rank: int, size: int, count: int, root: int,
          topology: Sequence[int], radix: int = RADIX,
          levels: Tuple[Tuple[int, ...], ...] = ()) -> Schedule:
    """The schedule of participant ``rank``: a rank below ``size``, a switch from it on.
    ``radix``: children per switch (``size`` on one server: a single switch, as the runtime's
    emulated switch is); ``levels``: a fabric-shaped tree instead (``switch_tree``)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"innet has no {collective}: a switch reduces and multicasts, which "
                         f"{collective} does not use; choose one of {', '.join(COLLECTIVES)}")
    tree = switch_tree(size, tuple(topology), radix, tuple(map(tuple, levels)))
    if not 0 <= rank < tree.participants:
        raise ValueError(f"participant {rank} outside 0..{tree.participants - 1}")
    placed: Placed = []
    tmp = _PLANS[collective](placed, tree, rank, count, root)
    ein, eout = buffer_counts(collective, size, count) if rank < size else (0, 0)
    return Schedule(collective, ALGORITHM, rank, size, count, root, concurrent(placed),
                    ein, eout, tmp)


def _reduce_tree(placed: Placed, tree: SwitchTree, me: int, n: int, down_to) -> int:
    """Up: chunks summed through the switches; down: the result sent to ``down_to(switch)``'s
    children, received by ranks among them into ``out``. Returns ``tmp``'s size."""
    H, h, up = tree.levels, tree.height[me], tree.parent[me]
    kids = tree.children[me]
    for t, (off, m) in enumerate(chunks(n, tree.levels)):
        if me < tree.size:
            if up >= 0:
                placed.append((t, (Send(up, IN, off, m),)))
            if me in down_to(up):
                placed.append((t + 2 * H - 1, (Recv(up, OUT, off, m),)))
            continue
        for i, kid in enumerate(kids):
            placed.append((t + h - 1, (Recv(kid, TMP, i * n + off, m),)))
        fold = tuple(Reduce(TMP, i * n + off, TMP, off, m) for i in range(1, len(kids)))
        if up >= 0:
            placed.append((t + h, fold + (Send(up, TMP, off, m),)))
            if me in down_to(up):
                placed.append((t + 2 * H - h - 1, (Recv(up, TMP, off, m),)))
        else:
            placed.append((t + h, fold))
        placed += [(t + 2 * H - h, (Send(kid, TMP, off, m),)) for kid in down_to(me)]
    return 0 if me < tree.size else len(kids) * n


def _allreduce(placed, tree, me, n, root):
    return _reduce_tree(placed, tree, me, n, lambda s: tree.children[s] if s >= 0 else ())


def _barrier(placed, tree, me, n, root):
    return _allreduce(placed, tree, me, 0, root)


def _reduce(placed, tree, me, n, root):
    def path(s):    # the child of s whose subtree holds the root rank
        return tuple(c for c in tree.children[s] if root in tree.ranks_under[c]) if s >= 0 else ()
    return _reduce_tree(placed, tree, me, n, path)


def _broadcast(placed, tree, me, n, root):
    H, h, up = tree.levels, tree.height[me], tree.parent[me]
    on_path = root in tree.ranks_under[me]
    for t, (off, m) in enumerate(chunks(n, tree.levels)):
        if me < tree.size:
            if me == root:
                placed.append((0, (Copy(IN, off, OUT, off, m),)))
                if up >= 0:
                    placed.append((t, (Send(up, IN, off, m),)))
            else:
                placed.append((t + 2 * H - 1, (Recv(up, OUT, off, m),)))
            continue
        if on_path:     # the chunk comes up from the root's side, and is not sent back there
            kid = next(c for c in tree.children[me] if root in tree.ranks_under[c])
            placed.append((t + h - 1, (Recv(kid, TMP, off, m),)))
            if up >= 0:
                placed.append((t + h, (Send(up, TMP, off, m),)))
        elif up >= 0:
            placed.append((t + 2 * H - h - 1, (Recv(up, TMP, off, m),)))
        placed += [(t + 2 * H - h, (Send(kid, TMP, off, m),)) for kid in tree.children[me]
                   if root not in tree.ranks_under[kid]]
    return 0 if me < tree.size else n


def _allgather(placed, tree, me, n, root):
    H, h, up = tree.levels, tree.height[me], tree.parent[me]
    p = tree.size
    if me < p:
        if up >= 0:
            placed.append((0, (Send(up, IN, 0, n),)))
        placed.append((2 * H - 1, (Recv(up, OUT, 0, p * n),)))
        return 0
    for kid in tree.children[me]:
        placed += [(h - 1, (Recv(kid, TMP, a * n, k * n),)) for a, k in _runs(tree.ranks_under[kid])]
    if up >= 0:
        placed += [(h, (Send(up, TMP, a * n, k * n),)) for a, k in _runs(tree.ranks_under[me])]
        placed.append((2 * H - h - 1, (Recv(up, TMP, 0, p * n),)))
    placed += [(2 * H - h, (Send(kid, TMP, 0, p * n),)) for kid in tree.children[me]]
    return p * n


def _reduce_scatter(placed, tree, me, n, root):
    H, h, up = tree.levels, tree.height[me], tree.parent[me]
    p, kids = tree.size, tree.children[me]
    w = p * n
    if me < p:
        if up >= 0:
            placed.append((0, (Send(up, IN, 0, w),)))
        placed.append((2 * H - 1, (Recv(up, OUT, 0, n),)))
        return 0
    placed += [(h - 1, (Recv(kid, TMP, i * w, w),)) for i, kid in enumerate(kids)]
    fold = tuple(Reduce(TMP, i * w, TMP, 0, w) for i in range(1, len(kids)))
    if up >= 0:
        placed.append((h, fold + (Send(up, TMP, 0, w),)))
        placed += [(2 * H - h - 1, (Recv(up, TMP, a * n, k * n),))
                   for a, k in _runs(tree.ranks_under[me])]
    else:
        placed.append((h, fold))
    for kid in kids:
        placed += [(2 * H - h, (Send(kid, TMP, a * n, k * n),))
                   for a, k in _runs(tree.ranks_under[kid])]
    return len(kids) * w


_PLANS = {"allreduce": _allreduce, "reduce": _reduce, "broadcast": _broadcast,
          "barrier": _barrier, "allgather": _allgather, "reduce_scatter": _reduce_scatter}


def build_all(collective: str, size: int, count: int, root: int = 0,
              topology: Sequence[int] = (), radix: int = RADIX,
              levels: Tuple[Tuple[int, ...], ...] = ()) -> List[Schedule]:
    """Every participant's schedule of one call (ranks, then switches): what the verifier
    takes."""
    topo = tuple(topology) or (0,) * size
    levels = tuple(map(tuple, levels))
    return [build(collective, r, size, count, root, topo, radix, levels)
            for r in range(switch_tree(size, topo, radix, levels).participants)]
