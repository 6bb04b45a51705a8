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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

IN, OUT, TMP = "in", "out", "tmp"
BUFFERS = (IN, OUT, TMP)

COLLECTIVES = ("broadcast", "reduce", "allreduce", "allgather", "reduce_scatter",
               "gather", "scatter", "alltoall", "barrier")
REDUCING = frozenset({"reduce", "allreduce", "reduce_scatter"})
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})


@dataclass(frozen=True)
class Send:
    peer: int
    buf: str
    offset: int
    count: int


@dataclass(frozen=True)
class Recv:
    peer: int
    buf: str
    offset: int
    count: int
    reduce: bool = False


@dataclass(frozen=True)
class Copy:
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    count: int


@dataclass(frozen=True)
class Reduce:
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    count: int


Op = Union[Send, Recv, Copy, Reduce]
Step = Tuple[Op, ...]
Topology = Tuple[int, ...]   # node id of every rank, e.g. (0, 0, 1, 1)


def buffer_counts(collective: str, size: int, count: int) -> Tuple[int, int]:
    """(in_count, out_count) in elements for a collective with per-rank block ``count``."""
    n, p = count, size
    return {
        "broadcast": (n, n), "reduce": (n, n), "allreduce": (n, n),
        "allgather": (n, p * n), "reduce_scatter": (p * n, n),
        "gather": (n, p * n), "scatter": (p * n, n), "alltoall": (p * n, p * n),
        "barrier": (0, 0),
    }[collective]


@dataclass
class Schedule:
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

    @property
    def comm_steps(self) -> int:
        """Number of steps that communicate (the 'rounds' of the algorithm's latency term)."""
        return sum(1 for s in self.steps if any(isinstance(o, (Send, Recv)) for o in s))

    def summary(self) -> str:
        return (f"{self.algorithm} {self.collective} rank {self.rank}/{self.size} "
                f"count={self.count} root={self.root}: {len(self.steps)} steps, "
                f"{self.comm_steps} communicating, tmp={self.tmp_count}")


class ScheduleBuilder:
    """Convenience for algorithm writers: collects steps and scratch space.

    >>> b = ScheduleBuilder("allreduce", "ring", rank, size, count, root)
    >>> b.step(Send(...), Recv(...))
    >>> off = b.alloc_tmp(k)          # a fresh region of k elements in ``tmp``
    >>> return b.build()
    """

    def __init__(self, collective: str, algorithm: str, rank: int, size: int, count: int,
                 root: int = 0):
        self.collective, self.algorithm = collective, algorithm
        self.rank, self.size, self.count, self.root = rank, size, count, root
        self.in_count, self.out_count = buffer_counts(collective, size, count)
        self.steps: List[Step] = []
        self.tmp_count = 0

    def step(self, *ops: Op) -> None:
        """Append one step; ops with count 0 are kept only if they carry ordering (Send/Recv)."""
        kept = tuple(o for o in ops if isinstance(o, (Send, Recv)) or o.count > 0)
        if kept:
            self.steps.append(kept)

    def extend(self, steps: Iterable[Step]) -> None:
        for s in steps:
            self.step(*s)

    def alloc_tmp(self, count: int) -> int:
        off = self.tmp_count
        self.tmp_count += count
        return off

    def build(self) -> Schedule:
        return Schedule(self.collective, self.algorithm, self.rank, self.size, self.count,
                        self.root, self.steps, self.in_count, self.out_count, self.tmp_count)


BufMap = Dict[str, Tuple[str, int]]   # sub-schedule buffer name -> (outer buffer, base offset)


def embed(sub: Schedule, group: Sequence[int], bufmap: BufMap) -> List[Step]:
    """Translate a schedule built for a sub-group into steps of the enclosing schedule.

    ``group[i]`` is the outer rank of sub-rank i; ``bufmap`` maps every buffer the sub-schedule
    uses to (outer buffer name, base offset). This is how hierarchical algorithms reuse the flat
    families on a node or on the node leaders: the verifier then checks the composition as a whole.
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
    """Split ``count`` elements into ``parts`` contiguous (offset, length) blocks, sizes differing
    by at most one (the first ``count % parts`` blocks are one longer). Works for count < parts."""
    q, r = divmod(count, parts)
    out, off = [], 0
    for i in range(parts):
        ln = q + (1 if i < r else 0)
        out.append((off, ln))
        off += ln
    return out


@dataclass(frozen=True)
class ScheduleKey:
    collective: str
    algorithm: str
    rank: int
    size: int
    count: int
    root: int
    topology: Optional[Topology] = None


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factors: busbw = algbw x factor (the bytes a link-bound ring
    would move per byte of the call; used by ``minicomm bench`` and ``minicomm sim``)."""
    if n <= 0:
        raise ValueError("world size must be positive")
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    if collective in ("reduce_scatter", "allgather", "alltoall", "gather", "scatter"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce"):
        return 1.0
    if collective == "barrier":
        return 0.0
    raise ValueError(f"unknown collective {collective!r}")
