"""Multi-host launcher: ``minicomm run --hosts a:2,b:2 | --hostfile FILE script.py args``.

The launcher serves the job's rendezvous store on an address every host reaches, then opens
one ssh session per host (all in parallel) running ``python -m minicomm.launch.agent`` and writes the
host's part of the job to the session's stdin as one JSON line — the job token travels only
there, never on a command line or in a file. Ranks are laid out in blocks by host: host i of
the list (``MINICOMM_NODE=i``) runs the next ``slots`` consecutive ranks, ``local_rank`` being
the index inside the host. The agent (see ``minicomm.launch.agent`` for the protocol) starts the
ranks, streams their output back as ``[rank] line`` and reports every rank's end.

Failure policy. The first failure the launcher hears of is the root cause: a rank that ended
by itself with a non-zero status, or a host that could not be started or was lost. The
launcher then ends the job everywhere (each agent SIGTERMs its ranks' process groups, SIGKILLs
them ``kill_grace`` seconds later, reaps them and sweeps the job's /dev/shm segments), waits
for every agent, and returns the root cause's status: the rank's (128+N for signal N), or
255 when a host could not be reached, refused the login, or dropped the connection. A host
that has not started its agent within ``connect_timeout`` (+2 s for ssh to say why) is such a
failure. Ctrl-C or SIGTERM is relayed to every rank as the same signal; a second one, or ranks
still running ``SIGNAL_GRACE`` seconds later, ends the job; the status is then 128+signal.

ssh runs with ``BatchMode=yes`` (a password prompt would hang the job) and the given
``ConnectTimeout``; everything else (user, keys, known hosts, jump hosts) comes from the
user's ssh configuration and ``ssh_opts``. Each ssh runs in a session of its own, so a
terminal's Ctrl-C reaches only the launcher, which relays it in order.
"""
from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import secrets
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..rendezvous import StoreServer
from .agent import EVENT

LAUNCH_FAILURE = 255     # status when a host could not be started or was lost
SSH_SAYS_WHY = 2.0       # extra seconds for ssh to report its own connect timeout first
SIGNAL_GRACE = 10.0      # after a relayed Ctrl-C/SIGTERM, ranks still running are ended
AGENT_GRACE = 5.0        # after kill_grace, how long agents get to report before ssh is killed
TAIL_SHOWN = 10          # stderr lines of the failing rank repeated in the final error
# The directory holding this ``minicomm`` package: the hosts' PYTHONPATH, so they import this copy.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HostList = List[Tuple[str, int]]


class LaunchError(Exception):
    """The job cannot be launched as given (bad host list, no reachable address, ...)."""


# ------------------------------------------------------------------------ host lists
def _merge(entries: Sequence[Tuple[str, int]]) -> HostList:
    """Sum the slots of a host named twice (as mpirun does), keeping first-seen order."""
    slots: Dict[str, int] = {}
    for host, n in entries:
        slots[host] = slots.get(host, 0) + n
    return list(slots.items())


def cap_slots(hosts: HostList, n: Optional[int]) -> HostList:
    """The first ``n`` slots of the list (``-n``); an error if the hosts have fewer."""
    if n is None:
        return list(hosts)
    total = sum(s for _, s in hosts)
    if n < 1:
        raise LaunchError(f"-n {n}: need at least one rank")
    if n > total:
        raise LaunchError(f"-n {n} exceeds the {total} slots of the host list")
    out, left = [], n
    for host, s in hosts:
        if left == 0:
            break
        out.append((host, min(s, left)))
        left -= out[-1][1]
    return out


def _slots(text: str, where: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise LaunchError(f"{where}: slots must be a positive integer, not {text!r}")
    return int(text)


def _host_and_slots(item: str, where: str) -> Tuple[str, int]:
    """``host``, ``host:N``, ``[v6addr]`` or ``[v6addr]:N``."""
    m = re.fullmatch(r"\[([^\]]+)\](?::(.*))?|([^:\s\[\]]+)(?::(.*))?", item)
    if not m:
        raise LaunchError(f"{where}: cannot parse host {item!r} (use host or host:slots)")
    host = m.group(1) or m.group(3)
    n = m.group(2) if m.group(1) else m.group(4)
    return host, 1 if n is None else _slots(n, where)


def parse_hosts(spec: str, n: Optional[int] = None) -> HostList:
    """``"a:2,b:2"`` -> ``[("a", 2), ("b", 2)]``; a host without ``:N`` has one slot."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise LaunchError(f"--hosts {spec!r}: no hosts")
    return cap_slots(_merge([_host_and_slots(s, f"--hosts {spec!r}") for s in items]), n)


def parse_hostfile(path: str, n: Optional[int] = None) -> HostList:
    """Lines ``host [slots=N]`` (``host:N`` also works); ``#`` starts a comment."""
    entries = []
    try:
        f = open(path)
    except OSError as e:
        raise LaunchError(f"hostfile: {e}") from e
    with f:
        for lineno, line in enumerate(f, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            where = f"{path}:{lineno}"
            host, slots = _host_and_slots(words[0], where)
            for w in words[1:]:
                key, _, value = w.partition("=")
                if key != "slots" or ":" in words[0]:
                    raise LaunchError(f"{where}: unexpected {w!r} (lines are 'host [slots=N]')")
                slots = _slots(value, where)
            entries.append((host, slots))
    if not entries:
        raise LaunchError(f"hostfile {path}: no hosts")
    return cap_slots(_merge(entries), n)


# ------------------------------------------------------------------------ addresses
def _ssh_hostname(host: str, ssh: str, ssh_opts: Sequence[str]) -> str:
    """The address ssh would connect to for ``host`` (its ssh_config HostName), offline."""
    try:
        res = subprocess.run([ssh, *ssh_opts, "-G", host], capture_output=True, text=True,
                             timeout=5, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in res.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value
    return host


def reachable_address(hosts: Sequence[str], ssh: str = "ssh", ssh_opts: Sequence[str] = ()) -> str:
    """This machine's address on the route to the hosts (non-loopback preferred).

    A UDP ``connect`` only asks the kernel for a route: no packet is sent."""
    loopback = None
    for host in hosts:
        try:
            name = _ssh_hostname(host, ssh, ssh_opts)
            family, _, _, _, sockaddr = socket.getaddrinfo(name, 22, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                addr = s.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
        loopback = loopback or addr
    if loopback:
        return loopback
    raise LaunchError("cannot tell which address of this machine the hosts reach (none of "
                      f"{', '.join(hosts)} resolves here); pass --master-addr")


def _start_store(master_addr: str, token: bytes):
    try:
        return StoreServer(master_addr, 0, token)
    except OSError:      # not an address of this machine (NAT, a name): listen everywhere
        return StoreServer("0.0.0.0", 0, token)


def remote_command(python: str, pythonpath: str, *agent_args: str) -> str:
    """The shell command ssh runs on a host: the agent, able to import this minicomm."""
    return (f"export PYTHONPATH={shlex.quote(pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}; "
            f"exec {' '.join(map(shlex.quote, (python, '-m', 'minicomm.launch.agent', *agent_args)))}")


# ------------------------------------------------------------------------ the launch
@dataclass
class _Host:
    index: int
    name: str
    first_rank: int
    proc: subprocess.Popen
    started: float
    pending_in: bytearray = field(default_factory=bytearray)  # not yet written to ssh's stdin
    partial: Dict[int, bytearray] = field(default_factory=dict)
    early_err: List[bytes] = field(default_factory=list)      # stderr before the agent said hello
    hello: bool = False
    timed_out: bool = False                                   # killed: no hello in time
    cut_off: bool = False                                     # killed: did not finish in time
    done: Optional[int] = None                                # the agent's final status
    streams_open: int = 2
    finished: bool = False


@dataclass
class _Failure:
    message: str
    status: int
    tail: List[str] = field(default_factory=list)


class _Launch:
    def __init__(self, hosts: HostList, out, err, kill_grace: float, connect_timeout: float):
        self.out, self.err = out, err
        self.kill_grace, self.connect_timeout = kill_grace, connect_timeout
        self.hosts: List[_Host] = []
        self.sel = selectors.DefaultSelector()
        self.root: Optional[_Failure] = None
        self.others: List[str] = []              # later independent failures, for the summary
        self.ending_since: Optional[float] = None
        self.signal: Optional[int] = None
        self.signal_at: Optional[float] = None
        self.pending_signals: List[int] = []
        self.n_ranks = sum(s for _, s in hosts)

    def say(self, msg: str) -> None:
        self.err.write(f"minicomm run: {msg}\n".encode())
        self.err.flush()

    # ---- starting
    def start(self, host: _Host, job: dict) -> None:
        self.hosts.append(host)
        os.set_blocking(host.proc.stdin.fileno(), False)
        self.sel.register(host.proc.stdout, selectors.EVENT_READ, (host, 1))
        self.sel.register(host.proc.stderr, selectors.EVENT_READ, (host, 2))
        self.send(host, job)

    def send(self, host: _Host, msg: dict) -> None:
        if host.proc.stdin.closed:
            return
        host.pending_in += json.dumps(msg).encode() + b"\n"
        self._flush_stdin(host)

    def _flush_stdin(self, host: _Host) -> None:
        try:
            while host.pending_in:
                k = os.write(host.proc.stdin.fileno(), host.pending_in)
                del host.pending_in[:k]
        except BlockingIOError:
            return                               # retried on the next turn of the loop
        except OSError:                          # ssh is gone; its end is noticed by the loop
            host.pending_in.clear()

    # ---- failures
    def fail(self, failure: _Failure, independent: bool = True) -> None:
        if self.signal is not None:
            return    # after a relayed signal ranks end as they choose; SIGNAL_GRACE bounds it
        if self.root is None:
            self.root = failure
            self.say(f"{failure.message}; ending the job on all hosts")
        elif independent and failure is not self.root:
            self.others.append(failure.message)
        self.end_job()

    def end_job(self) -> None:
        if self.ending_since is None:
            self.ending_since = time.monotonic()
            for h in self.hosts:
                self.send(h, {"cmd": "kill"})

    def _rank_where(self, host: _Host, rank: int) -> str:
        return f"rank {rank} (host {host.name}, node {host.index}, local rank {rank - host.first_rank})"

    def on_event(self, host: _Host, ev: dict) -> None:
        kind = ev.get("ev")
        if kind == "hello":
            host.hello = True
            for line in host.early_err:          # e.g. a login banner: not an error after all
                self.err.write(line)
            host.early_err.clear()
        elif kind == "exit" and ev.get("code"):
            code = int(ev["code"])
            how = (f"was killed by signal {code - 128} ({_signame(code - 128)})" if code > 128
                   else f"exited with status {code}")
            if ev.get("killed"):
                how += " (ended by its agent)"
            failure = _Failure(f"{self._rank_where(host, ev['rank'])} {how}", code, ev.get("tail") or [])
            # a rank ended by its agent (the job was already ending) is a consequence
            self.fail(failure, independent=not ev.get("killed"))
        elif kind == "done":
            host.done = int(ev.get("code", 0))

    # ---- output
    def on_readable(self, key) -> None:
        host, fd = key.data
        data = os.read(key.fd, 1 << 16)
        if not data:
            self.sel.unregister(key.fileobj)
            host.streams_open -= 1
            rest = host.partial.pop(fd, b"")
            if rest:
                self._line(host, fd, bytes(rest) + b"\n")
            return
        buf = host.partial.setdefault(fd, bytearray())
        buf += data
        *lines, rest = bytes(buf).split(b"\n")
        buf[:] = rest
        for line in lines:
            self._line(host, fd, line + b"\n")
        (self.out if fd == 1 else self.err).flush()

    def _line(self, host: _Host, fd: int, line: bytes) -> None:
        if fd == 1 and line.startswith(EVENT):
            try:
                self.on_event(host, json.loads(line[1:]))
            except (ValueError, KeyError, TypeError):
                self.say(f"host {host.name}: malformed agent event {line[:80]!r}")
        elif fd == 1:
            self.out.write(line)
        elif not host.hello:
            host.early_err.append(line)          # ssh's own complaints: part of the error
        else:
            self.err.write(line)

    # ---- the loop
    def check_hosts(self) -> None:
        now = time.monotonic()
        for h in self.hosts:
            if h.finished:
                continue
            rc = h.proc.poll()
            if rc is None:
                if not h.hello and not h.timed_out and now - h.started > self.connect_timeout + SSH_SAYS_WHY:
                    h.timed_out = True
                    h.proc.kill()                # reaped on a later turn; reported there
                continue
            if h.streams_open:
                continue                         # read ssh's last words first
            h.finished = True
            h.proc.stdin.close()
            if not h.hello:
                why = b"".join(h.early_err).decode(errors="replace").strip()
                if h.timed_out:
                    why = (f"{why}; " if why else "") + f"no answer within {self.connect_timeout:g} s"
                else:
                    why = f"{why or 'no output'} (ssh exit status {rc})"
                self.fail(_Failure(f"host {h.name}: cannot start the agent: {why}", LAUNCH_FAILURE))
            elif h.done is None and self.ending_since is None:
                self.fail(_Failure(f"host {h.name}: lost the connection to the agent "
                                   f"(ssh exit status {rc})", LAUNCH_FAILURE))

    def on_signal(self, signum: int) -> None:
        if self.signal is None and self.ending_since is None:
            self.signal, self.signal_at = signum, time.monotonic()
            self.say(f"{_signame(signum)}: relayed to every rank (once more to end the job)")
            for h in self.hosts:
                self.send(h, {"cmd": "signal", "sig": int(signum)})
        else:
            self.signal = self.signal or signum
            self.end_job()

    def loop(self) -> None:
        while not all(h.finished for h in self.hosts):
            for h in self.hosts:
                if h.pending_in and not h.proc.stdin.closed:
                    self._flush_stdin(h)
            for key, _ in self.sel.select(0.1):
                self.on_readable(key)
            while self.pending_signals:
                self.on_signal(self.pending_signals.pop(0))
            now = time.monotonic()
            if self.signal_at is not None and now - self.signal_at > SIGNAL_GRACE:
                self.end_job()
            if self.ending_since is not None and now - self.ending_since > self.kill_grace + AGENT_GRACE:
                for h in self.hosts:
                    if h.proc.poll() is None and not h.cut_off:
                        h.cut_off = True
                        self.say(f"host {h.name}: the agent did not finish; closing its ssh session "
                                 "(the agent ends its ranks when it sees that)")
                        h.proc.kill()
            self.check_hosts()

    def status(self) -> int:
        if self.signal is not None:
            return 128 + self.signal
        if self.root is None:
            return 0
        msg = [f"job failed: {self.root.message}"]
        if self.root.tail:
            msg.append("its last stderr lines:")
            msg += [f"    {line}" for line in self.root.tail[-TAIL_SHOWN:]]
        if self.others:
            msg.append(f"also failed: {'; '.join(self.others)}")
        self.say("\n  ".join(msg))
        return self.root.status

    def close(self) -> None:
        """Kill and reap every ssh still running (the agents then end their ranks)."""
        for h in self.hosts:
            if h.proc.poll() is None:
                h.proc.kill()
            for stream in (h.proc.stdin, h.proc.stdout, h.proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
            h.proc.wait()
        self.sel.close()


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def run_multihost(hosts: HostList, argv: Sequence[str], env_extra: Optional[Dict[str, str]] = None,
                  *, python: str = sys.executable, ssh_opts: Sequence[str] = (),
                  connect_timeout: float = 10.0, cwd: Optional[str] = None,
                  master_addr: Optional[str] = None, ssh: str = "ssh", kill_grace: float = 3.0,
                  out=None, err=None) -> int:
    """Run ``python argv...`` on every slot of ``hosts`` over ssh; return the job's exit status.

    ``env_extra`` is added to every rank's environment (the remote login environment is the
    base). ``cwd`` (default: the current directory) must exist on every host."""
    hosts = list(hosts)
    if not hosts or any(s < 1 for _, s in hosts):
        raise LaunchError(f"need at least one host, each with at least one slot: {hosts}")
    if not argv:
        raise LaunchError("no script to run")
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    cwd = cwd or os.getcwd()
    master_addr = master_addr or reachable_address([h for h, _ in hosts], ssh, ssh_opts)
    token = secrets.token_bytes(32)
    job_id = secrets.token_hex(6)
    store = _start_store(master_addr, token)
    pythonpath = PACKAGE_PARENT
    command = remote_command(python, pythonpath)
    # Our two options come first: for ssh the first value of an option wins.
    base = [ssh, "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, math.ceil(connect_timeout))}",
            *ssh_opts, "-o", "LogLevel=ERROR", "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3"]
    launch = _Launch(hosts, out, err, kill_grace, connect_timeout)
    in_main = threading.current_thread() is threading.main_thread()
    old = {}
    if in_main:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[s] = signal.signal(s, lambda signum, _: launch.pending_signals.append(signum))
    try:
        first = 0
        for index, (name, slots) in enumerate(hosts):
            job = dict(job_id=job_id, token=token.hex(), node=index, num_nodes=len(hosts),
                       world_size=launch.n_ranks, first_rank=first, local_size=slots,
                       master_addr=master_addr, master_port=store.port, cwd=cwd, python=python,
                       argv=list(argv), env=dict(env_extra or {}), pythonpath=pythonpath,
                       kill_grace=kill_grace)
            try:
                proc = subprocess.Popen([*base, "--", name, command], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
            except OSError as e:
                raise LaunchError(f"cannot run {ssh!r}: {e}") from e
            launch.start(_Host(index, name, first, proc, time.monotonic()), job)
            first += slots
        launch.loop()
        return launch.status()
    finally:
        launch.close()
        _sweep_lost_hosts(launch, base, python, pythonpath, job_id, connect_timeout)
        store.close()
        for s, h in old.items():
            signal.signal(s, h)


def _sweep_lost_hosts(launch: _Launch, base: List[str], python: str, pythonpath: str,
                      job_id: str, connect_timeout: float) -> None:
    """Hosts whose agent vanished (SIGKILLed, say) may hold the job's /dev/shm segments:
    one short ssh each, in parallel, sweeps them; a host that cannot be reached is skipped."""
    lost = [h for h in launch.hosts if h.hello and h.done is None]
    command = remote_command(python, pythonpath, "--sweep", job_id)
    procs = [subprocess.Popen([*base, "--", h.name, command], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for h in lost]
    deadline = time.monotonic() + connect_timeout + SSH_SAYS_WHY
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main_from_cli(a, hosts: HostList, argv: Sequence[str]) -> int:
    """``minicomm run --hosts/--hostfile`` (argparse namespace from minicomm.cli)."""
    try:
        hosts = cap_slots(hosts, a.n)
        opts = a.ssh_opts if a.ssh_opts is not None else os.environ.get("MINICOMM_SSH", "")
        # the project's own settings (MINICOMM_ALGO, ...) follow the job; per-job ones are set anew
        env = {k: v for k, v in os.environ.items() if k.startswith("MINICOMM_") and k not in _PER_JOB}
        env["MINICOMM_TRANSPORT"] = a.transport
        if a.timeout is not None:
            env["MINICOMM_TIMEOUT"] = str(a.timeout)
        return run_multihost(hosts, argv, env, python=a.python or sys.executable,
                             ssh_opts=shlex.split(opts), connect_timeout=a.connect_timeout,
                             master_addr=a.master_addr)
    except LaunchError as e:
        print(f"minicomm run: {e}", file=sys.stderr)
        return 2


_PER_JOB = {"MINICOMM_RANK", "MINICOMM_SIZE", "MINICOMM_LOCAL_RANK", "MINICOMM_LOCAL_SIZE",
            "MINICOMM_NODE", "MINICOMM_HOST", "MINICOMM_NUM_NODES", "MINICOMM_MASTER_ADDR", "MINICOMM_MASTER_PORT",
            "MINICOMM_JOB_TOKEN", "MINICOMM_JOB_ID", "MINICOMM_SSH", "MINICOMM_LAUNCHER_PID"}
