"""The bodies of the process group's collectives: each takes the communicator and arguments the
group has already checked, and moves the tensors through minicomm. They run on the group's
``CollectiveRunner`` (its worker thread, or the caller's for an inline call), one at a time.

A reduction's ``ops`` are (minicomm op, PREMUL_SUM factor or None) pairs: a factor scales a copy
of the input before the sum.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import torch

from ..communicator import Communicator
from .tensors import FlatView, np_dtype, pack, put, stack, unpack

Op = Tuple[object, object]          # (minicomm op, PREMUL_SUM factor or None)
Layout = Tuple[List[int], int]      # (rows per rank, elements per row)


def grouped(comm: Communicator, calls: int):
    """Several calls: one ``comm.group()`` (allreduces fused by op and dtype); one: as is."""
    return comm.group() if calls > 1 else contextlib.nullcontext()


def allreduce(comm: Communicator, tensors: Sequence[torch.Tensor], ops: Sequence[Op]) -> None:
    """Each tensor reduced in place; several (a list, ``allreduce_coalesced``) in one group."""
    views = [FlatView(t) for t in tensors]
    with grouped(comm, len(views)):
        for b, (op, factor) in zip(views, ops):
            if factor is not None:
                b.array *= factor
            comm.allreduce(b.array, op=op, out=b.array)
    for b in views:
        b.store()


def all_gather_single_coalesced(comm: Communicator, outputs: Sequence[torch.Tensor],
                                inputs: Sequence[torch.Tensor]) -> None:
    """One ``all_gather_into_tensor`` per pair, in one group."""
    views = [(FlatView(o, load=False), FlatView(i)) for o, i in zip(outputs, inputs)]
    with grouped(comm, len(views)):
        for bo, bi in views:
            comm.allgather(bi.array, out=bo.array.reshape(comm.size, -1))
    for bo, _ in views:
        bo.store()


def reduce_scatter_single_coalesced(comm: Communicator, outputs: Sequence[torch.Tensor],
                                    inputs: Sequence[torch.Tensor], ops: Sequence[Op]) -> None:
    """One ``reduce_scatter_tensor`` per pair, in one group."""
    views = []
    for o, i, (op, factor) in zip(outputs, inputs, ops):
        bi = FlatView(i)
        views.append((FlatView(o, load=False), bi.array * factor if factor is not None
                      else bi.array, op))
    with grouped(comm, len(views)):
        for bo, src, op in views:
            comm.reduce_scatter(src.reshape(comm.size, -1), op=op, out=bo.array)
    for bo, _, _ in views:
        bo.store()


def broadcast(comm: Communicator, tensors: Sequence[torch.Tensor], root: int) -> None:
    me = comm.rank
    for t in tensors:
        b = FlatView(t, load=me == root)
        comm.broadcast(b.array, root=root, out=b.array)
        if me != root:
            b.store()


def reduce(comm: Communicator, tensors: Sequence[torch.Tensor], root: int,
           ops: Sequence[Op]) -> None:
    me = comm.rank
    for t, (op, factor) in zip(tensors, ops):
        b = FlatView(t)
        src = b.array * factor if factor is not None else b.array
        comm.reduce(src, root=root, op=op, out=b.array if me == root else None)
        if me == root:
            b.store()


def allgather(comm: Communicator, outputs: Sequence[Sequence[torch.Tensor]],
              inputs: Sequence[torch.Tensor]) -> None:
    """Tensors of one size per list as one allgather; of several sizes as one allgatherv (the
    outputs' sizes are every rank's counts)."""
    for o, i in zip(outputs, inputs):
        sizes = [t.numel() for t in o]
        if len(set(sizes)) == 1:
            rows = comm.allgather(FlatView(i).array)
            for t, row in zip(o, rows):
                put(t, row)
            continue
        flat = comm.allgatherv(FlatView(i).array, counts=sizes)
        unpack(flat, o)


def all_gather_single(comm: Communicator, output: torch.Tensor, input: torch.Tensor) -> None:
    bo = FlatView(output, load=False)
    bi = FlatView(input)
    comm.allgather(bi.array, out=bo.array.reshape(comm.size, -1))
    bo.store()


def reduce_scatter(comm: Communicator, outputs: Sequence[torch.Tensor],
                   inputs: Sequence[Sequence[torch.Tensor]], ops: Sequence[Op]) -> None:
    for o, i, (op, factor) in zip(outputs, inputs, ops):
        block = stack(i, np_dtype(o))
        if factor is not None:
            block *= factor
        bo = FlatView(o, load=False)
        comm.reduce_scatter(block, op=op, out=bo.array)
        bo.store()


def reduce_scatter_single(comm: Communicator, output: torch.Tensor, input: torch.Tensor,
                          reduction: Op) -> None:
    op, factor = reduction
    bi = FlatView(input)
    src = bi.array * factor if factor is not None else bi.array
    bo = FlatView(output, load=False)
    comm.reduce_scatter(src.reshape(comm.size, -1), op=op, out=bo.array)
    bo.store()


def all_to_all_single(comm: Communicator, output: torch.Tensor, input: torch.Tensor,
                      layouts: Optional[Tuple[Layout, Layout]]) -> None:
    """``layouts`` None: equal splits, one alltoall. Else the (output, input) layouts, each
    (rows per rank, elements per row): one alltoallv, the receive counts known (no exchange:
    a rank whose splits disagree with a peer's meets a block of another length, a
    MismatchError)."""
    size = comm.size
    bi = FlatView(input)
    bo = FlatView(output, load=False)
    if layouts is None:
        comm.alltoall(bi.array.reshape(size, -1), out=bo.array.reshape(size, -1))
    else:
        (out_splits, row), (in_splits, _) = layouts
        comm.alltoallv(bi.array, [s * row for s in in_splits],
                       recv_counts=[s * row for s in out_splits], out=bo.array)
    bo.store()


def alltoall(comm: Communicator, outputs: Sequence[torch.Tensor],
             inputs: Sequence[torch.Tensor]) -> None:
    """Tensors of one size as one alltoall; of several sizes as one alltoallv."""
    if len({t.numel() for t in list(outputs) + list(inputs)}) == 1:
        rows = comm.alltoall(stack(inputs, np_dtype(inputs[0])))
        for t, row in zip(outputs, rows):
            put(t, row)
        return
    flat = comm.alltoallv(pack(inputs, np_dtype(inputs[0])), [t.numel() for t in inputs],
                          recv_counts=[t.numel() for t in outputs])
    unpack(flat, outputs)


def gather(comm: Communicator, outputs: Sequence[torch.Tensor], input: torch.Tensor,
           root: int) -> None:
    rows = comm.gather(FlatView(input).array, root=root)
    if comm.rank == root:
        for t, row in zip(outputs, rows):
            put(t, row)


def scatter(comm: Communicator, output: torch.Tensor, inputs: Sequence[torch.Tensor],
            root: int) -> None:
    """One scatterv: the root's inputs may differ in size."""
    bo = FlatView(output, load=False)
    if comm.rank == root:
        counts = [t.numel() for t in inputs]
        comm.scatterv(pack(inputs, np_dtype(output)), counts, root=root, out=bo.array)
    else:
        comm.scatterv(None, None, root=root, out=bo.array)
    bo.store()


def barrier(comm: Communicator) -> None:
    comm.barrier()


def nothing(comm: Communicator) -> None:
    """The body of a work that only marks a place in the order (the end of coalescing)."""
