"""The server loop: receive request frames from any worker, drive the shard, answer.

One thread per server. A receive for the next frame (``REQUEST_TAG``, ``ANY_SOURCE``: the only
receive a worker can trigger unasked) is always posted; each frame goes to the ``Shard``, which
posts ``irecv(out=...)`` for the request's data straight into its own buffers (validated before
anything is consumed) and answers with ``isend``s straight from the params, which it then leaves
untouched until those sends complete (``settle`` before every update). The loop blocks on the
oldest request whose data is in flight, else on the next frame; since a wait moves every posted
message, all workers' gradients stream in at once. Nothing is copied on the way in except the
BSP sum, nothing on the way out. Data moves only while its worker is inside a minicomm call
(the transports have no background thread), so a worker that pushes with ``wait=False`` and then
computes for long delays its own data, and, for that long, what this server does next.

Failures: an ANY_SOURCE receive reports a worker whose links fail; a worker whose process
ended in order without ``kv.close()`` (links closed, no failure report) is found by a receive
posted per worker on a tag nobody sends, polled every ``LIVENESS_S`` (1 s) and whenever a
failure is reported. A failure naming no rank (the whole communicator failed) ends the server.

Checkpoints are taken after every ``checkpoint_every``-th update, under the job's run id
(``checkpoint``): at start, server 0 collects every server's list of runs and update counts and
decides for all (``checkpoint.choose``) which run this job is (a new one, or with
``resume=True`` the one it goes on with) and what each server restores; a synchronous job
restores the newest update count every server holds, so all shards restart from the same clock.

Restrictions: a request's data messages must follow its frame within the timeout, else the
request is refused. ``TEST_HOOKS["after_update"](shard)``, when set, runs after each update (after
its checkpoint): tests use it to record clocks or to kill a server at a chosen update.

Cost: see ``shard``; per request one small frame each way plus one message per piece.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import CommError, CommTimeout, PeerFailure
from ..p2p import ANY_SOURCE
from . import checkpoint, wire
from .shard import INITED, NEW, Refuse, Shard, clone_optimizer

TEST_HOOKS: Dict[str, object] = {}
_REAP_EVERY = 256
LIVENESS_S = 1.0          # a worker gone without a failure report is noticed about this soon


def _json_message(obj) -> np.ndarray:
    """A server-to-server record as a uint8 message (JSON: nothing a peer sends is unpickled)."""
    return np.frombuffer(json.dumps(obj).encode(), np.uint8)


def _json_of(message, sender: str) -> dict:
    if not isinstance(message, np.ndarray) or message.dtype != np.uint8 or message.ndim != 1:
        raise wire.ProtocolError(f"{sender} sent a malformed checkpoint record")
    try:
        obj = json.loads(message.tobytes().decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise wire.ProtocolError(f"{sender} sent a checkpoint record that is not JSON") from None
    if not isinstance(obj, dict):
        raise wire.ProtocolError(f"{sender} sent a checkpoint record that is not a JSON object")
    return obj


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_run(x) -> bool:
    try:
        checkpoint.check_run_id(x)
    except ValueError:
        return False
    return True


def _listing_of(obj: dict, s: int) -> checkpoint.Listing:
    """Server ``s``'s ``{"runs": {run: [mtime_ns, [updates...]]}}``, checked field by field."""
    runs = obj.get("runs")
    out = {}
    ok = isinstance(runs, dict)
    for run, entry in (runs.items() if ok else ()):
        ok = (_is_run(run) and isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0])
              and isinstance(entry[1], list) and all(_is_int(u) and u >= 0 for u in entry[1]))
        if not ok:
            break
        out[run] = (entry[0], sorted(entry[1]))
    if not ok:
        raise wire.ProtocolError(f"server {s} sent a malformed checkpoint list")
    return out


class Payload:
    """The posted receives of one request's data messages (see ``CommIO.post_payload``)."""
    __slots__ = ("worker", "seq", "works", "error", "deadline")

    def __init__(self, worker: int, seq: int, works: list, deadline: float):
        self.worker, self.seq, self.works, self.deadline = worker, seq, works, deadline
        self.error: Optional[Tuple[int, BaseException]] = None


class CommIO:
    """The shard's I/O over a communicator's point-to-point API."""

    def __init__(self, comm, timeout: float):
        self.comm, self.timeout = comm, timeout
        self.sends: List[Tuple[int, object]] = []
        self.dead: List[int] = []

    # ---- request data: posted at once, completed later (several workers' data stream at once)
    def post_payload(self, worker: int, seq: int, bufs: List[np.ndarray]) -> Payload:
        t = wire.tag(wire.PUSH_DATA, seq)
        works = [self.comm.irecv(worker, tag=t, out=b) for b in bufs]
        return Payload(worker, seq, works, time.monotonic() + self.timeout)

    def _poll(self, h: Payload, timeout: float) -> bool:
        """Advance ``h`` (waiting up to ``timeout`` on its first open receive); True = done."""
        for i, work in enumerate(h.works):
            if work is None:
                continue
            try:
                work.wait(timeout)
            except CommTimeout:
                if time.monotonic() > h.deadline:
                    h.error = (i, CommTimeout(f"did not arrive within {self.timeout} s"))
                    return True
                return False
            except Exception as e:       # kept for finish_payload, which names it
                h.error = (i, e)
                return True
            h.works[i] = None
            timeout = 0
        return True

    def payload_done(self, h: Payload) -> bool:
        return h.error is not None or self._poll(h, 0)

    def wait_payload(self, h: Payload, timeout: float) -> None:
        """Block until ``h`` is done or ``timeout`` passes (everything posted moves meanwhile)."""
        if h.error is None:
            self._poll(h, timeout)

    def finish_payload(self, h: Payload) -> None:
        if h.error is None:
            return
        i, e = h.error
        if isinstance(e, PeerFailure):
            raise e
        what = f"data message {i} of request {h.seq}"
        if isinstance(e, (ValueError, TypeError)):
            # The message does not fit its piece, and stays queued: take it out of the way.
            try:
                self.comm.recv(h.worker, tag=wire.tag(wire.PUSH_DATA, h.seq), timeout=self.timeout)
            except CommError:
                pass
            raise Refuse(wire.PROTOCOL, f"{what} does not fit its piece: {e}") from None
        raise Refuse(wire.PROTOCOL, f"{what}: {e}") from None

    # ---- responses: sent straight from the params, which stay untouched until settle()
    def respond(self, worker: int, seq: int, frame: np.ndarray, arrays=()) -> None:
        if worker in self.dead:
            return
        try:
            self.sends.append((worker, self.comm.isend(frame, worker,
                                                       tag=wire.tag(wire.RESPONSE, seq))))
            t = wire.tag(wire.RESPONSE_DATA, seq)
            for a in arrays:
                self.sends.append((worker, self.comm.isend(a, worker, tag=t)))
        except PeerFailure:
            self.dead.append(worker)
        if len(self.sends) > _REAP_EVERY:
            self.dead.extend(self.settle())

    def settle(self) -> List[int]:
        """Wait for every send so far; return the workers found dead meanwhile."""
        sends, self.sends = self.sends, []
        for worker, work in sends:
            if worker in self.dead:
                continue
            try:
                work.wait(timeout=self.timeout)
            except (PeerFailure, CommTimeout):
                # gone, or not taking its reply within the timeout: either way lost to us
                self.dead.append(worker)
        dead, self.dead = self.dead, []
        return dead


class Server:
    """Serve one shard until every worker has closed or died."""

    def __init__(self, comm, num_servers: int, workers, staleness, optimizer, chunk_bytes: int,
                 checkpoint_dir: Optional[str], checkpoint_every: int, resume: bool,
                 run_id: Optional[str] = None, on_worker_failure: str = "fail"):
        self.comm = comm
        self.timeout = comm.timeout
        self.num_servers = num_servers
        self.io = CommIO(comm, self.timeout)
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.shard = Shard(comm.rank, num_servers, workers, staleness, clone_optimizer(optimizer),
                           chunk_bytes, self.io, after_update=self._after_update,
                           on_worker_failure=on_worker_failure)
        self.run_id: Optional[str] = None      # the run this job's checkpoints belong to
        if checkpoint_dir is not None:
            checkpoint.ensure_dir(checkpoint_dir)
            if checkpoint_every or resume:
                self._start_run(resume, run_id)

    # ------------------------------------------------------------------ checkpoints
    def _after_update(self, shard: Shard) -> None:
        if self.checkpoint_every and shard.updates % self.checkpoint_every == 0:
            meta, arrays = shard.snapshot()
            checkpoint.write(self.checkpoint_dir, shard.server, shard.updates, meta, arrays,
                             run=self.run_id)
        hook = TEST_HOOKS.get("after_update")
        if hook is not None:
            hook(shard)

    def _start_run(self, resume: bool, run_id: Optional[str]) -> None:
        """Decide this job's run (server 0 for all) and restore its checkpoint, if any."""
        server, directory = self.shard.server, self.checkpoint_dir
        mine = checkpoint.runs(directory, server)
        if self.num_servers > 1:
            run, choice = self._agree(mine, resume, run_id)
        else:
            run, choices, note = checkpoint.choose([mine], resume, run_id, self.shard.sync,
                                                   directory)
            choice = choices[0]
            if note:
                print(f"minicomm.ps: {note}", file=sys.stderr)
        self.run_id = run
        if resume:
            checkpoint.remove_temporaries(directory, server, run)
        if choice < 0:
            return
        path = os.path.join(directory, checkpoint.shard_file(server, choice, run))
        meta, arrays = checkpoint.read(path, run=run, server=server, updates=choice)
        self.shard.restore(meta, arrays, path)

    def _agree(self, mine: checkpoint.Listing, resume: bool,
               run_id: Optional[str]) -> Tuple[str, int]:
        """Server 0 collects every server's runs and decides for all: (run, update count)."""
        t = wire.tag(wire.SERVER, 0)
        comm = self.comm
        if comm.rank != 0:
            comm.send(_json_message({"runs": {r: [m, u] for r, (m, u) in mine.items()}}), 0,
                      tag=t)
            got = _json_of(comm.recv(0, tag=t + 1, timeout=self.timeout), "server 0")
            if isinstance(got.get("error"), str):
                raise checkpoint.CheckpointError(got["error"])
            run, choice = got.get("run"), got.get("updates")
            if not isinstance(run, str) or not _is_run(run) or not _is_int(choice):
                raise wire.ProtocolError("server 0 sent a malformed checkpoint choice")
            return run, choice
        listings = [mine]
        for s in range(1, self.num_servers):
            listings.append(_listing_of(_json_of(comm.recv(s, tag=t, timeout=self.timeout),
                                                 f"server {s}"), s))
        try:
            run, choices, note = checkpoint.choose(listings, resume, run_id, self.shard.sync,
                                                   self.checkpoint_dir)
        except checkpoint.CheckpointError as e:
            for s in range(1, self.num_servers):
                comm.send(_json_message({"error": str(e)}), s, tag=t + 1)
            raise
        if note:
            print(f"minicomm.ps: {note}", file=sys.stderr)
        for s in range(1, self.num_servers):
            comm.send(_json_message({"run": run, "updates": choices[s]}), s, tag=t + 1)
        return run, choices[0]

    # ------------------------------------------------------------------ the loop
    def _watch(self) -> Dict[int, object]:
        """One receive per worker on a tag nobody sends: it fails when the worker's links close,
        even in order (a process that exits without ``kv.close()``), which ANY_SOURCE does not
        report as a failure."""
        t = wire.tag(wire.LIVENESS, 0)
        return {w: self.comm.irecv(w, tag=t) for w in self.shard.workers}

    def _check_alive(self, watch: Dict[int, object]) -> None:
        shard = self.shard
        for w, work in list(watch.items()):
            if shard.status[w] not in (INITED, NEW):
                del watch[w]
                continue
            try:
                work.wait(0)
            except CommTimeout:
                continue
            except CommError:
                del watch[w]
                shard.worker_failed(w)
                continue
            watch[w] = self.comm.irecv(w, tag=wire.tag(wire.LIVENESS, 0))   # stray message

    def run(self) -> None:
        shard, comm, io = self.shard, self.comm, self.io
        frames = comm.irecv(ANY_SOURCE, tag=wire.REQUEST_TAG)     # always posted: frames land
        watch = self._watch()
        # Waits are cut into LIVENESS_S slices so a worker that vanished without a failure
        # report is noticed within about that long (a few receive polls per slice, no spinning).
        slice_s = min(self.timeout, LIVENESS_S)
        checked = time.monotonic()
        stale_failure = False
        while not shard.done:
            if time.monotonic() - checked >= slice_s:
                self._check_alive(watch)
                checked = time.monotonic()
                shard.progress()
                if shard.done:
                    break
            # Wait for the oldest request whose data is in flight, else for a frame; either
            # wait moves every posted message (other workers' data, the next frames) meanwhile.
            try:
                if shard.receiving:
                    io.wait_payload(shard.receiving[0].receiving, slice_s)
                    message = frames.wait(0)
                else:
                    message = frames.wait(slice_s)
            except CommTimeout:
                shard.progress()
                continue                 # workers computing; each waits under its own timeout
            except PeerFailure as e:
                frames = comm.irecv(ANY_SOURCE, tag=wire.REQUEST_TAG)
                peer = getattr(e, "peer", None)
                if peer in shard.status and shard.status[peer] in (INITED, NEW):
                    shard.worker_failed(peer)
                    continue
                # No live worker to blame: the whole communicator failed (peer None), or the
                # transport repeats a failure we already know (everyone else is gone: a worker
                # that left without a report is found by its links). Once may be another
                # server's death, which reaches the workers through their own waits; twice in
                # a row means nothing more can arrive.
                self._check_alive(watch)
                shard.progress()
                if shard.done:
                    break
                if peer is None or stale_failure:
                    raise
                stale_failure = True
                continue
            stale_failure = False
            source = frames.status.source
            frames = comm.irecv(ANY_SOURCE, tag=wire.REQUEST_TAG)
            shard.submit(source, message)
            shard.progress()
        self.io.settle()              # the last answers (to the closes) are out
        if shard.broken is not None and shard.broken[0] == wire.PEER_FAILED:
            err = PeerFailure(f"parameter server {shard.server}: {shard.broken[1]}")
            err.peer = shard.broken[2]
            raise err
