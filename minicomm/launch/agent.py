"""Per-host agent of the ssh launcher: ``python -m minicomm.launch.agent`` (started by
``minicomm.launch.ssh``).

Protocol, over the ssh session's pipes (nothing secret ever appears on a command line):

stdin (launcher -> agent)
    line 1: the job, one JSON object: job_id, token (hex), node, num_nodes, world_size,
            first_rank, local_size, master_addr, master_port, cwd, python, argv, env,
            pythonpath, kill_grace.
    then:   control lines ``{"cmd": "signal", "sig": N}`` (deliver N to every rank) and
            ``{"cmd": "kill"}`` (end every rank). End of file means the launcher is gone:
            the ranks are ended too.
stdout (agent -> launcher)
    the ranks' stdout, line by line, as ``[rank] line``; and event lines, which start with
    EVENT (a byte no forwarded line can start with) followed by JSON: ``hello`` (job read),
    ``exit`` (a rank ended: rank, status, whether the agent ended it, tail of its stderr), ``done`` (all
    ranks reaped; the agent's exit status follows).
stderr
    the ranks' stderr as ``[rank] line``, and the agent's own diagnostics.

Each rank runs in a process group of its own, so ending a rank ends what it started. The
agent is single-threaded (ranks are forked with a pre-exec hook that arms PR_SET_PDEATHSIG,
which is safe only without threads): if the agent itself is SIGKILLed, the kernel sends its
ranks SIGTERM, which mc.init made an orderly exit that cleans up (lifeline.py). On every exit path the ranks are reaped and /dev/shm/minicomm-<job_id>-* is swept.
Exit status: the first non-zero rank status (128+N for a rank killed by signal N), else 0.
``python -m minicomm.launch.agent --sweep JOB_ID`` only sweeps the segments (after a lost agent).
"""
from __future__ import annotations

import collections
import ctypes
import glob
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional

EVENT = b"\x1e"          # ASCII record separator: starts event lines; forwarded lines start with "["
MAX_LINE = 1 << 16       # a longer line without a newline is forwarded in pieces
TAIL_LINES = 20          # stderr lines kept per rank for the launcher's error report
JOB_READ_TIMEOUT = 30.0  # the launcher writes the job right after starting ssh
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _status_code(returncode: int) -> int:
    """Popen returncode -> shell-style exit status (a signal N becomes 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def _pdeathsig_hook():
    """A pre-exec function that makes the kernel SIGTERM the child when this agent dies (the
    rank's mc.init made SIGTERM an orderly, bounded exit that unlinks its segments and sweeps
    the job's: lifeline.py)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl   # resolved now: nothing to load after fork
    except (OSError, AttributeError):                     # not Linux: rely on the normal paths
        return None
    agent = os.getpid()

    def hook():
        prctl(1, signal.SIGTERM, 0, 0, 0)                 # PR_SET_PDEATHSIG
        if os.getppid() != agent:                         # the agent died before prctl took effect
            os._exit(1)
    return hook


class Rank:
    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank, self.proc = rank, proc
        self.prefix = b"[%d] " % rank
        self.open_streams = 2
        self.tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        self.exited_at: Optional[float] = None   # when the agent saw it end
        self.reported = False
        self.killed = False                       # ended by the agent, not by itself


class Agent:
    def __init__(self, job: dict, out, err):
        self.job, self.out, self.err = job, out, err
        self.ranks: List[Rank] = []
        self.sel = selectors.DefaultSelector()
        self.exit_status = 0
        self.ending_since: Optional[float] = None  # ranks were told to end at this time
        self.launcher_gone = False
        self.signals: List[int] = []
        self.interrupted = False                   # a user's signal was relayed: ranks end as they choose

    # ---------------------------------------------------------------- output to the launcher
    def _write(self, stream, data: bytes) -> None:
        if self.launcher_gone:
            return
        try:
            stream.write(data)
            stream.flush()
        except (BrokenPipeError, OSError):        # ssh is gone: keep going, end the ranks
            self.launcher_gone = True
            self.end_ranks()

    def event(self, **fields) -> None:
        self._write(self.out, EVENT + json.dumps(fields).encode() + b"\n")

    def say(self, msg: str) -> None:
        self._write(self.err, f"minicomm agent ({socket.gethostname()}): {msg}\n".encode())

    # ---------------------------------------------------------------- ranks
    def start_ranks(self) -> None:
        job = self.job
        env = dict(os.environ)
        env.update(job.get("env") or {})
        env.setdefault("PYTHONUNBUFFERED", "1")    # output arrives while it happens
        if job.get("pythonpath"):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (job["pythonpath"], env.get("PYTHONPATH")) if p)
        master = job["master_addr"], str(job["master_port"])
        env.update(MINICOMM_SIZE=str(job["world_size"]), MINICOMM_LOCAL_SIZE=str(job["local_size"]),
                   MINICOMM_NODE=str(job["node"]), MINICOMM_NUM_NODES=str(job["num_nodes"]),
                   MINICOMM_HOST=str(job["node"]),     # each host of the list is a machine
                   MINICOMM_MASTER_ADDR=master[0], MINICOMM_MASTER_PORT=master[1],
                   MASTER_ADDR=master[0], MASTER_PORT=master[1],
                   MINICOMM_JOB_TOKEN=job["token"], MINICOMM_JOB_ID=job["job_id"],
                   MINICOMM_LAUNCHER_PID=str(os.getpid()))
        hook = _pdeathsig_hook()
        for local in range(job["local_size"]):
            rank = job["first_rank"] + local
            env.update(MINICOMM_RANK=str(rank), MINICOMM_LOCAL_RANK=str(local))
            try:
                proc = subprocess.Popen([job["python"], *job["argv"]], cwd=job["cwd"], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True,
                                        preexec_fn=hook)
            except OSError as e:
                self.say(f"cannot start rank {rank}: {e}")
                self.event(ev="exit", rank=rank, code=127, killed=False,
                           tail=[f"cannot start rank {rank}: {e}"])
                self.exit_status = self.exit_status or 127
                self.end_ranks()
                return
            r = Rank(rank, proc)
            self.ranks.append(r)
            self.sel.register(proc.stdout, selectors.EVENT_READ, (r, self.out, bytearray()))
            self.sel.register(proc.stderr, selectors.EVENT_READ, (r, self.err, bytearray()))

    def signal_ranks(self, sig: int) -> None:
        for r in self.ranks:
            if r.exited_at is None:
                try:
                    os.killpg(r.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def end_ranks(self) -> None:
        """SIGTERM every live rank's group now; SIGKILL follows after the kill grace."""
        if self.ending_since is None:
            self.ending_since = time.monotonic()
            for r in self.ranks:
                r.killed = r.killed or r.exited_at is None
            self.signal_ranks(signal.SIGTERM)

    def _forward(self, key) -> None:
        r, stream, pending = key.data
        data = os.read(key.fd, MAX_LINE)
        if not data:
            self.sel.unregister(key.fileobj)
            key.fileobj.close()
            r.open_streams -= 1
            if pending:
                self._emit_line(r, stream, bytes(pending))
            return
        pending += data
        *lines, rest = bytes(pending).split(b"\n")
        if len(rest) >= MAX_LINE:
            lines.append(rest)
            rest = b""
        pending[:] = rest
        for line in lines:
            self._emit_line(r, stream, line)

    def _emit_line(self, r: Rank, stream, line: bytes) -> None:
        if stream is self.err:
            r.tail.append(line.decode(errors="replace"))
        self._write(stream, r.prefix + line + b"\n")

    def _reap(self) -> None:
        now = time.monotonic()
        for r in self.ranks:
            if r.exited_at is None and r.proc.poll() is not None:
                r.exited_at = now
            # report once its output is drained (or a grandchild holds the pipes: 1 s at most)
            if r.exited_at is not None and not r.reported and (r.open_streams == 0 or now - r.exited_at > 1.0):
                r.reported = True
                code = _status_code(r.proc.returncode)
                self.event(ev="exit", rank=r.rank, code=code, killed=r.killed,
                           tail=list(r.tail) if code else [])
                if code and not self.exit_status:
                    self.exit_status = code
                if code and not self.interrupted:
                    self.end_ranks()           # the job is lost: end this host's other ranks now

    # ---------------------------------------------------------------- control from the launcher
    def _control(self, data: bytes) -> None:
        if not data:                            # ssh closed: nobody to report to any more
            self.launcher_gone = True
            self.end_ranks()
            return
        self.control += data
        *lines, rest = bytes(self.control).split(b"\n")
        self.control[:] = rest
        for line in lines:
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
                if msg["cmd"] == "signal":
                    self.interrupted = True
                    self.signal_ranks(int(msg["sig"]))
                elif msg["cmd"] == "kill":
                    self.end_ranks()
            except (ValueError, KeyError, TypeError) as e:
                self.say(f"ignoring malformed control line {line[:80]!r}: {e}")

    def run(self, stdin_fd: int, early_control: bytes, wake_fd: int) -> int:
        """Start the ranks, forward and supervise until every rank is reaped; exit status."""
        self.event(ev="hello", hostname=socket.gethostname(), pid=os.getpid())
        self.start_ranks()
        self.control = bytearray()
        if early_control:
            self._control(early_control)
        self.sel.register(stdin_fd, selectors.EVENT_READ, "control")
        self.sel.register(wake_fd, selectors.EVENT_READ, "wake")
        grace = float(self.job.get("kill_grace", 3.0))
        while not all(r.reported for r in self.ranks):
            for key, _ in self.sel.select(0.5):
                if key.data == "control":
                    data = os.read(key.fd, 4096)
                    if not data:
                        self.sel.unregister(key.fd)
                    self._control(data)
                elif key.data == "wake":
                    os.read(wake_fd, 512)      # SIGCHLD or a termination signal arrived
                else:
                    self._forward(key)
            if self.signals:
                self.signals.clear()
                self.end_ranks()
            self._reap()
            if self.ending_since is not None and time.monotonic() - self.ending_since > grace:
                self.signal_ranks(signal.SIGKILL)
        self._drain()
        sweep_segments(self.job["job_id"])
        self.event(ev="done", code=self.exit_status)
        return self.exit_status

    def _drain(self) -> None:
        """Forward what ended ranks left in their pipes, waiting 1 s at most for grandchildren."""
        deadline = time.monotonic() + 1.0
        while any(isinstance(k.data, tuple) for k in self.sel.get_map().values()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in self.sel.select(left):
                if isinstance(key.data, tuple):
                    self._forward(key)
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, tuple):
                self.sel.unregister(key.fileobj)
                key.fileobj.close()


def sweep_segments(job_id: str) -> None:
    """Unlink this host's shared-memory segments of the job (ranks may have been SIGKILLed)."""
    for path in glob.glob(f"/dev/shm/minicomm-{job_id}-*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def read_job(fd: int, timeout: float):
    """The first line of fd as JSON, and whatever followed it; raises on timeout or EOF."""
    buf = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"no job description on stdin within {timeout:.0f} s")
            data = os.read(fd, 1 << 16)
            if not data:
                raise EOFError("stdin closed before the job description")
            buf += data
    line, rest = buf.split(b"\n", 1)
    job = json.loads(line)
    if not JOB_ID_RE.match(str(job.get("job_id", ""))):
        raise ValueError(f"bad job_id {job.get('job_id')!r}")
    return job, rest


def main() -> int:
    out, err = sys.stdout.buffer, sys.stderr.buffer
    if sys.argv[1:2] == ["--sweep"]:            # the launcher cleaning up after a lost agent
        if len(sys.argv) != 3 or not JOB_ID_RE.match(sys.argv[2]):
            err.write(b"usage: python -m minicomm.launch.agent [--sweep JOB_ID]\n")
            return 2
        sweep_segments(sys.argv[2])
        return 0
    try:
        job, early_control = read_job(0, JOB_READ_TIMEOUT)
    except (TimeoutError, EOFError, ValueError, KeyError) as e:
        err.write(f"minicomm agent ({socket.gethostname()}): {e}\n".encode())
        return 2
    agent = Agent(job, out, err)
    # Signals only set a flag; the wakeup pipe makes the loop's select return at once.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: agent.signals.append(signum))
    try:
        return agent.run(0, early_control, wake_r)
    finally:
        # Whatever went wrong in the agent itself, no rank outlives it.
        for r in agent.ranks:
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    r.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:   # stuck in the kernel: nothing more to do
                    agent.say(f"rank {r.rank} (pid {r.proc.pid}) survived SIGKILL for 5 s")
        sweep_segments(job["job_id"])


if __name__ == "__main__":
    sys.exit(main())
