"""``minicomm bench``: nccl-tests-style collective benchmark, with MPICH and gloo side by side.

    minicomm bench allreduce -b 8 -e 64M -f 4 -n 2 --transport shm --algorithms ring,rhd,auto
    minicomm bench all -b 1K -e 1M --peers mpi,gloo --csv out.csv --plot busbw.png
    minicomm bench pushpull       # parameter server vs allreduce vs p2p (minicomm.tools.pushpull_bench)
    minicomm bench put,get,accumulate,fetch_and_op,cas --peers mpi   # one-sided (tools/rma_bench)

Method, per collective and size, separately for out-of-place and in-place buffers:
  every library (each minicomm algorithm, then each peer) is warmed up; the iterations per batch
  are chosen so one batch lasts about ``--batch-time`` (or fixed by ``--iters``) and agreed by all
  ranks -- from a timed block of back-to-back calls a quarter batch long (``batch_iters``), since
  single warm-up calls right after a world starts or a barrier can take 10x their steady time;
  then ``--batches`` rounds run, each round timing one batch of every library in turn
  (minicomm ring, minicomm rhd, ..., mpi, gloo, then again), so drift on a shared machine hits all
  alike. Each batch starts after the library's own barrier; its time per call is that of the
  slowest rank; the figure reported is the median over batches. Then every library runs once more
  on freshly initialised buffers and its result is compared with closed-form expected values:
  #wrong is the number of wrong elements summed over ranks.
  Why this method: docs/decisions/bench-methodology.md.

Columns are those of nccl-tests: size is the bytes of the whole buffer (for allgather and gather
the output, for reduce_scatter, scatter and alltoall the input: n blocks), count the elements per
rank block, algbw = size / time, busbw = algbw x factor (``busbw_factor``), the bandwidth a
link-bound ring would need, comparable across collectives and world sizes. For a peer, ``vs mc``
is its time divided by minicomm's (the ``auto`` row when it runs, else the fastest algorithm):
above 1, minicomm is faster.

``--persistent`` times persistent requests: each library makes its request once per size and
placement with the plain call's buffers and arguments (``comm.allreduce_init``; MPI-4's
``MPI_Allreduce_init``) and every timed call is ``start()`` + ``wait()``. ``--group K`` times
groups: one ``with comm.group():`` of K calls, each on its own buffers of the row's size (MPI:
K nonblocking calls, then one ``MPI_Waitall``); the time is that of the whole group, algbw
counts its K buffers, and every one of the K results is checked. gloo has neither form.

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

from ..algorithms import FAMILIES
from ..schedule import matrix_of
from .benchspec import (
    BENCHED,
    COLLECTIVES,
    DTYPES,
    NCCL_TYPE,
    OPS,
    REDUCING,
    ROOTED,
    UNEVEN,
    BenchConfig,
    BenchError,
    Buffers,
    Call,
    Case,
    busbw_factor,
    format_size,
    make_cases,
    page_aligned_empty,
    parse_size,
    size_steps,
)


class MinicommRunner:
    library = "minicomm"

    def __init__(self, comm, algorithm: str, group: int = 0):
        self.comm, self.algorithm, self.group = comm, algorithm, group
        self.label = algorithm

    def describe(self, case: Case) -> str:
        if self.algorithm != "auto":
            return self.algorithm
        if case.collective == "alltoallv":
            return "auto>ring"            # recv_counts given: a pairwise family (uneven.py)
        return "auto>" + self.comm._resolve_algorithm(case.collective, None,
                                                      self._call_nbytes(case))

    def _call_nbytes(self, case: Case) -> int:
        """The bytes auto chooses by: the call's; under ``--group K``, a group's allreduces are
        fused into one of up to K calls' bytes (at most MINICOMM_FUSION_BYTES a buffer)."""
        nbytes = case.call_nbytes
        if self.group > 1 and case.collective == "allreduce" and nbytes:
            from ..communicator.grouping import fusion_bytes
            limit = fusion_bytes()
            if limit:
                nbytes *= max(1, min(self.group, limit // nbytes))
        return nbytes

    def supports(self, collective: str, inplace: bool) -> bool:
        return not (inplace and collective in UNEVEN)

    def prepare(self, b: Buffers, inplace: bool, op: str, root: int) -> Call:
        return self._bind(self.comm, b, inplace, op, root)

    def prepare_persistent(self, b: Buffers, inplace: bool, op: str, root: int) -> Call:
        """``--persistent``: the request ``comm.<collective>_init`` makes from the very
        arguments ``prepare``'s call passes (``_bind`` run on the communicator's ``_init``
        forms), created once; the timed call is ``req.start(); req.wait()``."""
        coll = b.case.collective
        if not callable(getattr(self.comm, coll + "_init", None)):
            raise BenchError(f"--persistent: this communicator has no {coll}_init")
        req = self._bind(_Initiating(self.comm), b, inplace, op, root).op()
        start, wait = req.start, req.wait

        def f():
            start()
            wait()
        return Call(f, self.comm.barrier, b.default_result(inplace), free=req.free)

    def prepare_group(self, bufs: Sequence[Buffers], inplace: bool, op: str, root: int) -> Call:
        """``--group K``: one ``with comm.group():`` holding ``prepare``'s call once on each of
        the K buffer sets; the timed call is the whole group (at its exit all K are done)."""
        calls = [self.prepare(b, inplace, op, root) for b in bufs]
        ops, group = [c.op for c in calls], self.comm.group

        def f():
            with group():
                for one in ops:
                    one()
        return Call(f, self.comm.barrier, calls[0].result, results=[c.result for c in calls])

    def _bind(self, comm, b: Buffers, inplace: bool, op: str, root: int) -> Call:
        """The call on ``b``'s buffers (``comm``: the communicator, or ``_Initiating``)."""
        a, coll = self.algorithm, b.case.collective
        n, r = comm.size, comm.rank
        is_root = r == root
        src = b.ip if inplace else b.send
        if not inplace:
            dst = b.recv
        elif b.ip.size == b.case.out_count:
            # out=x, the very array, as users write it: docs/decisions/bench-methodology.md
            dst = b.ip
        else:
            dst = b.ip[:b.case.out_count]       # the output is the buffer's first block
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
        elif coll == "allgatherv":        # the counts given, as MPI_Allgatherv takes them
            counts = b.case.counts
            f = lambda: comm.allgatherv(src, counts=counts, algorithm=a, out=dst)  # noqa: E731
        elif coll == "alltoallv":         # both counts given, as MPI_Alltoallv takes them
            rows = matrix_of(b.case.counts, n)
            send, recv = list(rows[r]), [row[r] for row in rows]
            f = lambda: comm.alltoallv(src, send, recv_counts=recv,  # noqa: E731
                                       algorithm=a, out=dst)
        else:
            raise ValueError(coll)
        return Call(f, comm.barrier, b.default_result(inplace))

    def close(self) -> None:
        pass


class _Initiating:
    """A communicator seen through its persistent forms: ``x.allreduce(...)`` is
    ``comm.allreduce_init(...)`` (every benchmarked collective, barrier too); anything else is
    the communicator's own. ``MinicommRunner._bind`` on it makes the request the plain call
    would be, with the same buffers and arguments."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        if name in BENCHED:
            return getattr(self._comm, name + "_init")
        return getattr(self._comm, name)


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
    runners: list = [MinicommRunner(comm, a, cfg.group) for a in cfg.algorithms]
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


def batch_iters(comm, cfg: BenchConfig, call: Call, est: float) -> int:
    """Iterations for a batch of about ``cfg.batch_time``, from blocks of back-to-back calls
    (timeit's autorange): a block sized by ``est`` to a quarter batch is timed (the slowest
    rank's time, agreed), and sized again from that while it came out shorter than an eighth
    (at most 3 blocks). Single warm-up calls are a poor guide where ranks share cores: right
    after a barrier, or in a world's first second, one call can take 10x its steady time, and
    batches sized from it would be ten times too short, their start (the ranks leaving the
    barrier one by one) then weighing on every call. Every rank runs the same blocks: each
    size comes from an agreed time."""
    per = max(est, 1e-9)
    for _ in range(3):
        k = int(np.clip(math.ceil(cfg.batch_time / 4 / per), 1, cfg.max_iters))
        call.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            call.op()
        block = float(_agree_max(comm, [time.perf_counter() - t0])[0])
        per = max(block / k, 1e-9)
        if block >= cfg.batch_time / 8 or k == cfg.max_iters:
            break
    return int(np.clip(math.ceil(cfg.batch_time / per), 1, cfg.max_iters))


def _agree_max(comm, values: Sequence[float]) -> np.ndarray:
    return comm.allreduce(np.asarray(values, dtype=np.float64), op="max", algorithm="auto")


def _bench_case(comm, cfg: BenchConfig, case: Case, runners, watchdog: Watchdog) -> List[dict]:
    # --group K: K buffer sets of the case's size, one per call of the group
    bufs: List[Buffers] = []
    try:
        for _ in range(cfg.group or 1):
            bufs.append(Buffers(case, cfg.op, comm.rank, cfg.root,
                                comm.empty if cfg.registered else page_aligned_empty))
        return _bench_buffers(comm, cfg, case, runners, watchdog, bufs)
    finally:
        if cfg.registered:
            comm.barrier()            # every peer is done reading them
            for b in bufs:
                for buf in (b.send, b.recv, b.ip):
                    if comm.is_registered(buf):
                        comm.free(buf)


def _prepare(runner, cfg: BenchConfig, bufs: List[Buffers], inplace: bool) -> Call:
    """The runner's timed call: a plain call, a persistent request (``--persistent``) or a
    group of K calls on the K buffer sets (``--group``)."""
    if cfg.group:
        return runner.prepare_group(bufs, inplace, cfg.op, cfg.root)
    if cfg.persistent:
        return runner.prepare_persistent(bufs[0], inplace, cfg.op, cfg.root)
    return runner.prepare(bufs[0], inplace, cfg.op, cfg.root)


def _free(calls, quiet: bool = False) -> None:
    """Release what the calls hold (``Call.free``: persistent requests)."""
    for c in calls:
        if c.free is not None:
            try:
                c.free()
            except Exception:
                if not quiet:
                    raise


def _bench_buffers(comm, cfg: BenchConfig, case: Case, runners, watchdog: Watchdog,
                   bufs: List[Buffers]) -> List[dict]:
    placements = (False,) if case.collective == "barrier" else (False, True)
    nr = len(runners)
    med = np.full((2, nr), np.nan)
    wrong = np.zeros((2, nr), dtype=np.int64)
    iters_used = np.zeros((2, nr), dtype=np.int64)
    batch_times: Dict[Tuple[int, int], List[float]] = {}
    for pi, inplace in enumerate(placements):
        where = f"{case.collective} {case.size} B {'in-place' if inplace else 'out-of-place'}"
        active = [i for i, r in enumerate(runners) if r.supports(case.collective, inplace)]
        calls: Dict[int, Call] = {}
        try:
            for i in active:
                calls[i] = _prepare(runners[i], cfg, bufs, inplace)
            _bench_placement(comm, cfg, runners, watchdog, bufs, where, active, calls, pi, med,
                             wrong, iters_used, batch_times)
        except BaseException:
            _free(calls.values(), quiet=True)       # the first error is the one to report
            raise
        _free(calls.values())         # persistent requests: released after each placement
        del calls
    if comm.rank != 0:
        return []
    return _rows(cfg, case, comm, runners, placements, med, wrong, iters_used, batch_times)


def _bench_placement(comm, cfg: BenchConfig, runners, watchdog: Watchdog, bufs: List[Buffers],
                     where: str, active: List[int], calls: Dict[int, Call], pi: int,
                     med: np.ndarray, wrong: np.ndarray, iters_used: np.ndarray,
                     batch_times: Dict[Tuple[int, int], List[float]]) -> None:
    """Warm up, size and time the batches, then check, for one placement (``_bench_buffers``)."""
    nr = len(runners)
    # warm up; the warm-up calls after the first estimate the time per call (their median:
    # one call preempted by another process must not shrink the batches)
    est = np.zeros(nr)
    for i in active:
        watchdog.tick(f"warm-up of {runners[i].label}, {where}")
        c = calls[i]
        c.barrier()
        if cfg.warmup >= 2:        # the first call pays for plans and page faults: untimed
            c.op()
            c.barrier()            # on every rank: no timed call waits for a peer's first
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
        iters = np.array([batch_iters(comm, cfg, calls[i], est[i]) if i in calls else 1
                          for i in range(nr)], dtype=np.int64)
    iters_used[pi] = iters
    times = np.full((nr, cfg.batches), np.nan)
    for k in range(cfg.batches):           # every library once per round, in turn
        for i in active:
            watchdog.tick(f"batch {k + 1} of {runners[i].label}, {where}")
            c, it = calls[i], int(iters[i])
            c.barrier()
            t0 = time.perf_counter()
            for _ in range(it):
                c.op()
            times[i, k] = (time.perf_counter() - t0) / it
    # check: fresh inputs, one call (one group: every one of its K results), compare with the
    # closed form
    mine = np.zeros(nr, dtype=np.int64)
    for i in active:
        watchdog.tick(f"check of {runners[i].label}, {where}")
        for b in bufs:
            b.reset()
        calls[i].barrier()
        calls[i].op()
        mine[i] = sum(b.count_wrong(res) for b, res in zip(bufs, calls[i].all_results()))
    wrong[pi] = comm.allreduce(mine, op="sum", algorithm="auto")
    every = comm.gather(times, root=0, algorithm="auto")     # (ranks, libraries, batches)
    if comm.rank == 0:
        slowest = every.max(axis=0)
        for i in active:
            med[pi, i] = float(np.median(slowest[i]))
            batch_times[(pi, i)] = slowest[i].tolist()


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
        if cfg.persistent:
            row["mode"] = "persistent"
        elif cfg.group:
            row.update(mode="group", group=cfg.group)     # time_us: per group of K calls
        for pi, inplace in enumerate(placements):
            key = "ip_" if inplace else ""
            t = med[pi, i]
            if math.isnan(t):
                row.update({key + "time_us": None, key + "algbw": None, key + "busbw": None,
                            key + "wrong": None, key + "ratio": None})
                continue
            # a group moves K buffers of `size` in `t`
            algbw = case.size * (cfg.group or 1) / t / 1e9 if t > 0 else 0.0
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
    mode = (" (persistent requests)" if cfg.persistent else
            f" (per group of {cfg.group} calls)" if cfg.group else "")
    lines = [f"# minicomm bench {coll}{mode}: {comm.size} ranks, {cfg.nodes} node(s), transport "
             f"{cfg.transport}, {cfg.dtype} {cfg.op if coll in REDUCING else ''}".rstrip(),
             f"#   warmup {cfg.warmup}, "
             + (f"{cfg.iters} iterations per batch" if cfg.iters else
                f"iterations per batch for ~{cfg.batch_time * 1e3:.0f} ms (max {cfg.max_iters})")
             + f", {cfg.batches} batches, libraries in turn; time = median over batches of the"
             " slowest rank"]
    if cfg.persistent:
        lines.append("#   persistent requests, made once per size and placement "
                     "(comm.<collective>_init, MPI_<Collective>_init): each timed call is "
                     "start() + wait()")
    elif cfg.group:
        k = cfg.group
        fused = " (its allreduces fused into one)" if coll == "allreduce" else ""
        lines.append(f"#   groups of {k} calls, each on its own buffers of the row's size: "
                     f"minicomm: one `with comm.group()` of {k} calls{fused}; MPI: {k} "
                     f"nonblocking calls, then one MPI_Waitall")
        lines.append(f"#   time is per group of {k} calls (not per call); algbw = {k} x size / "
                     f"time")
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
    us = "(us/grp)" if cfg.group else "(us)"       # --group: the time of a whole group
    units = (f"# {'(B)':>10}  {'(elements)':>12}  {'':>6}  {'':>5}  {'':>4}  {'':>12}"
             f"  {us:>9}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  {'':>5}"
             f"  {us:>9}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  {'':>5}")
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
    # --persistent / --group rows say so (mode, and group: the calls per timed group)
    fields = CSV_FIELDS + tuple(k for k in ("mode", "group") if any(k in r for r in rows))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})


def write_json(rows: List[dict], cfg: BenchConfig, path: str) -> None:
    meta = dict(dataclasses.asdict(cfg), hostname=socket.gethostname(),
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), python=sys.version.split()[0],
                numpy=np.__version__)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def _series_label(row: dict) -> str:
    mode = {"persistent": " (persistent)", "group": f" (groups of {row.get('group')})"}.get(
        row.get("mode"), "")
    if row["library"] == "minicomm":
        return "minicomm " + row["algo"].split(">")[0] + mode
    return {"mpi": "MPICH (mpi4py)", "gloo": "gloo (torch)"}.get(row["library"],
                                                                 row["library"]) + mode


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
    ``measure_table`` (float32 sum, families in turn batch by batch, slowest rank, median) and
    merge the entries into the table algorithm="auto" follows (``tuning.write_table``). With
    ``comm`` (inside ``minicomm run``) this rank takes part; rank 0 writes. Returns the path
    (rank 0)."""
    from .. import tuning
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
        return _peers.run_under_mpiexec(cfg, rank_module="minicomm.tools.bench")
    from ..launch import spawn
    return spawn(rank_main, cfg.nranks, args=(cfg,), transport=cfg.transport, nodes=cfg.nodes,
                 timeout=None, switch="innet" in cfg.algorithms)[0]


_NO_TUNE = object()


def run_in_launched_job(cfg: BenchConfig, tune_path=_NO_TUNE):
    """Inside `minicomm run` (MINICOMM_RANK set): this process is one rank. Runs the benchmark
    (rank 0 returns the rows), or with ``tune_path`` given (None: the default place) ``tune``."""
    from ..launch import init
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
                   help=f"one of {', '.join(BENCHED)}; a comma list; 'all'; or 'pushpull' "
                        f"(parameter server vs allreduce vs p2p, see minicomm.tools.pushpull_bench)")
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
    p.add_argument("--transport", default="auto",
                   choices=["auto", "shm", "tcp", "rdma", "ub", "inproc"],
                   help="how ranks talk (auto: shared memory within a node, tcp between; "
                        "inproc: threads)")
    p.add_argument("--transports", default=None,
                   help="comma list of transports compared in one run, batch by batch (one-sided "
                        "ops: default shm,rdma,ub; collectives: e.g. shm,rdma,ub)")
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes (blocks of ranks)")
    p.add_argument("--algorithms", default="auto",
                   help=f"comma list of {', '.join(FAMILIES)}, innet (in-network reduction: "
                        f"the job gets an emulated switch), auto (default auto)")
    p.add_argument("-d", "--datatype", default="float32", choices=sorted(DTYPES),
                   help="element type of the buffers (default: float32)")
    p.add_argument("-o", "--op", default="sum", choices=OPS,
                   help="reduction operator (default: sum)")
    p.add_argument("-r", "--root", type=int, default=0,
                   help="root rank of rooted collectives (default: 0)")
    p.add_argument("--iters", type=int, default=0,
                   help="iterations per batch (default: enough for --batch-time)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls per library and size")
    p.add_argument("--batches", type=int, default=5, help="timed batches (median taken)")
    p.add_argument("--batch-time", type=float, default=0.02, help="seconds per batch (auto iters)")
    p.add_argument("--peers", default="", help="comma list: mpi (mpi4py + MPICH), gloo (torch)")
    p.add_argument("--registered", action="store_true",
                   help="allocate the buffers with comm.empty (registered memory the node's "
                        "peers map; every library uses the same buffers), as nccl-tests -R")
    p.add_argument("--persistent", action="store_true",
                   help="time persistent requests: each library makes its request once per "
                        "size (comm.<collective>_init; MPI-4 MPI_<Collective>_init) and every "
                        "timed call is start() + wait()")
    p.add_argument("--group", type=int, default=None, metavar="K",
                   help="time groups of K calls, each on its own buffers of the size: one "
                        "`with comm.group()` of K calls (MPI: K nonblocking calls, then one "
                        "MPI_Waitall); the time reported is per group")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds without progress before a rank gives up (default 300)")
    p.add_argument("--csv", help="write the rows as CSV")
    p.add_argument("--json", help="write the rows and the settings as JSON")
    p.add_argument("--plot", help="write busbw vs size as a PNG (needs matplotlib)")
    p.add_argument("--tune", action="store_true",
                   help="instead of the benchmark: time every algorithm per size and write the "
                        "table algorithm='auto' follows")
    p.add_argument("--soak", default=None, metavar="DURATION",
                   help="instead of the benchmark: a soak test (e.g. 10s, 10m) of mixed "
                        "collectives, p2p and parameter-server traffic, every result checked; "
                        "reports ops, errors, RSS and open fds per rank (minicomm.tools.soak)")
    p.add_argument("--soak-seed", type=int, default=0, help="the soak's random seed")
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
    group = getattr(a, "group", None)
    if group is not None and group < 1:
        raise BenchError(f"--group {group}: the calls per group must be at least 1")
    return BenchConfig(collectives=colls, sizes=sizes,
                       nranks=a.nranks if a.nranks is not None else 2, transport=a.transport,
                       nodes=a.nodes, algorithms=algos, dtype=DTYPES[a.datatype], op=a.op,
                       root=a.root, iters=a.iters, warmup=a.warmup, batches=a.batches,
                       batch_time=a.batch_time,
                       peers=[x.strip() for x in a.peers.split(",") if x.strip()],
                       timeout=a.timeout, registered=a.registered,
                       persistent=getattr(a, "persistent", False), group=group or 0)


def _check_modes(a) -> None:
    """--persistent and --group time the collectives' benchmark only: refuse them elsewhere."""
    flags = [f for f, on in (("--persistent", getattr(a, "persistent", False)),
                             ("--group", getattr(a, "group", None) is not None)) if on]
    if not flags:
        return
    what = " and ".join(flags)
    if len(flags) == 2:
        raise BenchError("--persistent and --group are separate modes: choose one (a "
                         "persistent request cannot be started inside comm.group())")
    if getattr(a, "soak", None):
        raise BenchError(f"{what} does not apply to --soak (a soak mixes its own calls)")
    if getattr(a, "tune", False):
        raise BenchError(f"{what} does not apply to --tune (the table is of single blocking "
                         f"calls)")
    if a.collective == "pushpull":
        raise BenchError(f"{what} does not apply to pushpull")
    from . import rma_bench
    if rma_bench.handles([c.strip() for c in a.collective.split(",")],
                         getattr(a, "transports", None)):
        raise BenchError(f"{what} does not apply to one-sided ops or --transports")


def main_from_cli(a) -> int:
    try:
        _check_modes(a)
    except BenchError as e:
        print(f"minicomm bench: {e}", file=sys.stderr)
        return 2
    if getattr(a, "soak", None):
        from .soak import main_from_cli as soak_main
        return soak_main(a)
    if a.collective == "pushpull":
        from .pushpull_bench import main_from_cli as pushpull_main
        return pushpull_main(a)
    from . import rma_bench
    if rma_bench.handles([c.strip() for c in a.collective.split(",")], a.transports):
        return rma_bench.main_from_cli(a, config_from_args)   # one-sided ops, or transports
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


# ------------------------------------------------------------------------ an mpiexec rank
def _mpi_rank(cfg_path: str, out_path: str) -> int:
    """One rank of ``run_under_mpiexec``: MPI first (mpiexec's PMI), then the minicomm world."""
    from mpi4py import MPI

    from ..launch import init, node_map
    with open(cfg_path) as f:
        cfg = BenchConfig(**json.load(f))
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    os.environ.update(MINICOMM_RANK=str(rank), MINICOMM_SIZE=str(size),
                      MINICOMM_NODE=str(node_map(size, cfg.nodes)[rank]),
                      MINICOMM_HOST=socket.gethostname())     # emulated nodes of one machine
    comm = init(transport=cfg.transport, timeout=cfg.timeout)
    try:
        rows = rank_main(comm, cfg, mpi_comm=MPI.COMM_WORLD)
        if rank == 0:
            tmp = out_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rows, f)
            os.replace(tmp, out_path)
    finally:
        comm.close()
    return 0


if __name__ == "__main__":   # one rank of peers.run_under_mpiexec: python -m minicomm.tools.bench
    from minicomm.tools import bench as _self  # the package's module, not a second __main__ copy
    sys.exit(_self._mpi_rank(sys.argv[1], sys.argv[2]))
