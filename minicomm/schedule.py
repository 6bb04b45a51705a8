"""The schedule IR: what every algorithm produces and every interpreter consumes.

A schedule is the program one rank runs for one collective call. It is a list of *steps*; a step
is a tuple of ops issued together and completed together:

    Send(peer, buf, offset, count)                 send buf[offset:offset+count] to peer
    Recv(peer, buf, offset, count, reduce=False)   receive into buf[...] (reduce=True: buf op= msg)
    Copy(src, src_offset, dst, dst_offset, count)  local dst[...] = src[...]
    Reduce(src, src_offset, dst, dst_offset, count) local dst[...] op= src[...]

Buffers are flat 1-D arrays of the call's dtype, named ``in`` (the caller's input, never written),
``out`` (the result) and ``tmp`` (scratch of ``Schedule.tmp_count`` elements). Offsets and counts
are in elements.

Execution order inside one step (all three interpreters agree on it):
  1. local ops (Copy / Reduce), in the order listed;
  2. every Recv is posted;
  3. every Send is posted — the data sent is the buffer content after (1);
  4. the step ends when every Send and Recv of it has completed.
Messages between one ordered pair (src, dst) match in FIFO order: the k-th Send from a to b is
the k-th Recv on b from a; both must have the same count.

Buffer sizes per collective (n = the per-rank block ``count``, p = world size):

    collective      in        out       notes
    broadcast       n         n         only root's ``in`` is read
    reduce          n         n         only root's ``out`` is the result (others: scratch)
    allreduce       n         n
    allgather       n         p*n       out[j*n:(j+1)*n] = in of rank j
    reduce_scatter  p*n       n         out = sum over ranks of in[rank*n:(rank+1)*n]
    gather          n         p*n       only root's ``out`` is the result (others: scratch)
    scatter         p*n       n         only root's ``in`` is read
    alltoall        p*n       p*n       out[j*n:...] = in of rank j at [rank*n:...]
    barrier         0         0         messages of count 0 carry only ordering

Uneven blocks (``counts``, c_j elements for rank j; T = their sum; blocks lie in rank order, block
j at o_j = c_0 + ... + c_{j-1}) and prefix reductions:

    allgatherv      c_r       T         out[o_j:o_j+c_j] = in of rank j
    gatherv         c_r       T         only root's ``out`` is the result
    scatterv        T         c_r       only root's ``in`` is read; out = its block r
    reduce_scatterv T         c_r       out = sum over ranks of in[o_r:o_r+c_r]
    alltoallv       S_r       R_r       ``counts`` is the p x p matrix C, row-major: rank i sends
                                        C[i][j] elements to rank j; S_r = sum_j C[r][j], R_r =
                                        sum_i C[i][r]; out holds the blocks by source rank, in
                                        holds them by destination rank
    scan            n         n         out = in_0 op ... op in_r
    exscan          n         n         out = in_0 op ... op in_{r-1} (rank 0: undefined)

For these ``count`` is T (alltoallv: the sum of C; scan: n), the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

IN, OUT, TMP = "in", "out", "tmp"
BUFFERS = (IN, OUT, TMP)

COLLECTIVES = ("broadcast", "reduce", "allreduce", "allgather", "reduce_scatter",
               "gather", "scatter", "alltoall", "barrier")
# uneven blocks (``counts``) and prefix reductions: module doc
UNEVEN = ("allgatherv", "gatherv", "scatterv", "alltoallv", "reduce_scatterv")
PREFIX = ("scan", "exscan")
ALL_COLLECTIVES = COLLECTIVES + UNEVEN + PREFIX
REDUCING = frozenset({"reduce", "allreduce", "reduce_scatter", "reduce_scatterv", "scan",
                      "exscan"})
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter", "gatherv", "scatterv"})


@dataclass(frozen=True)
class Send:
    """Send ``buf[offset:offset+count]`` to ``peer``.

    The data sent is the buffer's content after the step's local ops.

    Attributes:
        peer (int): The destination rank.
        buf (str): "in", "out" or "tmp".
        offset (int): The first element.
        count (int): The number of elements (0: a message that only orders).

    Examples:
        >>> Send(1, IN, 0, 4)
        Send(peer=1, buf='in', offset=0, count=4)
    """
    peer: int
    buf: str
    offset: int
    count: int


@dataclass(frozen=True)
class Recv:
    """Receive from ``peer`` into ``buf[offset:offset+count]`` (``reduce=True``: ``buf op= msg``).

    Messages of one ordered pair match in FIFO order, with the same count on both sides.

    Attributes:
        peer (int): The source rank.
        buf (str): "out" or "tmp" (never "in").
        offset (int): The first element.
        count (int): The number of elements.
        reduce (bool): Combine the message into the buffer with the call's op instead of
            overwriting it.

    Examples:
        >>> Recv(0, TMP, 0, 4, reduce=True).reduce
        True
    """
    peer: int
    buf: str
    offset: int
    count: int
    reduce: bool = False


@dataclass(frozen=True)
class Copy:
    """Local ``dst[dst_offset:dst_offset+count] = src[src_offset:src_offset+count]``.

    Attributes:
        src (str): The buffer read.
        src_offset (int): Its first element.
        dst (str): The buffer written ("out" or "tmp").
        dst_offset (int): Its first element.
        count (int): The number of elements.

    Examples:
        >>> Copy(IN, 0, OUT, 4, 4).dst
        'out'
    """
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    count: int


@dataclass(frozen=True)
class Reduce:
    """Local ``dst[dst_offset:...] op= src[src_offset:...]`` with the call's op.

    Attributes:
        src (str): The buffer read.
        src_offset (int): Its first element.
        dst (str): The buffer combined into ("out" or "tmp").
        dst_offset (int): Its first element.
        count (int): The number of elements.

    Examples:
        >>> Reduce(TMP, 0, OUT, 0, 4).count
        4
    """
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    count: int


Op = Union[Send, Recv, Copy, Reduce]
Step = Tuple[Op, ...]
Topology = Tuple[int, ...]   # node id of every rank, e.g. (0, 0, 1, 1)


@lru_cache(maxsize=256)
def servers(topology: Topology) -> Tuple[Tuple[int, ...], ...]:
    """The ranks of each node of ``topology``, nodes in order of their lowest rank.

    Args:
        topology (tuple): The node id of every rank.

    Returns:
        (tuple): One tuple of ranks (ascending) per node.

    Examples:
        >>> servers((1, 1, 0, 1, 0))
        ((0, 1, 3), (2, 4))
    """
    members: Dict[int, List[int]] = {}
    for r, node in enumerate(topology):
        members.setdefault(node, []).append(r)   # dicts keep first appearance: lowest-rank order
    return tuple(tuple(g) for g in members.values())


def buffer_counts(collective: str, size: int, count: int) -> Tuple[int, int]:
    """(in_count, out_count) in elements for a collective with per-rank block ``count``.

    Args:
        collective (str): One of ``COLLECTIVES``.
        size (int): The world size.
        count (int): The per-rank block, in elements.

    Returns:
        (tuple): ``(in_count, out_count)`` (module doc: the buffer sizes per collective).

    Raises:
        KeyError: An unknown collective.

    Examples:
        >>> buffer_counts("allgather", 4, 10)
        (10, 40)
    """
    n, p = count, size
    return {
        "broadcast": (n, n), "reduce": (n, n), "allreduce": (n, n),
        "allgather": (n, p * n), "reduce_scatter": (p * n, n),
        "gather": (n, p * n), "scatter": (p * n, n), "alltoall": (p * n, p * n),
        "barrier": (0, 0),
    }[collective]


def blocks_of(counts: Sequence[int]) -> List[Tuple[int, int]]:
    """(offset, count) of each rank's block when blocks of ``counts`` lie in rank order.

    Examples:
        >>> blocks_of((2, 0, 3))
        [(0, 2), (2, 0), (2, 3)]
    """
    out, off = [], 0
    for c in counts:
        out.append((off, c))
        off += c
    return out


def matrix_of(counts: Sequence[int], size: int) -> List[Tuple[int, ...]]:
    """alltoallv's ``counts`` as rows: row i holds what rank i sends to each rank."""
    if len(counts) != size * size:
        raise ValueError(f"alltoallv counts: {len(counts)} entries for {size} x {size}")
    return [tuple(counts[i * size:(i + 1) * size]) for i in range(size)]


def call_buffer_counts(collective: str, rank: int, size: int, count: int,
                       counts: Sequence[int] = ()) -> Tuple[int, int]:
    """(in_count, out_count) of ``rank``'s buffers, uneven and prefix collectives included
    (module doc); the others as ``buffer_counts``."""
    if collective in ("allgatherv", "gatherv"):
        return counts[rank], sum(counts)
    if collective in ("scatterv", "reduce_scatterv"):
        return sum(counts), counts[rank]
    if collective == "alltoallv":
        rows = matrix_of(counts, size)
        return sum(rows[rank]), sum(row[rank] for row in rows)
    if collective in PREFIX:
        return count, count
    return buffer_counts(collective, size, count)


@dataclass
class Schedule:
    """The program one rank runs for one collective call: its steps and buffer sizes.

    Attributes:
        collective (str): The collective.
        algorithm (str): The family that built it.
        rank (int): The rank that runs it.
        size (int): The world size.
        count (int): The per-rank block, in elements.
        root (int): The root (0 for unrooted collectives).
        steps (list): The steps, each a tuple of ops issued and completed together.
        in_count (int): Elements of ``in``.
        out_count (int): Elements of ``out``.
        tmp_count (int): Elements of scratch ``tmp``.
        counts (tuple): The uneven collectives' blocks (module doc); empty for the others.

    Examples:
        >>> from minicomm.algorithms import build_schedule
        >>> s = build_schedule("allreduce", "ring", 0, 4, 8, 0)
        >>> s.in_count, s.out_count, s.comm_steps
        (8, 8, 6)
    """
    collective: str
    algorithm: str
    rank: int
    size: int
    count: int
    root: int
    steps: List[Step]
    in_count: int
    out_count: int
    tmp_count: int = 0
    counts: Tuple[int, ...] = ()      # uneven collectives: the blocks (module doc)

    @property
    def comm_steps(self) -> int:
        """Number of steps that communicate (the 'rounds' of the algorithm's latency term).

        Returns:
            (int): The steps with a Send or a Recv.
        """
        return sum(1 for s in self.steps if any(isinstance(o, (Send, Recv)) for o in s))

    def summary(self) -> str:
        """A one-line description: algorithm, collective, rank, count, root and step counts.

        Returns:
            (str): The summary.

        Examples:
            >>> b = ScheduleBuilder("barrier", "ring", rank=0, size=2, count=0)
            >>> b.step(Send(1, IN, 0, 0), Recv(1, OUT, 0, 0))
            >>> b.build().summary()
            'ring barrier rank 0/2 count=0 root=0: 1 steps, 1 communicating, tmp=0'
        """
        return (f"{self.algorithm} {self.collective} rank {self.rank}/{self.size} "
                f"count={self.count} root={self.root}: {len(self.steps)} steps, "
                f"{self.comm_steps} communicating, tmp={self.tmp_count}")


@dataclass(frozen=True)
class Chunk:
    """A region of one buffer, and the ops that move it (MSCCLang's chunks in this IR).

    ``ScheduleBuilder.chunks`` cuts a buffer into them; a schedule is then written in chunks,
    not offsets.

    Attributes:
        buf (str): "in", "out" or "tmp".
        offset (int): Its first element.
        count (int): Its elements.

    Examples:
        >>> c = Chunk(OUT, 4, 4)
        >>> c.send(1), c.recv(2, reduce=True).reduce
        (Send(peer=1, buf='out', offset=4, count=4), True)
    """
    buf: str
    offset: int
    count: int

    def send(self, peer: int) -> Send:
        """Send this chunk to ``peer``."""
        return Send(peer, self.buf, self.offset, self.count)

    def recv(self, peer: int, reduce: bool = False) -> Recv:
        """Receive this chunk from ``peer`` (``reduce``: combine into it)."""
        return Recv(peer, self.buf, self.offset, self.count, reduce)

    def copy_to(self, dst: "Chunk") -> Copy:
        """``dst = this chunk`` (same count)."""
        return Copy(self.buf, self.offset, dst.buf, dst.offset, self.count)

    def reduce_into(self, dst: "Chunk") -> Reduce:
        """``dst op= this chunk`` (same count)."""
        return Reduce(self.buf, self.offset, dst.buf, dst.offset, self.count)

    def split(self, parts: int) -> List["Chunk"]:
        """This chunk cut into ``parts`` (sizes differ by at most one)."""
        return [Chunk(self.buf, self.offset + o, n) for o, n in chunk_bounds(self.count, parts)]


class ScheduleBuilder:
    """Convenience for algorithm writers: collects steps and scratch space.

    Args:
        collective (str): One of ``COLLECTIVES``.
        algorithm (str): The family's name.
        rank (int): The rank the schedule is for.
        size (int): The world size.
        count (int): The per-rank block, in elements.
        root (int): The root of a rooted collective.

    Examples:
        >>> b = ScheduleBuilder("allreduce", "ring", rank=0, size=2, count=4)
        >>> off = b.alloc_tmp(4)                   # a fresh region of 4 elements in ``tmp``
        >>> b.step(Copy(IN, 0, OUT, 0, 4), Send(1, IN, 0, 4), Recv(1, TMP, off, 4))
        >>> b.step(Reduce(TMP, off, OUT, 0, 4))
        >>> b.build().summary()
        'ring allreduce rank 0/2 count=4 root=0: 2 steps, 1 communicating, tmp=4'
    """

    def __init__(self, collective: str, algorithm: str, rank: int, size: int, count: int,
                 root: int = 0, counts: Sequence[int] = ()):
        self.collective, self.algorithm = collective, algorithm
        self.rank, self.size, self.count, self.root = rank, size, count, root
        self.counts = tuple(counts)
        self.in_count, self.out_count = call_buffer_counts(collective, rank, size, count,
                                                           self.counts)
        self.steps: List[Step] = []
        self.tmp_count = 0

    def step(self, *ops: Op) -> None:
        """Append one step; ops with count 0 are kept only if they carry ordering (Send/Recv).

        Args:
            *ops (Op): The step's ops, issued together and completed together.

        Examples:
            >>> b = ScheduleBuilder("allreduce", "ring", rank=0, size=2, count=4)
            >>> b.step(Copy(IN, 0, OUT, 0, 0))         # nothing to do: no step
            >>> len(b.steps)
            0
        """
        for o in ops:
            if o.count <= 0 and o.__class__ is not Send and o.__class__ is not Recv:
                ops = tuple(o for o in ops if isinstance(o, (Send, Recv)) or o.count > 0)
                break
        if ops:
            self.steps.append(ops)

    def extend(self, steps: Iterable[Step]) -> None:
        """Append steps (each through ``step``), e.g. those ``embed`` made.

        Args:
            steps (Iterable[Step]): The steps.
        """
        for s in steps:
            self.step(*s)

    def chunks(self, buf: str, parts: int) -> List[Chunk]:
        """Buffer ``buf`` ("in", "out") cut into ``parts`` chunks (sizes differ by at most one):
        with ``parts`` = size, block j of a blocked buffer is chunk j.

        Examples:
            >>> b = ScheduleBuilder("allgather", "mine", rank=0, size=2, count=3)
            >>> b.chunks(OUT, 2)
            [Chunk(buf='out', offset=0, count=3), Chunk(buf='out', offset=3, count=3)]
        """
        size = {IN: self.in_count, OUT: self.out_count}.get(buf)
        if size is None:
            raise ValueError(f"chunks of {buf!r}: give 'in' or 'out' (tmp: tmp_chunk)")
        return Chunk(buf, 0, size).split(parts)

    def tmp_chunk(self, count: int) -> Chunk:
        """A fresh region of ``count`` elements of ``tmp``."""
        return Chunk(TMP, self.alloc_tmp(count), count)

    def alloc_tmp(self, count: int) -> int:
        """Reserve ``count`` fresh elements of ``tmp``.

        Args:
            count (int): The number of elements.

        Returns:
            (int): The region's offset in ``tmp``.

        Examples:
            >>> b = ScheduleBuilder("allreduce", "ring", rank=0, size=2, count=4)
            >>> b.alloc_tmp(4), b.alloc_tmp(2), b.tmp_count
            (0, 4, 6)
        """
        off = self.tmp_count
        self.tmp_count += count
        return off

    def build(self) -> Schedule:
        """The ``Schedule`` of the steps so far.

        Returns:
            (Schedule): The schedule.
        """
        return Schedule(self.collective, self.algorithm, self.rank, self.size, self.count,
                        self.root, self.steps, self.in_count, self.out_count, self.tmp_count,
                        self.counts)


BufMap = Dict[str, Tuple[str, int]]   # sub-schedule buffer name -> (outer buffer, base offset)


def concurrent(placed: Iterable[Tuple[int, Step]]) -> List[Step]:
    """Streams of steps run at once: each step placed at an index of the merged schedule, whose
    step k holds every op placed at k, in the order placed (what ring's channels and hier's
    pipeline do); indices nothing was placed at are dropped.

    Args:
        placed (Iterable[tuple]): ``(index, step)`` pairs.

    Returns:
        (list): The merged steps, by index.

    Examples:
        >>> a, b = Send(1, IN, 0, 2), Recv(1, OUT, 0, 2)
        >>> concurrent([(0, (a,)), (0, (b,)), (3, (a,))])
        [(Send(peer=1, buf='in', offset=0, count=2), Recv(peer=1, buf='out', offset=0, count=2, reduce=False)), (Send(peer=1, buf='in', offset=0, count=2),)]
    """
    slots: Dict[int, List[Op]] = {}
    for k, step in placed:
        slots.setdefault(k, []).extend(step)
    return [tuple(slots[k]) for k in sorted(slots)]


def embed(sub: Schedule, group: Sequence[int], bufmap: BufMap) -> List[Step]:
    """Translate a schedule built for a sub-group into steps of the enclosing schedule.

    This is how hierarchical algorithms reuse the flat families on a node or on the node
    leaders: the verifier then checks the composition as a whole.

    Args:
        sub (Schedule): The sub-group's schedule.
        group (Sequence[int]): ``group[i]`` is the outer rank of sub-rank i.
        bufmap (BufMap): Every buffer the sub-schedule uses -> (outer buffer name, base offset).

    Returns:
        (list): The steps, in the enclosing schedule's ranks and buffers.

    Examples:
        >>> sub = ScheduleBuilder("broadcast", "tree", rank=0, size=2, count=3)
        >>> sub.step(Send(1, IN, 0, 3))
        >>> embed(sub.build(), group=[0, 2], bufmap={IN: (OUT, 3)})
        [(Send(peer=2, buf='out', offset=3, count=3),)]
    """
    def mb(name: str, off: int) -> Tuple[str, int]:
        outer, base = bufmap[name]
        return outer, base + off

    steps: List[Step] = []
    for st in sub.steps:
        ops: List[Op] = []
        for o in st:
            if isinstance(o, Send):
                b, off = mb(o.buf, o.offset)
                ops.append(Send(group[o.peer], b, off, o.count))
            elif isinstance(o, Recv):
                b, off = mb(o.buf, o.offset)
                ops.append(Recv(group[o.peer], b, off, o.count, o.reduce))
            else:
                sb, so = mb(o.src, o.src_offset)
                db, do = mb(o.dst, o.dst_offset)
                ops.append(type(o)(sb, so, db, do, o.count))
        steps.append(tuple(ops))
    return steps


def chunk_bounds(count: int, parts: int) -> List[Tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous (offset, length) blocks.

    Sizes differ by at most one (the first ``count % parts`` blocks are one longer). Works for
    count < parts.

    Args:
        count (int): The number of elements.
        parts (int): The number of blocks.

    Returns:
        (list): ``parts`` pairs ``(offset, length)``.

    Examples:
        >>> chunk_bounds(10, 3)
        [(0, 4), (4, 3), (7, 3)]
    """
    q, r = divmod(count, parts)
    out, off = [], 0
    for i in range(parts):
        ln = q + (1 if i < r else 0)
        out.append((off, ln))
        off += ln
    return out


@dataclass(frozen=True)
class ScheduleKey:
    """What identifies a schedule: the key of the schedule caches.

    Attributes:
        collective (str): The collective.
        algorithm (str): The family.
        rank (int): The rank.
        size (int): The world size.
        count (int): The per-rank block, in elements.
        root (int): The root.
        topology (tuple | None): The node of every rank (hierarchical families only).

    Examples:
        >>> key = ScheduleKey("allreduce", "ring", rank=0, size=4, count=1024, root=0)
        >>> key == ScheduleKey("allreduce", "ring", 0, 4, 1024, 0)
        True
    """
    collective: str
    algorithm: str
    rank: int
    size: int
    count: int
    root: int
    topology: Optional[Topology] = None


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor.

    The bytes a link-bound ring would move per byte of the call; ``minicomm bench`` and
    ``minicomm sim`` use it.

    Args:
        collective (str): One of ``COLLECTIVES``.
        n (int): The world size.

    Returns:
        (float): The factor (allreduce: 2(n-1)/n).

    Raises:
        ValueError: A world size below 1, or an unknown collective.

    Examples:
        >>> busbw_factor("allreduce", 4)
        1.5
    """
    if n <= 0:
        raise ValueError("world size must be positive")
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    if collective in ("reduce_scatter", "allgather", "alltoall", "gather", "scatter") \
            or collective in UNEVEN:
        return (n - 1) / n
    if collective in ("broadcast", "reduce") or collective in PREFIX:
        return 1.0
    if collective == "barrier":
        return 0.0
    raise ValueError(f"unknown collective {collective!r}")
