"""The flight recorder: each communicator's last calls, always on, dumped when a job goes wrong.

Each communicator keeps a bounded ring (``MINICOMM_FLIGHT_RECORDS`` calls, default 2048; 0 turns
it off) of its collectives and point-to-point calls. A record is a list, cheap to append on the
hot path (``FlightRecorder``'s doc has its slots): the call's number, kind, op, algorithm, count, dtype, root
or peer, tag, state, entry and end times, and the error that ended it.

States: ``queued`` (an ``async_op`` call not yet started; ``started`` once the communicator's
worker takes it, its collective record following), ``entered`` (running), ``done``, ``failed``.

Numbers: a collective's is its sequence number on the communicator (``#N``), the same on every
rank for the same call: setup's calls and internal exchanges count too. A point-to-point call's
is this rank's own count of point-to-point calls on the communicator.

Dumps (``dump``): on ``CommTimeout``, ``PeerFailure`` and ``MismatchError``, on ``SIGUSR1`` (when
the program has no handler of its own), and on ``comm.dump_flight_record()``. One JSON file per
world rank, ``rank-<R>.json``, in ``flight_dir()``: ``MINICOMM_FLIGHT_DIR``, else the job's
``<tmp>/minicomm-flight-<job id>`` (``minicomm-flight-pid<pid>`` outside a launcher). The file is
replaced atomically by each dump; its format (``FORMAT``)::

    {"format": "minicomm-flight-record/1", "rank": R, "pid": ..., "host": ...,
     "time": <unix seconds>, "reason": "CommTimeout: ...",
     "communicators": [{"comm_id": 1, "rank": r, "size": n, "group": [world ranks],
                        "calls": [{"number": N, "kind": "collective" | "p2p", "op": ...,
                                   "algorithm": ..., "count": ..., "dtype": ..., "root": ...,
                                   "peer": ..., "tag": ..., "state": ..., "entered": <unix s>,
                                   "ended": <unix s> | null, "error": ... | null,
                                   "repeats": N, "earlier_seconds": s}, ...]}]}

(``root`` for rooted collectives, ``peer`` and ``tag`` for point-to-point; the others null.)
"""
from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections import deque
from typing import Dict, Iterable, List, Optional

import numpy as np

from .errors import CommTimeout
from .settings import env_int, env_path

FORMAT = "minicomm-flight-record/1"
DEFAULT_RECORDS = 2048
DUMP_LOCK_S = 2.0             # a dump waits this long for another one in progress
NUMBER, WHAT, ENTERED, ENDED = range(4)      # a record's slots (FlightRecorder)
QUEUED, STARTED, RUNNING, DONE, FAILED = "queued", "started", "entered", "done", "failed"
COLLECTIVE, P2P = "collective", "p2p"

_monotonic = time.monotonic
_recorders: "weakref.WeakSet[FlightRecorder]" = weakref.WeakSet()
_dump_lock = threading.Lock()


def record_capacity() -> int:
    """MINICOMM_FLIGHT_RECORDS: the calls each communicator keeps (0: no recorder)."""
    return env_int("MINICOMM_FLIGHT_RECORDS", DEFAULT_RECORDS, minimum=0)


def flight_dir() -> str:
    """Where dumps go: MINICOMM_FLIGHT_DIR, else a directory per job under the temp directory."""
    chosen = env_path("MINICOMM_FLIGHT_DIR")
    if chosen:
        return chosen
    job = os.environ.get("MINICOMM_JOB_ID", "").strip()
    name = f"minicomm-flight-{job}" if job else f"minicomm-flight-pid{os.getpid()}"
    return os.path.join(tempfile.gettempdir(), name)


class FlightRecorder:
    """One communicator's ring of call records (module doc). ``None`` stands for "off" where a
    communicator holds one, so that an off recorder costs a single test.

    A record is a list ``[number, what, entered, ended, repeats, earlier_seconds]``: ``what``
    is the bound call (an object with ``coll``, ``algo``, ``count``, ``root`` and the packed
    ``call``, whose dtype it names) or a tuple ``(kind, op, algorithm, count, dtype, root,
    peer, tag)``; ``ended`` is None while it runs; a failed record has the error's text and
    the peer it waited on appended (``end``). Back-to-back repeats of one bound call on the hot
    path share a record (``repeat``): it keeps the latest call's number and times, how many
    calls it stands for and the time of the earlier ones, so a training loop's thousands of
    identical calls neither allocate nor evict records."""

    __slots__ = ("calls", "comm_id", "rank", "size", "group", "p2p_calls", "directory",
                 "latest", "__weakref__")

    def __init__(self, capacity: int, comm_id: int, rank: int, group):
        self.calls: deque = deque(maxlen=capacity)
        self.comm_id, self.rank, self.group = comm_id, rank, tuple(group)
        self.size = len(self.group)
        self.p2p_calls = 0
        self.latest: Optional[list] = None     # the newest record, unless it failed
        self.directory: Optional[str] = None   # where its dumps go (None: flight_dir())
        _recorders.add(self)

    def call(self, number, kind: str, op: str, algorithm=None, count=None, dtype=None,
             root=None, peer=None, tag=None) -> list:
        """A call entered now, described field by field: its record."""
        rec = [number, (kind, op, algorithm, count, dtype, root, peer, tag), _monotonic(), None,
               1, 0.0]
        self.calls.append(rec)
        self.latest = rec
        return rec

    def repeat(self, number: int, call, now: Optional[float] = None) -> list:
        """A bound collective entered ``now`` (default: now): its record, the latest one's when
        that is the same call and done (class doc; the small path inlines this)."""
        now = _monotonic() if now is None else now
        last = self.latest
        if last is not None and last[WHAT] is call and last[ENDED] is not None:
            last[5] += last[ENDED] - last[ENTERED]
            last[4] += 1
            last[NUMBER], last[ENTERED], last[ENDED] = number, now, None
            return last
        rec = self.latest = [number, call, now, None, 1, 0.0]
        self.calls.append(rec)
        return rec

    def p2p(self, op: str, count, dtype, peer: int, tag: int) -> list:
        """A point-to-point call entered now (numbered by this rank's own count)."""
        self.p2p_calls += 1
        return self.call(self.p2p_calls, P2P, op, None, count, dtype, None, peer, tag)

    def queued(self, op: str) -> list:
        """An async call submitted now; its collective record follows when it starts."""
        return self.call(None, QUEUED, op)

    def failed(self, error: BaseException) -> None:
        """The running collective (the latest entered one) ended with ``error``; the peer: the
        rank of this communicator a timeout waited on."""
        for rec in reversed(self.calls):
            if rec[ENDED] is None and fields(rec[WHAT])[0] == COLLECTIVE:
                world = getattr(error, "peer", None)
                end(rec, error, self.group.index(world)
                    if isinstance(error, CommTimeout) and world in self.group else None)
                self.latest = None          # a failed record is never repeated
                return

    def snapshot(self) -> dict:
        """This communicator's part of a dump (times as unix seconds)."""
        shift = time.time() - _monotonic()
        calls = []
        for rec in list(self.calls):
            d = describe(rec)
            d["entered"] += shift
            d["ended"] = None if d["ended"] is None else d["ended"] + shift
            calls.append(d)
        return {"comm_id": self.comm_id, "rank": self.rank, "size": self.size,
                "group": list(self.group), "calls": calls}

    def totals(self) -> Dict[tuple, list]:
        """(kind, op, algorithm) -> [calls, bytes, seconds, finished calls], over the calls the
        ring holds (the last ``MINICOMM_FLIGHT_RECORDS``)."""
        out: Dict[tuple, list] = {}
        for rec in list(self.calls):
            d = describe(rec)
            if d["state"] in (QUEUED, STARTED):
                continue
            row = out.setdefault((d["kind"], d["op"], d["algorithm"]), [0, 0, 0.0, 0])
            row[0] += d["repeats"]
            row[1] += d["repeats"] * (d["count"] or 0) * _itemsize(d["dtype"])
            row[2] += d["earlier_seconds"]
            row[3] += d["repeats"] - 1
            if d["state"] == DONE:
                row[2] += d["ended"] - d["entered"]
                row[3] += 1
        return out


def fields(what) -> tuple:
    """A record's ``what`` as (kind, op, algorithm, count, dtype, root, peer, tag)."""
    if type(what) is tuple:
        return what
    return (COLLECTIVE, what.coll, what.algo, what.count, _dtype_name((what.call >> 13) & 255),
            what.root, None, None)


def describe(rec: list) -> dict:
    """A record as the dump's dict (the module doc's fields; times still monotonic)."""
    kind, op, algorithm, count, dtype, root, peer, tag = fields(rec[WHAT])
    error = rec[6] if len(rec) > 6 else None
    if kind in (QUEUED, STARTED):
        state, kind = kind, COLLECTIVE
    elif error is not None:
        state, peer = FAILED, (rec[7] if rec[7] is not None else peer)
    else:
        state = RUNNING if rec[ENDED] is None else DONE
    return {"number": rec[NUMBER], "kind": kind, "op": op, "algorithm": algorithm,
            "count": count, "dtype": None if dtype is None else str(dtype), "root": root,
            "peer": peer, "tag": tag, "state": state, "entered": rec[ENTERED],
            "ended": rec[ENDED], "error": error, "repeats": rec[4],
            "earlier_seconds": rec[5]}


def started(rec: list) -> None:
    """A queued async call was taken by the worker (its collective record follows)."""
    rec[WHAT] = (STARTED,) + rec[WHAT][1:]


def received(rec: list, got) -> None:
    """A receive's record learns what arrived (count and dtype)."""
    kind, op, algorithm, _, _, root, peer, tag = rec[WHAT]
    rec[WHAT] = (kind, op, algorithm, got.size, got.dtype, root, peer, tag)


_DTYPE_NAMES: Dict[int, str] = {}


def _dtype_name(num: int) -> Optional[str]:
    if not _DTYPE_NAMES:
        for t in np.sctypeDict.values():
            _DTYPE_NAMES.setdefault(np.dtype(t).num, np.dtype(t).name)
    return _DTYPE_NAMES.get(num)


def _itemsize(name: Optional[str]) -> int:
    try:
        return np.dtype(name).itemsize if name else 0
    except TypeError:
        return 0


def recorders_of(world_rank: int) -> List[FlightRecorder]:
    """The live recorders of one world rank's communicators (one process may hold several
    ranks under the inproc transport)."""
    return [r for r in list(_recorders) if r.group[r.rank] == world_rank]


def retire(recorder: Optional[FlightRecorder]) -> None:
    """A closed communicator's recorder leaves later dumps."""
    if recorder is not None:
        _recorders.discard(recorder)


def end(rec: list, error: Optional[BaseException] = None, peer: Optional[int] = None) -> None:
    """Close a record: done, or failed with ``error`` (``peer``: the rank it waited on)."""
    rec[ENDED] = _monotonic()
    if error is not None:
        rec += [f"{type(error).__name__}: {error}", peer]


def dump(reason: str, recorders: Optional[Iterable[FlightRecorder]] = None,
         directory: Optional[str] = None) -> List[str]:
    """Write the records of ``recorders`` (default: every live one in this process), one file
    per world rank (a process holds one rank, or several under the inproc transport); returns
    the paths written. Never raises: a dump must not hide the error it reports."""
    try:
        chosen = list(_recorders) if recorders is None else list(recorders)
        if not chosen:
            return []
        by_rank: Dict[int, list] = {}
        for r in chosen:
            by_rank.setdefault(r.group[r.rank], []).append(r)
        directory = directory or next((r.directory for r in chosen if r.directory), None) \
            or flight_dir()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        paths = []
        # bounded: SIGUSR1 may arrive while this thread is inside a dump
        if not _dump_lock.acquire(timeout=DUMP_LOCK_S):
            return []
        try:
            for world_rank, recs in sorted(by_rank.items()):
                doc = {"format": FORMAT, "rank": world_rank, "pid": os.getpid(),
                       "host": socket.gethostname(), "time": time.time(), "reason": reason,
                       "communicators": [r.snapshot() for r in
                                         sorted(recs, key=lambda r: r.comm_id)]}
                path = os.path.join(directory, f"rank-{world_rank}.json")
                tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, path)
                paths.append(path)
        finally:
            _dump_lock.release()
        return paths
    except Exception:                 # a full disk or a bad directory: the error itself goes on
        return []


def load(directory: str) -> Dict[int, dict]:
    """The dumps in ``directory`` by world rank (files that are not dumps are skipped)."""
    out: Dict[int, dict] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in sorted(names):
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("format") == FORMAT and isinstance(doc.get("rank"),
                                                                                  int):
            out[doc["rank"]] = doc
    return out


def _on_sigusr1(signum, frame) -> None:
    dump("SIGUSR1")


def install_signal_handler() -> bool:
    """Dump on SIGUSR1, unless the program handles SIGUSR1 itself (or this is not the main
    thread, where Python cannot set handlers). True when installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, _on_sigusr1):
            return False
        signal.signal(signal.SIGUSR1, _on_sigusr1)
        return True
    except (ValueError, OSError):
        return False
