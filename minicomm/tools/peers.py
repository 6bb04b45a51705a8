"""Peers for ``minicomm bench --peers``: the same calls through MPICH (mpi4py) and gloo (torch).

Both run in the benchmark's own rank processes, on the same numpy buffers, taking turns batch by
batch with minicomm's algorithms. The MPI peer needs its ranks started by MPICH's ``mpiexec`` (the
one the ``mpich`` wheel installs beside this interpreter): ``run_under_mpiexec`` starts them, and
each also builds its minicomm communicator from the environment (``mc.init``), so one job carries
both. gloo only needs a TCP store, which rank 0 hosts.

Buffer semantics match nccl-tests: out-of-place calls read ``send`` and write ``recv``. Where a
library has no out-of-place form (MPI_Bcast; gloo's allreduce, reduce and broadcast work in
place), the out-of-place call copies the input into the output first and then works in place,
which is what its users do to get the same contract. gloo's all_to_all_single gives wrong results
when input and output alias, so gloo has no in-place alltoall (n/a).

Install: ``pip install 'minicomm[peers]'`` (mpi4py and the MPICH wheel); torch is detected, never
required (CPU build: ``pip install torch``).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import List

import numpy as np

from ..schedule import matrix_of
from .benchspec import (  # noqa: F401
    GLOO_OPS,
    MPI_OPS,
    UNEVEN,
    BenchConfig,
    BenchError,
    Buffers,
    Call,
    check_supported,
    find_mpiexec,
    gloo_available,
    mpi_available,
)


def start(peer: str, comm, cfg: BenchConfig, mpi_comm=None):
    if peer == "mpi":
        if mpi_comm is None:
            raise BenchError("--peers mpi: this rank was not started by mpiexec")
        return MpiRunner(mpi_comm, cfg)
    return GlooRunner(comm, cfg)


# ------------------------------------------------------------------------ MPI
class MpiRunner:
    library = "mpi"
    label = "mpi"
    algorithm = "mpi"

    def __init__(self, mpi_comm, cfg: BenchConfig):
        from mpi4py import MPI
        self.MPI, self.c = MPI, mpi_comm
        self.version = MPI.Get_library_version().splitlines()[0].strip() + \
            f", mpi4py {__import__('mpi4py').__version__}"
        self.transport = "mpich-tcp" if os.environ.get("MPIR_CVAR_NOLOCAL") == "1" else "mpich"
        if self.transport == "mpich-tcp":
            self.version += f" over TCP (MPIR_CVAR_NOLOCAL=1, UCX_TLS={os.environ.get('UCX_TLS')})"
        self.mpi_op = getattr(MPI, MPI_OPS[cfg.op])
        self._requests: list = []          # --persistent: the live requests, freed in turn
        if cfg.persistent and MPI.Get_version() < (4, 0):
            raise BenchError(f"--persistent --peers mpi: {self.version} implements MPI "
                             f"{'.'.join(map(str, MPI.Get_version()))}; persistent collectives "
                             f"(MPI_Allreduce_init, ...) need MPI 4.0")

    def describe(self, case) -> str:
        return "mpi"

    def supports(self, collective: str, inplace: bool) -> bool:
        return not (inplace and collective in UNEVEN)

    def prepare(self, b: Buffers, inplace: bool, op: str, root: int) -> Call:
        MPI, c, o = self.MPI, self.c, self.mpi_op
        coll, r = b.case.collective, c.rank
        is_root = r == root
        send, recv, ip = b.send, b.recv, b.ip
        IP = MPI.IN_PLACE
        result = b.default_result(inplace)
        if coll == "allreduce":
            f = (lambda: c.Allreduce(IP, ip, o)) if inplace else (lambda: c.Allreduce(send, recv, o))
        elif coll == "reduce":
            if inplace:
                f = (lambda: c.Reduce(IP, ip, o, root)) if is_root else (lambda: c.Reduce(ip, None, o, root))
            else:
                f = lambda: c.Reduce(send, recv if is_root else None, o, root)  # noqa: E731
        elif coll == "broadcast":
            if inplace:
                f = lambda: c.Bcast(ip, root)  # noqa: E731
            elif is_root:
                def f():
                    np.copyto(recv, send)
                    c.Bcast(recv, root)
            else:
                f = lambda: c.Bcast(recv, root)  # noqa: E731
        elif coll == "allgather":
            f = (lambda: c.Allgather(IP, ip)) if inplace else (lambda: c.Allgather(send, recv))
        elif coll == "gather":
            if inplace:
                f = (lambda: c.Gather(IP, ip, root)) if is_root else \
                    (lambda: c.Gather(b.block(ip, r), None, root))
            else:
                f = lambda: c.Gather(send, recv if is_root else None, root)  # noqa: E731
        elif coll == "scatter":
            if inplace:
                f = (lambda: c.Scatter(ip, IP, root)) if is_root else \
                    (lambda: c.Scatter(None, b.block(ip, r), root))
            else:
                f = lambda: c.Scatter(send if is_root else None, recv, root)  # noqa: E731
        elif coll == "reduce_scatter":
            if inplace:
                f = lambda: c.Reduce_scatter_block(IP, ip, o)  # noqa: E731
                result = b.block(ip, 0)     # MPI puts an in-place result at the buffer's start
            else:
                f = lambda: c.Reduce_scatter_block(send, recv, o)  # noqa: E731
        elif coll == "alltoall":
            f = (lambda: c.Alltoall(IP, ip)) if inplace else (lambda: c.Alltoall(send, recv))
        elif coll == "barrier":
            f = c.Barrier
        elif coll == "allgatherv":
            counts = list(b.case.counts)
            f = lambda: c.Allgatherv(send, [recv, counts])  # noqa: E731
        elif coll == "alltoallv":
            rows = matrix_of(b.case.counts, c.size)
            scounts, rcounts = list(rows[r]), [row[r] for row in rows]
            f = lambda: c.Alltoallv([send, scounts], [recv, rcounts])  # noqa: E731
        else:
            raise ValueError(coll)
        return Call(f, c.Barrier, result)

    def _spec(self, b: Buffers, inplace: bool, root: int):
        """The call ``prepare`` makes, as data: (its MPI name, its arguments, the copy made
        before it or None, where the result lands). ``--persistent`` and ``--group`` pass the
        same arguments to ``<Name>_init`` and ``I<name>``, which take them as the blocking call
        does. (``prepare`` keeps its own lambdas: no argument unpacking in the timed call.)"""
        MPI, c, o = self.MPI, self.c, self.mpi_op
        coll, r = b.case.collective, c.rank
        is_root = r == root
        send, recv, ip = b.send, b.recv, b.ip
        IP = MPI.IN_PLACE
        result, before = b.default_result(inplace), None
        if coll == "allreduce":
            name, args = "Allreduce", ((IP, ip, o) if inplace else (send, recv, o))
        elif coll == "reduce":
            name = "Reduce"
            if inplace:
                args = (IP, ip, o, root) if is_root else (ip, None, o, root)
            else:
                args = (send, recv if is_root else None, o, root)
        elif coll == "broadcast":
            name = "Bcast"
            if inplace:
                args = (ip, root)
            else:
                args = (recv, root)
                if is_root:
                    before = (recv, send)      # np.copyto(recv, send), then in place
        elif coll == "allgather":
            name, args = "Allgather", ((IP, ip) if inplace else (send, recv))
        elif coll == "gather":
            name = "Gather"
            if inplace:
                args = (IP, ip, root) if is_root else (b.block(ip, r), None, root)
            else:
                args = (send, recv if is_root else None, root)
        elif coll == "scatter":
            name = "Scatter"
            if inplace:
                args = (ip, IP, root) if is_root else (None, b.block(ip, r), root)
            else:
                args = (send if is_root else None, recv, root)
        elif coll == "reduce_scatter":
            name = "Reduce_scatter_block"
            if inplace:
                args = (IP, ip, o)
                result = b.block(ip, 0)     # MPI puts an in-place result at the buffer's start
            else:
                args = (send, recv, o)
        elif coll == "alltoall":
            name, args = "Alltoall", ((IP, ip) if inplace else (send, recv))
        elif coll == "barrier":
            name, args = "Barrier", ()
        elif coll == "allgatherv":
            name, args = "Allgatherv", (send, [recv, list(b.case.counts)])
        elif coll == "alltoallv":
            rows = matrix_of(b.case.counts, c.size)
            name = "Alltoallv"
            args = ([send, list(rows[r])], [recv, [row[r] for row in rows]])
        else:
            raise ValueError(coll)
        return name, args, before, result

    def prepare_persistent(self, b: Buffers, inplace: bool, op: str, root: int) -> Call:
        """``--persistent``: ``Comm.<Name>_init`` (MPI-4) on ``prepare``'s arguments, made
        once; the timed call is ``req.Start(); req.Wait()`` (after the out-of-place
        broadcast's copy, as ``prepare`` does it)."""
        name, args, before, result = self._spec(b, inplace, root)
        init = getattr(self.c, name + "_init", None)
        if init is None:
            raise BenchError(f"--persistent --peers mpi: {self.version} has no "
                             f"Comm.{name}_init (persistent collectives need mpi4py >= 4)")
        req = init(*args)
        self._requests.append(req)
        start, wait = req.Start, req.Wait
        if before is None:
            def f():
                start()
                wait()
        else:
            dst, src = before

            def f():
                np.copyto(dst, src)
                start()
                wait()
        return Call(f, self.c.Barrier, result, free=lambda: self._free(req))

    def prepare_group(self, bufs, inplace: bool, op: str, root: int) -> Call:
        """``--group K``: the MPI analogue of one ``comm.group()`` of K calls: K nonblocking
        calls (``Comm.I<name>``, one per buffer set, as ``prepare``'s arguments), then one
        ``MPI.Request.Waitall``."""
        specs = [self._spec(b, inplace, root) for b in bufs]
        name = specs[0][0]
        post = getattr(self.c, "I" + name[0].lower() + name[1:])
        waitall = self.MPI.Request.Waitall
        arglists = [args for _, args, _, _ in specs]
        if all(before is None for _, _, before, _ in specs):
            def f():
                waitall([post(*args) for args in arglists])
        else:
            jobs = [(args, before) for _, args, before, _ in specs]

            def f():
                reqs = []
                for args, before in jobs:
                    if before is not None:
                        np.copyto(*before)
                    reqs.append(post(*args))
                waitall(reqs)
        return Call(f, self.c.Barrier, specs[0][3], results=[s[3] for s in specs])

    def _free(self, req) -> None:
        for j, live in enumerate(self._requests):
            if live is req:
                del self._requests[j]
                req.Free()
                return

    def close(self) -> None:
        while self._requests:           # left by a placement that failed
            self._free(self._requests[-1])


# ------------------------------------------------------------------------ gloo
class GlooRunner:
    library = "gloo"
    label = "gloo"
    algorithm = "gloo"
    transport = "gloo-tcp"

    def __init__(self, comm, cfg: BenchConfig):
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        # one compute thread per rank, as minicomm and MPI have (the out-of-place copies would
        # otherwise fan out over every core and steal them from the other ranks)
        torch.set_num_threads(1)
        addr = os.environ.get("MINICOMM_MASTER_ADDR", "127.0.0.1")
        if addr in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        limit = datetime.timedelta(seconds=cfg.timeout if cfg.timeout is not None else comm.timeout)
        if comm.rank == 0:
            store = dist.TCPStore(addr, 0, comm.size, True, timeout=limit, wait_for_workers=False)
            comm.broadcast_object(store.port, root=0)
        else:
            port = comm.broadcast_object(None, root=0)
            store = dist.TCPStore(addr, port, comm.size, False, timeout=limit)
        self.store = store
        self.pg = None
        dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size,
                                timeout=limit)
        self.pg = dist.group.WORLD
        self.version = f"torch {torch.__version__} gloo (TCP loopback)"
        self.red = getattr(dist.ReduceOp, GLOO_OPS[cfg.op])
        # torch 2.13 names these *_single; older releases *_tensor
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = (getattr(dist, "reduce_scatter_single", None)
                                or dist.reduce_scatter_tensor)

    def describe(self, case) -> str:
        return "gloo"

    def supports(self, collective: str, inplace: bool) -> bool:
        return not (collective == "alltoall" and inplace) and collective not in UNEVEN

    def prepare(self, b: Buffers, inplace: bool, op: str, root: int) -> Call:
        torch, dist, red = self.torch, self.dist, self.red
        coll = b.case.collective
        n, r = b.case.n, b.rank
        is_root = r == root
        t = torch.from_numpy
        send, recv, ip = t(b.send), t(b.recv), t(b.ip)
        c = b.case.count

        def blocks(x):
            return list(x.split(c)) if c else [x[:0] for _ in range(n)]

        def block(x, j):
            return x[j * c:(j + 1) * c]
        if coll == "allreduce":
            if inplace:
                f = lambda: dist.all_reduce(ip, red)  # noqa: E731
            else:
                def f():
                    recv.copy_(send)
                    dist.all_reduce(recv, red)
        elif coll == "reduce":
            if inplace:
                f = lambda: dist.reduce(ip, root, red)  # noqa: E731
            else:
                def f():
                    recv.copy_(send)
                    dist.reduce(recv, root, red)
        elif coll == "broadcast":
            if inplace:
                f = lambda: dist.broadcast(ip, root)  # noqa: E731
            elif is_root:
                def f():
                    recv.copy_(send)
                    dist.broadcast(recv, root)
            else:
                f = lambda: dist.broadcast(recv, root)  # noqa: E731
        elif coll == "allgather":
            ag = self._all_gather
            f = (lambda: ag(ip, block(ip, r))) if inplace else (lambda: ag(recv, send))
        elif coll == "gather":
            if inplace:
                lst = blocks(ip) if is_root else None
                x = block(ip, r)
            else:
                lst = blocks(recv) if is_root else None
                x = send
            f = lambda: dist.gather(x, lst, root)  # noqa: E731
        elif coll == "scatter":
            if inplace:
                lst = blocks(ip) if is_root else None
                y = block(ip, r)
            else:
                lst = blocks(send) if is_root else None
                y = recv
            f = lambda: dist.scatter(y, lst, root)  # noqa: E731
        elif coll == "reduce_scatter":
            rs = self._reduce_scatter
            f = (lambda: rs(block(ip, r), ip, red)) if inplace else (lambda: rs(recv, send, red))
        elif coll == "alltoall":
            f = lambda: dist.all_to_all_single(recv, send)  # noqa: E731
        elif coll == "barrier":
            f = dist.barrier
        else:
            raise ValueError(coll)
        return Call(f, dist.barrier, b.default_result(inplace))

    def prepare_persistent(self, b: Buffers, inplace: bool, op: str, root: int) -> Call:
        raise BenchError("--persistent: the gloo peer has no persistent collectives")

    def prepare_group(self, bufs, inplace: bool, op: str, root: int) -> Call:
        raise BenchError("--group: the gloo peer has no grouped form")

    def close(self) -> None:
        if self.pg is not None:
            self.dist.destroy_process_group()
            self.pg = None


# ------------------------------------------------------------------------ mpiexec launch
def run_under_mpiexec(cfg: BenchConfig, rank_module: str) -> List[dict]:
    """Start cfg.nranks ranks with mpiexec, each running ``python -m rank_module CONFIG OUT`` (the
    benchmark driver's MPI rank entry); each joins a minicomm world through a store this
    process hosts (the same authenticated rendezvous ``minicomm run`` uses) and runs the bench;
    rank 0 writes its rows to a file we read back."""
    from ..launch.local import _sweep
    from ..rendezvous import StoreServer
    mpiexec = find_mpiexec()
    token = secrets.token_bytes(32)
    job_id = secrets.token_hex(6)
    server = StoreServer("127.0.0.1", 0, token)
    tmp = tempfile.mkdtemp(prefix="minicomm-bench-")
    cfg_path, out_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "rows.json")
    with open(cfg_path, "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MINICOMM_") or k in ("MINICOMM_ALGO", "MINICOMM_DEBUG")}
    env.update(MINICOMM_MASTER_ADDR="127.0.0.1", MINICOMM_MASTER_PORT=str(server.port),
               MINICOMM_JOB_TOKEN=token.hex(), MINICOMM_JOB_ID=job_id,
               MINICOMM_TRANSPORT=cfg.transport, PYTHONUNBUFFERED="1")
    if cfg.transport == "tcp":
        # Compare like with like: MPICH between ranks over TCP, not shared memory. NOLOCAL sends
        # local peers through the network module; that module (UCX by default in the mpich
        # wheel, or libfabric) would still pick shared memory unless told to use TCP.
        env.setdefault("MPIR_CVAR_NOLOCAL", "1")
        env.setdefault("UCX_TLS", "tcp,self")
        env.setdefault("FI_PROVIDER", "tcp")
    cmd = [mpiexec, "-n", str(cfg.nranks), sys.executable, "-m", rank_module, cfg_path,
           out_path]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        # No overall deadline here: every rank ends itself when it makes no progress for
        # cfg.timeout seconds (bench.Watchdog), and mpiexec then ends the job.
        rc = proc.wait()
        if rc != 0:
            raise BenchError(f"the mpiexec job failed (exit status {rc})")
        with open(out_path) as f:
            return json.load(f)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        server.close()
        _sweep(job_id)
        shutil.rmtree(tmp, ignore_errors=True)
