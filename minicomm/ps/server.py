"""The server loop: receive request frames from any worker, drive the shard, answer.

One thread per server. It waits for a frame on ``REQUEST_TAG`` from ``ANY_SOURCE`` (the only
receive a worker can trigger unasked), hands it to the ``Shard``, and the shard pulls the request's
data messages from that worker straight into its own buffers (``recv(out=...)``, validated before
they are consumed) and answers with ``isend``s straight from the params, which it then leaves
untouched until those sends complete (``settle`` before every update). Nothing is copied on the
way in except the BSP staging add, nothing on the way out.

Checkpoints are taken after every ``checkpoint_every``-th update; with ``resume=True`` the
servers of a synchronous job first agree (server 0 collects what each has) on the newest update
count every one of them holds, so all shards restart from the same clock.

Restrictions: a request's data messages must follow its frame within the timeout, else the
request is refused. ``TEST_HOOKS["after_update"](shard)``, when set, runs after each update (after
its checkpoint): tests use it to record clocks or to kill a server at a chosen update.

Cost: see ``shard``; per request one small frame each way plus one message per piece.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import CommError, CommTimeout, PeerFailure
from ..p2p import ANY_SOURCE, Status
from . import checkpoint, wire
from .shard import INITED, NEW, Refuse, Shard, clone_optimizer

TEST_HOOKS: Dict[str, object] = {}
_REAP_EVERY = 256


class CommIO:
    """The shard's I/O over a communicator's point-to-point API."""

    def __init__(self, comm, timeout: float):
        self.comm, self.timeout = comm, timeout
        self.sends: List[Tuple[int, object]] = []
        self.dead: List[int] = []

    def recv_payload(self, worker: int, seq: int, index: int, buf: np.ndarray) -> None:
        t = wire.tag(wire.PUSH_DATA, seq)
        try:
            self.comm.recv(worker, tag=t, out=buf, timeout=self.timeout)
        except (ValueError, TypeError) as e:
            # The message does not fit the piece (it stays queued): take it out of the way.
            try:
                self.comm.recv(worker, tag=t, timeout=self.timeout)
            except CommError:
                pass
            raise Refuse(wire.PROTOCOL, f"data message {index} of request {seq} does not fit "
                         f"its piece ({buf.size} x {buf.dtype}): {e}") from None
        except CommTimeout:
            raise Refuse(wire.PROTOCOL, f"data message {index} of request {seq} did not arrive "
                         f"within {self.timeout} s") from None

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
                 checkpoint_dir: Optional[str], checkpoint_every: int, resume: bool):
        self.comm = comm
        self.timeout = comm.timeout
        self.num_servers = num_servers
        self.io = CommIO(comm, self.timeout)
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.shard = Shard(comm.rank, num_servers, workers, staleness, clone_optimizer(optimizer),
                           chunk_bytes, self.io, after_update=self._after_update)
        if checkpoint_dir is not None:
            checkpoint.ensure_dir(checkpoint_dir)
        if resume:
            self._resume()

    # ------------------------------------------------------------------ checkpoints
    def _after_update(self, shard: Shard) -> None:
        if self.checkpoint_every and shard.updates % self.checkpoint_every == 0:
            meta, arrays = shard.snapshot()
            checkpoint.write(self.checkpoint_dir, shard.server, shard.updates, meta, arrays)
        hook = TEST_HOOKS.get("after_update")
        if hook is not None:
            hook(shard)

    def _resume(self) -> None:
        server = self.shard.server
        checkpoint.remove_temporaries(self.checkpoint_dir, server)
        have = dict(checkpoint.available(self.checkpoint_dir, server))
        if self.shard.sync and self.num_servers > 1:
            choice = self._agree(sorted(have))
        else:
            choice = max(have) if have else -1
        if choice < 0:
            if have:
                print(f"minicomm.ps: server {server}: no checkpoint that every server holds; "
                      f"starting from the initial values", file=sys.stderr)
            return
        meta, arrays = checkpoint.read(have[choice])
        self.shard.restore(meta, arrays, have[choice])

    def _agree(self, have: List[int]) -> int:
        """The newest update count every server holds a checkpoint of (-1: none)."""
        t = wire.tag(wire.SERVER, 0)
        comm = self.comm
        if comm.rank == 0:
            common = set(have)
            for s in range(1, self.num_servers):
                theirs = comm.recv(s, tag=t, timeout=self.timeout)
                if not isinstance(theirs, np.ndarray) or theirs.dtype != np.int64 \
                        or theirs.ndim != 1:
                    raise wire.ProtocolError(f"server {s} sent a malformed checkpoint list")
                common &= set(int(u) for u in theirs)
            choice = max(common) if common else -1
            for s in range(1, self.num_servers):
                comm.send(np.array([choice], np.int64), s, tag=t + 1)
            return choice
        comm.send(np.array(have, np.int64), 0, tag=t)
        got = comm.recv(0, tag=t + 1, timeout=self.timeout)
        if not isinstance(got, np.ndarray) or got.dtype != np.int64 or got.shape != (1,):
            raise wire.ProtocolError("server 0 sent a malformed checkpoint choice")
        return int(got[0])

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        shard, comm = self.shard, self.comm
        status = Status()
        stale_failure = False
        while not shard.done:
            try:
                message = comm.recv(ANY_SOURCE, tag=wire.REQUEST_TAG, status=status,
                                    timeout=self.timeout)
            except CommTimeout:
                continue              # workers computing; each waits under its own timeout
            except PeerFailure as e:
                peer = getattr(e, "peer", None)
                if peer in shard.status and shard.status[peer] in (INITED, NEW):
                    shard.worker_failed(peer)
                    continue
                # No live worker to blame: the whole communicator failed (peer None), or the
                # transport repeats a failure we already know (everyone else is gone). Once
                # may be another server's death, which reaches the workers through their own
                # waits; twice in a row means nothing more can arrive.
                if peer is None or stale_failure:
                    raise
                stale_failure = True
                continue
            stale_failure = False
            shard.submit(status.source, message)
            shard.progress()
        self.io.settle()              # the last answers (to the closes) are out
        if shard.broken is not None and shard.broken[0] == wire.PEER_FAILED:
            err = PeerFailure(f"parameter server {shard.server}: {shard.broken[1]}")
            err.peer = shard.broken[2]
            raise err
