"""torch.distributed backend ``"minicomm"``: ``import minicomm.torch``, then
``dist.init_process_group("minicomm", ...)`` (torchrun, ``torch.multiprocessing`` spawn, ``env://``,
``tcp://``, ``file://`` or an explicit ``store=``). CPU tensors only; stock
``DistributedDataParallel`` trains over it unchanged.

Tensors: contiguous CPU tensors of a numpy dtype move as zero-copy numpy views; others are staged
(float16 / bfloat16 through float32). Other dtypes raise ``TypeError``; non-CPU or sparse tensors
``ValueError`` / ``TypeError``, from the call. Ops: ``ReduceOp`` SUM, PRODUCT, MIN, MAX, BAND,
BOR, BXOR, AVG and PREMUL_SUM (the factor, a number or a one-element tensor, scales a copy of the
input before a sum). Per collective the adapter adds one queue hand-off unless the call runs
inline, and one copy in and one out for a staged tensor (docs/decisions/torch-backend.md).

The package, by concern:

- ``store``: ``TorchStore``, minicomm's rendezvous store over torch's c10d store;
- ``backend``: the backend creator (the world bootstrapped through that store, sub-groups on
  the world's transports) and ``register``;
- ``group``: ``MinicommProcessGroup``, each call validate, bind, run;
- ``validate``: the argument checks and ``ReduceOp`` translation, on the caller's thread;
- ``collectives``: the bodies that move tensors through the communicator;
- ``runner``: ``CollectiveRunner``, the group's calls in issue order on one worker thread;
- ``works``: ``MinicommWork`` (with a future), ``P2PWork``, ``DoneWork``;
- ``tensors``: tensors as numpy buffers (dtypes, zero-copy views, staging).

Importing the package registers the backend (``register()``, idempotent).
"""
import torch.distributed as dist

if not dist.is_available():                          # pragma: no cover - torch built without it
    raise ImportError("minicomm.torch needs torch.distributed (this torch build has none)")

from .backend import register  # noqa: E402
from .group import BACKEND, MinicommProcessGroup  # noqa: E402
from .works import MinicommWork  # noqa: E402

__all__ = ["BACKEND", "MinicommProcessGroup", "MinicommWork", "register"]

register()
