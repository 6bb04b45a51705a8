"""Tensors as numpy buffers: which dtypes minicomm moves, zero-copy views of contiguous tensors,
and staging (a contiguous copy, float32 for the half types) for everything else.

Contiguous CPU tensors of a numpy dtype are passed as zero-copy numpy views, so results land in
the caller's tensors in place. Non-contiguous tensors (and conjugate / negative views) are staged
through a contiguous copy, float16 and bfloat16 through float32 (reduced in float32, rounded once
when written back).
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch

# torch dtype -> the numpy dtype a zero-copy view has
DIRECT = {torch.float32: np.float32, torch.float64: np.float64, torch.int8: np.int8,
          torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
          torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64,
          torch.complex128: np.complex128}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        DIRECT[getattr(torch, _name)] = _np
# torch dtype numpy has no type for -> the dtype it is staged through
STAGED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def np_dtype(t: torch.Tensor) -> np.dtype:
    """The numpy dtype minicomm moves ``t`` as (float32 for the half types)."""
    return np.dtype(DIRECT[STAGED.get(t.dtype, t.dtype)])


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with its conjugate and negative bits applied (a copy only where one is
    set). A converting ``copy_`` from a float16 tensor with the negative bit set (what
    torch.distributed makes of a complex32 negative view, through view_as_real) drops the sign
    in torch 2.13, so staging resolves the bits before it converts."""
    return t.detach().resolve_conj().resolve_neg()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, converting first where ``dst`` has the negative or conjugate bit set:
    a converting copy into a float16 negative view stores the values unnegated (torch 2.13)."""
    if src.dtype != dst.dtype and (dst.is_neg() or dst.is_conj()):
        src = src.to(dst.dtype)
    with torch.no_grad():
        dst.copy_(src)


def is_zero_copy(t: torch.Tensor) -> bool:
    """Whether ``t``'s own memory can be handed to minicomm as a numpy view."""
    return t.dtype in DIRECT and t.is_contiguous() and not t.is_conj() and not t.is_neg()


class FlatView:
    """A flat numpy view of a tensor: the tensor's own memory when it can be (contiguous, numpy
    dtype), else a contiguous staging tensor (float32 for the half types) that ``store()`` copies
    back. ``load=False``: an output whose old contents do not matter (nothing is copied in)."""
    __slots__ = ("tensor", "stage", "array")

    def __init__(self, t: torch.Tensor, load: bool = True):
        self.tensor = t
        if is_zero_copy(t):
            self.stage = None
            self.array = t.detach().numpy().reshape(-1)
        else:
            self.stage = torch.empty(t.shape, dtype=STAGED.get(t.dtype, t.dtype))
            if load:
                self.stage.copy_(resolved(t))
            self.array = self.stage.numpy().reshape(-1)

    def store(self) -> None:
        """Write a staged result back into the tensor (nothing to do for a zero-copy view)."""
        if self.stage is not None:
            copy_into(self.tensor, self.stage)


def put(t: torch.Tensor, row: np.ndarray) -> None:
    """Copy a flat numpy block into tensor ``t`` (any layout or dtype: torch converts)."""
    copy_into(t, torch.from_numpy(row).view(t.shape))


def stack(ts: Sequence[torch.Tensor], dtype: np.dtype) -> np.ndarray:
    """Tensors of one element count as the rows of a fresh (len, n) array."""
    n = ts[0].numel() if ts else 0
    out = np.empty((len(ts), n), dtype=dtype)
    for j, t in enumerate(ts):
        torch.from_numpy(out[j]).view(t.shape).copy_(resolved(t))
    return out


def pack(ts: Sequence[torch.Tensor], dtype: np.dtype) -> np.ndarray:
    """Tensors of one dtype, flattened and packed end to end into a fresh array."""
    flat = np.empty(sum(t.numel() for t in ts), dtype=dtype)
    pos = 0
    for t in ts:
        torch.from_numpy(flat[pos:pos + t.numel()]).view(t.shape).copy_(resolved(t))
        pos += t.numel()
    return flat


def unpack(flat: np.ndarray, ts: Sequence[torch.Tensor]) -> None:
    """The inverse of ``pack``: each tensor gets its piece of ``flat`` back."""
    pos = 0
    for t in ts:
        put(t, flat[pos:pos + t.numel()])
        pos += t.numel()


def pieces(flat: np.ndarray, splits: Sequence[int], row: int) -> List[np.ndarray]:
    """``flat`` cut into consecutive pieces of ``splits[j]`` rows of ``row`` elements each."""
    out, pos = [], 0
    for s in splits:
        out.append(flat[pos:pos + s * row])
        pos += s * row
    return out
