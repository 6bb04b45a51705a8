"""Starting worlds on this machine: ``spawn`` (threads or fresh processes) and ``run_local``
(``minicomm run -n N script.py``).

Process worlds: the parent hosts the rendezvous store (authenticated with a fresh job token),
starts ``world_size`` interpreters running ``python -m minicomm.launch.worker``, and hands each
its function, arguments and configuration over its stdin (cloudpickle; the token never appears on a command
line). Each child writes one result record to a private pipe. A child dies with its parent: the
kernel sends it SIGTERM when the parent dies (PR_SET_PDEATHSIG, lifeline.py), and its stdin
reaching end-of-file says the same; either way it leaves through an orderly, bounded exit that
unlinks its /dev/shm segments and sweeps the job's, so a killed caller leaves nothing behind.

Failure policy (what ``SpawnError`` reports): the first rank to fail with its own error is the root
cause; ranks that then fail with ``PeerFailure`` (they lost a peer) are listed after it. After the
first failure the others get a grace period to fail on their own, then are killed; every child is
reaped and the job's /dev/shm segments are swept, whatever happened.
"""
from __future__ import annotations

import os
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import cloudpickle

from .. import flightrecord
from ..algorithms import registered
from ..communicator import Communicator
from ..cost import LinkModel, parse_algo_env
from ..diagnosis import FINISHED
from ..errors import CommError, PeerFailure, SpawnError
from ..rendezvous import StoreServer
from ..settings import env_debug, env_timeout, timeout_arg
from ..transports import fault
from .lifeline import EXEC_UNDER_LIFELINE
from .records import ASK_AFTER_TIMEOUT_S, JobRecords, exit_text
from .world import TRANSPORTS, node_map

FAILURE_GRACE = 5.0     # seconds the surviving ranks get to notice a failure by themselves
ON_FAILURE = ("end", "continue")   # what a rank's failure does to the others (spawn, run)


# ---------------------------------------------------------------------------------- spawn
def spawn(fn: Callable, world_size: int, args: Sequence = (), transport: str = "auto",
          nodes: int = 1, timeout: Optional[float] = None,
          on_failure: str = "end", switch: bool = False) -> List[Any]:
    """Run ``fn(comm, *args)`` on ``world_size`` ranks; return the results by rank.

    Args:
        fn (Callable): The rank's program, called with its ``Communicator`` first (for processes
            it travels by cloudpickle, so a lambda or a closure is fine).
        world_size (int): The number of ranks.
        args (Sequence): More arguments for ``fn``, the same on every rank.
        transport (str): "auto", "inproc" (threads of this process), "shm", "tcp", "rdma" or
            "ub" (fresh processes).
        nodes (int): Emulated nodes: the ranks are split into this many blocks, each a node of
            ``comm.topology`` (the hierarchical algorithms and "auto" use it).
        timeout (float | None): Seconds each wait of a rank may take (default
            ``MINICOMM_TIMEOUT``); not a deadline for the job.
        on_failure (str): "end": after the first failure the others get a grace period to fail
            by themselves, then are killed. "continue": a failure ends no other rank; the
            survivors go on (``comm.shrink()``) and spawn waits for every rank.
        switch (bool): Start the job's emulated in-network switch (launch/switch.py), which
            ``algorithm="innet"`` runs through; process worlds only.

    Returns:
        (list): ``fn``'s return value on each rank, by rank.

    Raises:
        ValueError: An unknown transport, ``world_size < 1``, or a bad setting
            (``MINICOMM_TIMEOUT``, ``MINICOMM_DEBUG``, ``MINICOMM_ALGO``).
        SpawnError: One or more ranks raised or died; the root cause first, with every failed
            rank's traceback (``failures``) and the other ranks' return values (``results``).

    Examples:
        >>> mc.spawn(lambda comm: comm.allreduce(np.ones(2)), world_size=4, transport="inproc")
        [array([4., 4.]), array([4., 4.]), array([4., 4.]), array([4., 4.])]
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure {on_failure!r}: choose one of {', '.join(ON_FAILURE)}")
    timeout = timeout_arg("spawn: timeout", timeout)
    # the settings every rank reads, checked once here: a bad one is this ValueError, named,
    # instead of the same error from every rank
    env_timeout()
    env_debug()
    parse_algo_env()
    flightrecord.record_capacity()
    topology = node_map(world_size, nodes)
    if transport == "inproc" and switch:
        raise ValueError("switch=True needs a process world: the switch is a process that the "
                         "ranks reach over shm or tcp; choose transport auto, shm or tcp")
    if transport == "inproc":
        return _spawn_threads(fn, world_size, tuple(args), topology, timeout, on_failure)
    return _spawn_processes(fn, world_size, tuple(args), transport, topology, timeout,
                            on_failure, switch)


def _order_failures(failures):
    """Root causes (own errors, deaths) first, then ranks that only lost a peer; by time."""
    return sorted(failures, key=lambda f: (f[3], f[0]))


def _raise_spawn_error(failures, world_size: int, results: Sequence = (),
                       diagnosis: Sequence[str] = ()):
    failures = _order_failures(failures)
    first = failures[0]
    lines = [f"{len(failures)} of {world_size} ranks failed; root cause: rank {first[1]}: "
             f"{first[2]}"]
    for _, rank, summary, _, tb in failures:
        lines.append(f"--- rank {rank}: {summary}\n{tb.rstrip()}")
    lines += diagnosis
    raise SpawnError("\n".join(lines), [(f[1], f[4]) for f in failures], results)


def _spawn_threads(fn, world_size, args, topology, timeout, on_failure):
    from ..transports.inproc import Fabric, InprocTransport
    fabric = Fabric(world_size)
    results: List[Any] = [None] * world_size
    failures = []
    lock = threading.Lock()
    model = LinkModel.for_transports("inproc", "inproc")

    # MINICOMM_FAULT (checked here, in the caller: a bad value is its ValueError)
    transports = [fault.wrap(InprocTransport(fabric, r), r, processes=False)
                  for r in range(world_size)]
    finished = threading.Condition()
    done = []
    records = JobRecords(f"inproc{os.getpid()}")
    comms: List[Any] = [None] * world_size

    def body(rank: int):
        comm = None
        try:                          # a failure to build the communicator is the rank's too
            comm = comms[rank] = Communicator(transports[rank], rank, world_size,
                                              topology=topology, timeout=timeout, check="full",
                                              link_model=model)
            if comm._flight is not None:
                comm._flight.directory = records.directory
            results[rank] = fn(comm, *args)
        except BaseException as e:   # reported to the caller through SpawnError
            with lock:
                failures.append((time.monotonic(), rank, f"{type(e).__name__}: {e}",
                                 isinstance(e, PeerFailure), traceback.format_exc()))
            fabric.abort(rank, e)
        finally:
            if comm is not None:
                comm.close()
            with finished:
                done.append(rank)
                finished.notify_all()

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"minicomm-rank{r}")
               for r in range(world_size)]
    for t in threads:
        t.start()
    # As for processes: ``timeout`` is the ranks' per-wait limit, not a job deadline. A healthy
    # job runs as long as it computes; after the first failure the others get a grace period.
    with finished:
        while len(done) < world_size:
            with lock:
                first = min((f[0] for f in failures), default=None)
            if first is None or on_failure == "continue":
                finished.wait(60.0)          # woken by each finishing rank; re-checks failures
                continue
            left = first + FAILURE_GRACE - time.monotonic()
            if left <= 0:
                break
            finished.wait(left)
    hung = [r for r in range(world_size) if r not in done]
    if hung:
        fabric.shutdown(CommError("spawn: the job failed"))
        failures.extend((time.monotonic(), r, f"still running {FAILURE_GRACE:.0f}s after the job "
                         f"failed", True, "") for r in hung)
    try:
        if failures:
            _raise_spawn_error(failures, world_size, results,
                               _thread_diagnosis(records, comms, failures, hung))
    finally:
        records.close()
    return results


def _thread_diagnosis(records: JobRecords, comms, failures, hung) -> List[str]:
    """As ``_diagnosis``, for ranks that are threads: the ranks that wrote no record of their
    own (they finished, or hang) are recorded here from their world communicators."""
    exits: Dict[int, Optional[str]] = {r: FINISHED for r in range(len(comms))}
    for _, r, summary, _, _ in failures:
        exits[r] = None if r in hung else summary.split("\n", 1)[0][:200]
    for r, comm in enumerate(comms):
        if comm is not None and comm._flight is not None and not os.path.exists(
                os.path.join(records.directory, f"rank-{r}.json")):
            flightrecord.dump("the job ended", [comm._flight], records.directory)
    return records.diagnosis(exits, len(comms))


def _sweep(job_id: str) -> None:
    try:
        from ..transports.shm import sweep_job_segments
    except ImportError:       # shm transport not available: nothing of ours can be in /dev/shm
        return
    sweep_job_segments(job_id)


last_job_id: Optional[str] = None   # of the latest process job (tests check it left nothing)


def _spawn_processes(fn, world_size, args, transport, topology, timeout, on_failure,
                     switch=False):
    global last_job_id
    job_id = last_job_id = secrets.token_hex(6)
    host = socket.gethostname()
    token = secrets.token_bytes(32)
    server = StoreServer("127.0.0.1", 0, token)
    blob = cloudpickle.dumps((fn, args, registered()))   # the parent's registered algorithms
    procs: List[subprocess.Popen] = []
    readers: Dict[int, int] = {}
    records = JobRecords(job_id)
    try:
        for rank in range(world_size):
            rfd, wfd = os.pipe()
            cfg = dict(rank=rank, size=world_size, node=topology[rank], topology=topology,
                       hosts=(host,) * world_size,      # emulated nodes, one machine
                       master_addr="127.0.0.1", master_port=server.port, token=token.hex(),
                       job_id=job_id, transport=transport, timeout=timeout, result_fd=wfd,
                       sys_path=list(sys.path), cwd=os.getcwd(), flight_dir=records.directory,
                       switch=switch)
            payload = cloudpickle.dumps(cfg) + blob
            p = subprocess.Popen([sys.executable, "-m", "minicomm.launch.worker", str(os.getpid())],
                                 stdin=subprocess.PIPE,
                                 pass_fds=(wfd,), cwd=os.getcwd())
            os.close(wfd)
            readers[rank] = rfd
            procs.append(p)
            header = struct.pack("!QQ", len(payload) - len(blob), len(blob))
            p.stdin.write(header + payload)
            p.stdin.flush()            # stdin stays open: it is the child's lifeline
        return _collect(procs, readers, world_size, on_failure, records)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
            p.wait()
        for fd in readers.values():
            try:
                os.close(fd)
            except OSError:
                pass
        server.close()
        _sweep(job_id)
        records.close()


def _collect(procs, readers, world_size, on_failure, records: JobRecords):
    sel = selectors.DefaultSelector()
    chunks: Dict[int, List[bytes]] = {r: [] for r in readers}
    for r, fd in readers.items():
        sel.register(fd, selectors.EVENT_READ, r)
    results: List[Any] = [None] * world_size
    failures = []
    finished = set()
    first_failure_at: Optional[float] = None
    ask_at: Optional[float] = None    # when to ask the running ranks for their records
    # ``timeout`` is the ranks' limit for each wait (they raise CommTimeout naming the silent
    # peer), not a deadline for the job: a healthy job may compute as long as it likes. What
    # ends a failed job here is the grace period after its first failure.
    while len(finished) < world_size:
        now = time.monotonic()
        limit = None
        if first_failure_at is not None and on_failure == "end":
            limit = first_failure_at + FAILURE_GRACE
        if ask_at is not None and now >= ask_at:
            ask_at = None             # a timeout: the diagnosis now, the grace period goes on
            records.ask({r: procs[r].pid for r in range(world_size) if r not in finished})
            _print_lines(_diagnosis(records, procs, failures, world_size))
        if limit is not None and now >= limit:
            for r in range(world_size):
                if r not in finished:
                    procs[r].kill()
                    why = f"killed {FAILURE_GRACE:.0f}s after the job failed"
                    # wall clock, as the ranks' own records (monotonic sorted it first)
                    failures.append((time.time(), r, why, True, ""))
                    finished.add(r)
            break
        wake = min(t for t in (limit, ask_at, now + 3600) if t is not None)
        events = sel.select(None if limit is None and ask_at is None else max(0.01, wake - now))
        for key, _ in events:
            r = key.data
            data = os.read(key.fd, 1 << 20)
            if data:
                chunks[r].append(data)
                continue
            sel.unregister(key.fd)
            finished.add(r)
            raw = b"".join(chunks[r])
            rc = procs[r].wait()
            if raw:
                status, value = cloudpickle.loads(raw)
            else:
                sig = -rc if rc < 0 else None
                status = "error"
                value = (time.time(), f"process died ({'signal ' + signal.Signals(sig).name if sig else 'exit code ' + str(rc)}) without reporting",
                         False, "")
            if status == "ok":
                results[r] = value
            else:
                when, summary, consequence, tb = value
                failures.append((when, r, summary, consequence, tb))
                if first_failure_at is None:
                    first_failure_at = time.monotonic()
                if summary.startswith("CommTimeout") and ask_at is None:
                    ask_at = time.monotonic() + ASK_AFTER_TIMEOUT_S
    sel.close()
    if failures:
        _raise_spawn_error(failures, world_size, results,
                           _diagnosis(records, procs, failures, world_size))
    return results


def _print_lines(lines: Sequence[str]) -> None:
    sys.stderr.write("".join(f"{ln}\n" for ln in lines))
    sys.stderr.flush()


def _diagnosis(records: JobRecords, procs, failures, world_size: int) -> List[str]:
    """The diagnosis of a failed job from its ranks' records and how each ended."""
    exits: Dict[int, Optional[str]] = {}
    for r, p in enumerate(procs):
        rc = p.poll()
        exits[r] = None if rc is None else exit_text(rc)
    for _, r, summary, _, _ in failures:
        if summary.startswith("killed "):
            exits[r] = None           # killed by this launcher: it was running until then
        elif exits.get(r) != FINISHED and not summary.startswith("process died"):
            exits[r] = summary.split("\n", 1)[0][:200]
    return records.diagnosis(exits, world_size)


# ---------------------------------------------------------------------------------- run -n
def run_local(nprocs: int, argv: Sequence[str], nodes: int = 1, transport: str = "auto",
              timeout: Optional[float] = None, python: str = sys.executable,
              out=None, on_failure: str = "end") -> int:
    """``minicomm run -n N script.py args`` on this box: start N ranks, prefix their output with
    ``[rank]``, end them all when one fails or on Ctrl-C/SIGTERM; return the exit status.

    ``on_failure="continue"`` (``--on-failure continue``): a rank's failure is reported and ends
    no other rank (they may ``shrink()`` and go on); the job exits 0 when a rank finished with 0.

    Each rank is exec'd through lifeline.EXEC_UNDER_LIFELINE: if this launcher dies (even by
    SIGKILL) the kernel sends every rank SIGTERM, and ``mc.init`` gave the rank an orderly SIGTERM
    exit that unlinks its segments and sweeps the job's (lifeline.py)."""
    out = out or sys.stdout.buffer
    if on_failure not in ON_FAILURE:
        raise ValueError(f"--on-failure {on_failure!r}: choose one of {', '.join(ON_FAILURE)}")
    timeout = timeout_arg("--timeout", timeout)
    topology = node_map(nprocs, nodes)
    job_id = secrets.token_hex(6)
    token = secrets.token_bytes(32)
    server = StoreServer("127.0.0.1", 0, token)
    job = _LocalJob(nprocs, out, on_failure)
    job.records = JobRecords(job_id)

    def on_signal(signum, frame):
        job.stop_signal = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(nprocs):
            env = _rank_env(rank, topology, nodes, server.port, token, job_id, transport, timeout)
            env["MINICOMM_FLIGHT_DIR"] = job.records.directory
            # through the lifeline: the rank gets SIGTERM if this launcher dies, even by SIGKILL
            job.start(rank, [python, "-S", "-c", EXEC_UNDER_LIFELINE, str(os.getpid()),
                             python] + list(argv), env)
        return job.supervise()
    finally:
        job.end()
        for s, h in old.items():
            signal.signal(s, h)
        server.close()
        _sweep(job_id)
        job.records.close(keep=job.diagnosed)


def _rank_env(rank: int, topology: Sequence[int], nodes: int, port: int, token: bytes,
              job_id: str, transport: str, timeout: Optional[float]) -> Dict[str, str]:
    """The environment ``mc.init`` reads in rank ``rank`` of a ``run_local`` job."""
    nprocs = len(topology)
    node = topology[rank]
    same = [r for r in range(nprocs) if topology[r] == node]
    env = dict(os.environ, MINICOMM_RANK=str(rank), MINICOMM_SIZE=str(nprocs),
               MINICOMM_LOCAL_RANK=str(same.index(rank)), MINICOMM_LOCAL_SIZE=str(len(same)),
               MINICOMM_NODE=str(node), MINICOMM_NUM_NODES=str(nodes),
               MINICOMM_HOST=socket.gethostname(),    # the nodes are emulated: one host
               MINICOMM_MASTER_ADDR="127.0.0.1", MINICOMM_MASTER_PORT=str(port),
               MINICOMM_JOB_TOKEN=token.hex(), MINICOMM_JOB_ID=job_id,
               MINICOMM_TRANSPORT=transport, PYTHONUNBUFFERED="1",
               MINICOMM_LAUNCHER_PID=str(os.getpid()))
    if timeout is not None:
        env["MINICOMM_TIMEOUT"] = str(timeout)
    return env


class _LocalJob:
    """The ranks of one ``run_local`` job: their output, relayed line by line with a ``[rank]``
    prefix, and the verdict when one fails (which rank is the cause, the exit status)."""

    def __init__(self, nprocs: int, out, on_failure: str = "end"):
        self.out = out
        self.on_failure = on_failure
        self.reported: set = set()            # continue: the failed ranks already named
        self.procs: List[subprocess.Popen] = []
        self.sel = selectors.DefaultSelector()
        self.stop_signal: Optional[int] = None   # SIGINT / SIGTERM received by the launcher
        self.exit_code = 0
        self.open_streams = 0
        self.closed: Dict[int, int] = {}      # rank -> order in which its output first ended
        self.drained: Dict[int, int] = {r: 0 for r in range(nprocs)}   # rank -> streams at EOF
        self.last_error: Dict[int, bytes] = {}  # rank -> its last stderr line at column 0
        self.failed_at: Optional[float] = None
        self.first_death_at: Optional[float] = None
        self.dead_since: Dict[int, float] = {}
        self.records: Optional[JobRecords] = None   # the job's flight records (run_local)
        self.diagnosed = False

    def start(self, rank: int, cmd: List[str], env: Dict[str, str]) -> None:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                             start_new_session=True)
        self.procs.append(p)
        for stream in (p.stdout, p.stderr):
            self.sel.register(stream, selectors.EVENT_READ, (rank, stream, bytearray()))
        self.open_streams += 2

    def supervise(self) -> int:
        """Relay output until every rank has exited and its output ended; end the job on a
        signal or a failure (SIGTERM, then SIGKILL after the grace period). The exit status."""
        procs = self.procs
        while self.open_streams or any(p.poll() is None for p in procs):
            if self.stop_signal is not None and self.failed_at is None:
                self.failed_at = time.monotonic()
                self.exit_code = 128 + self.stop_signal
                for p in procs:
                    _signal_group(p, signal.SIGTERM)
            if self.failed_at is not None and time.monotonic() > self.failed_at + FAILURE_GRACE:
                for p in procs:
                    _signal_group(p, signal.SIGKILL)
            self.relay(0.2)
            if self.on_failure == "continue" and self.stop_signal is None:
                self.report_failures()
            else:
                self.judge()
            if not self.open_streams and all(p.poll() is not None for p in procs):
                break
        return self.exit_code

    def report_failures(self) -> None:
        """``on_failure="continue"``: name each rank that failed, end nobody. The exit status:
        0 once a rank has finished with 0, else the first failure's."""
        for r, p in enumerate(self.procs):
            rc = p.poll()
            if rc is None or r in self.reported:
                continue
            self.reported.add(r)
            if rc == 0:
                self.exit_code = 0
                continue
            if not any(q.poll() == 0 for q in self.procs):
                self.exit_code = self.exit_code or (rc if rc > 0 else 128 - rc)
            self.out.write(f"minicomm run: rank {r} exited with status {rc}; the others go on "
                           f"(--on-failure continue)\n".encode())
            self.out.flush()

    def relay(self, timeout: float) -> None:
        """Copy what the ranks wrote within ``timeout`` to ``out``, whole lines, prefixed."""
        out = self.out
        for key, _ in self.sel.select(timeout):
            rank, stream, pending = key.data
            data = os.read(stream.fileno(), 65536)
            if not data:
                if pending:
                    out.write(b"[%d] " % rank + bytes(pending) + b"\n")
                self.sel.unregister(stream)
                self.open_streams -= 1
                self.drained[rank] += 1
                self.closed.setdefault(rank, len(self.closed))
                continue
            pending += data
            *lines, rest = bytes(pending).split(b"\n")
            pending[:] = rest
            for line in lines:
                out.write(b"[%d] " % rank + line + b"\n")
                if stream is self.procs[rank].stderr and line[:1].strip():
                    self.last_error[rank] = line    # an exception's line, not a frame or note
            out.flush()

    def judge(self) -> None:
        """Once a rank has died: name the cause, set the exit status and end the others.

        The first rank to fail is the root cause; the others may only have lost it. Ranks
        found dead in one pass are ordered by when their output ended (the epoll ready list
        keeps that order), not by rank. A rank that died of a PeerFailure (its last error line
        says so) only lost a peer: while the peer that failed first may still be on its way
        out, the verdict waits for it (bounded by the grace period), so the cause is named,
        not the first of its casualties to exit."""
        procs = self.procs
        now = time.monotonic()
        for r, p in enumerate(procs):
            if p.poll() not in (None, 0):
                self.dead_since.setdefault(r, now)
        # read to the end first (its last error line), unless a child of it holds the pipes
        dead = [(self.closed.get(r, len(procs)), r) for r, t in self.dead_since.items()
                if self.drained[r] == 2 or now >= t + FAILURE_GRACE]
        if not dead or self.failed_at is not None:
            return
        if self.first_death_at is None:
            self.first_death_at = now
        ordered = [r for _, r in sorted(dead)]
        causes = [r for r in ordered
                  if not self.last_error.get(r, b"").startswith(b"minicomm.errors.PeerFailure")]
        everyone_done = all(p.poll() is not None for p in procs)
        if causes or everyone_done or now >= self.first_death_at + FAILURE_GRACE:
            rank = (causes or ordered)[0]
            rc = procs[rank].poll()
            self.failed_at = now
            self.exit_code = rc if rc > 0 else 128 - rc
            msg = f"minicomm run: rank {rank} exited with status {rc}; ending the job\n"
            self.out.write(msg.encode())
            self.out.flush()
            self.diagnose()
            for q in procs:
                if q.poll() is None:
                    _signal_group(q, signal.SIGTERM)

    def diagnose(self) -> None:
        """A failed job: ask the running ranks for their flight records, then print the
        diagnosis (minicomm.diagnosis) to stderr; the records are kept for ``minicomm doctor``."""
        if self.records is None:
            return
        running = {r: p.pid for r, p in enumerate(self.procs) if p.poll() is None}
        self.records.ask(running)
        exits: Dict[int, Optional[str]] = {}
        for r, p in enumerate(self.procs):
            rc = p.poll()
            exits[r] = None if rc is None else exit_text(rc)
            if rc not in (None, 0) and self.last_error.get(r):
                exits[r] += ": " + self.last_error[r].decode(errors="replace")[:200]
        lines = self.records.diagnosis(exits, len(self.procs))
        if self.records.owned:
            lines.append(f"diagnosis: the flight records are in {self.records.directory} "
                         f"(minicomm doctor {self.records.directory})")
        _print_lines(lines)
        self.diagnosed = True

    def end(self) -> None:
        """Kill what still runs (its whole session) and reap every rank."""
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
            p.wait()
        self.sel.close()

def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
