"""Timelines of collective calls and their schedule steps, measured or simulated, in one format.

``MINICOMM_TRACE=DIR`` makes every rank write ``DIR/rank-<R>.json`` (R: its world rank): every
collective call the executor runs and, inside it, every step of the call's schedule.
``minicomm sim ... --trace FILE`` writes the same events for the same schedules on a modelled
cluster, and ``minicomm trace merge DIR`` joins a job's files (and, with ``--sim FILE``, a
prediction) into one. The files are Chrome trace-event JSON: Perfetto (https://ui.perfetto.dev)
and Chrome's Trace Viewer (chrome://tracing, where a browser still has it) open them.

The format (``FORMAT``)::

    {"traceEvents": [
       {"ph": "M", "name": "process_name", "pid": R, "tid": 0, "args": {"name": "rank R"}},
       {"ph": "M", "name": "thread_name", "pid": R, "tid": C, "args": {"name": "communicator C"}},
       {"ph": "X", "cat": "call", "name": "allreduce (ring)", "ts": 12.5, "dur": 80.25,
        "pid": R, "tid": C, "args": {"op": "allreduce", "algorithm": "ring", "seq": 7,
                                     "count": 1024, "bytes": 4096}},
       {"ph": "X", "cat": "step", "name": "step 0", "ts": 13.0, "dur": 11.75, "pid": R, "tid": C,
        "args": {"seq": 7, "step": 0, "sends": [{"peer": 1, "bytes": 1024}],
                 "recvs": [{"peer": 3, "bytes": 1024, "reduce": true}],
                 "copy_bytes": 0, "reduce_bytes": 0, "wait_us": 9.5}},
       ...],
     "displayTimeUnit": "ns",
     "otherData": {"format": "minicomm-trace/1", "source": "measured" | "simulated", ...}}

Every call and step is an "X" (complete) event: ``ts`` its start and ``dur`` its length, both in
microseconds; ``pid`` the world rank and ``tid`` the communicator's id (1: the world). A call's
``args``: ``op`` the collective, ``algorithm`` the family, ``seq`` its sequence number on the
communicator (the number every rank gives the same call), ``count`` the per-rank element count
the call passes and ``bytes`` that count in bytes. A step's ``args``: ``seq`` and ``step`` (its
index in the schedule), ``sends`` (``peer``: a world rank, ``bytes``) in posting order,
``recvs`` (``reduce``: the data is reduced on arrival), ``copy_bytes`` and ``reduce_bytes`` of
its local ops, and ``wait_us``, the time it waited for its messages once they were posted. A
call that failed has ``error`` in its ``args``, and its last step is the one it failed in.

Measured files: ``ts`` counts from when the process started tracing, ``otherData`` holds
``rank``, ``host``, ``pid`` and ``origin_unix_us`` (that start as a Unix time, by which
``merge`` aligns the ranks). A rank's file is valid JSON after every call: each call's events
are appended as the call returns, so a job that hangs or is killed keeps the calls it finished
(a new job's first call replaces the file, atomically). Simulated files: ``ts`` counts from the
first call's start and the calls run back to back; ``otherData`` says what was modelled.

Point-to-point messages and the small-message path are not schedules run by the executor:
with tracing on, the communicator runs every collective through the executor (so that each is
traced) and point-to-point calls are not traced. Tracing off costs one test per call.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from .settings import env_path

FORMAT = "minicomm-trace/1"
TRACE_ENV = "MINICOMM_TRACE"
RANK_FILE = re.compile(r"rank-(\d+)\.json$")

_HEAD = '{"traceEvents":[\n'
_lock = threading.Lock()
_pauses = 0
_paused_tracer: "Optional[Tracer]" = None
# The process's tracer, None while tracing is off: the executor's one test per call reads it.
TRACER: "Optional[Tracer]" = None


def to_us(seconds: float) -> float:
    """Seconds as microseconds, to the nanosecond (keeps the files short)."""
    return round(seconds * 1e6, 3)


def call_event(pid: int, tid: int, name: str, ts_us: float, dur_us: float, op: str,
               algorithm: str, seq: int, count: int, nbytes: int,
               error: Optional[str] = None) -> Dict[str, Any]:
    """One call as a trace event (module doc).

    Args:
        pid (int): The world rank.
        tid (int): The communicator's id.
        name (str): What the timeline shows, e.g. ``"allreduce (ring)"``.
        ts_us (float): Its start, in microseconds.
        dur_us (float): Its length, in microseconds.
        op (str): The collective.
        algorithm (str): The family that built its schedule.
        seq (int): Its sequence number on the communicator.
        count (int): The per-rank element count of the call.
        nbytes (int): ``count`` in bytes.
        error (str): Why it failed (None: it did not).

    Returns:
        (dict): The "X" event.

    Examples:
        >>> call_event(0, 1, "allreduce (ring)", 0.0, 5.0, "allreduce", "ring", 1, 2, 8)["args"]
        {'op': 'allreduce', 'algorithm': 'ring', 'seq': 1, 'count': 2, 'bytes': 8}
    """
    args: Dict[str, Any] = {"op": op, "algorithm": algorithm, "seq": seq, "count": count,
                            "bytes": nbytes}
    if error is not None:
        args["error"] = error
    return {"ph": "X", "cat": "call", "name": name, "ts": ts_us, "dur": dur_us, "pid": pid,
            "tid": tid, "args": args}


def step_event(pid: int, tid: int, seq: int, step: int, ts_us: float, dur_us: float,
               sends: Iterable[Tuple[int, int]], recvs: Iterable[Tuple[int, int, bool]],
               copy_bytes: int, reduce_bytes: int, wait_us: float) -> Dict[str, Any]:
    """One schedule step as a trace event (module doc).

    Args:
        pid (int): The world rank.
        tid (int): The communicator's id.
        seq (int): The sequence number of the call it belongs to.
        step (int): Its index in the call's schedule.
        ts_us (float): Its start, in microseconds.
        dur_us (float): Its length, in microseconds.
        sends (iterable): ``(peer, bytes)`` of each send, in posting order.
        recvs (iterable): ``(peer, bytes, reduce)`` of each receive.
        copy_bytes (int): Bytes its local copies move.
        reduce_bytes (int): Bytes its local reductions read.
        wait_us (float): Time it waited for its messages, in microseconds.

    Returns:
        (dict): The "X" event.

    Examples:
        >>> e = step_event(0, 1, 1, 0, 0.0, 3.0, [(1, 8)], [(3, 8, True)], 0, 0, 2.5)
        >>> e["name"], e["args"]["recvs"]
        ('step 0', [{'peer': 3, 'bytes': 8, 'reduce': True}])
    """
    return {"ph": "X", "cat": "step", "name": f"step {step}", "ts": ts_us, "dur": dur_us,
            "pid": pid, "tid": tid,
            "args": {"seq": seq, "step": step,
                     "sends": [{"peer": p, "bytes": b} for p, b in sends],
                     "recvs": [{"peer": p, "bytes": b, "reduce": bool(r)} for p, b, r in recvs],
                     "copy_bytes": copy_bytes, "reduce_bytes": reduce_bytes,
                     "wait_us": wait_us}}


def process_name(pid: int, label: str) -> Dict[str, Any]:
    """The metadata event that names process ``pid`` in the timeline ("rank 3")."""
    return {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}}


def thread_name(pid: int, tid: int, label: str) -> Dict[str, Any]:
    """The metadata event that names thread ``tid`` of ``pid`` ("communicator 1")."""
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}}


def _dumps(event: Dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))


def _tail(other: Dict[str, Any]) -> str:
    return f'\n],\n"displayTimeUnit":"ns",\n"otherData":{json.dumps(other)}}}\n'


def write_trace(path: str, events: Sequence[Dict[str, Any]], other: Dict[str, Any]) -> str:
    """Write a whole trace file atomically (a temporary file in the same directory, renamed).

    Args:
        path (str): The file.
        events (sequence): Its trace events.
        other (dict): Its ``otherData`` (``format`` is added).

    Returns:
        (str): ``path``.

    Examples:
        >>> write_trace(str(tmp / "t.json"), [process_name(0, "rank 0")], {"source": "measured"})
    """
    other = {"format": FORMAT, **other}
    text = _HEAD + ",\n".join(_dumps(e) for e in events) + _tail(other)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


class RankLog:
    """One rank's file of a measured trace, appended to as calls return (module doc): the
    events go where the file's closing part was, followed by it again, so the file is valid
    JSON after every append. Thread-safe (a rank's communicators may run on several threads)."""

    def __init__(self, tracer: "Tracer", rank: int):
        self.rank, self.path = rank, os.path.join(tracer.directory, f"rank-{rank}.json")
        self.other = {"format": FORMAT, "source": "measured", "rank": rank,
                      "host": os.uname().nodename, "pid": os.getpid(),
                      "origin_unix_us": tracer.origin_unix_us}
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.end = 0                  # where the closing part starts
        self.tids: set = set()
        self.broken = False

    def add(self, events: List[Dict[str, Any]]) -> None:
        """Append one call's events (never raises: a failed write stops this rank's trace with
        a warning on stderr, and the job goes on)."""
        with self.lock:
            if self.broken:
                return
            tids = {e["tid"] for e in events} - self.tids
            self.tids |= tids
            events = [thread_name(self.rank, t, f"communicator {t}") for t in sorted(tids)] \
                + events
            try:
                if self.fd is None:
                    self._create()
                chunk = "".join(",\n" + _dumps(e) for e in events).encode()
                os.pwrite(self.fd, chunk + _tail(self.other).encode(), self.end)
                self.end += len(chunk)
            except OSError as e:
                self.broken = True
                print(f"minicomm: {TRACE_ENV}: cannot write {self.path} ({e}); rank "
                      f"{self.rank} is no longer traced", file=sys.stderr)

    def _create(self) -> None:
        head = _HEAD + _dumps(process_name(self.rank, f"rank {self.rank}"))
        write_trace(self.path, [process_name(self.rank, f"rank {self.rank}")], self.other)
        self.fd = os.open(self.path, os.O_WRONLY)
        self.end = len(head.encode())

    def close(self) -> None:
        """Close the file (its content is complete already)."""
        with self.lock:
            if self.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
                self.fd = None
            self.broken = True


class Tracer:
    """The process's measured trace: a ``RankLog`` per world rank run here (a process runs
    several with the inproc transport), and the clock they share."""

    def __init__(self, directory: str):
        self.directory = directory
        self.origin = time.perf_counter()
        self.origin_unix_us = to_us(time.time())
        self.logs: Dict[int, RankLog] = {}

    def log(self, rank: int) -> RankLog:
        """The log of world rank ``rank``, made on its first call."""
        log = self.logs.get(rank)
        if log is None:
            with _lock:
                log = self.logs.setdefault(rank, RankLog(self, rank))
        return log

    def us(self, t: float) -> float:
        """A ``time.perf_counter()`` reading as this trace's microseconds."""
        return to_us(t - self.origin)

    def close(self) -> None:
        """Close every rank's file."""
        for log in list(self.logs.values()):
            log.close()


def tracing_enabled() -> bool:
    """Whether ``MINICOMM_TRACE`` asks for a trace now; makes the process's tracer follow it
    (created on first use, replaced when the directory changed, closed when it is unset).
    Every new communicator asks, so a change of the variable applies from the next one.

    Returns:
        (bool): True when calls are traced.

    Raises:
        ValueError: The variable names something that is not a directory.

    Examples:
        >>> tracing_enabled()
        False
    """
    global TRACER, _paused_tracer
    path = env_path(TRACE_ENV)
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{TRACE_ENV}={path!r} is not a directory: name the directory the "
                         f"ranks' trace files go to")
    with _lock:
        current = TRACER or _paused_tracer
        if current is not None and (path is None or current.directory != path):
            current.close()
            current = None
        if current is None and path is not None:
            current = Tracer(path)
        if _pauses:
            _paused_tracer = current
        else:
            TRACER = current
    return path is not None


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No call of this process is traced inside the block (link probes time the untraced
    paths). Nests, and holds across threads: tracing resumes when the last block ends.

    Examples:
        >>> with paused():
        ...     pass
    """
    global TRACER, _pauses, _paused_tracer
    with _lock:
        if _pauses == 0:
            _paused_tracer, TRACER = TRACER, None
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0:
                TRACER, _paused_tracer = _paused_tracer, None


# ------------------------------------------------------------------------------------ simulated
WORLD_TID = 1                  # the world communicator's id, which a measured run's tid shows


class SimulatedTrace:
    """Simulated calls as trace events, laid end to end: each call starts, on every rank, when
    the previous one ended on its last rank. ``minicomm sim --trace`` makes one and hands it to
    ``minicomm.sim.simulate(..., timeline=)`` per call. Per rank a call event from the call's
    start to the rank's end, and one step event per schedule step; ``wait_us`` is from when the
    step's messages were posted (its start plus its local ops' modelled time) to its end.

    Examples:
        >>> from minicomm import sim
        >>> tl = SimulatedTrace()
        >>> topo = sim.get_topology("dgx-h100", nodes=1)
        >>> r = sim.simulate("allreduce", "ring", topo, 4096, ranks=4, timeline=tl)
        >>> tl.calls, tl.ranks
        (1, 4)
    """

    def __init__(self):
        self.events: List[Dict[str, Any]] = []
        self.end_s = 0.0            # when the last call added so far ended
        self.calls = 0
        self.ranks = 0

    def add(self, collective: str, algorithm: str, count: int, itemsize: int, time_s: float,
            ranks: Iterable[Tuple[int, float, Sequence[Any]]]) -> None:
        """One simulated call: ``ranks`` gives per rank (rank, its end in seconds, its steps as
        ``minicomm.sim.timeline.ModelledStep``); ``time_s`` is the call's time."""
        self.calls += 1
        seq, t0, name = self.calls, self.end_s, f"{collective} ({algorithm})"
        for r, end_s, steps in ranks:
            if r >= self.ranks:       # name each new rank's process and thread
                self.events += [process_name(r, f"rank {r}"),
                                thread_name(r, WORLD_TID, f"communicator {WORLD_TID}")]
            self.ranks = max(self.ranks, r + 1)
            self.events.append(call_event(r, WORLD_TID, name, to_us(t0), to_us(end_s),
                                          collective, algorithm, seq, count, count * itemsize))
            for st in steps:
                took = st.end_s - st.start_s
                self.events.append(step_event(
                    r, WORLD_TID, seq, st.step, to_us(t0 + st.start_s), to_us(took), st.sends,
                    st.recvs, st.copy_bytes, st.reduce_bytes,
                    to_us(max(0.0, took - st.local_s))))
        self.end_s = t0 + float(time_s)

    def write(self, path: str, **other: Any) -> str:
        """Write the trace file (atomically); ``other``: what was modelled, for ``otherData``.

        Returns:
            (str): ``path``.
        """
        return write_trace(path, self.events, {"source": "simulated", "calls": self.calls,
                                               "ranks": self.ranks, **other})


# ------------------------------------------------------------------------------------ reading
def read_trace(path: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The events and ``otherData`` of a trace file (either Chrome form: an object with
    ``traceEvents``, or a bare list of events).

    Args:
        path (str): The file.

    Returns:
        (tuple): (list of events, dict of otherData; empty for a bare list).

    Raises:
        ValueError: The file is not a Chrome trace.

    Examples:
        >>> events, other = read_trace("traces/rank-0.json")
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not a JSON trace file: {e}") from None
    if isinstance(data, list):
        return data, {}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return data["traceEvents"], dict(data.get("otherData") or {})


def rank_files(directory: str) -> List[Tuple[int, str]]:
    """(world rank, path) of every ``rank-<R>.json`` in ``directory``, by rank."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "rank-*.json")):
        m = RANK_FILE.search(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found)


def merge(directory: str, output: Optional[str] = None,
          sim: Optional[str] = None) -> Tuple[str, int, int]:
    """One trace of a whole job: every ``rank-<R>.json`` of ``directory``, aligned by the time
    each process started tracing (``origin_unix_us``), optionally beside a simulated trace.

    Args:
        directory (str): Where ``MINICOMM_TRACE`` wrote the ranks' files.
        output (str): The merged file (default: ``<directory>/merged.json``).
        sim (str): A ``minicomm sim --trace`` file to show beside the ranks: its rank R becomes
            process ``offset + R``, named "rank R (simulated)", where ``offset`` is the
            smallest power of ten at least ten times past the highest measured rank; its first
            call starts where the first measured call of the same name does (at 0 if none).

    Returns:
        (tuple): (the merged file, the ranks merged, the call events in it).

    Raises:
        ValueError: ``directory`` holds no rank files, or a file is not a trace.

    Examples:
        >>> path, ranks, calls = merge("traces")
    """
    files = rank_files(directory)
    if not files:
        raise ValueError(f"{directory}: no rank-<R>.json trace files (set MINICOMM_TRACE to "
                         f"this directory and run the job)")
    loaded = [read_trace(path) for _, path in files]
    origins = [float(other.get("origin_unix_us", 0.0)) for _, other in loaded]
    base = min(origins)
    events: List[Dict[str, Any]] = []
    for (evs, _), origin in zip(loaded, origins):
        shift = origin - base
        events.extend(dict(e, ts=to_us((e["ts"] + shift) / 1e6)) if "ts" in e else e for e in evs)
    other: Dict[str, Any] = {"source": "measured", "ranks": [r for r, _ in files],
                             "origin_unix_us": base}
    if sim is not None:
        evs, sim_other = read_trace(sim)
        offset = 10 ** (len(str(max(r for r, _ in files))) + 1)
        first = min((e for e in evs if e.get("cat") == "call"), key=lambda e: e["ts"],
                    default=None)
        starts = [e["ts"] for e in events if first is not None and e.get("cat") == "call"
                  and e.get("name") == first["name"]]
        shift = min(starts) - first["ts"] if starts else 0.0
        for e in evs:
            e = dict(e, pid=e["pid"] + offset)
            if "ts" in e:
                e["ts"] = to_us((e["ts"] + shift) / 1e6)
            if e.get("name") == "process_name":
                e["args"] = {"name": f"rank {e['pid'] - offset} (simulated)"}
            events.append(e)
        other.update(source="measured and simulated", simulated_pid_offset=offset,
                     simulated=sim_other)
    path = output or os.path.join(directory, "merged.json")
    write_trace(path, events, other)
    return path, len(files), sum(1 for e in events if e.get("cat") == "call")
