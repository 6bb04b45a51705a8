"""Argument checks of the process group's calls, done on the caller's thread before anything is
sent: a bad argument raises ``TypeError`` / ``ValueError`` from the call and never breaks the
group. Also the translation of torch's ``ReduceOp`` into minicomm's ops.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .. import ops as mc_ops
from .tensors import DIRECT, STAGED

RED = dist.ReduceOp
# PREMUL_SUM is a SUM of inputs scaled by its factor first
OPS = {RED.SUM: mc_ops.SUM, RED.PRODUCT: mc_ops.PROD, RED.MIN: mc_ops.MIN, RED.MAX: mc_ops.MAX,
       RED.BAND: mc_ops.BAND, RED.BOR: mc_ops.BOR, RED.BXOR: mc_ops.BXOR, RED.AVG: mc_ops.AVG,
       RED.PREMUL_SUM: mc_ops.SUM}


def check_tensor(t, what: str) -> torch.Tensor:
    """``t`` itself if minicomm can move it: a dense CPU tensor of a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what}: the minicomm backend moves CPU tensors, got one on {t.device}")
    if t.layout != torch.strided:
        raise TypeError(f"{what}: the minicomm backend moves dense (strided) tensors, got {t.layout}")
    if t.dtype not in DIRECT and t.dtype not in STAGED:
        raise TypeError(f"{what}: dtype {t.dtype} is not supported by the minicomm backend")
    return t


def check_list(ts, what: str, n: Optional[int] = None) -> List[torch.Tensor]:
    """``ts`` as a list of checked tensors, ``n`` of them when ``n`` is given."""
    ts = list(ts)
    if n is not None and len(ts) != n:
        raise ValueError(f"{what}: expected {n} tensors, got {len(ts)}")
    for t in ts:
        check_tensor(t, what)
    return ts


def one_or_list(ts) -> list:
    """A lone tensor as a list of one (allreduce, broadcast and reduce take either)."""
    return [ts] if isinstance(ts, torch.Tensor) else ts


def check_same(ts: Sequence[torch.Tensor], ref: torch.Tensor, what: str) -> None:
    """Every tensor of ``ts`` has ``ref``'s element count and dtype."""
    for t in ts:
        if t.numel() != ref.numel() or t.dtype != ref.dtype:
            raise ValueError(f"{what}: every tensor must have {ref.numel()} elements of "
                             f"{ref.dtype} (the input's), got {t.numel()} of {t.dtype}")


def check_blocks(whole: torch.Tensor, block: torch.Tensor, size: int, what: str,
                 which: str) -> None:
    """``whole`` holds ``size`` blocks of ``block``'s element count and dtype, end to end."""
    if whole.numel() != size * block.numel() or whole.dtype != block.dtype:
        raise ValueError(f"{what}: {which} needs {size} x {block.numel()} elements of "
                         f"{block.dtype}, got {whole.numel()} of {whole.dtype}")


def check_root(root: int, size: int, what: str) -> int:
    """``root`` as an int, if it is a rank of a group of ``size``."""
    if not 0 <= int(root) < size:
        raise ValueError(f"{what}: root {root} is not a rank of this group (size {size})")
    return int(root)


def check_rooted_list(lists, me: int, root: int, size: int, ref: torch.Tensor, what: str,
                      side: str, uneven: bool = False) -> List[torch.Tensor]:
    """gather's outputs / scatter's inputs: the root passes one list of ``size`` tensors shaped
    like ``ref`` (``uneven``: of its dtype, any sizes, the root's own of ``ref``'s size), the
    other ranks pass none. Returns the root's list ([] elsewhere)."""
    if me != root:
        if any(len(x) for x in lists):
            raise ValueError(f"{what}: only the root passes {side} tensors")
        return []
    if len(lists) != 1:
        raise ValueError(f"{what}: the root passes one list of {side} tensors")
    ts = check_list(lists[0], what, size)
    if uneven:
        check_sizes(ts, me, ref, what)
    else:
        check_same(ts, ref, what)
    return ts


def check_sizes(ts: Sequence[torch.Tensor], me: int, ref: torch.Tensor, what: str) -> None:
    """Uneven blocks: every tensor of ``ts`` has ``ref``'s dtype, and this rank's its size."""
    for t in ts:
        if t.dtype != ref.dtype:
            raise ValueError(f"{what}: every tensor must be {ref.dtype} (the input's), got "
                             f"{t.dtype}")
    if ts[me].numel() != ref.numel():
        raise ValueError(f"{what}: this rank's tensor has {ts[me].numel()} elements, its "
                         f"input {ref.numel()}")


def check_splits(t: torch.Tensor, splits, size: int, which: str) -> Tuple[List[int], int]:
    """all_to_all_single's split sizes for ``t`` (``which``: "input" or "output"): ``size`` row
    counts of dimension 0 (empty: equal splits), and the element count of one row."""
    rows = t.shape[0] if t.dim() > 0 else 1
    row = t.numel() // rows if rows else 0
    splits = [int(s) for s in splits] if splits else None
    if splits is None:
        if rows % size:
            raise ValueError(f"all_to_all_single: {which} has {rows} rows, not divisible by "
                             f"the group size {size} (pass {which}_split_sizes)")
        splits = [rows // size] * size
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"all_to_all_single: {which}_split_sizes {splits} must be {size} "
                         f"non-negative row counts summing to {rows}")
    return splits, row


def check_tag(tag: int, what: str) -> int:
    """A send/recv tag minicomm can carry."""
    if not 0 <= int(tag) < 2 ** 31:
        raise ValueError(f"{what}: tag {tag} must be in 0..2**31-1 for the minicomm backend")
    return int(tag)


def reduce_op(opts, dtype: np.dtype, what: str) -> Tuple[object, Optional[object]]:
    """``opts.reduceOp`` for ``dtype`` as (minicomm op, PREMUL_SUM factor or None)."""
    red = opts.reduceOp
    kind = getattr(red, "op", red)
    if kind not in OPS:
        raise ValueError(f"{what}: reduce op {red} is not supported by the minicomm backend")
    op = OPS[kind]
    factor = None
    if kind == RED.PREMUL_SUM:
        factor = red.factor
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise ValueError(f"{what}: a PREMUL_SUM factor must have one element")
            factor = factor.item()
        if dtype.kind not in "fc":
            raise TypeError(f"{what}: PREMUL_SUM needs a floating or complex dtype, got {dtype}")
    mc_ops.check_dtype(op, dtype)
    return op, factor
