"""One-sided benchmark, OSU style, and collectives across transports, with MPICH side by side.

    minicomm bench put,get,accumulate,fetch_and_op,cas -b 8 -e 1M --peers mpi
    minicomm bench allreduce,allgather --sizes 64M --transports shm,rdma,ub

One-sided ops (osu_put_latency / osu_put_bw / osu_get_bw / osu_acc_latency / osu_fop_latency /
osu_cas_latency). Rank 0 is the origin, rank 1 the target; every other rank only waits. For each
library -- minicomm windows over each of ``--transports`` (default shm, rdma, ub; every rank holds
one world communicator per transport, built on the job's store), and with ``--peers mpi`` MPICH's
MPI RMA through mpi4py: ``MPI.Win.Allocate`` (memory MPICH chooses, shared inside a node -- the
same mechanism minicomm's shm windows use) and ``MPI.Win.Create`` (MPI_Win_create on the user's
array, comm.window's interface) -- the origin takes a *shared lock* on the target once per batch
(as OSU's lock synchronisation), then times, per call:

    put, get          latency: one op + flush;  bandwidth: 64 ops, then one flush (OSU's window)
    accumulate        one MPI_SUM accumulate of float64 + flush
    fetch_and_op      one 8-byte int64 sum + flush
    cas               one 8-byte int64 compare-and-swap + flush

Every library runs one batch per round, round after round (``--batches``, median taken), so load
from other processes on a shared machine hits all alike; iterations per batch make a batch last
about ``--batch-time``. The target takes part only through its barrier: MPI_Win_create's
passive target needs MPI progress there, so MPI libraries wait in MPI_Barrier, minicomm in its own.
A check follows the timing: put/get compare the bytes moved, accumulate, fetch_and_op and cas the
target's final value with what the counted operations must have left (#wrong).

Collectives across transports: with collective names, the same interleaving times minicomm's
collective (``--algorithms``' first, default auto) over each transport's communicator and reports
every time against the first transport's (``vs first``: above 1, slower than it).

``vs mpi`` is minicomm's time per call divided by MPICH's ``Win.Allocate`` time (below 1, minicomm
is faster; for bandwidth rows, the bandwidth ratio is its inverse).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
from typing import List, Optional

import numpy as np

from .benchspec import BenchConfig, BenchError, format_size

RMA_OPS = ("put", "get", "accumulate", "fetch_and_op", "cas")
BW_WINDOW = 64                        # ops per flush in the bandwidth rows (osu_put_bw's window)
_ONE_SIDED_TRANSPORTS = ("shm", "rdma", "ub")


def handles(names: List[str], transports: Optional[str]) -> bool:
    """Does ``minicomm bench`` hand this request here? (one-sided ops, or several transports)"""
    return bool(set(names) & set(RMA_OPS)) or bool(transports)


# ------------------------------------------------------------------ communicators per transport
def transport_worlds(comm, kinds: List[str]):
    """{kind: communicator over kind} for this job: the world itself for its own transport,
    the others connected through the job's store (every rank builds them in the same order)."""
    from ..communicator import Communicator
    from ..transports import connect
    worlds = {}
    own = comm.transport.name
    for kind in kinds:
        if kind == own:
            worlds[kind] = comm
            continue
        t = connect(kind, comm.rank, comm.size, comm._store, _job_id(comm),
                    comm._store.token, comm.topology, comm.timeout)
        worlds[kind] = Communicator(t, comm.rank, comm.size, topology=comm.topology,
                                    timeout=comm.timeout)
    return worlds


def _job_id(comm) -> str:
    job = comm.caps.job_id or os.environ.get("MINICOMM_JOB_ID") or comm.caps.device_job_id
    if job is None:
        raise BenchError("cannot tell this job's id (run under mc.spawn, minicomm run or "
                         "mpiexec through minicomm bench)")
    return job


# ------------------------------------------------------------------------------- runners
class _McWindows:
    """minicomm windows over one transport's communicator."""

    def __init__(self, comm, kind: str, max_bytes: int):
        self.comm, self.label, self.transport = comm, f"mc {kind}", kind
        self.bytes = comm.window(np.zeros(max(max_bytes, 8), dtype=np.uint8))
        self.doubles = comm.window(np.zeros(max(max_bytes // 8, 1), dtype=np.float64))
        self.words = comm.window(np.zeros(2, dtype=np.int64))
        for w in (self.bytes, self.doubles, self.words):
            w.fence()

    def barrier(self) -> None:
        self.comm.barrier()

    def lock(self, w) -> None:
        w.lock(1, exclusive=False)

    def unlock(self, w) -> None:
        w.unlock(1)

    def ops(self, op: str, size: int, window: int):
        """(window object, the timed call) for one op of ``size`` bytes."""
        if op in ("put", "get"):
            w, src = self.bytes, np.full(size, 7, dtype=np.uint8)
            if op == "put":
                def call():
                    for _ in range(window):
                        w.put(src, 1)
                    w.flush(1)
            else:
                def call():
                    for _ in range(window):
                        w.get(1, 0, size)
                    w.flush(1)
            return w, call
        if op == "accumulate":
            w, src = self.doubles, np.ones(max(size // 8, 1))

            def call():
                w.accumulate(src, 1)
                w.flush(1)
            return w, call
        w = self.words
        if op == "fetch_and_op":
            def call():
                w.fetch_and_op(1, 1, 0)
                w.flush(1)
            return w, call
        state = [0]

        def call():                   # 0 -> 1 -> 0 ...: every compare succeeds
            w.compare_and_swap(1 - state[0], state[0], 1, 1)
            w.flush(1)
            state[0] = 1 - state[0]
        return w, call

    def target_value(self, op: str, size: int) -> np.ndarray:
        w = {"put": self.bytes, "get": self.bytes, "accumulate": self.doubles}.get(op, self.words)
        if op in ("put", "get"):
            return w.local[:size]
        if op == "accumulate":
            return w.local[:max(size // 8, 1)]
        return w.local[:2]

    def reset(self) -> None:
        for w in (self.bytes, self.doubles, self.words):
            w.local[...] = 0

    def close(self) -> None:
        for w in (self.bytes, self.doubles, self.words):
            w.free()


class _MpiWindows:
    """MPICH's RMA through mpi4py: Win.Allocate or Win.Create (module doc)."""

    def __init__(self, mpi_comm, kind: str, max_bytes: int):
        from mpi4py import MPI
        self.MPI, self.c = MPI, mpi_comm
        self.label, self.transport = f"mpi {kind}", "mpich"
        self.version = MPI.Get_library_version().splitlines()[0].strip()
        self._mem = []

        def make(nbytes: int, dtype):
            if kind == "Win.Allocate":
                win = MPI.Win.Allocate(nbytes, 1, comm=mpi_comm)
                arr = np.frombuffer(win.tomemory(), dtype=dtype)
            else:
                arr = np.zeros(nbytes // np.dtype(dtype).itemsize, dtype=dtype)
                win = MPI.Win.Create(arr, 1, comm=mpi_comm)
            self._mem.append((win, arr))
            return win, arr
        self.bytes = make(max(max_bytes, 8), np.uint8)
        self.doubles = make(max(max_bytes // 8, 1) * 8, np.float64)
        self.words = make(16, np.int64)
        self.reset()
        mpi_comm.Barrier()

    def barrier(self) -> None:
        self.c.Barrier()

    def lock(self, w) -> None:
        w[0].Lock(1, self.MPI.LOCK_SHARED)

    def unlock(self, w) -> None:
        w[0].Unlock(1)

    def ops(self, op: str, size: int, window: int):
        MPI = self.MPI
        if op in ("put", "get"):
            w, buf = self.bytes[0], np.full(size, 7, dtype=np.uint8)
            if op == "put":
                def call():
                    for _ in range(window):
                        w.Put(buf, 1)
                    w.Flush(1)
            else:
                def call():
                    for _ in range(window):
                        w.Get(buf, 1)
                    w.Flush(1)
            return self.bytes, call
        if op == "accumulate":
            w, src = self.doubles[0], np.ones(max(size // 8, 1))

            def call():
                w.Accumulate([src, MPI.DOUBLE], 1, op=MPI.SUM)
                w.Flush(1)
            return self.doubles, call
        w = self.words[0]
        one, res = np.ones(1, np.int64), np.zeros(1, np.int64)
        if op == "fetch_and_op":
            def call():
                w.Fetch_and_op([one, MPI.INT64_T], [res, MPI.INT64_T], 1, 0, MPI.SUM)
                w.Flush(1)
            return self.words, call
        state = [0]
        vals = [np.array([v], np.int64) for v in (0, 1)]

        def call():
            w.Compare_and_swap([vals[1 - state[0]], MPI.INT64_T], [vals[state[0]], MPI.INT64_T],
                               [res, MPI.INT64_T], 1, 8)
            w.Flush(1)
            state[0] = 1 - state[0]
        return self.words, call

    def target_value(self, op: str, size: int) -> np.ndarray:
        if op in ("put", "get"):
            return self.bytes[1][:size]
        if op == "accumulate":
            return self.doubles[1][:max(size // 8, 1)]
        return self.words[1][:2]

    def reset(self) -> None:
        for win, arr in self._mem:
            win.Lock(self.c.rank, self.MPI.LOCK_EXCLUSIVE)
            arr[...] = 0
            win.Unlock(self.c.rank)

    def close(self) -> None:
        for win, _ in self._mem:
            win.Free()


# ------------------------------------------------------------------------------- one-sided
def _expected(op: str, size: int, calls: int) -> np.ndarray:
    if op == "put":
        return np.full(size, 7, dtype=np.uint8)
    if op == "get":
        return np.zeros(size, dtype=np.uint8)
    if op == "accumulate":
        return np.full(max(size // 8, 1), float(calls))
    if op == "fetch_and_op":
        return np.array([calls, 0], dtype=np.int64)
    return np.array([0, calls % 2], dtype=np.int64)


def _time_rma(comm, runners, op: str, size: int, mode: str, cfg: BenchConfig) -> List[dict]:
    """Batches of one (op, size, mode), every runner in turn; rows on rank 0."""
    window = BW_WINDOW if mode == "bw" else 1
    origin = comm.rank == 0
    nr = len(runners)
    for r in runners:
        r.reset()
        r.barrier()
    prepared = [r.ops(op, size, window) for r in runners]
    calls_made = np.zeros(nr, dtype=np.int64)
    iters = np.zeros(nr, dtype=np.int64)
    for i, r in enumerate(runners):             # warm up and size the batches (origin decides)
        w, call = prepared[i]
        r.barrier()
        if origin:
            r.lock(w)
            t0 = time.perf_counter()
            for _ in range(max(2, cfg.warmup)):
                call()
            each = (time.perf_counter() - t0) / max(2, cfg.warmup)
            r.unlock(w)
            calls_made[i] += max(2, cfg.warmup)
            iters[i] = cfg.iters or int(np.clip(np.ceil(cfg.batch_time / max(each, 1e-9)), 2,
                                                cfg.max_iters))
        r.barrier()
    times = np.full((nr, cfg.batches), np.nan)
    for k in range(cfg.batches):
        for i, r in enumerate(runners):
            w, call = prepared[i]
            r.barrier()
            if origin:
                r.lock(w)
                n = int(iters[i])
                t0 = time.perf_counter()
                for _ in range(n):
                    call()
                times[i, k] = (time.perf_counter() - t0) / (n * window)
                r.unlock(w)
                calls_made[i] += n
            r.barrier()
    wrong = np.zeros(nr, dtype=np.int64)
    calls_made = comm.broadcast(calls_made, root=0)     # the target checks against the count
    for i, r in enumerate(runners):
        r.barrier()
        if comm.rank == 1:
            got = r.target_value(op, size)
            wrong[i] = int(np.count_nonzero(got != _expected(op, size, int(calls_made[i]))))
        r.barrier()
    wrong = comm.allreduce(wrong, op="sum")
    if not origin:
        return []
    rows = []
    ref = next((i for i, r in enumerate(runners) if r.label == "mpi Win.Allocate"), None)
    for i, r in enumerate(runners):
        t = float(np.median(times[i]))
        ratio = None
        if ref is not None and i != ref and r.label.startswith("mc"):
            ratio = t / float(np.median(times[ref]))
        rows.append(dict(op=op, mode=mode, size=size, library=r.label, transport=r.transport,
                         time_us=t * 1e6, bw_GBs=size / t / 1e9 if t > 0 else 0.0,
                         vs_mpi=ratio, wrong=int(wrong[i]), iters=int(iters[i]),
                         batches_us=[x * 1e6 for x in times[i]]))
    return rows


def _rma_main(comm, cfg: BenchConfig, transports: List[str], mpi_comm=None) -> Optional[List[dict]]:
    if comm.size < 2:
        raise BenchError("the one-sided benchmark needs at least 2 ranks (origin and target)")
    max_bytes = max(cfg.sizes)
    worlds = transport_worlds(comm, transports)
    runners: list = []
    try:
        for kind in transports:
            runners.append(_McWindows(worlds[kind], kind, max_bytes))
        if "mpi" in cfg.peers:
            runners.append(_MpiWindows(mpi_comm, "Win.Allocate", max_bytes))
            runners.append(_MpiWindows(mpi_comm, "Win.Create", max_bytes))
        rows: List[dict] = []
        for op in cfg.collectives:
            if comm.rank == 0 and not cfg.quiet:
                print(_header(op, comm, cfg, runners), flush=True)
            sizes = [8] if op in ("fetch_and_op", "cas") else [max(s, 8 if op == "accumulate"
                                                                    else 1) for s in cfg.sizes]
            for size in dict.fromkeys(sizes):
                for mode in (("lat", "bw") if op in ("put", "get") else ("lat",)):
                    got = _time_rma(comm, runners, op, size, mode, cfg)
                    rows.extend(got)
                    if comm.rank == 0 and not cfg.quiet:
                        for row in got:
                            print(_format(row), flush=True)
        return rows if comm.rank == 0 else None
    finally:
        for r in runners:
            r.close()
        for kind, w in worlds.items():
            if w is not comm:
                w.close()


# ------------------------------------------------------------------ collectives per transport
def _collectives_main(comm, cfg: BenchConfig, transports: List[str]) -> Optional[List[dict]]:
    worlds = transport_worlds(comm, transports)
    algo = cfg.algorithms[0] if cfg.algorithms else "auto"
    rows: List[dict] = []
    try:
        for coll in cfg.collectives:
            for size in cfg.sizes:
                n = max(size // 4, comm.size)
                n -= n % comm.size
                x = np.ones(n, dtype=np.float32)
                calls = []
                for kind in transports:
                    c = worlds[kind]
                    calls.append(_collective_call(c, coll, x, algo))
                times = np.full((len(transports), cfg.batches), np.nan)
                for f in calls:                # warm-up
                    for _ in range(max(1, cfg.warmup // 2)):
                        f()
                for k in range(cfg.batches):
                    for i, kind in enumerate(transports):
                        worlds[kind].barrier()
                        t0 = time.perf_counter()
                        calls[i]()
                        times[i, k] = time.perf_counter() - t0
                slowest = comm.allreduce(times, op="max")
                if comm.rank == 0:
                    med = np.median(slowest, axis=1)
                    for i, kind in enumerate(transports):
                        row = dict(op=coll, mode="time", size=n * 4, library=f"mc {kind}",
                                   transport=kind, time_us=float(med[i]) * 1e6,
                                   vs_first=float(med[i] / med[0]) if med[0] > 0 else None,
                                   batches_us=[t * 1e6 for t in slowest[i]])
                        rows.append(row)
                        if not cfg.quiet:
                            print(f"  {coll:>14}  {format_size(n * 4):>6}  {'mc ' + kind:>8}  "
                                  f"{med[i] * 1e3:10.1f} ms  vs {transports[0]} "
                                  f"{med[i] / med[0]:5.2f}", flush=True)
        return rows if comm.rank == 0 else None
    finally:
        for kind, w in worlds.items():
            if w is not comm:
                w.close()


def _collective_call(c, coll: str, x: np.ndarray, algo: str):
    p = c.size
    out = np.empty_like(x)
    grid = x.reshape(p, -1)
    if coll == "allreduce":
        return lambda: c.allreduce(x, algorithm=algo, out=out)
    if coll == "broadcast":
        return lambda: c.broadcast(x, algorithm=algo, out=out)
    if coll == "reduce":
        return lambda: c.reduce(x, algorithm=algo, out=out if c.rank == 0 else None)
    if coll == "allgather":
        return lambda: c.allgather(grid[0], algorithm=algo)
    if coll == "reduce_scatter":
        return lambda: c.reduce_scatter(grid, algorithm=algo)
    if coll == "alltoall":
        return lambda: c.alltoall(grid, algorithm=algo)
    if coll == "gather":
        return lambda: c.gather(grid[0], algorithm=algo)
    if coll == "scatter":
        return lambda: c.scatter(grid if c.rank == 0 else None, algorithm=algo)
    raise BenchError(f"{coll}: not a collective this benchmark times across transports")


# ------------------------------------------------------------------------------- printing
def _header(op: str, comm, cfg: BenchConfig, runners) -> str:
    lines = [f"# minicomm bench {op}: origin rank 0, target rank 1 of {comm.size}, {cfg.nodes} "
             f"node(s); shared lock per batch, flush per call"
             + (f" (bandwidth rows: {BW_WINDOW} calls per flush)" if op in ("put", "get") else ""),
             f"#   {cfg.batches} batches of ~{cfg.batch_time * 1e3:.0f} ms, runners in turn; median"]
    for r in runners:
        if hasattr(r, "version"):
            lines.append(f"#   {r.label}: {r.version}")
    lines.append(f"# {'size':>10}  {'mode':>4}  {'library':>16}  {'time (us)':>10}  "
                 f"{'GB/s':>7}  {'vs mpi':>6}  {'#wrong':>6}")
    return "\n".join(lines)


def _format(row: dict) -> str:
    ratio = row.get("vs_mpi")
    return (f"  {row['size']:>10}  {row['mode']:>4}  {row['library']:>16}  "
            f"{row['time_us']:10.2f}  {row['bw_GBs']:7.3f}  "
            f"{(f'{ratio:.2f}' if ratio is not None else ''):>6}  {row['wrong']:>6}")


# ------------------------------------------------------------------------------- driving
def rank_main(comm, cfg: BenchConfig, transports: List[str], mpi_comm=None):
    if set(cfg.collectives) <= set(RMA_OPS):
        return _rma_main(comm, cfg, transports, mpi_comm)
    if set(cfg.collectives) & set(RMA_OPS):
        raise BenchError("name either one-sided ops or collectives, not both")
    return _collectives_main(comm, cfg, transports)


def main_from_cli(a, config_from_args) -> int:
    """``minicomm bench`` hands over its arguments and its parser of them (bench imports this
    module, never the other way round)."""
    try:
        cfg = config_from_args(a)
        transports = [t.strip() for t in (a.transports or ",".join(_ONE_SIDED_TRANSPORTS))
                      .split(",") if t.strip()]
        bad = [t for t in transports if t not in ("shm", "tcp", "rdma", "ub")]
        if bad:
            raise BenchError(f"--transports: unknown {', '.join(bad)}")
        one_sided = set(cfg.collectives) & set(RMA_OPS)
        if one_sided and "tcp" in transports:
            raise BenchError("tcp has no one-sided access: drop it from --transports")
        cfg = dataclasses.replace(cfg, transport="shm" if "shm" in transports else transports[0])
        if "mpi" in cfg.peers:
            from .benchspec import mpi_available
            why = mpi_available()
            if why:
                raise BenchError(f"--peers mpi: {why}")
            from . import peers as _peers
            rows = _peers.run_under_mpiexec(_WithTransports(cfg, transports),
                                            rank_module="minicomm.tools.rma_bench")
        else:
            from ..launch import spawn
            rows = spawn(rank_main, cfg.nranks, args=(cfg, transports), transport=cfg.transport,
                         nodes=cfg.nodes, timeout=None)[0]
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": dict(dataclasses.asdict(cfg), transports=transports,
                                        hostname=socket.gethostname(),
                                        created=time.strftime("%Y-%m-%dT%H:%M:%S%z")),
                           "rows": rows}, f, indent=1)
    except BenchError as e:
        print(f"minicomm bench: {e}", file=sys.stderr)
        return 2
    return 1 if any(r.get("wrong") for r in rows) else 0


@dataclasses.dataclass
class _WithTransports(BenchConfig):
    transports: List[str] = dataclasses.field(default_factory=list)

    def __init__(self, cfg: BenchConfig, transports: List[str]):
        for f in dataclasses.fields(BenchConfig):
            setattr(self, f.name, getattr(cfg, f.name))
        self.transports = list(transports)


def _mpi_rank(cfg_path: str, out_path: str) -> int:
    """One rank under mpiexec (``peers.run_under_mpiexec``): MPI first, then minicomm."""
    from mpi4py import MPI

    from ..launch import init, node_map
    with open(cfg_path) as f:
        raw = json.load(f)
    transports = raw.pop("transports")
    cfg = BenchConfig(**raw)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    os.environ.update(MINICOMM_RANK=str(rank), MINICOMM_SIZE=str(size),
                      MINICOMM_NODE=str(node_map(size, cfg.nodes)[rank]),
                      MINICOMM_HOST=socket.gethostname())
    comm = init(transport=cfg.transport, timeout=cfg.timeout)
    try:
        rows = rank_main(comm, cfg, transports, mpi_comm=MPI.COMM_WORLD)
        if rank == 0:
            tmp = out_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rows, f)
            os.replace(tmp, out_path)
    finally:
        comm.close()
    return 0


if __name__ == "__main__":   # one rank of peers.run_under_mpiexec
    from minicomm.tools import rma_bench as _self
    sys.exit(_self._mpi_rank(sys.argv[1], sys.argv[2]))
