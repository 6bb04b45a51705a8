"""Parameter-server training through ``minicomm.ps``: sync (BSP), async, or bounded staleness.

    log = train_ps(comm, dataset, TrainConfig(), num_servers=2, staleness=0)   # None on servers

Ranks ``0 .. num_servers-1`` serve (``ps.start`` returns None to them once every worker has
closed); the other ``W = size - num_servers`` ranks are workers. Worker i takes shard i of every
global batch (``ShardedLoader(..., rank=i, world=W)``), computes its gradients, and calls
``kv.pushpull(grads)``: the servers apply ``ps.SGD(lr)`` and return the updated parameters.

- ``staleness=0`` (sync): a server averages the W gradients of one clock and applies SGD once —
  exactly large-batch SGD on the global batch, so the trajectory equals ``train_single``'s.
- ``staleness=None`` (async): every push is one SGD step on arrival (no 1/W scaling): W times as
  many, W times smaller-batch steps per global batch.
- ``staleness=k`` (SSP): pushes applied as in async; a worker's pull at clock c waits until the
  slowest worker has reached c - k.

After the last step every worker's final push has been applied (``push`` returns once the servers
applied it); a barrier among the workers then lets the first worker pull the final parameters.

``on_worker_failure="drop"``: a worker that dies is dropped by the servers (in sync mode at the
clock it held back, which then averages the gradients that arrived: ``ps.start``), and the
end-of-training barriers become fault-tolerant agreements (``comm.agree``) among the workers, so
the survivors finish the configured steps and the lowest surviving worker pulls the final
parameters. The default "fail" keeps the parameter server's own behaviour (sync: the others'
calls raise ``PeerFailure``).

Traffic per step per worker: it pushes every gradient and pulls every parameter, so it sends and
receives the model's size in bytes; the servers together receive and send W times that, and a
server holding a share m_s of the model carries W·m_s in each direction per step
(``server_shares``: from the server's sharding plan; small ``chunk_bytes`` spread a small model
evenly, the 4 MiB default leaves each of its arrays whole on one server).
"""
from __future__ import annotations

import importlib
import time
from typing import Callable, List, Optional

import numpy as np

from .data import Dataset
from .single import RankLog, StepCallback, TrainConfig

_WORKER_COLOR = 1


def ps_available() -> bool:
    """Whether ``minicomm.ps`` can be imported (the PS modes need it)."""
    try:
        importlib.import_module("minicomm.ps")
    except ImportError:
        return False
    return True


def train_ps(comm, dataset: Dataset, config: TrainConfig, num_servers: int = 2,
             staleness: Optional[int] = 0, chunk_bytes: int = 4 << 20,
             on_step: Optional[StepCallback] = None, return_params: Optional[bool] = None,
             ps_module=None, on_worker_failure: str = "fail",
             before_step: Optional[Callable[[int], None]] = None) -> Optional[RankLog]:
    """Train through the parameter server on every rank of ``comm``.

    Args:
        comm (Communicator): Every rank of the job; ranks below ``num_servers`` serve.
        dataset (Dataset): The data (the same on every rank).
        config (TrainConfig): Steps, global batch, learning rate, model, seed.
        num_servers (int): Server ranks, 1 <= num_servers < comm.size.
        staleness (int | None): 0 sync (BSP), k > 0 bounded staleness (SSP), None async.
        chunk_bytes (int): Arrays above this size are split across servers.
        on_step (Callable | None): Called as ``on_step(step, loss)`` after every step.
        return_params (bool | None): Every worker's log carries the final parameters (True),
            or only the first (surviving) worker's (None).
        ps_module (module | None): Replaces ``minicomm.ps`` (tests of this trainer alone).
        on_worker_failure (str): "fail" or "drop" (module docstring): whether the surviving
            workers finish when a worker dies.
        before_step (Callable | None): Called as ``before_step(step)`` before every step (a
            failure drill can end the process there).

    Returns:
        (RankLog | None): A worker's log; None on servers.

    Raises:
        ValueError: A bad num_servers, staleness or on_worker_failure.
        PeerFailure: A worker died and ``on_worker_failure`` is "fail" (sync mode).

    Examples:
        >>> logs = mc.spawn(train_ps, 3, transport="shm",
        ...                 args=(load_dataset("synthetic"), TrainConfig(steps=20), 1, 0))
        >>> logs[0] is None, len(logs[1].losses)
        (True, 20)
    """
    if on_worker_failure not in ("fail", "drop"):
        raise ValueError(f"on_worker_failure={on_worker_failure!r}: choose fail or drop")
    if not isinstance(num_servers, int) or not 1 <= num_servers < comm.size:
        raise ValueError(f"num_servers={num_servers!r} must leave at least one worker among "
                         f"{comm.size} ranks")
    if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
        raise ValueError(f"staleness must be None (async) or an int >= 0, got {staleness!r}")
    ps = ps_module if ps_module is not None else importlib.import_module("minicomm.ps")
    num_workers = comm.size - num_servers
    is_server = comm.rank < num_servers
    # Split before ps.start, while every rank still takes part in collectives on ``comm``: the
    # workers need a communicator of their own for the end-of-training barrier.
    peers = comm.split(None if is_server else _WORKER_COLOR)
    try:
        # only named when asked for: a stand-in ``ps_module`` may not know the option
        options = {"on_worker_failure": "drop"} if on_worker_failure == "drop" else {}
        kv = ps.start(comm, num_servers=num_servers, staleness=staleness,
                      optimizer=ps.SGD(lr=config.lr), chunk_bytes=chunk_bytes, **options)
        if kv is None:
            return None
        return _work(ps, kv, peers, dataset, config, num_servers, num_workers,
                     comm.rank - num_servers, chunk_bytes, on_step, return_params,
                     on_worker_failure == "drop", before_step)
    finally:
        if peers is not None:
            peers.close()


def server_shares(ps, params, num_servers: int, chunk_bytes: int) -> List[int]:
    """Bytes of the model each server holds — what one worker's push sends to it (and its pull
    receives from it) per step. From the parameter server's own sharding plan (``ps.Plan``)
    where it has one, else an even split."""
    total = sum(int(np.asarray(p).nbytes) for p in params.values())
    plan_cls = getattr(ps, "Plan", None)
    sharding = getattr(ps, "sharding", None)
    if plan_cls is not None and hasattr(sharding, "key_table"):
        return list(plan_cls(sharding.key_table(params), num_servers, chunk_bytes)
                    .bytes_per_server())
    return [total // num_servers + (1 if s < total % num_servers else 0)
            for s in range(num_servers)]


def _workers_done(peers, tolerant: bool) -> int:
    """A barrier among the workers; returns the lowest live worker. ``tolerant``: an
    agreement, which also completes when workers have died (they are left out)."""
    if not tolerant:
        peers.barrier()
        return 0
    peers.agree(True)
    failed = set(peers.failed_ranks(agreed=True))
    return min(r for r in range(peers.size) if r not in failed)


def _work(ps, kv, peers, dataset, config, num_servers, num_workers, worker, chunk_bytes,
          on_step, return_params, tolerant=False, before_step=None) -> RankLog:
    model = config.model(dataset)
    names = model.param_names()
    try:
        kv.init(model.init_params())         # the same seed everywhere; the lowest worker wins
        params = kv.pull(names)
        loader = config.loader(dataset, worker, num_workers)
        model_bytes = sum(p.nbytes for p in params.values())
        log = RankLog(rank=worker, bytes_sent_per_step=model_bytes,
                      bytes_received_per_step=model_bytes,
                      info={"model_bytes": model_bytes,
                            "server_bytes": server_shares(ps, params, num_servers, chunk_bytes)})
        peers.barrier()                      # everyone starts the clock together
        start = time.perf_counter()
        for step in range(config.steps):
            if before_step is not None:
                before_step(step)
            x, y = loader.batch(step)
            loss, grads = model.loss_and_grads(params, x, y)
            if step + 1 < config.steps:
                params = kv.pushpull(grads)
            else:
                kv.push(grads)               # returns once applied; the final pull is below
            log.losses.append(loss)
            log.step_times.append(time.perf_counter() - start)
            if on_step is not None:
                on_step(step, loss)
        reporter = _workers_done(peers, tolerant)      # every worker's last push is applied
        log.wall_s = time.perf_counter() - start
        if return_params or (return_params is None and worker == reporter):
            log.params = kv.pull(names)
        _workers_done(peers, tolerant)       # nobody closes while the reporter still pulls
    finally:
        kv.close()
    return log
