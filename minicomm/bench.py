"""``minicomm bench``: nccl-tests-style collective benchmark, with MPICH and gloo side by side.

    minicomm bench allreduce -b 8 -e 64M -f 4 -n 2 --transport shm --algorithms ring,rhd,auto
    minicomm bench all -b 1K -e 1M --peers mpi,gloo --csv out.csv --plot busbw.png
    minicomm bench pushpull       # parameter server vs allreduce vs p2p (minicomm.pushpull_bench)

Method, per collective and size, separately for out-of-place and in-place buffers:
  every library (each minicomm algorithm, then each peer) is warmed up; the iterations per batch
  are chosen so one batch lasts about ``--batch-time`` (or fixed by ``--iters``) and agreed by all
  ranks; then ``--batches`` rounds run, each round timing one batch of every library in turn
  (minicomm ring, minicomm rhd, ..., mpi, gloo, then again), so drift on a shared machine hits all
  alike. Each batch starts after the library's own barrier; its time per call is that of the
  slowest rank; the figure reported is the median over batches. Then every library runs once more
  on freshly initialised buffers and its result is compared with closed-form expected values:
  #wrong is the number of wrong elements summed over ranks.

Columns are those of nccl-tests: size is the bytes of the whole buffer (for allgather and gather
the output, for reduce_scatter, scatter and alltoall the input: n blocks), count the elements per
rank block, algbw = size / time, busbw = algbw x factor (``busbw_factor``), the bandwidth a
link-bound ring would need, comparable across collectives and world sizes. For a peer, ``vs mc``
is its time divided by minicomm's (the ``auto`` row when measured, else the fastest algorithm):
above 1, minicomm is faster.

``--tune`` runs no benchmark: it times every fixed algorithm (those of ``--algorithms``, all by
default) per collective and size with ``minicomm.tuning.measure_table`` and merges the results
into the table ``algorithm="auto"`` follows (``tuning.write_table``; its format is documented
there).

Ranks are started with ``mc.spawn`` (or by mpiexec when the MPI peer is asked for, so MPICH runs
as its users run it), or the benchmark runs inside ``minicomm run`` when MINICOMM_RANK is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .algorithms import FAMILIES

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "gather", "scatter",
               "reduce_scatter", "alltoall", "barrier")
REDUCING = ("allreduce", "reduce", "reduce_scatter")
BLOCKED_IN = ("reduce_scatter", "scatter", "alltoall")    # input is n blocks of `count`
BLOCKED_OUT = ("allgather", "gather", "alltoall")         # output is n blocks of `count`
ROOTED = ("reduce", "broadcast", "gather", "scatter")
PEERS = ("mpi", "gloo")
DTYPES = {"float": "float32", "float32": "float32", "double": "float64", "float64": "float64",
          "int": "int32", "int32": "int32", "int64": "int64", "uint8": "uint8"}
OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
NCCL_TYPE = {"float32": "float", "float64": "double", "int32": "int32", "int64": "int64",
             "uint8": "uint8"}
PERIOD = 251          # inputs repeat with this (prime) period: expected values have a closed form


class BenchError(Exception):
    """A benchmark that cannot run as asked (bad option, missing peer, failed launch)."""


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factors: busbw = algbw x factor."""
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
    count: int        # elements per rank block (what the call's own count is)
    dtype: str

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
        """nccl-tests' size column: bytes of the larger of the two buffers."""
        return max(self.in_count, self.out_count) * self.itemsize

    @property
    def call_nbytes(self) -> int:
        """Bytes of the count the call passes (per block): what algorithm="auto" looks at."""
        return self.count * self.itemsize


def make_cases(collective: str, sizes: Sequence[int], n: int, dtype: str) -> List[Case]:
    """Round each size down to whole elements (whole blocks of n for blocked collectives, at least
    one element per block), dropping duplicates; barrier has one size, 0."""
    if collective == "barrier":
        return [Case(collective, n, 0, dtype)]
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
    raise ValueError(coll)


class Buffers:
    """The buffers of one case on one rank, shared by every library (numpy memory; torch wraps it
    without a copy). ``send``/``recv`` for out-of-place calls, ``ip`` for in-place ones, laid out
    as nccl-tests does: allgather/gather input at block ``rank`` of the output, reduce_scatter /
    scatter output at block ``rank`` of the input."""

    def __init__(self, case: Case, op: str, rank: int, root: int):
        self.case, self.rank = case, rank
        dt, c = case.dtype, case.count
        coll = case.collective
        self.send = np.empty(case.in_count, dtype=dt)
        self.recv = np.empty(case.out_count, dtype=dt)
        self.ip = np.empty(max(case.in_count, case.out_count), dtype=dt)
        src = root if coll in ("broadcast", "scatter") else rank
        self._send_init = pattern(op, dt, src, 0, case.in_count)
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


# ------------------------------------------------------------------------ libraries under test
@dataclasses.dataclass
class Call:
    """One library's call on one placement. ``op()`` runs it once, ``barrier()`` is the library's
    own barrier (batches start after it), ``result`` is where this rank's result lands."""
    op: object
    barrier: object
    result: Optional[np.ndarray]


class MinicommRunner:
    library = "minicomm"

    def __init__(self, comm, algorithm: str):
        self.comm, self.algorithm = comm, algorithm
        self.label = algorithm

    def describe(self, case: Case) -> str:
        if self.algorithm != "auto":
            return self.algorithm
        return "auto>" + self.comm._resolve_algorithm(case.collective, None, case.call_nbytes)

    def supports(self, collective: str, inplace: bool) -> bool:
        return True

    def prepare(self, b: Buffers, inplace: bool, op: str, root: int) -> Call:
        comm, a, coll = self.comm, self.algorithm, b.case.collective
        n, r = comm.size, comm.rank
        is_root = r == root
        src = b.ip if inplace else b.send
        dst = b.ip[:b.case.out_count] if inplace else b.recv
        grid = (lambda x: x.reshape(n, b.case.count))
        if coll == "allreduce":
            f = lambda: comm.allreduce(src, op=op, algorithm=a, out=dst)  # noqa: E731
        elif coll == "reduce":
            out = dst if is_root else None
            f = lambda: comm.reduce(src, root=root, op=op, algorithm=a, out=out)  # noqa: E731
        elif coll == "broadcast":
            f = lambda: comm.broadcast(src, root=root, algorithm=a, out=dst)  # noqa: E731
        elif coll in ("allgather", "gather"):
            x = b.block(b.ip, r) if inplace else b.send
            out2 = grid(dst)
            if coll == "allgather":
                f = lambda: comm.allgather(x, algorithm=a, out=out2)  # noqa: E731
            else:
                out2 = out2 if is_root else None
                f = lambda: comm.gather(x, root=root, algorithm=a, out=out2)  # noqa: E731
        elif coll == "scatter":
            x = grid(src) if is_root else None
            out = b.block(b.ip, r) if inplace else b.recv
            f = lambda: comm.scatter(x, root=root, algorithm=a, out=out)  # noqa: E731
        elif coll == "reduce_scatter":
            x = grid(src)
            out = b.block(b.ip, r) if inplace else b.recv
            f = lambda: comm.reduce_scatter(x, op=op, algorithm=a, out=out)  # noqa: E731
        elif coll == "alltoall":
            x, out2 = grid(src), grid(dst)
            f = lambda: comm.alltoall(x, algorithm=a, out=out2)  # noqa: E731
        elif coll == "barrier":
            f = lambda: comm.barrier(algorithm=a)  # noqa: E731
        else:
            raise ValueError(coll)
        return Call(f, comm.barrier, b.default_result(inplace))

    def close(self) -> None:
        pass


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

    def validate(self) -> None:
        bad = [c for c in self.collectives if c not in COLLECTIVES]
        if bad or not self.collectives:
            raise BenchError(f"unknown collective {', '.join(bad) or '(none)'}; choose from "
                             f"{', '.join(COLLECTIVES)} or 'all'")
        bad = [a for a in self.algorithms if a not in FAMILIES + ("auto",)]
        if bad or not self.algorithms:
            raise BenchError(f"unknown algorithm {', '.join(bad) or '(none)'}; choose from "
                             f"{', '.join(FAMILIES)}, auto")
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
        from . import peers as _peers
        for p in self.peers:
            _peers.check_supported(p, self.op, self.dtype)


# ------------------------------------------------------------------------ the rank side
class Watchdog:
    """Ends this rank process if a phase makes no progress for ``limit`` seconds: MPI calls have
    no timeout of their own, and a hung peer must not hang the benchmark forever. Armed only when
    peers run (minicomm's own waits time out by themselves, and inproc ranks share the caller's
    process, which must never be ended from here)."""

    def __init__(self, limit: float, rank: int, armed: bool):
        self.limit, self.rank = limit, rank
        self.what, self.last = "start", time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if armed:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="minicomm-bench-watchdog")
            self._thread.start()

    def tick(self, what: str) -> None:
        self.what, self.last = what, time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.limit / 4)):
            if time.monotonic() - self.last > self.limit:
                print(f"minicomm bench rank {self.rank}: no progress for {self.limit:.0f} s in "
                      f"{self.what}; ending", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(75)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def _progress_limit(cfg: BenchConfig, comm) -> float:
    return float(cfg.timeout if cfg.timeout is not None else comm.timeout)


def rank_main(comm, cfg: BenchConfig, mpi_comm=None) -> Optional[List[dict]]:
    """Run the whole benchmark on this rank. Rank 0 prints the table and returns the rows."""
    from . import peers as _peers
    watchdog = Watchdog(_progress_limit(cfg, comm), comm.rank, armed=bool(cfg.peers))
    runners: list = [MinicommRunner(comm, a) for a in cfg.algorithms]
    try:
        for p in cfg.peers:
            watchdog.tick(f"starting peer {p}")
            runners.append(_peers.start(p, comm, cfg, mpi_comm))
        rows: List[dict] = []
        # In-place batches feed each result back in: sums grow to inf, as in nccl-tests. The
        # values do not change the work done (no denormals on the way up); checks use fresh data.
        with np.errstate(over="ignore", invalid="ignore"):
            for coll in cfg.collectives:
                if comm.rank == 0 and not cfg.quiet:
                    print(header(cfg, coll, comm, runners), flush=True)
                for case in make_cases(coll, cfg.sizes, comm.size, cfg.dtype):
                    got = _bench_case(comm, cfg, case, runners, watchdog)
                    rows.extend(got)
                    if not cfg.quiet:
                        for row in got:
                            print(format_row(row), flush=True)
                if comm.rank == 0 and not cfg.quiet:
                    print(footer([r for r in rows if r["collective"] == coll]), flush=True)
        return rows if comm.rank == 0 else None
    finally:
        for r in runners:
            r.close()
        watchdog.stop()


def _agree_max(comm, values: Sequence[float]) -> np.ndarray:
    return comm.allreduce(np.asarray(values, dtype=np.float64), op="max", algorithm="auto")


def _bench_case(comm, cfg: BenchConfig, case: Case, runners, watchdog: Watchdog) -> List[dict]:
    b = Buffers(case, cfg.op, comm.rank, cfg.root)
    placements = (False,) if case.collective == "barrier" else (False, True)
    nr = len(runners)
    med = np.full((2, nr), np.nan)
    wrong = np.zeros((2, nr), dtype=np.int64)
    iters_used = np.zeros((2, nr), dtype=np.int64)
    batch_times: Dict[Tuple[int, int], List[float]] = {}
    for pi, inplace in enumerate(placements):
        where = f"{case.collective} {case.size} B {'in-place' if inplace else 'out-of-place'}"
        active = [i for i, r in enumerate(runners) if r.supports(case.collective, inplace)]
        calls = {i: runners[i].prepare(b, inplace, cfg.op, cfg.root) for i in active}
        # warm up; the warm-up calls after the first estimate the time per call (their median:
        # one call preempted by another process must not shrink the batches)
        est = np.zeros(nr)
        for i in active:
            watchdog.tick(f"warm-up of {runners[i].label}, {where}")
            c = calls[i]
            c.barrier()
            if cfg.warmup >= 2:        # the first call pays for plans and page faults: untimed
                c.op()
            each = []
            for _ in range(max(1, cfg.warmup - 1)):
                t0 = time.perf_counter()
                c.op()
                each.append(time.perf_counter() - t0)
            est[i] = float(np.median(each))
        if cfg.iters:
            iters = np.full(nr, cfg.iters, dtype=np.int64)
        else:
            est = _agree_max(comm, est)
            iters = np.clip(np.ceil(cfg.batch_time / np.maximum(est, 1e-9)), 1,
                            cfg.max_iters).astype(np.int64)
        iters_used[pi] = iters
        times = np.full((nr, cfg.batches), np.nan)
        for k in range(cfg.batches):           # interleaved: every library once per round
            for i in active:
                watchdog.tick(f"batch {k + 1} of {runners[i].label}, {where}")
                c, it = calls[i], int(iters[i])
                c.barrier()
                t0 = time.perf_counter()
                for _ in range(it):
                    c.op()
                times[i, k] = (time.perf_counter() - t0) / it
        # check: fresh inputs, one call, compare with the closed form
        mine = np.zeros(nr, dtype=np.int64)
        for i in active:
            watchdog.tick(f"check of {runners[i].label}, {where}")
            b.reset()
            calls[i].barrier()
            calls[i].op()
            mine[i] = b.count_wrong(calls[i].result)
        wrong[pi] = comm.allreduce(mine, op="sum", algorithm="auto")
        every = comm.gather(times, root=0, algorithm="auto")     # (ranks, libraries, batches)
        if comm.rank == 0:
            slowest = every.max(axis=0)
            for i in active:
                med[pi, i] = float(np.median(slowest[i]))
                batch_times[(pi, i)] = slowest[i].tolist()
        del calls
    if comm.rank != 0:
        return []
    return _rows(cfg, case, comm, runners, placements, med, wrong, iters_used, batch_times)


def _rows(cfg, case, comm, runners, placements, med, wrong, iters_used, batch_times) -> List[dict]:
    factor = busbw_factor(case.collective, case.n)
    ref_idx = [i for i, r in enumerate(runners) if r.library == "minicomm"]
    auto = [i for i in ref_idx if runners[i].algorithm == "auto"]
    rows = []
    for i, r in enumerate(runners):
        row = dict(collective=case.collective, library=r.library, algo=r.describe(case),
                   nranks=case.n, nodes=cfg.nodes,
                   transport=cfg.transport if r.library == "minicomm" else r.transport,
                   run_transport=cfg.transport,
                   size=case.size, count=case.count, type=NCCL_TYPE[case.dtype],
                   redop=cfg.op if case.collective in REDUCING else "none",
                   root=cfg.root if case.collective in ROOTED else -1)
        for pi, inplace in enumerate(placements):
            key = "ip_" if inplace else ""
            t = med[pi, i]
            if math.isnan(t):
                row.update({key + "time_us": None, key + "algbw": None, key + "busbw": None,
                            key + "wrong": None, key + "ratio": None})
                continue
            algbw = case.size / t / 1e9 if t > 0 else 0.0
            row[key + "time_us"] = t * 1e6
            row[key + "algbw"] = algbw
            row[key + "busbw"] = algbw * factor
            row[key + "wrong"] = int(wrong[pi, i])
            row[key + "iters"] = int(iters_used[pi, i])
            row[key + "batches_us"] = [x * 1e6 for x in batch_times[(pi, i)]]
            ratio = None
            if r.library != "minicomm":
                refs = [med[pi, j] for j in (auto or ref_idx) if not math.isnan(med[pi, j])]
                if refs and min(refs) > 0:
                    ratio = t / min(refs)
            row[key + "ratio"] = ratio
        rows.append(row)
    return rows


# ------------------------------------------------------------------------ printing
def header(cfg: BenchConfig, coll: str, comm, runners) -> str:
    peers = [r for r in runners if r.library != "minicomm"]
    lines = [f"# minicomm bench {coll}: {comm.size} ranks, {cfg.nodes} node(s), transport "
             f"{cfg.transport}, {cfg.dtype} {cfg.op if coll in REDUCING else ''}".rstrip(),
             f"#   warmup {cfg.warmup}, "
             + (f"{cfg.iters} iterations per batch" if cfg.iters else
                f"iterations per batch for ~{cfg.batch_time * 1e3:.0f} ms (max {cfg.max_iters})")
             + f", {cfg.batches} interleaved batches; time = median over batches of the slowest rank"]
    for p in peers:
        lines.append(f"#   peer {p.label}: {p.version}")
    if peers:
        lines.append("#   vs mc = peer time / minicomm time "
                     f"({'auto' if any(r.algorithm == 'auto' for r in runners if r.library == 'minicomm') else 'fastest algorithm'}): above 1, minicomm is faster")
    lines.append("#")
    lead = f"# {'':>10}  {'':>12}  {'':>6}  {'':>5}  {'':>4}  {'':>12}"
    width = len(f"  {'':>9}  {'':>6}  {'':>6}  {'':>6}  {'':>5}")
    lines.append(lead + "out-of-place".center(width) + "in-place".center(width))
    cols = (f"# {'size':>10}  {'count':>12}  {'type':>6}  {'redop':>5}  {'root':>4}  {'algo':>12}"
            f"  {'time':>9}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  {'vs mc':>5}"
            f"  {'time':>9}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  {'vs mc':>5}")
    units = (f"# {'(B)':>10}  {'(elements)':>12}  {'':>6}  {'':>5}  {'':>4}  {'':>12}"
             f"  {'(us)':>9}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  {'':>5}"
             f"  {'(us)':>9}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  {'':>5}")
    lines += [cols, units]
    return "\n".join(lines)


def _fmt_time(us: Optional[float]) -> str:
    if us is None:
        return "n/a"
    return f"{us:.2f}" if us < 1e4 else f"{us:.0f}"


def format_row(row: dict) -> str:
    def part(key: str) -> str:
        if key + "time_us" not in row:
            return ""
        t = row[key + "time_us"]
        if t is None:
            return f"  {'n/a':>9}  {'':>6}  {'':>6}  {'':>6}  {'':>5}"
        ratio = row.get(key + "ratio")
        return (f"  {_fmt_time(t):>9}  {row[key + 'algbw']:6.2f}  {row[key + 'busbw']:6.2f}"
                f"  {row[key + 'wrong']:>6}  {(f'{ratio:.2f}' if ratio is not None else ''):>5}")
    return (f"  {row['size']:>10}  {row['count']:>12}  {row['type']:>6}  {row['redop']:>5}"
            f"  {row['root']:>4}  {row['algo']:>12}" + part("") + part("ip_"))


def footer(rows: List[dict]) -> str:
    wrong = sum((r.get("wrong") or 0) + (r.get("ip_wrong") or 0) for r in rows)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    for algo in dict.fromkeys(r["algo"].split(">")[0] for r in rows):
        bw = [r[k] for r in rows if r["algo"].split(">")[0] == algo for k in ("busbw", "ip_busbw")
              if r.get(k) is not None]
        if bw:
            lines.append(f"# Avg bus bandwidth    : {sum(bw) / len(bw):.3f} GB/s  ({algo})")
    return "\n".join(lines) + "\n#"


# ------------------------------------------------------------------------ outputs
CSV_FIELDS = ("collective", "library", "algo", "nranks", "nodes", "transport", "run_transport",
              "size", "count",
              "type", "redop", "root", "time_us", "algbw", "busbw", "wrong", "ratio", "iters",
              "ip_time_us", "ip_algbw", "ip_busbw", "ip_wrong", "ip_ratio", "ip_iters")


def write_csv(rows: List[dict], path: str) -> None:
    import csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})


def write_json(rows: List[dict], cfg: BenchConfig, path: str) -> None:
    meta = dict(dataclasses.asdict(cfg), hostname=socket.gethostname(),
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), python=sys.version.split()[0],
                numpy=np.__version__)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def _series_label(row: dict) -> str:
    if row["library"] == "minicomm":
        return "minicomm " + row["algo"].split(">")[0]
    return {"mpi": "MPICH (mpi4py)", "gloo": "gloo (torch)"}.get(row["library"], row["library"])


def plot(rows: List[dict], path: str, title: str = "") -> None:
    """busbw (out-of-place) against size, one line per algorithm and peer; one panel per
    (collective, world size, nodes, minicomm's transport), so rows of several runs can share a
    figure. Barrier, which moves no data, is left out."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'minicomm[plot]'") from None

    def panel(r):
        return (r["collective"], r["nranks"], r["nodes"], r["run_transport"])
    keys = list(dict.fromkeys(panel(r) for r in rows if r["collective"] != "barrier"))
    if not keys:
        raise BenchError("--plot: nothing to plot (barrier moves no data)")
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.9 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        sub = [r for r in rows if panel(r) == key and r.get("busbw") is not None]
        for label in dict.fromkeys(_series_label(r) for r in sub):
            pts = sorted((r["size"], r["busbw"]) for r in sub if _series_label(r) == label)
            peer = not label.startswith("minicomm")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s" if peer else "o",
                    linestyle="--" if peer else "-", markersize=3.5, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        nodes = f", {key[2]} nodes" if key[2] > 1 else ""
        ax.set_title(f"{key[0]}, n={key[1]}{nodes}, minicomm over {key[3]}", fontsize=10)
        ticks = sorted({r["size"] for r in sub})
        if len(ticks) > 8:
            ticks = ticks[::math.ceil(len(ticks) / 8)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(t) for t in ticks], fontsize=7)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------ --tune
def tune(cfg: BenchConfig, path: Optional[str] = None, comm=None) -> Optional[str]:
    """``--tune``: time every fixed algorithm per (collective, size) with minicomm.tuning's
    ``measure_table`` (float32 sum, interleaved batches, slowest rank, median) and merge the
    entries into the table algorithm="auto" follows (``tuning.write_table``). With ``comm``
    (inside ``minicomm run``) this rank takes part; rank 0 writes. Returns the path (rank 0)."""
    from . import tuning
    algos = [a for a in cfg.algorithms if a != "auto"] or list(FAMILIES)
    n = comm.size if comm is not None else cfg.nranks
    target = comm if comm is not None else {"world_size": cfg.nranks,
                                             "transport": cfg.transport, "nodes": cfg.nodes}
    entries: List[dict] = []
    for coll in cfg.collectives:
        # the table is keyed by the bytes the call passes (per block), not nccl-tests' size
        sizes = [c.call_nbytes for c in make_cases(coll, cfg.sizes, n, "float32")]
        entries += tuning.measure_table(target, [coll], sizes, algorithms=algos,
                                        batch_seconds=cfg.batch_time, batches=cfg.batches,
                                        max_iters=cfg.max_iters)
    if comm is not None and comm.rank != 0:
        return None
    if not cfg.quiet:
        print(f"# tuned table: {n} ranks, {cfg.nodes} node(s), transport {cfg.transport}; "
              f"median us per call of the slowest rank")
        print(f"# {'collective':>14}  {'bytes':>10}  {'best':>5}" +
              "".join(f"  {a:>9}" for a in algos))
        for e in entries:
            print(f"  {e['collective']:>14}  {e['bytes']:>10}  {e['best']:>5}" +
                  "".join(f"  {e['seconds'][a] * 1e6:9.2f}" for a in algos))
    return tuning.write_table(entries, path)


# ------------------------------------------------------------------------ driving a run
def run(cfg: BenchConfig) -> List[dict]:
    """Start the ranks (mc.spawn, or mpiexec for the MPI peer) and return rank 0's rows."""
    cfg.validate()
    if "mpi" in cfg.peers:
        from . import peers as _peers
        return _peers.run_under_mpiexec(cfg)
    from .launch import spawn
    return spawn(rank_main, cfg.nranks, args=(cfg,), transport=cfg.transport, nodes=cfg.nodes,
                 timeout=None)[0]


_NO_TUNE = object()


def run_in_launched_job(cfg: BenchConfig, tune_path=_NO_TUNE):
    """Inside `minicomm run` (MINICOMM_RANK set): this process is one rank. Runs the benchmark
    (rank 0 returns the rows), or with ``tune_path`` given (None: the default place) ``tune``."""
    from .launch import init
    if "mpi" in cfg.peers:
        raise BenchError("--peers mpi needs ranks started by mpiexec: run `minicomm bench` "
                         "directly (it starts them), not under `minicomm run`")
    comm = init(transport=None if cfg.transport == "auto" else cfg.transport, timeout=cfg.timeout)
    try:
        if cfg.nranks not in (0, comm.size):
            raise BenchError(f"-n {cfg.nranks} differs from the job's {comm.size} ranks")
        cfg = dataclasses.replace(cfg, nranks=comm.size, nodes=comm.num_nodes)
        cfg.validate()
        if tune_path is not _NO_TUNE:
            return tune(cfg, tune_path, comm)
        return rank_main(comm, cfg)
    finally:
        comm.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("collective", nargs="?", default="allreduce",
                   help=f"one of {', '.join(COLLECTIVES)}; a comma list; 'all'; or 'pushpull' "
                        f"(parameter server vs allreduce vs p2p, see minicomm.pushpull_bench)")
    p.add_argument("--servers", type=int, default=2,
                   help="pushpull: parameter servers (workers: -n minus this, default 2)")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size (e.g. 8, 1K, 4M)")
    p.add_argument("-e", "--maxbytes", default="1M", help="largest size")
    p.add_argument("-f", "--stepfactor", type=float, default=4.0, help="size multiplier")
    p.add_argument("-i", "--stepbytes", default="0", help="fixed size increment (instead of -f)")
    p.add_argument("--sizes", default=None,
                   help="comma list of sizes (e.g. 8,1M,64M) instead of -b/-e/-f/-i")
    p.add_argument("-n", "--nranks", type=int, default=None,
                   help="ranks to start (default 2; inside `minicomm run`: the job's)")
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "inproc"])
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes (blocks of ranks)")
    p.add_argument("--algorithms", default="auto",
                   help=f"comma list of {', '.join(FAMILIES)}, auto (default auto)")
    p.add_argument("-d", "--datatype", default="float32", choices=sorted(DTYPES))
    p.add_argument("-o", "--op", default="sum", choices=OPS)
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("--iters", type=int, default=0,
                   help="iterations per batch (default: enough for --batch-time)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls per library and size")
    p.add_argument("--batches", type=int, default=5, help="timed batches (median taken)")
    p.add_argument("--batch-time", type=float, default=0.02, help="seconds per batch (auto iters)")
    p.add_argument("--peers", default="", help="comma list: mpi (mpi4py + MPICH), gloo (torch)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds without progress before a rank gives up (default 300)")
    p.add_argument("--csv", help="write the rows as CSV")
    p.add_argument("--json", help="write the rows and the settings as JSON")
    p.add_argument("--plot", help="write busbw vs size as a PNG (needs matplotlib)")
    p.add_argument("--tune", action="store_true",
                   help="instead of the benchmark: time every algorithm per size and write the "
                        "table algorithm='auto' follows")
    p.add_argument("--tune-file", default=None,
                   help="where --tune writes (default: minicomm.tuning.table_path(), "
                        "~/.cache/minicomm/tune-<hostname>.json)")


def config_from_args(a) -> BenchConfig:
    colls = (list(COLLECTIVES) if a.collective == "all"
             else [c.strip() for c in a.collective.split(",") if c.strip()])
    algos = [x.strip() for x in a.algorithms.split(",") if x.strip()]
    try:
        if a.sizes:
            sizes = [parse_size(x) for x in a.sizes.split(",") if x.strip()]
        else:
            sizes = size_steps(parse_size(a.minbytes), parse_size(a.maxbytes), a.stepfactor,
                               parse_size(a.stepbytes))
    except ValueError as e:
        raise BenchError(str(e)) from None
    return BenchConfig(collectives=colls, sizes=sizes,
                       nranks=a.nranks if a.nranks is not None else 2, transport=a.transport,
                       nodes=a.nodes, algorithms=algos, dtype=DTYPES[a.datatype], op=a.op,
                       root=a.root, iters=a.iters, warmup=a.warmup, batches=a.batches,
                       batch_time=a.batch_time,
                       peers=[x.strip() for x in a.peers.split(",") if x.strip()],
                       timeout=a.timeout)


def main_from_cli(a) -> int:
    if a.collective == "pushpull":
        from .pushpull_bench import main_from_cli as pushpull_main
        return pushpull_main(a)
    launched = os.environ.get("MINICOMM_RANK") not in (None, "")
    try:
        cfg = config_from_args(a)
        if launched and a.nranks is None:
            cfg.nranks = 0                     # the job's size
        if a.tune:
            if cfg.peers or a.csv or a.json or a.plot:
                raise BenchError("--tune writes the tuning table only: drop --peers, --csv, "
                                 "--json and --plot")
            if launched:
                path = run_in_launched_job(cfg, tune_path=a.tune_file)
            else:
                cfg.validate()
                path = tune(cfg, a.tune_file)
            if path:
                print(f"# tuning table written to {path}")
            return 0
        if launched:
            rows = run_in_launched_job(cfg)
            if rows is None:                   # ranks other than 0 report nothing
                return 0
        else:
            rows = run(cfg)
        if a.csv:
            write_csv(rows, a.csv)
        if a.json:
            write_json(rows, cfg, a.json)
        if a.plot:
            plot(rows, a.plot, title=f"minicomm bench, {socket.gethostname()}")
    except BenchError as e:
        print(f"minicomm bench: {e}", file=sys.stderr)
        return 2
    wrong = sum((r.get("wrong") or 0) + (r.get("ip_wrong") or 0) for r in rows)
    return 1 if wrong else 0
