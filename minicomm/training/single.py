"""What every trainer shares: the run configuration, the per-rank log a run returns, evaluation,
and the single-process reference trainer that the distributed ones must reproduce.

``train_single(dataset, config)`` is plain large-batch SGD: step t takes global batch t of
``ShardedLoader(..., config.global_batch)`` and applies ``p -= lr * grad``. Data-parallel
allreduce and PS-sync training with W workers of ``global_batch / W`` samples each compute the
same mean gradient, so they follow the same trajectory up to floating-point summation order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .data import Dataset, ShardedLoader
from .mlp import MLP, Params, sgd_step

StepCallback = Callable[[int, float], None]     # (0-based step, this rank's batch loss)


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters shared by every mode (the demo's defaults: test accuracy on digits
    above 0.9 in a fraction of a second of compute)."""
    hidden: Tuple[int, ...] = (64,)
    steps: int = 400
    global_batch: int = 64
    lr: float = 0.2
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def model(self, dataset: Dataset) -> MLP:
        return MLP((dataset.num_features, *self.hidden, dataset.num_classes), seed=self.seed)

    def loader(self, dataset: Dataset, rank: int = 0, world: int = 1) -> ShardedLoader:
        return ShardedLoader(dataset.x_train, dataset.y_train, self.global_batch, rank, world,
                             seed=self.seed)


@dataclass
class RankLog:
    """What one training rank reports back (picklable; params only where asked for)."""
    rank: int
    losses: List[float] = field(default_factory=list)       # this rank's batch loss per step
    step_times: List[float] = field(default_factory=list)   # seconds since start, after each step
    wall_s: float = 0.0
    params: Optional[Params] = None
    bytes_sent_per_step: float = 0.0         # payload this rank sends per step
    bytes_received_per_step: float = 0.0     # payload this rank receives per step
    info: Dict[str, object] = field(default_factory=dict)


def evaluate(model: MLP, params: Params, dataset: Dataset) -> Tuple[float, float]:
    """(mean cross-entropy over the whole training split, test accuracy)."""
    return (model.loss(params, dataset.x_train, dataset.y_train),
            model.accuracy(params, dataset.x_test, dataset.y_test))


def train_single(dataset: Dataset, config: TrainConfig,
                 on_step: Optional[StepCallback] = None) -> RankLog:
    model = config.model(dataset)
    params = model.init_params()
    loader = config.loader(dataset)
    log = RankLog(rank=0)
    start = time.perf_counter()
    for step in range(config.steps):
        x, y = loader.batch(step)
        loss, grads = model.loss_and_grads(params, x, y)
        sgd_step(params, grads, config.lr)
        log.losses.append(loss)
        log.step_times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step(step, loss)
    log.wall_s = time.perf_counter() - start
    log.params = params
    return log
