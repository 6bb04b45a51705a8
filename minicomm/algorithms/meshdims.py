"""meshdims: allreduce, reduce_scatter and allgather along the dimensions of an n-D full mesh.

The shape is UB-Mesh's (Liao et al., "UB-Mesh: a Hierarchically Localized nD-FullMesh
Datacenter Network Architecture", arXiv 2503.20377): inside a mesh unit (a rack, a pod) of
G = d_0 x ... x d_{k-1} accelerators, each accelerator has a direct link to the d_i - 1 others
that differ from it only in coordinate i; above the units, a Clos (the simulator's NICs and
fat-tree). This is not a runtime family (not in ``FAMILIES``): the simulator prices it
(``minicomm sim --algorithms mesh``), taking the dimensions from the topology
(``Topology.mesh_shape``: ``mesh_dims``, else one dimension of the server's g).

Ranks. The node map ``topology`` groups ranks into m mesh units, each of exactly G ranks (nodes
ordered by lowest rank, ranks in rank order: ``schedule.servers``); local index l in a unit has
coordinates c_i = (l // s_i) % d_i, s_0 = 1, s_i = d_0 ... d_{i-1} (the simulator's layout:
dimension 0 varies fastest). A rank's dimension-i group is the d_i ranks of its unit that differ
from it only in coordinate i; its Clos group the m ranks with its local index, one per unit.

Parts. The vector is cut into P = k parts (``parts``; fewer when there are fewer elements);
part c visits the dimensions in the order c, c+1, ..., c+k-1 (mod k). At every step the parts
are on different dimensions, so all of an accelerator's mesh links carry data at once instead
of one dimension's (the aim of the paper's Multi-Ring allreduce with All-Path Routing: no link
left idle). ``orders`` gives each part's order instead (the simulator's, ``engine.mesh_orders``:
the fastest dimensions first, those of equal bandwidth rotated among themselves). Parts run as
one merged schedule (``schedule.concurrent``): step s holds every part's s-th phase.

allreduce (per part, a vector of n' elements):
  reduce-scatter along each dimension in the part's order: in dimension i the rank's current
    segment is cut into d_i blocks (``chunk_bounds``), it sends block x to the group member of
    coordinate x and receives its own block (its coordinate's) from all d_i - 1 of them at
    once, reducing as they arrive (one step); the own block is the next dimension's segment.
  across the Clos: the Clos group allreduces its segment (of n'/G elements) with INTER
    ("rhd"; ``inter``), embedded at hier's lockstep rounds (skipped when m = 1).
  allgather back, the dimensions in reverse: the rank sends its block to the d_i - 1 group
    members and receives theirs into their places (one step each).
reduce_scatter: the input's blocks are first copied into part order (``tmp``): rank r's block
  goes to position ((c_{o_0} d_{o_1} + c_{o_1}) ... + c_{o_{k-1}}) m + u, o the part's
  dimension order and u r's unit, so that every dimension's split is contiguous; then the
  dimensions' reduce-scatters as above on that vector (in place), then the Clos group's
  reduce-scatter of its m blocks into ``out``. The Clos moves the least data, so it comes last.
allgather: the reverse: the Clos group's allgather first (into the rank's place of the part
  order), the dimensions' allgathers in reverse order, then the blocks copied to rank order
  (skipped where part order is rank order).

The paper's own allreduce is a Multi-Ring: logical rings mapped onto disjoint paths, idle links
borrowed through All-Path Routing (its section 5.1). What is built here is the dimension-order
reduce-scatter / allgather the n-D full mesh invites, one direct step per dimension, which on
one dimension is the Mesh algorithm of Huawei's HCCL (reduce-scatter α + (1/p)nβ + ((p-1)/p)nγ,
β per link: https://github.com/hicann/hccl, docs/en/user_guide/coll_algo_intro/Mesh.md), with
the Clos between the reduce-scatters and the allgathers.

Costs (α-β-γ; per dimension i, α_i the latency of a direct link, B_i an accelerator's bandwidth
in dimension i, shared evenly by its d_i - 1 links, which all carry at once; n_i the segment
entering dimension i, n_0 = n; T_I the INTER family's cost, rhd.py):
  allreduce, one part: sum_i 2(α_i + ((d_i - 1)/d_i) n_i/B_i) + sum_i ((d_i - 1)/d_i) n_i γ
    + T_I(allreduce, m, n/G), n_{i+1} = n_i / d_i. With equal dimensions (B_i = B) and m = 1,
    k parts: 2(1 - 1/G) n/(kB), so busbw = k B, the accelerator's whole mesh bandwidth (one
    part: B, one dimension's share).
  reduce_scatter: sum_i (α_i + ((d_i - 1)/d_i) N_i/B_i + ((d_i - 1)/d_i) N_i γ) + δ p n
    + T_I(reduce_scatter, m, n), N_0 = p n, N_{i+1} = N_i / d_i.
  allgather: T_I(allgather, m, n) + sum_i (α_i + ((d_i - 1)/d_i) N_i/B_i) + δ p n.
  A rank starts d_i - 1 messages at once per dimension step (the sender's issue gap each).
  Communicating steps: allreduce 2k + the INTER rounds; reduce_scatter and allgather k + them.

Restrictions: every unit holds exactly G ranks (else ValueError); dimensions of at least 2;
only allreduce, reduce_scatter and allgather; assumes a commutative op (a block's
contributions are reduced in arrival order).
"""
from __future__ import annotations

from functools import lru_cache
from math import prod
from numbers import Integral
from typing import List, NamedTuple, Optional, Sequence, Tuple

from ..schedule import (
    IN,
    OUT,
    TMP,
    Copy,
    Op,
    Recv,
    Schedule,
    ScheduleBuilder,
    Send,
    chunk_bounds,
    concurrent,
    embed,
    servers,
)
from .hier import _flat, _rounds, _span  # hier's flat phases and their lockstep rounds

ALGORITHM = "mesh"
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
INTER = "rhd"          # across the Clos: log-depth rounds on the slow tier, as hier's

Placed = List[Tuple[int, Tuple[Op, ...]]]
Span = Tuple[int, int]   # (offset, length)


def check_dims(dims: Sequence[int]) -> Tuple[int, ...]:
    """The dimensions as a tuple, or a ValueError saying what is wrong with them."""
    try:
        out = tuple(dims)
    except TypeError:
        raise ValueError(f"mesh dims must be a sequence of integers, got {dims!r}") from None
    if not out:
        raise ValueError("mesh dims must name at least one dimension")
    for d in out:
        if not isinstance(d, Integral) or isinstance(d, bool) or d < 2:
            raise ValueError(f"mesh dims {list(out)}: every dimension is an integer >= 2, "
                             f"got {d!r}")
    return tuple(int(d) for d in out)


class _Place(NamedTuple):
    """Where one rank sits: every unit, its unit and index there, its coordinates."""
    rank: int
    dims: Tuple[int, ...]
    units: Tuple[Tuple[int, ...], ...]
    unit: int                      # index of the rank's unit
    local: int                     # its index inside the unit
    coords: Tuple[int, ...]
    strides: Tuple[int, ...]

    @property
    def m(self) -> int:
        return len(self.units)

    def peer(self, dim: int, x: int) -> int:
        """The member of this rank's dimension-``dim`` group with coordinate x."""
        return self.units[self.unit][self.local + (x - self.coords[dim]) * self.strides[dim]]

    def clos_group(self) -> List[int]:
        return [u[self.local] for u in self.units]


@lru_cache(maxsize=64)
def _layout(topology: Tuple[int, ...]):
    """(units, unit of every rank, local index of every rank)."""
    units = servers(topology)
    unit_of, local_of = [0] * len(topology), [0] * len(topology)
    for k, u in enumerate(units):
        for i, r in enumerate(u):
            unit_of[r], local_of[r] = k, i
    return units, unit_of, local_of


def _place(rank: int, size: int, topology: Optional[Sequence[int]], dims) -> _Place:
    dims = check_dims(dims)
    topology = tuple(topology) if topology is not None else (0,) * size
    if len(topology) != size:
        raise ValueError(f"topology names {len(topology)} ranks, world size is {size}")
    units, unit_of, local_of = _layout(topology)
    G = prod(dims)
    if any(len(u) != G for u in units):
        raise ValueError(f"mesh dims {list(dims)} need units of {G} ranks; the node map has units "
                         f"of {sorted({len(u) for u in units})}")
    strides = tuple(prod(dims[:i]) for i in range(len(dims)))
    local = local_of[rank]
    coords = tuple(local // s % d for s, d in zip(strides, dims))
    return _Place(rank, dims, units, unit_of[rank], local, coords, strides)


@lru_cache(maxsize=64)
def _positions(units: Tuple[Tuple[int, ...], ...], dims: Tuple[int, ...],
               order: Tuple[int, ...]) -> Tuple[int, ...]:
    """Every rank's block position in part order (module doc: reduce_scatter)."""
    strides = [prod(dims[:i]) for i in range(len(dims))]
    pos = [0] * (len(units) * prod(dims))
    for u, members in enumerate(units):
        for local, r in enumerate(members):
            x = 0
            for dim in order:
                x = x * dims[dim] + local // strides[dim] % dims[dim]
            pos[r] = x * len(units) + u
    return tuple(pos)


def build(collective: str, rank: int, size: int, count: int, root: int,
          topology: Optional[Sequence[int]], dims: Sequence[int],
          parts: Optional[int] = None, inter: str = INTER,
          orders: Optional[Sequence[Sequence[int]]] = None) -> Schedule:
    """One rank's schedule (module doc). ``parts``: the vector's parts, default one per
    dimension, part c visiting the dimensions from c on; ``orders``: instead, one dimension
    order per part (each a permutation of the dimensions); ``inter``: the flat family across
    the Clos ("rhd" or "ring")."""
    if collective not in COLLECTIVES:
        raise ValueError(f"mesh builds {', '.join(COLLECTIVES)}, not {collective}: use a "
                         f"family (ring, tree, rhd, hier) for it")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if inter not in ("rhd", "ring"):
        raise ValueError(f"inter must be 'rhd' or 'ring', got {inter!r}")
    me = _place(rank, size, topology, dims)
    orders = check_orders(len(me.dims), parts, orders)
    b = ScheduleBuilder(collective, ALGORITHM, rank, size, count, root)
    placed: Placed = []
    bounds = chunk_bounds(count, len(orders))
    span = _clos_span(collective, me, [ln for _, ln in bounds], inter)
    for order, (off, ln) in zip(orders, bounds):
        if ln:
            _BUILDERS[collective](b, me, placed, order, off, ln, inter, span)
    b.extend(concurrent(placed))
    return b.build()


def check_orders(k: int, parts: Optional[int] = None,
                 orders: Optional[Sequence[Sequence[int]]] = None) -> Tuple[Tuple[int, ...], ...]:
    """Each part's dimension order: ``orders`` as given, else ``parts`` (default k) rotations
    of 0..k-1; a ValueError when an order is not a permutation of the dimensions."""
    if orders is None:
        parts = k if parts is None else int(parts)
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        return tuple(tuple((c + s) % k for s in range(k)) for c in range(parts))
    out = tuple(tuple(int(x) for x in o) for o in orders)
    if not out or any(sorted(o) != list(range(k)) for o in out):
        raise ValueError(f"orders {list(out)}: each must be a permutation of the {k} dimensions")
    return out


def _clos_span(collective: str, me: _Place, lengths: Sequence[int], inter: str) -> int:
    """Rounds of the longest Clos phase of any rank and part: the phases after it start at one
    index everywhere, so that every pair's messages of several parts are in one order on both
    sides (FIFO matching)."""
    if me.m == 1:
        return 0
    G = prod(me.dims)
    counts = set(lengths)
    if collective == "allreduce":        # what the dimensions' splits leave: ⌊n'/G⌋ or ⌈n'/G⌉
        counts = {c for ln in lengths for c in (ln // G, -(-ln // G))}
    return max((_span(collective, inter, me.m, c) for c in counts if c), default=0)


def build_all(collective: str, size: int, count: int, root: int = 0,
              topology: Optional[Sequence[int]] = None, dims: Sequence[int] = (),
              parts: Optional[int] = None, inter: str = INTER,
              orders: Optional[Sequence[Sequence[int]]] = None) -> List[Schedule]:
    """The schedules of every rank of one call (what the verifier and the simulator take);
    ``dims`` defaults to one dimension of every rank of a unit."""
    if not tuple(dims):
        units = servers(tuple(topology) if topology is not None else (0,) * size)
        dims = (len(units[0]),)
    return [build(collective, r, size, count, root, topology, dims, parts, inter, orders)
            for r in range(size)]


Where = Tuple[str, int]   # (buffer, the offset that part-order offset 0 maps to)


def _exchange(me: _Place, dim: int, blocks: Sequence[Span], reduce: bool, src: Where,
              dst: Where) -> List[Op]:
    """One dimension step. Reducing: block x (read at ``src``) to member x, and the own block
    (its coordinate's) from every member into ``dst``, reducing as they arrive. Gathering: the
    own block (read at ``src``) to every member, theirs into their places at ``dst``.
    Zero-length blocks send nothing (both sides know every length)."""
    mine = me.coords[dim]
    own = blocks[mine]
    (sb, so), (db, do) = src, dst
    ops: List[Op] = []
    for x, blk in enumerate(blocks):
        if x == mine:
            continue
        peer = me.peer(dim, x)
        out, into = (blk, own) if reduce else (own, blk)
        if out[1]:
            ops.append(Send(peer, sb, so + out[0], out[1]))
        if into[1]:
            ops.append(Recv(peer, db, do + into[0], into[1], reduce=reduce))
    return ops


def _split(seg: Span, d: int) -> List[Span]:
    return [(seg[0] + o, ln) for o, ln in chunk_bounds(seg[1], d)]


def _clos(b: ScheduleBuilder, me: _Place, coll: str, inter: str, count: int, inb: Where,
          outb: Where, first: int, placed: Placed) -> None:
    """The Clos group's ``coll`` of ``count`` at hier's lockstep rounds from index ``first``
    (a message sits at one index on both of its sides, so parts merge in one order on both)."""
    if me.m == 1 or count == 0:
        return
    sub = _flat(coll, inter, me.unit, me.m, count, 0)
    steps = embed(sub, me.clos_group(),
                  {IN: inb, OUT: outb, TMP: (TMP, b.alloc_tmp(sub.tmp_count))})
    rounds = _rounds(coll, inter, me.m, count, 0)[me.unit]
    placed.extend((first + r, st) for r, st in zip(rounds, steps))


def _allreduce(b: ScheduleBuilder, me: _Place, placed: Placed, order, off: int, ln: int,
               inter: str, span: int) -> None:
    seg: Span = (off, ln)
    levels = []
    for s, dim in enumerate(order):
        blocks = _split(seg, me.dims[dim])
        own = blocks[me.coords[dim]]
        # the first dimension reads the input and reduces into ``out``, its own block staged
        ops = _exchange(me, dim, blocks, True, (IN if s == 0 else OUT, 0), (OUT, 0))
        if s == 0 and own[1]:
            ops.insert(0, Copy(IN, own[0], OUT, own[0], own[1]))
        placed.append((s, tuple(ops)))
        levels.append((dim, blocks))
        seg = own
    k = len(order)
    total = None
    if me.m > 1 and seg[1]:
        total = (TMP, b.alloc_tmp(seg[1]))
    _clos(b, me, "allreduce", inter, seg[1], (OUT, seg[0]), total, k, placed)
    for t, (dim, blocks) in enumerate(reversed(levels)):
        own = blocks[me.coords[dim]]
        src = (TMP, total[1] - own[0]) if t == 0 and total else (OUT, 0)
        ops = _exchange(me, dim, blocks, False, src, (OUT, 0))
        if t == 0 and total:
            ops.insert(0, Copy(TMP, total[1], OUT, own[0], own[1]))
        placed.append((k + span + t, tuple(ops)))


def _moves(me: _Place, order, off: int, ln: int, n: int) -> List[Tuple[int, int]]:
    """(rank-order offset, part-order offset) of this part of every block; [] when the part
    order is the rank order (nothing to move)."""
    pos = _positions(me.units, me.dims, tuple(order))
    if ln == n and all(x == r for r, x in enumerate(pos)):
        return []
    return sorted((r * n + off, x * ln) for r, x in enumerate(pos))


def _copies(src: str, dst: str, moves, ln: int, sbase: int, dbase: int) -> List[Copy]:
    """Copy ops for ``ln``-element blocks (source offset, destination offset), adjacent blocks
    merged."""
    ops: List[List[int]] = []
    for so, do in sorted(moves):
        if ops and ops[-1][0] + ops[-1][2] == so and ops[-1][1] + ops[-1][2] == do:
            ops[-1][2] += ln
        else:
            ops.append([so, do, ln])
    return [Copy(src, sbase + so, dst, dbase + do, c) for so, do, c in ops]


def _reduce_scatter(b: ScheduleBuilder, me: _Place, placed: Placed, order, off: int, ln: int,
                    inter: str, span: int) -> None:
    p = me.m * prod(me.dims)
    moves = _moves(me, order, off, ln, b.count)
    k = len(order)
    # one unit, one dimension, rank order: straight from ``in`` into ``out``, no scratch
    vec = b.alloc_tmp(p * ln) if moves or k > 1 or me.m > 1 else 0
    # the part-order vector: copied into ``tmp``, or read where it is when that is rank order
    first = _copies(IN, TMP, moves, ln, 0, vec) if moves else []
    at: Where = (TMP, vec) if moves else (IN, 0)
    seg: Span = (0, p * ln)
    for s, dim in enumerate(order):
        blocks = _split(seg, me.dims[dim])
        own = blocks[me.coords[dim]]
        # the last reduction of a single unit lands in ``out``; the others stay in ``tmp``
        dst: Where = (OUT, off - own[0]) if s == k - 1 and me.m == 1 else (TMP, vec)
        ops = _exchange(me, dim, blocks, True, at, dst)
        if at != dst and own[1]:
            ops.insert(0, Copy(at[0], at[1] + own[0], dst[0], dst[1] + own[0], own[1]))
        placed.append((s, tuple(first + ops) if s == 0 else tuple(ops)))
        at, seg = (TMP, vec), own
    _clos(b, me, "reduce_scatter", inter, ln, (TMP, vec + seg[0]), (OUT, off), k, placed)


def _allgather(b: ScheduleBuilder, me: _Place, placed: Placed, order, off: int, ln: int,
               inter: str, span: int) -> None:
    p = me.m * prod(me.dims)
    moves = _moves(me, order, off, ln, b.count)
    at: Where = (TMP, b.alloc_tmp(p * ln)) if moves else (OUT, 0)
    levels = []
    seg: Span = (0, p * ln)
    for dim in order:
        blocks = _split(seg, me.dims[dim])
        levels.append((dim, blocks))
        seg = blocks[me.coords[dim]]
    _clos(b, me, "allgather", inter, ln, (IN, off), (at[0], at[1] + seg[0]), 0, placed)
    for t, (dim, blocks) in enumerate(reversed(levels)):
        own = blocks[me.coords[dim]]
        # one unit: the first step sends the input block itself and keeps a copy of it
        src: Where = (IN, off - own[0]) if t == 0 and me.m == 1 else at
        ops = _exchange(me, dim, blocks, False, src, at)
        if t == 0 and me.m == 1:
            ops.insert(0, Copy(IN, off, at[0], at[1] + own[0], ln))
        placed.append((span + t, tuple(ops)))
    if moves:
        back = [(x, r) for r, x in moves]
        placed.append((span + len(order), tuple(_copies(TMP, OUT, back, ln, at[1], 0))))


_BUILDERS = {"allreduce": _allreduce, "reduce_scatter": _reduce_scatter,
             "allgather": _allgather}
