"""minicomm.ps: a parameter server (sync, async, bounded staleness) over point-to-point messages.

    from minicomm import ps
    kv = ps.start(comm, num_servers=2, staleness=0, optimizer=ps.SGD(lr=0.1),
                  checkpoint_dir=None, checkpoint_every=0, resume=False, chunk_bytes=4 << 20)
    if kv is not None:                       # ranks >= num_servers are workers
        kv.init({"w1": w1, "b1": b1})        # the lowest-ranked worker's values win; all wait
        params = kv.pull(["w1", "b1"])       # dict of new arrays
        kv.push({"w1": g1, "b1": gb1})       # returns once the servers applied them
        ts = kv.push(grads, wait=False); kv.wait(ts)
        params = kv.pushpull(grads)          # push, then the updated values, one round trip
        kv.close()

Ranks ``0..num_servers-1`` become servers: ``start`` serves until every worker has closed (or
died) and returns None. The others get a ``Worker``. Keys are sharded across servers by range of
name; an array above ``chunk_bytes`` is split across servers (``sharding``). ``staleness``: 0 =
BSP (a clock's gradients averaged over the workers, applied once), None = async (every push one
optimizer step on arrival), k = SSP (a pull at clock c waits for the slowest worker to reach
c - k); enforced by a clock per worker on every server (``shard``). Optimizers run on the servers
(``SGD``, ``Adam``). ``checkpoint_every=N`` writes every shard and its clocks atomically every N
updates (0600 files in a 0700 directory), under the job's run id: a job never deletes, overwrites
or restores another run's checkpoints (``checkpoint``); ``resume=True`` goes on with the named
``run_id``, else the run that wrote last, from the newest checkpoint all servers hold. Requests
are binary frames validated field by field (``wire``); nothing a peer sends is unpickled, and the
transport authenticates every peer with the job token before that.

Failures: in async/SSP mode a dead worker is dropped and the rest go on; in BSP mode the others'
calls raise ``mc.PeerFailure`` (naming the dead rank) instead of hanging, or, with
``on_worker_failure="drop"``, the dead worker is dropped at the clock it held back (that clock
averages the gradients that arrived) and the rest go on. A malformed request is
refused with ``ProtocolError`` and the server keeps serving.

Restrictions: floating-point arrays; the key set is fixed at ``init`` (at most 12288 keys, names of
1..1024 utf-8 bytes, 32 dimensions: a request must fit one 16 MiB frame); one thread per Worker;
``num_servers=None`` reads ``MINICOMM_NUM_SERVERS`` (``minicomm run -n 6 --servers 2``).
Cost per step (model of M bytes, W workers, k servers): push + pull move 2M per worker; each
server's link carries 2M·W/k, so k >= W keeps a server no busier than a worker, and a
ring allreduce's 2M(W-1)/W per rank is the decentralised comparison.
"""
from __future__ import annotations

import os
from typing import Optional

from .checkpoint import CheckpointError, check_run_id
from .optimizers import SGD, Adam, Optimizer
from .server import Server
from .shard import ON_WORKER_FAILURE
from .sharding import Plan
from .wire import ProtocolError
from .worker import Worker

__all__ = ["start", "Worker", "SGD", "Adam", "Optimizer", "ProtocolError", "CheckpointError",
           "Plan", "ENV_NUM_SERVERS"]

ENV_NUM_SERVERS = "MINICOMM_NUM_SERVERS"


def _num_servers(num_servers, size: int) -> int:
    if num_servers is None:
        raw = os.environ.get(ENV_NUM_SERVERS)
        if raw is None:
            raise ValueError("ps.start: num_servers not given and MINICOMM_NUM_SERVERS is not set "
                             "(launch with `minicomm run -n N --servers K`)")
        try:
            num_servers = int(raw)
        except ValueError:
            raise ValueError(f"{ENV_NUM_SERVERS}={raw!r} is not an integer") from None
    if isinstance(num_servers, bool) or not isinstance(num_servers, int):
        raise TypeError(f"ps.start: num_servers must be an int, got {num_servers!r}")
    if not 1 <= num_servers < size:
        raise ValueError(f"ps.start: num_servers={num_servers} needs 1 <= num_servers < world size "
                         f"({size}): at least one server and one worker")
    return num_servers


def _check_options(checkpoint_dir, checkpoint_every, resume, run_id, chunk_bytes,
                   on_worker_failure) -> None:
    """ValueError naming the first bad option of ``start``."""
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) \
            or checkpoint_every < 0:
        raise ValueError(f"ps.start: checkpoint_every must be an int >= 0, "
                         f"got {checkpoint_every!r}")
    if (checkpoint_every or resume or run_id is not None) and checkpoint_dir is None:
        raise ValueError("ps.start: checkpoint_every, resume and run_id need a checkpoint_dir")
    if run_id is not None:
        try:
            check_run_id(run_id)
        except ValueError as e:
            raise ValueError(f"ps.start: {e}") from None
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 8:
        raise ValueError(f"ps.start: chunk_bytes must be an int >= 8, got {chunk_bytes!r}")
    if on_worker_failure not in ON_WORKER_FAILURE:
        raise ValueError(f"ps.start: on_worker_failure must be one of "
                         f"{', '.join(ON_WORKER_FAILURE)}, got {on_worker_failure!r}")


def start(comm, num_servers: Optional[int] = None, staleness: Optional[int] = 0,
          optimizer: Optional[Optimizer] = None, checkpoint_dir=None, checkpoint_every: int = 0,
          resume: bool = False, chunk_bytes: int = 4 << 20,
          run_id: Optional[str] = None, on_worker_failure: str = "fail") -> Optional[Worker]:
    """Make ranks ``0..num_servers-1`` parameter servers and the rest workers.

    Every rank of ``comm`` calls it with the same arguments. The servers serve until every
    worker has closed (or died), then return None; the workers get a ``Worker`` at once.

    Args:
        comm (Communicator): The ranks of the job; it stays usable (``start`` works on a
            private ``split`` of it).
        num_servers (int | None): How many servers, 1 <= num_servers < comm.size; None reads
            ``MINICOMM_NUM_SERVERS`` (``minicomm run -n 6 --servers 2``).
        staleness (int | None): 0: synchronous (BSP: a clock's gradients averaged over the
            workers, applied once); k > 0: bounded staleness (SSP: a pull at clock c waits for
            the slowest worker to reach c - k); None: asynchronous (every push one optimizer step
            on arrival).
        optimizer (Optimizer | None): What the servers apply gradients with (default
            ``SGD(lr=0.1)``).
        checkpoint_dir (str | os.PathLike | None): Where the servers write checkpoints: created
            0700, or an existing directory of this user that group and others cannot write.
        checkpoint_every (int): Write every shard and its clocks atomically every N updates
            (0: never).
        resume (bool): False: a new run, which never deletes, overwrites nor restores another
            run's checkpoints. True: go on with the run ``run_id`` names, else with the run that
            wrote the newest checkpoint, from the newest checkpoint all servers hold (none: from
            the initial values).
        chunk_bytes (int): Arrays above this size are split across servers.
        run_id (str | None): The run's name in the checkpoint files (1..64 letters, digits,
            ``_.-``). With ``resume=False`` it must have no checkpoints yet (None: a fresh id
            from the time and 32 random bits); with ``resume=True`` it picks the run to resume.
        on_worker_failure (str): What synchronous mode does when a worker dies. "fail" (the
            default): the other workers' calls raise ``PeerFailure`` naming it. "drop": the
            servers drop it at the clock it held back, average that clock over the workers
            whose gradients arrived, and serve the others on (as async and SSP always do).

    Returns:
        (Worker | None): A ``Worker`` on worker ranks; None on server ranks, once every worker
            has closed.

    Raises:
        ValueError: A bad num_servers, staleness, checkpoint_every, chunk_bytes, run_id or
            on_worker_failure, or
            checkpointing (or a run_id) asked for without a checkpoint_dir.
        TypeError: An optimizer that is not a ``ps.Optimizer``.
        CheckpointError: On the servers: the checkpoint directory is not a directory, is
            another user's, or group or others can write it; ``resume=False`` with a
            ``run_id`` that has checkpoints; ``resume`` found an unreadable checkpoint, one of
            another configuration, or (a named run) no update count every server holds.
        PeerFailure: In synchronous mode with ``on_worker_failure="fail"``, a worker died
            (naming it).

    Examples:
        >>> from minicomm import ps
        >>> kv = ps.start(comm, num_servers=1, optimizer=ps.SGD(lr=0.1))  # doctest: +SKIP
        >>> if kv is not None:          # ranks >= num_servers are workers  # doctest: +SKIP
        ...     kv.init({"w": np.zeros(4)})
        ...     kv.push({"w": np.ones(4)})
        ...     print(kv.pull(["w"])["w"])
        ...     kv.close()
        [-0.1 -0.1 -0.1 -0.1]
    """
    k = _num_servers(num_servers, comm.size)
    if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int)
                                  or staleness < 0):
        raise ValueError(f"ps.start: staleness must be None (async) or an int >= 0, "
                         f"got {staleness!r}")
    if optimizer is None:
        optimizer = SGD(lr=0.1)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"ps.start: optimizer must be a ps.Optimizer (ps.SGD, ps.Adam), "
                        f"got {type(optimizer).__name__}")
    _check_options(checkpoint_dir, checkpoint_every, resume, run_id, chunk_bytes,
                   on_worker_failure)
    checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
    # A private communicator: the servers' ANY_SOURCE receives and the PS tags never meet the
    # caller's own point-to-point traffic, and the caller may keep using comm in another thread.
    sub = comm.split(0)
    workers = list(range(k, sub.size))
    if sub.rank < k:
        try:
            Server(sub, k, workers, staleness, optimizer, chunk_bytes, checkpoint_dir,
                   checkpoint_every, bool(resume), run_id, on_worker_failure).run()
        finally:
            sub.close()
        return None
    return Worker(sub, k, workers, staleness, chunk_bytes)
