"""Training a numpy MLP three ways on the same data and seed: one process, data-parallel over
allreduce (DDP-style buckets), and through the parameter server (``minicomm.ps``).

    from minicomm.training import TrainConfig, load_dataset, train_single, train_data_parallel
    ds = load_dataset()                          # digits (scikit-learn) or synthetic
    log = train_single(ds, TrainConfig())
    logs = mc.spawn(train_data_parallel, 2, args=(ds, TrainConfig(), "ring"))

Modules: ``mlp`` (the model, backward by hand), ``data`` (datasets, rank-sharded loader),
``single`` (config, per-rank log, reference trainer), ``data_parallel``, ``elastic``
(data-parallel training that survives dead workers: shrink, roll back, go on), ``ps_trainer``.
``minicomm.ps`` is imported only when a PS run starts.
"""
from .data import Dataset, ShardedLoader, load_dataset
from .data_parallel import DataParallel, GradBuckets, train_data_parallel
from .elastic import shard_bounds, train_elastic
from .mlp import MLP, sgd_step
from .ps_trainer import ps_available, train_ps
from .single import RankLog, TrainConfig, evaluate, train_single

__all__ = ["MLP", "sgd_step", "Dataset", "ShardedLoader", "load_dataset", "TrainConfig",
           "RankLog", "evaluate", "train_single", "DataParallel", "GradBuckets",
           "train_data_parallel", "train_elastic", "shard_bounds", "train_ps", "ps_available"]
