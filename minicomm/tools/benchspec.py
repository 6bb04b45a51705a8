"""What a benchmark run is: its configuration, cases, inputs with closed-form expected results,
the buffers every library shares, one library's prepared ``Call``, and which peers can run here.

Shared by ``bench`` (the driver, the minicomm runner, the output) and ``peers`` (the MPICH and
gloo runners), and below both, so neither imports the other's module for its types.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..algorithms import FAMILIES, registered
from ..schedule import (
    busbw_factor,  # noqa: F401  (re-exported: bench and its tests use it)
    call_buffer_counts,
    matrix_of,
)
from ..sim.engine import skewed_counts
from ..transports.bytecopy import page_aligned

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "gather", "scatter",
               "reduce_scatter", "alltoall", "barrier")
UNEVEN = ("allgatherv", "alltoallv")    # blocks skewed by ``SKEW`` (sim.engine.skewed_counts)
BENCHED = COLLECTIVES + UNEVEN          # 'all' is COLLECTIVES
SKEW = 1.0                              # Zipf: the hottest block about p / ln p times the mean
REDUCING = ("allreduce", "reduce", "reduce_scatter")
BLOCKED_IN = ("reduce_scatter", "scatter", "alltoall")    # input is n blocks of `count`
BLOCKED_OUT = ("allgather", "gather", "alltoall")         # output is n blocks of `count`
ROOTED = ("reduce", "broadcast", "gather", "scatter")
PEERS = ("mpi", "gloo")
# ``--persistent`` and ``--group``: the collectives both minicomm (``comm.<name>_init``,
# ``comm.group()``) and the MPI peer (``Comm.<Name>_init``, ``Comm.I<name>`` + ``Waitall``) have
PERSISTENT_COLLECTIVES = COLLECTIVES + UNEVEN
GROUPED_COLLECTIVES = COLLECTIVES + UNEVEN       # barrier: K barriers in one group
DTYPES = {"float": "float32", "float32": "float32", "double": "float64", "float64": "float64",
          "int": "int32", "int32": "int32", "int64": "int64", "uint8": "uint8"}
OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
NCCL_TYPE = {"float32": "float", "float64": "double", "int32": "int32", "int64": "int64",
             "uint8": "uint8"}
PERIOD = 251          # inputs repeat with this (prime) period: expected values have a closed form


class BenchError(Exception):
    """A benchmark that cannot run as asked (bad option, missing peer, failed launch)."""


def parse_size(text: str) -> int:
    """'8' -> 8, '4K' -> 4096, '64M' -> 67108864, '1G' (powers of 1024, as nccl-tests)."""
    t = str(text).strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if mult != 1 else t
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"size {text!r}: expected a number with an optional K, M or G") from None
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    return int(value * mult)


def format_size(nbytes: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes / 1024:.1f}K"


def size_steps(minbytes: int, maxbytes: int, factor: float = 2.0, step: int = 0) -> List[int]:
    """The sizes nccl-tests visits: multiply by ``factor`` (or add ``step`` when given)."""
    if maxbytes < minbytes:
        raise ValueError(f"maxbytes {maxbytes} is below minbytes {minbytes}")
    if step <= 0 and factor <= 1:
        raise ValueError("the step factor must be above 1 (or give a step in bytes)")
    out, s = [], minbytes
    while s <= maxbytes:
        out.append(s)
        nxt = s + step if step > 0 else int(s * factor)
        s = nxt if nxt > s else s + 1
    return out


@dataclasses.dataclass(frozen=True)
class Case:
    collective: str
    n: int
    count: int        # elements per rank block (what the call's own count is); uneven: all
    dtype: str
    counts: Tuple[int, ...] = ()     # uneven: the blocks (alltoallv: the p x p matrix)

    def in_count_at(self, rank: int) -> int:
        """Elements of ``rank``'s input (every rank alike but for the uneven collectives)."""
        return call_buffer_counts(self.collective, rank, self.n, self.count, self.counts)[0] \
            if self.counts else self.in_count

    def out_count_at(self, rank: int) -> int:
        return call_buffer_counts(self.collective, rank, self.n, self.count, self.counts)[1] \
            if self.counts else self.out_count

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def in_count(self) -> int:
        return self.count * (self.n if self.collective in BLOCKED_IN else 1)

    @property
    def out_count(self) -> int:
        return self.count * (self.n if self.collective in BLOCKED_OUT else 1)

    @property
    def size(self) -> int:
        """nccl-tests' size column: bytes of the larger of the two buffers (allgatherv: its
        output; alltoallv: a rank's input, every rank sending as much)."""
        if self.collective == "allgatherv":
            return self.count * self.itemsize
        if self.collective == "alltoallv":
            return self.count // self.n * self.itemsize
        return max(self.in_count, self.out_count) * self.itemsize

    @property
    def call_nbytes(self) -> int:
        """Bytes of the count the call passes (per block): what algorithm="auto" looks at."""
        return self.count * self.itemsize


def make_cases(collective: str, sizes: Sequence[int], n: int, dtype: str) -> List[Case]:
    """Round each size down to whole elements (whole blocks of n for blocked collectives, at least
    one element per block), dropping duplicates; barrier has one size, 0; the uneven ones cut
    each size into ``SKEW``-skewed blocks."""
    if collective == "barrier":
        return [Case(collective, n, 0, dtype)]
    if collective in UNEVEN:
        out = []
        for s in sizes:
            counts = skewed_counts(collective, s, n, SKEW, np.dtype(dtype).itemsize)
            case = Case(collective, n, sum(counts), dtype, counts)
            if case not in out:
                out.append(case)
        return out
    item = np.dtype(dtype).itemsize
    per = item * (n if collective in BLOCKED_IN + BLOCKED_OUT else 1)
    counts: List[int] = []
    for s in sizes:
        c = 0 if s == 0 else max(1, s // per)
        if c not in counts:
            counts.append(c)
    return [Case(collective, n, c, dtype) for c in counts]


# ------------------------------------------------------------------------ inputs and expected values
def _base(op: str, dtype: str) -> np.ndarray:
    """One period of rank 0's input. prod uses values 1 and 2 so products stay exact."""
    k = np.arange(PERIOD)
    vals = np.where(k == 0, 2, 1) if op == "prod" else k + 1
    return vals.astype(dtype)


def _periodic(table: np.ndarray, offset: int, length: int) -> np.ndarray:
    """table[(offset + i) % PERIOD] for i in range(length), by repetition (no index arrays)."""
    return np.resize(np.roll(table, -(offset % PERIOD)), length)


def pattern(op: str, dtype: str, rank: int, start: int, length: int) -> np.ndarray:
    """Rank ``rank``'s input elements start..start+length: base[(31 rank + i) % PERIOD]."""
    return _periodic(_base(op, dtype), 31 * rank + start, length)


def _reduced_table(op: str, dtype: str, n: int) -> np.ndarray:
    base = _base(op, dtype)
    rows = np.stack([np.roll(base, -(31 * r % PERIOD)) for r in range(n)])
    ufunc = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
             "max": np.maximum, "band": np.bitwise_and, "bor": np.bitwise_or,
             "bxor": np.bitwise_xor}[op]
    table = ufunc.reduce(rows, axis=0, dtype=np.dtype(dtype))
    if op == "avg":
        table /= n          # as the communicator does: reduce, then divide in the dtype
    return table


def reduced(op: str, dtype: str, n: int, start: int, length: int) -> np.ndarray:
    """The reduction over all n ranks of elements start..start+length (closed form)."""
    return _periodic(_reduced_table(op, dtype, n), start, length)


def expected_result(case: Case, op: str, rank: int, root: int) -> Optional[np.ndarray]:
    """What ``rank`` must hold after the call (flat), or None where the result is undefined."""
    n, c, dt, coll = case.n, case.count, case.dtype, case.collective
    if coll in ("reduce", "gather") and rank != root:
        return None
    if coll in ("allreduce", "reduce"):
        return reduced(op, dt, n, 0, c)
    if coll == "reduce_scatter":
        return reduced(op, dt, n, rank * c, c)
    if coll == "broadcast":
        return pattern(op, dt, root, 0, c)
    if coll == "scatter":
        return pattern(op, dt, root, rank * c, c)
    if coll in ("allgather", "gather"):
        return np.concatenate([pattern(op, dt, j, 0, c) for j in range(n)]) if c else \
            np.empty(0, dtype=dt)
    if coll == "alltoall":
        return np.concatenate([pattern(op, dt, j, rank * c, c) for j in range(n)]) if c else \
            np.empty(0, dtype=dt)
    if coll == "barrier":
        return None
    if coll == "allgatherv":
        return np.concatenate([pattern(op, dt, j, 0, k) for j, k in enumerate(case.counts)])
    if coll == "alltoallv":
        rows = matrix_of(case.counts, n)
        return np.concatenate([pattern(op, dt, i, sum(rows[i][:rank]), rows[i][rank])
                               for i in range(n)])
    raise ValueError(coll)


def page_aligned_empty(count: int, dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` starting on a page boundary, as OSU's and nccl-tests'
    buffers do (``bytecopy.page_aligned``). Heap arrays allocated one after the other often lie
    16 bytes apart modulo a page, where the C library's memmove runs several times slower on AMD
    Zen (transports/bytecopy.py): every library's local copy between the send and receive
    buffers then depends on allocation luck: docs/decisions/bench-methodology.md."""
    dtype = np.dtype(dtype)
    return page_aligned(count * dtype.itemsize).view(dtype)


class Buffers:
    """The buffers of one case on one rank, shared by every library (numpy memory; torch wraps it
    without a copy). ``send``/``recv`` for out-of-place calls, ``ip`` for in-place ones, laid out
    as nccl-tests does: allgather/gather input at block ``rank`` of the output, reduce_scatter /
    scatter output at block ``rank`` of the input."""

    def __init__(self, case: Case, op: str, rank: int, root: int, alloc=page_aligned_empty):
        self.case, self.rank = case, rank
        dt, c = case.dtype, case.count
        coll = case.collective
        # alloc: page-aligned heap memory, or comm.empty for registered buffers (``--registered``)
        n_in, n_out = case.in_count_at(rank), case.out_count_at(rank)
        self.send = alloc(n_in, dtype=dt)
        self.recv = alloc(n_out, dtype=dt)
        self.ip = alloc(max(n_in, n_out), dtype=dt)
        src = root if coll in ("broadcast", "scatter") else rank
        self._send_init = pattern(op, dt, src, 0, n_in)
        self._ip_init = np.zeros(self.ip.size, dtype=dt)
        if coll in ("allgather", "gather"):
            self._ip_init[rank * c:(rank + 1) * c] = pattern(op, dt, rank, 0, c)
        elif coll in ("broadcast", "scatter"):
            if rank == root:
                self._ip_init[:] = self._send_init
        else:
            self._ip_init[:] = pattern(op, dt, rank, 0, self.ip.size)
        self.expected = expected_result(case, op, rank, root)
        self.reset()

    def block(self, buf: np.ndarray, j: int) -> np.ndarray:
        c = self.case.count
        return buf[j * c:(j + 1) * c]

    def reset(self) -> None:
        """Fresh inputs; outputs zeroed (no expected value is 0, so an unwritten output shows)."""
        np.copyto(self.send, self._send_init)
        self.recv.fill(0)
        np.copyto(self.ip, self._ip_init)

    def default_result(self, inplace: bool) -> np.ndarray:
        if not inplace:
            return self.recv
        if self.case.collective in ("reduce_scatter", "scatter"):
            return self.block(self.ip, self.rank)
        return self.ip[:self.case.out_count]

    def count_wrong(self, result: Optional[np.ndarray]) -> int:
        if self.expected is None or result is None:
            return 0
        return int(np.count_nonzero(result != self.expected))


@dataclasses.dataclass
class Call:
    """One library's call on one placement. ``op()`` runs it once, ``barrier()`` is the library's
    own barrier (batches start after it), ``result`` is where this rank's result lands.

    Under ``--group K``, ``op()`` is one group of K calls and ``results`` holds the K results,
    one per buffer set, in the order of the buffers. ``free()``, when given, releases what the
    call holds (persistent requests) once the placement is done."""
    op: object
    barrier: object
    result: Optional[np.ndarray]
    results: Optional[List[Optional[np.ndarray]]] = None
    free: Optional[object] = None

    def all_results(self) -> List[Optional[np.ndarray]]:
        return list(self.results) if self.results is not None else [self.result]


# ------------------------------------------------------------------------ configuration
@dataclasses.dataclass
class BenchConfig:
    collectives: List[str]
    sizes: List[int]
    nranks: int = 2
    transport: str = "auto"
    nodes: int = 1
    algorithms: List[str] = dataclasses.field(default_factory=lambda: ["auto"])
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    iters: int = 0              # 0: choose per library and size from batch_time
    warmup: int = 5
    batches: int = 5
    batch_time: float = 0.02    # seconds a batch should last when iters is 0
    max_iters: int = 1000
    peers: List[str] = dataclasses.field(default_factory=list)
    timeout: Optional[float] = None
    quiet: bool = False
    registered: bool = False    # buffers from comm.empty (registered memory), for every library
    persistent: bool = False    # time persistent requests: *_init once, then start(); wait()
    group: int = 0              # K >= 1: time groups of K calls (comm.group()); 0: single calls

    @property
    def mode(self) -> Optional[str]:
        """'persistent', 'group' or None (single blocking calls, the default)."""
        return "persistent" if self.persistent else "group" if self.group else None

    def validate(self) -> None:
        bad = [c for c in self.collectives if c not in BENCHED]
        if bad or not self.collectives:
            raise BenchError(f"unknown collective {', '.join(bad) or '(none)'}; choose from "
                             f"{', '.join(BENCHED)} or 'all'")
        bad = [a for a in self.algorithms if a not in FAMILIES + ("innet", "auto")
               + tuple(r.name for r in registered())]
        if bad or not self.algorithms:
            raise BenchError(f"unknown algorithm {', '.join(bad) or '(none)'}; choose from "
                             f"{', '.join(FAMILIES)}, innet (the job gets a switch), auto")
        bad = [p for p in self.peers if p not in PEERS]
        if bad:
            raise BenchError(f"unknown peer {', '.join(bad)}; choose from {', '.join(PEERS)}")
        if self.nranks < 1:
            raise BenchError("-n must be at least 1")
        if not 0 <= self.root < self.nranks:
            raise BenchError(f"root {self.root} is not a rank of {self.nranks}")
        if self.op not in OPS:
            raise BenchError(f"unknown op {self.op!r}; choose from {', '.join(OPS)}")
        kind = np.dtype(self.dtype).kind
        if self.op == "avg" and kind != "f":
            raise BenchError("avg needs a floating dtype")
        if self.op in ("band", "bor", "bxor") and kind not in "iu":
            raise BenchError(f"{self.op} needs an integer dtype (-d int32, int64 or uint8)")
        if self.transport == "inproc" and self.peers:
            raise BenchError("peers need one process per rank: use --transport auto, shm or tcp")
        if self.batches < 1 or self.warmup < 0 or self.iters < 0:
            raise BenchError("--batches must be >= 1, --warmup and --iters >= 0")
        if self.group < 0:
            raise BenchError("--group must be at least 1 (the calls per group)")
        if self.persistent and self.group:
            raise BenchError("--persistent and --group are separate modes: choose one (a "
                             "persistent request cannot be started inside comm.group())")
        if self.mode:
            flag = "--persistent" if self.persistent else "--group"
            ok = PERSISTENT_COLLECTIVES if self.persistent else GROUPED_COLLECTIVES
            bad = [c for c in self.collectives if c not in ok]
            if bad:
                raise BenchError(f"{flag} does not apply to {', '.join(bad)}; it takes "
                                 f"{', '.join(ok)}")
            if "gloo" in self.peers:
                form = "persistent collectives" if self.persistent else "grouped form"
                raise BenchError(f"{flag}: the gloo peer has no {form}; drop it from --peers "
                                 f"(mpi has both)")
        for p in self.peers:
            check_supported(p, self.op, self.dtype)
        if self.persistent and "mpi" in self.peers:
            import mpi4py
            if int(mpi4py.__version__.split(".")[0]) < 4:
                raise BenchError(f"--persistent --peers mpi: mpi4py {mpi4py.__version__} has no "
                                 f"persistent collectives (Comm.Allreduce_init, ...): it needs "
                                 f"mpi4py >= 4")


# ------------------------------------------------------------------------ peers available here
MPI_OPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX", "band": "BAND",
           "bor": "BOR", "bxor": "BXOR"}
GLOO_OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "band": "BAND",
            "bor": "BOR", "bxor": "BXOR"}


def mpi_available() -> Optional[str]:
    """None when mpi4py and an mpiexec can be used, else why not."""
    try:
        import mpi4py  # noqa: F401  (the MPI module itself initialises MPI: import it in ranks)
    except ImportError:
        return "mpi4py is not installed (pip install 'minicomm[peers]')"
    if find_mpiexec() is None:
        return "no mpiexec found (pip install mpich puts one beside the interpreter)"
    return None


def gloo_available() -> Optional[str]:
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install torch; the CPU build is enough)"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


def find_mpiexec() -> Optional[str]:
    """The mpiexec of the environment mpi4py is installed in (the mpich wheel's), else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec")


def check_supported(peer: str, op: str, dtype: str) -> None:
    why = mpi_available() if peer == "mpi" else gloo_available()
    if why:
        raise BenchError(f"--peers {peer}: {why}")
    table = MPI_OPS if peer == "mpi" else GLOO_OPS
    if op not in table:
        raise BenchError(f"--peers {peer}: the peer has no {op!r} reduction")
