"""Data-parallel training over allreduce, the way DDP does it: gradient buckets whose averaging
starts while backward is still running.

    log = train_data_parallel(comm, dataset, TrainConfig(), algorithm="ring")

Every rank holds the whole model (rank 0's initial parameters are broadcast) and takes its
``global_batch / size`` shard of each global batch. Gradients are assigned to buckets of at most
``bucket_cap_bytes`` in reverse layer order — the order backward produces them. As soon as the
last gradient of a bucket exists, the bucket is packed into one flat array and
``comm.allreduce(bucket, op="avg", algorithm=..., async_op=True)`` starts on the communicator's
worker thread, so the earlier layers' backward overlaps the later layers' communication. After
backward, the trainer waits for every bucket, unpacks the averages and applies the same SGD
step as the single-process trainer: the result is large-batch SGD on the global batch.

Traffic: per step a rank sends, for each bucket of n elements, the elements of the Send ops of
its allreduce schedule (``minicomm.algorithms.build_schedule``) — 2(p-1)/p · n for ring — times
the itemsize; that is what ``RankLog.bytes_sent_per_step`` reports.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..algorithms import FAMILIES, build_schedule
from ..schedule import Recv, Send
from .data import Dataset
from .mlp import MLP, Params, sgd_step
from .single import RankLog, StepCallback, TrainConfig

ALGORITHMS = FAMILIES + ("auto",)
DEFAULT_BUCKET_CAP = 16 << 10    # small, so the demo's 64-unit MLP gets more than one bucket


class GradBuckets:
    """The fixed assignment of named gradients to flat buckets, in backward order."""

    def __init__(self, model: MLP, cap_bytes: int = DEFAULT_BUCKET_CAP):
        if cap_bytes < 1:
            raise ValueError(f"bucket cap must be >= 1 byte, got {cap_bytes}")
        shapes = model.param_shapes()
        itemsize = model.dtype.itemsize
        backward_order = [n for k in range(model.num_layers, 0, -1) for n in (f"w{k}", f"b{k}")]
        self.buckets: List[List[str]] = []
        size = 0
        for name in backward_order:
            nbytes = int(np.prod(shapes[name])) * itemsize
            if self.buckets and size + nbytes <= cap_bytes:
                self.buckets[-1].append(name)
                size += nbytes
            else:
                self.buckets.append([name])
                size = nbytes
        self.shapes = shapes
        self.dtype = model.dtype
        self.bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b}
        self.counts = [sum(int(np.prod(shapes[n])) for n in b) for b in self.buckets]

    def pack(self, i: int, grads: Dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([grads[n].reshape(-1) for n in self.buckets[i]])

    def unpack(self, i: int, flat: np.ndarray, into: Dict[str, np.ndarray]) -> None:
        offset = 0
        for n in self.buckets[i]:
            count = int(np.prod(self.shapes[n]))
            into[n] = flat[offset:offset + count].reshape(self.shapes[n])
            offset += count


def resolved_algorithm(comm, algorithm: str, nbytes: int) -> str:
    """The family ``comm.allreduce(..., algorithm=algorithm)`` runs for ``nbytes``: the
    communicator's own choice (per-call name, else MINICOMM_ALGO, else its cost model)."""
    return comm._resolve_algorithm("allreduce", algorithm, nbytes)


def schedule_traffic(algorithm: str, rank: int, size: int, count: int,
                     topology: Optional[Sequence[int]] = None) -> Tuple[int, int, int]:
    """(elements sent, elements received, communicating steps) of ``rank`` in one allreduce of
    ``count`` elements, read off its schedule."""
    topo = tuple(topology) if algorithm == "hier" and topology is not None else None
    sched = build_schedule("allreduce", algorithm, rank, size, count, 0, topo)
    sent = sum(op.count for step in sched.steps for op in step if isinstance(op, Send))
    received = sum(op.count for step in sched.steps for op in step if isinstance(op, Recv))
    return sent, received, sched.comm_steps


class DataParallel:
    """One rank's side of DDP-style training: ``step(params, x, y, lr)`` -> this shard's loss."""

    def __init__(self, comm, model: MLP, algorithm: str = "auto",
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        self.comm, self.model, self.algorithm = comm, model, algorithm
        self.buckets = GradBuckets(model, bucket_cap_bytes)
        itemsize = model.dtype.itemsize
        self.bucket_algorithms = [resolved_algorithm(comm, algorithm, n * itemsize)
                                  for n in self.buckets.counts]
        sent = received = rounds = 0
        for algo, n in zip(self.bucket_algorithms, self.buckets.counts):
            s, r, k = schedule_traffic(algo, comm.rank, comm.size, n, comm.topology)
            sent, received, rounds = sent + s, received + r, rounds + k
        self.bytes_sent_per_step = sent * itemsize
        self.bytes_received_per_step = received * itemsize
        self.message_rounds_per_step = rounds     # communicating schedule steps, all buckets

    def broadcast_params(self, params: Params) -> None:
        """Make every rank start from rank 0's parameters (as DDP does at construction)."""
        for name, p in params.items():
            self.comm.broadcast(p, root=0, out=p)

    def step(self, params: Params, x: np.ndarray, y: np.ndarray, lr: float,
             weight: Optional[float] = None) -> float:
        """One SGD step on this rank's shard ``x, y``; returns the shard's loss.

        ``weight=None``: the ranks' gradients are averaged (equal shards). ``weight=w``: this
        rank's mean gradient is scaled by w and the ranks' are summed (unequal shards: w = the
        shard's share of the global batch, so the sum is the global batch's mean gradient).
        """
        buckets = self.buckets
        op = "avg" if weight is None else "sum"
        ready: Dict[str, np.ndarray] = {}
        works = []            # (bucket index, Work) in launch order

        def on_layer(layer_grads: Dict[str, np.ndarray]) -> None:
            ready.update(layer_grads)
            # Buckets complete in order (reverse layers); launch each as soon as it is whole.
            while len(works) < len(buckets.buckets) and \
                    all(n in ready for n in buckets.buckets[len(works)]):
                i = len(works)
                flat = buckets.pack(i, ready)
                if weight is not None:
                    flat *= weight
                works.append((i, self.comm.allreduce(flat, op=op, out=flat,
                                                     algorithm=self.algorithm, async_op=True)))

        loss, grads = self.model.loss_and_grads(params, x, y, on_layer=on_layer)
        averaged: Dict[str, np.ndarray] = {}
        for i, work in works:
            buckets.unpack(i, work.wait(timeout=self.comm.timeout), averaged)
        sgd_step(params, averaged, lr)
        return loss


def train_data_parallel(comm, dataset: Dataset, config: TrainConfig, algorithm: str = "auto",
                        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP,
                        on_step: Optional[StepCallback] = None,
                        return_params: Optional[bool] = None) -> RankLog:
    """Train on every rank of ``comm``; returns this rank's log (with the final parameters on
    rank 0, or everywhere with ``return_params=True``)."""
    model = config.model(dataset)
    params = model.init_params()
    dp = DataParallel(comm, model, algorithm, bucket_cap_bytes)
    dp.broadcast_params(params)
    loader = config.loader(dataset, comm.rank, comm.size)
    log = RankLog(rank=comm.rank, bytes_sent_per_step=dp.bytes_sent_per_step,
                  bytes_received_per_step=dp.bytes_received_per_step,
                  info={"bucket_algorithms": list(dp.bucket_algorithms),
                        "bucket_elements": list(dp.buckets.counts),
                        "message_rounds_per_step": dp.message_rounds_per_step})
    comm.barrier()                      # everyone starts the clock together
    start = time.perf_counter()
    for step in range(config.steps):
        x, y = loader.batch(step)
        loss = dp.step(params, x, y, config.lr)
        log.losses.append(loss)
        log.step_times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step(step, loss)
    log.wall_s = time.perf_counter() - start
    if return_params or (return_params is None and comm.rank == 0):
        log.params = params
    return log
