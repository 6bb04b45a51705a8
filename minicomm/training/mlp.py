"""A numpy multi-layer perceptron: dense layers, ReLU, softmax cross-entropy, backward by hand.

    model = MLP((64, 64, 10), seed=0)          # layer sizes: inputs, hidden..., classes
    params = model.init_params()               # {"w1", "b1", "w2", "b2", ...} float64 by default
    loss, grads = model.loss_and_grads(params, x, y)
    sgd_step(params, grads, lr=0.1)            # p -= lr * g, in place

Parameters are an ordered dict of named arrays, ``w{k}`` of shape (fan_in, fan_out) and ``b{k}``
of shape (fan_out,); gradients use the same names and shapes. The loss is the *mean*
cross-entropy over the batch, so the mean of equal-sized shards' gradients is exactly the
gradient of their union — what data-parallel training relies on.

``loss_and_grads(..., on_layer=f)`` calls ``f({"w2": dw2, "b2": db2})`` as soon as backward has
produced the gradients of one layer, last layer first (the order DDP's bucket hooks see), so a
trainer can start communicating them while backward continues.

Initialisation is He-normal from ``numpy.random.default_rng(seed)``: the same seed gives the same
parameters on every process. Cost per step: O(batch x sum(fan_in x fan_out)) flops, two matmuls
per layer backward, one forward.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

Params = "OrderedDict[str, np.ndarray]"


class MLP:
    """Fully connected network; ``sizes`` = (inputs, hidden..., classes)."""

    def __init__(self, sizes: Sequence[int], seed: int = 0, dtype=np.float64):
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or any(s < 1 for s in sizes):
            raise ValueError(f"MLP sizes must be at least (inputs, classes), all >= 1; got {sizes}")
        self.sizes = sizes
        self.seed = int(seed)
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise TypeError(f"MLP dtype must be floating point, got {self.dtype}")
        self.num_layers = len(sizes) - 1

    def param_names(self) -> List[str]:
        """Names in forward order: w1, b1, w2, b2, ..."""
        return [n for k in range(1, self.num_layers + 1) for n in (f"w{k}", f"b{k}")]

    def param_shapes(self) -> "OrderedDict[str, Tuple[int, ...]]":
        shapes: "OrderedDict[str, Tuple[int, ...]]" = OrderedDict()
        for k in range(1, self.num_layers + 1):
            shapes[f"w{k}"] = (self.sizes[k - 1], self.sizes[k])
            shapes[f"b{k}"] = (self.sizes[k],)
        return shapes

    def num_params(self) -> int:
        return sum(int(np.prod(s)) for s in self.param_shapes().values())

    def init_params(self) -> Params:
        rng = np.random.default_rng(self.seed)
        params: Params = OrderedDict()
        for k in range(1, self.num_layers + 1):
            fan_in, fan_out = self.sizes[k - 1], self.sizes[k]
            params[f"w{k}"] = (rng.standard_normal((fan_in, fan_out)) *
                               np.sqrt(2.0 / fan_in)).astype(self.dtype)
            params[f"b{k}"] = np.zeros(fan_out, dtype=self.dtype)
        return params

    # ------------------------------------------------------------------ forward
    def _check_batch(self, x: np.ndarray, y: Optional[np.ndarray] = None) -> None:
        if x.ndim != 2 or x.shape[1] != self.sizes[0]:
            raise ValueError(f"inputs must have shape (batch, {self.sizes[0]}), got {x.shape}")
        if y is not None:
            if y.shape != (x.shape[0],):
                raise ValueError(f"labels must have shape ({x.shape[0]},), got {y.shape}")
            if x.shape[0] == 0:
                raise ValueError("empty batch")
            if y.dtype.kind not in "iu" or y.min() < 0 or y.max() >= self.sizes[-1]:
                raise ValueError(f"labels must be integers in [0, {self.sizes[-1]})")

    def logits(self, params: Params, x: np.ndarray) -> np.ndarray:
        self._check_batch(x)
        h = x
        for k in range(1, self.num_layers + 1):
            h = h @ params[f"w{k}"] + params[f"b{k}"]
            if k < self.num_layers:
                h = np.maximum(h, 0.0)
        return h

    def predict(self, params: Params, x: np.ndarray) -> np.ndarray:
        return np.argmax(self.logits(params, x), axis=1)

    def accuracy(self, params: Params, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(self.predict(params, x) == y))

    def loss(self, params: Params, x: np.ndarray, y: np.ndarray) -> float:
        """Mean softmax cross-entropy over the batch."""
        self._check_batch(x, y)
        return float(_cross_entropy(self.logits(params, x), y)[0])

    # ------------------------------------------------------------------ backward
    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray,
                       on_layer: Optional[Callable[[Dict[str, np.ndarray]], None]] = None
                       ) -> Tuple[float, Params]:
        """Mean cross-entropy and its gradient w.r.t. every parameter (same names, shapes).

        ``on_layer({w_name: dw, b_name: db})`` runs right after each layer's gradients exist,
        last layer first; the arrays it gets are the ones returned (do not modify them before
        backward has finished)."""
        self._check_batch(x, y)
        activations = [x]                 # input of layer k is activations[k-1]
        h = x
        for k in range(1, self.num_layers + 1):
            h = h @ params[f"w{k}"] + params[f"b{k}"]
            if k < self.num_layers:
                h = np.maximum(h, 0.0)
                activations.append(h)
        loss, dz = _cross_entropy(h, y, want_grad=True)
        grads: Params = OrderedDict()
        for k in range(self.num_layers, 0, -1):
            a_in = activations[k - 1]
            grads[f"w{k}"] = a_in.T @ dz
            grads[f"b{k}"] = dz.sum(axis=0)
            if on_layer is not None:          # before the rest of backward: overlap starts here
                on_layer({f"w{k}": grads[f"w{k}"], f"b{k}": grads[f"b{k}"]})
            if k > 1:
                # ReLU's derivative: 1 where the unit was active (activations hold max(z, 0))
                dz = (dz @ params[f"w{k}"].T) * (a_in > 0)
        ordered: Params = OrderedDict((n, grads[n]) for n in self.param_names())
        return loss, ordered


def _cross_entropy(logits: np.ndarray, y: np.ndarray, want_grad: bool = False):
    """(mean loss, d mean loss / d logits) with the max-subtraction that keeps exp finite."""
    z = logits - logits.max(axis=1, keepdims=True)
    logsumexp = np.log(np.exp(z).sum(axis=1))
    n = logits.shape[0]
    loss = float(np.mean(logsumexp - z[np.arange(n), y]))
    if not want_grad:
        return loss, None
    probs = np.exp(z - logsumexp[:, None])
    probs[np.arange(n), y] -= 1.0
    return loss, probs / n


def sgd_step(params: Params, grads: Dict[str, np.ndarray], lr: float) -> None:
    """Plain SGD, in place: p -= lr * g (the update every trainer here applies)."""
    for name, p in params.items():
        p -= lr * grads[name]


def copy_params(params: Dict[str, np.ndarray]) -> Params:
    return OrderedDict((k, np.array(v, copy=True)) for k, v in params.items())
