"""Server-side optimizers: ``SGD(lr, momentum=0)`` and ``Adam(lr, betas=(0.9, 0.999), eps=1e-8)``.

A server holds one optimizer and, per piece of a key it owns, that piece's optimizer state (the
momentum buffer; Adam's two moments and step count). ``step(param, grad, state, scale)`` applies
the gradient ``scale * grad`` to ``param`` in place, with the PyTorch update rules:

    SGD:  v = momentum * v + g;  p -= lr * v            (momentum 0: p -= lr * g, no buffer)
    Adam: t += 1;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
          p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

``grad`` is the server's own receive buffer and is overwritten (it doubles as scratch: no
temporary the size of the model is allocated per step). Adam needs one extra scratch array per
dtype, reused across pieces. Cost per element per step: SGD 2 passes (3 with momentum), Adam ~9.

Restrictions: floating-point params; the state's dtype is the param's. ``config()`` and
``from_config()`` round-trip the hyperparameters through a checkpoint (plain JSON, no pickle).
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import numpy as np


def _positive(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {x!r}")
    return float(x)


def _unit(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < 1:
        raise ValueError(f"{name} must be in [0, 1), got {x!r}")
    return float(x)


class Optimizer:
    """Base class of the server-side optimizers.

    A subclass defines ``new_state(count, dtype)``, ``step(param, grad, state, scale)`` and
    ``config()`` (a checkpoint records it).

    Examples:
        >>> ps.SGD(lr=0.1) == ps.SGD(0.1)
        True
    """
    name = "optimizer"

    def new_state(self, count: int, dtype: np.dtype) -> Dict[str, np.ndarray]:
        """The optimizer state of one piece of a key (none by default).

        Args:
            count (int): The piece's number of elements.
            dtype (np.dtype): The piece's dtype.

        Returns:
            (dict): ``{name: array}`` of the state (empty: stateless).
        """
        return {}

    def step(self, param: np.ndarray, grad: np.ndarray, state: Dict[str, np.ndarray],
             scale: float = 1.0) -> None:
        """Apply the gradient ``scale * grad`` to ``param`` in place.

        Args:
            param (np.ndarray): The parameters, updated in place.
            grad (np.ndarray): The gradient; overwritten (it doubles as scratch).
            state (dict): This piece's state from ``new_state``, updated in place.
            scale (float): A factor on the gradient (1 / workers for a synchronous average).

        Returns:
            (None): Once ``param`` holds the new values.

        Raises:
            NotImplementedError: In the base class.
        """
        raise NotImplementedError

    def config(self) -> dict:
        """The hyperparameters, as plain JSON (a checkpoint records them).

        Returns:
            (dict): ``{"name": ..., hyperparameter: value}``.

        Raises:
            NotImplementedError: In the base class.
        """
        raise NotImplementedError

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.config() == other.config()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"ps.{type(self).__name__}({args})"


class SGD(Optimizer):
    """Stochastic gradient descent with optional (heavy-ball, PyTorch-style) momentum.

    ``v = momentum * v + g; p -= lr * v`` (momentum 0: ``p -= lr * g``, no buffer).

    Args:
        lr (float): The learning rate, positive.
        momentum (float): In [0, 1).

    Raises:
        ValueError: A learning rate that is not positive, or a momentum outside [0, 1).

    Examples:
        >>> opt = ps.SGD(lr=0.5)
        >>> p, g = np.ones(2), np.ones(2)
        >>> opt.step(p, g, opt.new_state(2, p.dtype))
        >>> p
        array([0.5, 0.5])
    """
    name = "sgd"

    def __init__(self, lr: float, momentum: float = 0.0):
        self.lr = _positive(lr, "SGD lr")
        self.momentum = _unit(momentum, "SGD momentum")

    def new_state(self, count, dtype):
        """The momentum buffer of one piece (none without momentum).

        Args:
            count (int): The piece's number of elements.
            dtype (np.dtype): The piece's dtype.

        Returns:
            (dict): ``{"velocity": zeros}`` with momentum, else empty.
        """
        return {"velocity": np.zeros(count, dtype)} if self.momentum else {}

    def step(self, param, grad, state, scale=1.0):
        """One SGD step on ``param`` in place (PyTorch's update rule).

        Args:
            param (np.ndarray): The parameters, updated in place.
            grad (np.ndarray): The gradient; overwritten.
            state (dict): The momentum buffer from ``new_state``.
            scale (float): A factor on the gradient.

        Returns:
            (None): Once ``param`` holds the new values.
        """
        if not self.momentum:
            grad *= param.dtype.type(self.lr * scale)
            param -= grad
            return
        v = state["velocity"]
        if scale != 1.0:
            grad *= param.dtype.type(scale)
        v *= param.dtype.type(self.momentum)
        v += grad
        np.multiply(v, param.dtype.type(self.lr), out=grad)
        param -= grad

    def config(self):
        """The hyperparameters, as plain JSON.

        Returns:
            (dict): ``{"name": "sgd", "lr": ..., "momentum": ...}``.

        Examples:
            >>> ps.SGD(lr=0.1).config()
            {'name': 'sgd', 'lr': 0.1, 'momentum': 0.0}
        """
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum}


class Adam(Optimizer):
    """Adam (Kingma & Ba), bias-corrected, as torch.optim.Adam without weight decay.

    Args:
        lr (float): The learning rate, positive.
        betas (tuple): The moments' decay rates (b1, b2), each in [0, 1).
        eps (float): Added to the denominator, positive.

    Raises:
        ValueError: A bad learning rate, betas or eps.

    Examples:
        >>> opt = ps.Adam(lr=0.1)
        >>> p, g = np.zeros(2), np.ones(2)
        >>> opt.step(p, g, opt.new_state(2, p.dtype))
        >>> p.round(6)                  # the first step moves each element by lr
        array([-0.1, -0.1])
    """
    name = "adam"

    def __init__(self, lr: float, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.lr = _positive(lr, "Adam lr")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Adam betas must be a pair, got {betas!r}")
        self.betas = (_unit(betas[0], "Adam beta1"), _unit(betas[1], "Adam beta2"))
        self.eps = _positive(eps, "Adam eps")
        self._scratch: Dict[np.dtype, np.ndarray] = {}

    def new_state(self, count, dtype):
        """Adam's two moments and step count of one piece.

        Args:
            count (int): The piece's number of elements.
            dtype (np.dtype): The piece's dtype.

        Returns:
            (dict): ``{"m": zeros, "v": zeros, "t": [0]}``.
        """
        return {"m": np.zeros(count, dtype), "v": np.zeros(count, dtype),
                "t": np.zeros(1, np.int64)}

    def _tmp(self, like: np.ndarray) -> np.ndarray:
        buf = self._scratch.get(like.dtype)
        if buf is None or buf.size < like.size:
            buf = self._scratch[like.dtype] = np.empty(like.size, like.dtype)
        return buf[:like.size]

    def step(self, param, grad, state, scale=1.0):
        """One Adam step on ``param`` in place (torch.optim.Adam's update rule).

        Args:
            param (np.ndarray): The parameters, updated in place.
            grad (np.ndarray): The gradient; overwritten.
            state (dict): This piece's moments and step count from ``new_state``.
            scale (float): A factor on the gradient.

        Returns:
            (None): Once ``param`` holds the new values.
        """
        b1, b2 = self.betas
        f = param.dtype.type
        m, v, t = state["m"], state["v"], state["t"]
        t[0] += 1
        step = int(t[0])
        if scale != 1.0:
            grad *= f(scale)
        tmp = self._tmp(param)
        np.multiply(grad, grad, out=tmp)
        tmp *= f(1 - b2)
        v *= f(b2)
        v += tmp
        grad *= f(1 - b1)
        m *= f(b1)
        m += grad
        np.sqrt(v, out=tmp)
        tmp *= f(1 / math.sqrt(1 - b2 ** step))
        tmp += f(self.eps)
        np.divide(m, tmp, out=tmp)
        tmp *= f(self.lr / (1 - b1 ** step))
        param -= tmp

    def config(self):
        """The hyperparameters, as plain JSON.

        Returns:
            (dict): ``{"name": "adam", "lr": ..., "betas": [...], "eps": ...}``.
        """
        return {"name": self.name, "lr": self.lr, "betas": list(self.betas), "eps": self.eps}


def from_config(cfg: dict) -> Optimizer:
    """Rebuild an optimizer from ``config()`` (a checkpoint's record of it)."""
    if not isinstance(cfg, dict):
        raise ValueError("optimizer config must be a dict")
    name = cfg.get("name")
    if name == "sgd":
        return SGD(cfg["lr"], cfg.get("momentum", 0.0))
    if name == "adam":
        return Adam(cfg["lr"], tuple(cfg.get("betas", (0.9, 0.999))), cfg.get("eps", 1e-8))
    raise ValueError(f"unknown optimizer {name!r}")
