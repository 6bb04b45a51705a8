"""Elastic data-parallel training: the survivors of a worker's death shrink, roll back to the last
committed step and train on to the configured number of steps.

    log = train_elastic(comm, dataset, TrainConfig(), algorithm="ring", commit_every=10)

The step is ``DataParallel``'s (DDP-style gradient buckets averaged by async allreduce); around
it, the fault-tolerance loop of docs/guide/failures.md ("Surviving failures"):

- **Commits.** Every ``commit_every`` steps (default 10) and after the last step, the ranks
  ``comm.agree`` that the steps since the last commit completed on every rank; then each keeps
  an in-memory copy of the commit: the parameters, the optimizer state and the step. The
  optimizer is plain SGD (``sgd_step``), which has no state of its own, and the data loader's
  position is a function of the step, so (params, step) is the whole state. A commit costs one
  agreement (a few small messages, about as long as the small model's allreduce on one box)
  and one copy of the parameters; the default 10 keeps that cost a small fraction of training,
  and a failure rolls back at most ``commit_every`` completed steps.
- **Failure.** A step that raises ``CommError`` (``PeerFailure``, ``CommTimeout``, ``Revoked``)
  makes its rank vote False in the agreement at once; since a failed collective breaks the
  communicator on every member, the others fail their next call and vote False too. On False
  every survivor calls ``comm.shrink()`` (the communicator of the survivors, ranks renumbered
  in the old order), restores the last commit, rebuilds the gradient buckets on the new
  communicator and trains on from the committed step. A rank that dies during the recovery is
  found by the next step, and the survivors shrink again.
- **Batch policy: the global batch is kept.** Every step takes the same ``global_batch``
  samples as before the failure, re-sharded over the survivors (``shard_bounds``: sizes differ
  by at most one sample); each rank weights its mean gradient by its share of the batch and the
  ranks sum them, which is exactly the global batch's mean gradient. The learning rate is not
  touched. Why this rather than keeping the per-worker batch and scaling the learning rate by
  new/old size (the linear scaling rule): the optimisation problem stays the one the run was
  tuned for — the same batches, the same steps, the same trajectory as a run without a failure
  (up to floating-point summation order) — so the final accuracy does not depend on when or
  whether a worker died. The price is time: each survivor computes ``old/new`` times the samples
  per step.

``RankLog.info["recoveries"]`` lists, per recovery on this rank: ``failed_at`` (the step this
rank was at when it learned of the failure), ``resumed_at`` (the committed step training went on
from), ``steps_lost`` (this rank's completed steps rolled back: ``failed_at - resumed_at``),
``recover_s`` (seconds from the failure's detection to training again, shrink and restore
included) and ``world`` (sizes before and after). ``losses`` and ``step_times`` hold one entry
per step of the final trajectory (a redone step's entry is the redo's). After the run
``info["world_size"]`` is the final communicator's size and ``log.rank`` this rank's rank in it.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import CommError
from .data import Dataset
from .data_parallel import DEFAULT_BUCKET_CAP, DataParallel
from .mlp import Params
from .single import RankLog, StepCallback, TrainConfig


def shard_bounds(global_batch: int, rank: int, world: int) -> Tuple[int, int]:
    """The slice of a global batch that ``rank`` of ``world`` ranks takes.

    The first ``global_batch % world`` ranks take one sample more; with a multiple of the world
    size every rank takes ``global_batch / world`` consecutive samples, as ``ShardedLoader``.

    Args:
        global_batch (int): Samples in the global batch (>= world).
        rank (int): This rank, 0 <= rank < world.
        world (int): Ranks sharing the batch (>= 1).

    Returns:
        (tuple[int, int]): ``(start, stop)`` of this rank's samples.

    Raises:
        ValueError: world < 1, rank outside the world, or fewer samples than ranks.

    Examples:
        >>> [shard_bounds(64, r, 3) for r in range(3)]
        [(0, 22), (22, 43), (43, 64)]
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if global_batch < world:
        raise ValueError(f"global_batch {global_batch} is smaller than the {world} workers: "
                         f"every worker needs at least one sample")
    base, extra = divmod(global_batch, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class _Commit:
    """The in-memory copy of the last committed step: parameters and step (SGD has no state)."""

    def __init__(self, step: int, params: Params):
        self.step = step
        self.params = {name: p.copy() for name, p in params.items()}

    def restore(self) -> Params:
        return {name: p.copy() for name, p in self.params.items()}


def train_elastic(comm, dataset: Dataset, config: TrainConfig, algorithm: str = "auto",
                  commit_every: int = 10, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP,
                  on_step: Optional[StepCallback] = None,
                  return_params: Optional[bool] = None,
                  before_step: Optional[Callable[[int], None]] = None) -> RankLog:
    """Data-parallel training that survives the death of workers (module docstring).

    Every rank of ``comm`` calls it. When a worker dies, the survivors shrink the communicator,
    roll back to the last committed step and go on to ``config.steps``, keeping the global
    batch (re-sharded over the survivors) and the learning rate.

    Args:
        comm (Communicator): The training ranks (a launcher's world or any communicator).
        dataset (Dataset): The data (the same on every rank).
        config (TrainConfig): Steps, global batch, learning rate, model and seed.
        algorithm (str): The allreduce family: ring, tree, rhd, hier or auto.
        commit_every (int): Agree on and keep a commit every this many steps (>= 1).
        bucket_cap_bytes (int): Largest gradient bucket (``DataParallel``).
        on_step (Callable | None): ``on_step(step, loss)`` after every completed step (a step
            redone after a rollback is reported again).
        return_params (bool | None): True: every survivor's log carries the final parameters;
            None: only the final communicator's rank 0.
        before_step (Callable | None): ``before_step(step)`` before every step attempt (a
            failure drill can end the process there).

    Returns:
        (RankLog): This rank's log; ``info["recoveries"]`` lists its recoveries.

    Raises:
        ValueError: A bad algorithm or commit_every, or a global batch smaller than the world.
        CommError: An agreement or shrink failed (a live rank stopped taking part).

    Examples:
        >>> logs = mc.spawn(train_elastic, 2, transport="shm",
        ...                 args=(load_dataset("synthetic"), TrainConfig(steps=20)))
        >>> [len(log.losses) for log in logs], logs[0].info["recoveries"]
        ([20, 20], [])
    """
    if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
        raise ValueError(f"commit_every must be an int >= 1, got {commit_every!r}")
    shard_bounds(config.global_batch, comm.rank, comm.size)          # validates the batch
    model = config.model(dataset)
    params = model.init_params()
    dp = DataParallel(comm, model, algorithm, bucket_cap_bytes)
    dp.broadcast_params(params)
    loader = config.loader(dataset)              # the whole global batch; sliced per rank below
    recoveries: List[Dict[str, object]] = []
    log = RankLog(rank=comm.rank, bytes_sent_per_step=dp.bytes_sent_per_step,
                  bytes_received_per_step=dp.bytes_received_per_step,
                  info={"bucket_algorithms": list(dp.bucket_algorithms),
                        "message_rounds_per_step": dp.message_rounds_per_step,
                        "commit_every": commit_every, "recoveries": recoveries})
    commit = _Commit(0, params)
    comm.barrier()                               # everyone starts the clock together
    start = time.perf_counter()
    step = 0
    while step < config.steps:
        loss = _attempt(comm, dp, params, loader, config, step, before_step)
        detected = time.perf_counter()
        if loss is not None:
            log.losses.append(loss)
            log.step_times.append(detected - start)
            if on_step is not None:
                on_step(step, loss)
            step += 1
            if step % commit_every and step < config.steps:
                continue                         # not a commit point
        if comm.agree(loss is not None):
            commit = _Commit(step, params)
            continue
        # ``step``: the step that failed here, or (this rank's steps all completed) the count
        old_size = comm.size
        comm = comm.shrink()
        dp = DataParallel(comm, model, algorithm, bucket_cap_bytes)
        params = commit.restore()
        del log.losses[commit.step:], log.step_times[commit.step:]
        recoveries.append({"failed_at": step, "resumed_at": commit.step,
                           "steps_lost": step - commit.step,
                           "recover_s": time.perf_counter() - detected,
                           "world": [old_size, comm.size]})
        step = commit.step
    log.wall_s = time.perf_counter() - start
    log.rank = comm.rank
    log.info["world_size"] = comm.size
    if return_params or (return_params is None and comm.rank == 0):
        log.params = params
    return log


def _attempt(comm, dp: DataParallel, params: Params, loader, config: TrainConfig, step: int,
             before_step) -> Optional[float]:
    """One step on this rank's shard of the global batch: its loss, or None when a
    communication error ended it (the parameters are then untouched: SGD runs after every
    bucket arrived)."""
    try:
        if before_step is not None:
            before_step(step)
        x, y = loader.batch(step)
        lo, hi = shard_bounds(config.global_batch, comm.rank, comm.size)
        loss = dp.step(params, x[lo:hi], y[lo:hi], config.lr,
                       weight=(hi - lo) / config.global_batch)
    except CommError:
        return None
    return loss
