"""Training data: scikit-learn's bundled digits, or a deterministic synthetic stand-in; a loader
that shards every global batch by rank.

``load_dataset()`` returns scikit-learn's 8x8 handwritten digits (1,797 images, 64 features,
10 classes; the data ships inside the scikit-learn wheel, nothing is downloaded) when
scikit-learn is importable — the ``demo`` extra installs it. Otherwise, or with
``name="synthetic"``, it builds a synthetic set of the same shape: 10 Gaussian clusters in 64
dimensions whose centres and samples come from ``numpy.random.default_rng(seed)``, so every
process that calls it with the same seed gets the same arrays. ``Dataset.name`` says which one
was used ("digits" or "synthetic").

Features are scaled to [0, 1]-ish float64; the train/test split is a fixed permutation from the
seed (25 % test by default).

``ShardedLoader(x, y, global_batch, rank, world)`` yields, for step t, rank ``rank``'s slice of
global batch t: the global batch is ``global_batch`` consecutive samples of an epoch-wise
permutation (a new permutation per epoch, drawn from the seed), and rank r takes its
``r * B/W .. (r+1) * B/W`` part. So W workers with B/W samples each see exactly the samples,
in the same order, that one process with batch B sees — the concatenation of the shards is the
single-process batch. An incomplete last batch of an epoch is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

DATASETS = ("auto", "digits", "synthetic")


@dataclass(frozen=True)
class Dataset:
    name: str                 # "digits" or "synthetic"
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])


def digits_available() -> bool:
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        return False
    return True


def _digits() -> Tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    d = load_digits()
    return d.data.astype(np.float64) / 16.0, d.target.astype(np.int64)   # pixels are 0..16


def synthetic(seed: int = 0, n: int = 1797, features: int = 64, classes: int = 10
              ) -> Tuple[np.ndarray, np.ndarray]:
    """``classes`` Gaussian clusters in ``features`` dimensions, clipped to [0, 1]: separable
    enough to learn, noisy enough that accuracy is below 100 %."""
    rng = np.random.default_rng([seed, 0x5E7])
    centres = rng.uniform(0.0, 1.0, size=(classes, features))
    y = rng.integers(0, classes, size=n).astype(np.int64)
    x = centres[y] + rng.normal(0.0, 0.6, size=(n, features))
    return np.clip(x, 0.0, 1.0), y


def load_dataset(name: str = "auto", seed: int = 0, test_fraction: float = 0.25) -> Dataset:
    """The demo's data; ``name`` "auto" = digits if scikit-learn is importable, else synthetic."""
    if name not in DATASETS:
        raise ValueError(f"dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if name == "digits" and not digits_available():
        raise ValueError("dataset 'digits' needs scikit-learn (pip install 'minicomm[demo]')")
    if name == "auto":
        name = "digits" if digits_available() else "synthetic"
    x, y = _digits() if name == "digits" else synthetic(seed)
    order = np.random.default_rng([seed, 0x5B1]).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, np.ascontiguousarray(x[train]), y[train].copy(),
                   np.ascontiguousarray(x[test]), y[test].copy(), int(y.max()) + 1)


class ShardedLoader:
    """Rank ``rank``'s part of every global batch (see the module docstring)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, global_batch: int, rank: int = 0,
                 world: int = 1, seed: int = 0):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples, y has {len(y)}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        if global_batch < world or global_batch % world:
            raise ValueError(f"global batch {global_batch} must be a positive multiple of the "
                             f"number of workers ({world}) so every shard is the same size")
        if global_batch > len(x):
            raise ValueError(f"global batch {global_batch} exceeds the {len(x)} samples")
        self.x, self.y = x, y
        self.global_batch, self.rank, self.world, self.seed = global_batch, rank, world, seed
        self.local_batch = global_batch // world
        self.steps_per_epoch = len(x) // global_batch
        self._epoch: Optional[int] = None
        self._order: Optional[np.ndarray] = None

    def indices(self, step: int) -> np.ndarray:
        """Sample indices of this rank's shard of global batch ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, 0xDA7A, epoch]).permutation(len(self.x))
            self._epoch = epoch
        start = within * self.global_batch + self.rank * self.local_batch
        return self._order[start:start + self.local_batch]

    def batch(self, step: int) -> Tuple[np.ndarray, np.ndarray]:
        idx = self.indices(step)
        return self.x[idx], self.y[idx]
