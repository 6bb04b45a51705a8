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

Traffic per step per worker: it pushes every gradient and pulls every parameter, so it sends and
receives the model's size in bytes; the servers together receive and send W times that, and a
server holding a share m_s of the model carries W·m_s in each direction per step
(``server_shares``: from the server's sharding plan; small ``chunk_bytes`` spread a small model
evenly, the 4 MiB default leaves each of its arrays whole on one server).
"""
from __future__ import annotations

import importlib
import time
from typing import List, Optional

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
             ps_module=None) -> Optional[RankLog]:
    """Run on every rank of ``comm``: servers return None, workers their ``RankLog`` (the first
    worker's carries the final parameters, or every worker's with ``return_params=True``).
    ``ps_module`` replaces ``minicomm.ps`` (for tests of this trainer alone)."""
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
        kv = ps.start(comm, num_servers=num_servers, staleness=staleness,
                      optimizer=ps.SGD(lr=config.lr), chunk_bytes=chunk_bytes)
        if kv is None:
            return None
        return _work(ps, kv, peers, dataset, config, num_servers, num_workers,
                     comm.rank - num_servers, chunk_bytes, on_step, return_params)
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


def _work(ps, kv, peers, dataset, config, num_servers, num_workers, worker, chunk_bytes,
          on_step, return_params) -> RankLog:
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
        peers.barrier()                      # every worker's last push is applied
        log.wall_s = time.perf_counter() - start
        if return_params or (return_params is None and worker == 0):
            log.params = kv.pull(names)
        peers.barrier()                      # nobody closes while worker 0 still pulls
    finally:
        kv.close()
    return log
