"""``MinicommProcessGroup``: a ``torch.distributed`` process group whose calls run on minicomm
communicators. Each public call reads like c10d's: validate the arguments (``validate``, on the
caller's thread), bind the body (``collectives``) to them, run it on the group's
``CollectiveRunner`` and return the work.

Execution. A group owns a ``Communicator`` for collectives and a second one for send/recv.
Collectives run in issue order on one worker thread per group; ``async_op=True`` returns at once
and the work's future completes on that thread (``then`` callbacks run there, and a collective
they issue runs at once, in the same place of the order on every rank). Send/recv are posted at
once on the caller's thread and move when waited on (like MPI; torch's gloo likewise gives p2p
works no future).

Errors. A minicomm ``CommError`` (``MismatchError``, ``CommTimeout``, ``PeerFailure``) raised by a
collective fails its work: ``wait()`` raises it; ``get_future()`` ends in error (torch reports a
``RuntimeError`` naming it), and so do chained futures, and the DDP reducer raises it from
``backward()``. The first such error breaks the group for good (minicomm's rule): later calls on
it raise ``CommError("communicator is broken: ...")``. Argument errors (wrong device, dtype,
sizes, a root outside the group) raise from the call itself.

Who reaches what. Python ``dist.*`` functions call the Python methods of the group object, so they
reach every method here. C++ callers (the DDP ``Reducer``, ``_broadcast_coalesced``, parameter
verification, c10d functional collectives) hold the group as a C++ ``ProcessGroup`` and reach
Python only through torch's trampoline (``PyProcessGroup``), which forwards exactly:
``allreduce``, ``allreduce_coalesced``, ``allgather``, ``all_gather_single_coalesced``,
``all_to_all_single``, ``barrier``, ``broadcast``, ``reduce_scatter``,
``reduce_scatter_single_coalesced``, ``send``, ``recv``, and ``getBackendName``, ``getRank``,
``getSize``, ``abort``, ``getGroupName``/``setGroupName``, ``getGroupDesc``/``setGroupDesc``
(plus ``wait`` and ``get_future`` on works). ``reduce``, ``gather``, ``scatter``, ``alltoall``,
``all_gather_single``, ``reduce_scatter_single``, ``allgather_coalesced``, ``recv_anysource`` and
``shutdown`` are Python-only: a C++ caller of those gets torch's "not supported" error.

The group name: torch sets it with ``_set_group_name`` after the creator returns, and a Python
group has no C++ backend to hold it, so ``group_name``, ``_set_group_name`` and the trampoline's
``getGroupName`` / ``setGroupName`` are all answered from Python.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..communicator import Communicator
from ..errors import CommError, CommTimeout
from ..p2p import ANY_SOURCE
from . import collectives
from .runner import CollectiveRunner
from .tensors import FlatView, np_dtype
from .validate import (
    check_blocks,
    check_list,
    check_root,
    check_rooted_list,
    check_same,
    check_sizes,
    check_splits,
    check_tag,
    check_tensor,
    one_or_list,
    reduce_op,
)
from .works import DoneWork, MinicommWork, P2PWork

BACKEND = "minicomm"


class MinicommProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on minicomm communicators.

    Created by ``dist.init_process_group("minicomm")`` / ``dist.new_group(backend="minicomm")``;
    see the module docstring for what reaches which method. CPU tensors only.

    Args:
        coll (Communicator): The communicator the collectives run on.
        p2p (Communicator): A second one, for send / recv.
        timeout (float): Seconds a call waits at most (the group's ``timeout``).
        owned (Sequence[Communicator]): The communicators ``shutdown`` closes, in order.

    Examples:
        >>> import torch, torch.distributed as dist, minicomm.torch  # doctest: +SKIP
        >>> dist.init_process_group("minicomm")  # doctest: +SKIP
        >>> t = torch.ones(4)  # doctest: +SKIP
        >>> dist.all_reduce(t)  # doctest: +SKIP
    """

    def __init__(self, coll: Communicator, p2p: Communicator, timeout: float,
                 owned: Sequence[Communicator]):
        super().__init__(coll.rank, coll.size)
        self._coll, self._p2p_comm = coll, p2p
        self._owned = list(owned)              # closed by shutdown(), in this order
        self._timeout = timeout
        self._runner = CollectiveRunner(f"r{coll.world_ranks[coll.rank]}-c{coll.comm_id}", timeout)
        self._p2p_lock = threading.Lock()
        self._group_name = ""
        self._group_desc = "undefined"
        self._shut = False

    # ---- identity (the group-name pitfall: answered from Python, for Python and C++ callers)
    def getBackendName(self) -> str:
        """The backend's name, for torch's C++ side.

        Returns:
            (str): ``"minicomm"``.
        """
        return BACKEND

    def name(self) -> str:
        """The backend's name, as ``dist.get_backend`` reports it.

        Returns:
            (str): ``"minicomm"``.
        """
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._group_name = str(name)

    def setGroupName(self, name: str) -> None:
        """Set the group's name (torch names groups after creating them).

        Args:
            name (str): The name.
        """
        self._group_name = str(name)

    @property
    def group_name(self) -> str:
        """The group's name, as torch set it (answered from Python: no C++ backend holds it).

        Returns:
            (str): The name ("" until torch sets it).
        """
        return self._group_name

    def getGroupName(self) -> str:
        """The group's name, for torch's C++ side.

        Returns:
            (str): The name ("" until torch sets it).
        """
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = str(desc)

    def setGroupDesc(self, desc: str) -> None:
        """Set the group's description (``dist.new_group(group_desc=...)``).

        Args:
            desc (str): The description.
        """
        self._group_desc = str(desc)

    @property
    def group_desc(self) -> str:
        """The group's description.

        Returns:
            (str): The description ("undefined" unless torch set one).
        """
        return self._group_desc

    def getGroupDesc(self) -> str:
        """The group's description, for torch's C++ side.

        Returns:
            (str): The description ("undefined" unless torch set one).
        """
        return self._group_desc

    @property
    def communicator(self) -> Communicator:
        """The minicomm communicator the collectives run on (its rank and size are the group's).

        Returns:
            (Communicator): The communicator.
        """
        return self._coll

    @property
    def is_shut(self) -> bool:
        """Whether ``shutdown()`` (``destroy_process_group``) has run.

        Returns:
            (bool): True once shut down.
        """
        return self._shut

    def __repr__(self):
        return (f"<MinicommProcessGroup {self._group_name or '?'} rank {self.rank()}/"
                f"{self.size()} on {self._coll!r}>")

    def _launch(self, what: str, outputs: List[torch.Tensor], body: Callable, *args,
                opts=None) -> MinicommWork:
        """Run ``body(communicator, *args)`` on the runner; the work completes with
        ``outputs``. Synchronous ``opts`` (``asyncOp`` False) may run it on this thread."""
        if self._shut:
            raise CommError(f"{what}: the process group was shut down")
        work = MinicommWork(what, outputs, self._runner.wait_done)
        inline = opts is not None and not getattr(opts, "asyncOp", True)
        self._runner.submit(work, functools.partial(body, self._coll, *args), inline)
        return work

    # ---- allreduce
    def allreduce(self, tensors, opts=None):
        """Reduce each tensor over the group, in place.

        Args:
            tensors (list[torch.Tensor]): The tensors (or one tensor), reduced in place.
            opts (dist.AllreduceOptions | None): c10d's options: ``reduceOp`` (``asyncOp=False`` may
                run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).

        Examples:
            >>> dist.all_reduce(t, op=dist.ReduceOp.SUM)  # doctest: +SKIP
        """
        opts = opts if opts is not None else dist.AllreduceOptions()
        tensors = check_list(one_or_list(tensors), "allreduce")
        ops = [reduce_op(opts, np_dtype(t), "allreduce") for t in tensors]
        return self._launch("allreduce", tensors, collectives.allreduce, tensors, ops,
                            opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        """The tensors reduced in place in one ``comm.group()``: fused by dtype (and op).

        Args:
            tensors (list[torch.Tensor]): The tensors, reduced in place.
            opts (dist.AllreduceCoalescedOptions | None): c10d's options: ``reduceOp``
                (``asyncOp=False`` may run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        tensors = check_list(tensors, "allreduce_coalesced")
        ops = [reduce_op(opts, np_dtype(t), "allreduce_coalesced") for t in tensors]
        return self._launch("allreduce_coalesced", tensors, collectives.allreduce, tensors, ops,
                            opts=opts)

    # ---- broadcast / reduce
    def broadcast(self, tensors, opts=None):
        """Every rank's tensors get the root's (``opts.rootRank``).

        Args:
            tensors (list[torch.Tensor]): The tensors (or one tensor): the root's are sent, the
                others'
                overwritten.
            opts (dist.BroadcastOptions | None): c10d's options: ``rootRank`` (``asyncOp=False`` may
                run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).

        Examples:
            >>> dist.broadcast(t, src=0)  # doctest: +SKIP
        """
        opts = opts if opts is not None else dist.BroadcastOptions()
        tensors = check_list(one_or_list(tensors), "broadcast")
        root = check_root(opts.rootRank, self.size(), "broadcast")
        return self._launch("broadcast", tensors, collectives.broadcast, tensors, root,
                            opts=opts)

    def reduce(self, tensors, opts=None):
        """The root's tensors get the reduction over the group; other ranks' are unchanged.

        Args:
            tensors (list[torch.Tensor]): The tensors (or one tensor).
            opts (dist.ReduceOptions | None): c10d's options: ``rootRank``, ``reduceOp``
                (``asyncOp=False`` may run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        opts = opts if opts is not None else dist.ReduceOptions()
        tensors = check_list(one_or_list(tensors), "reduce")
        root = check_root(opts.rootRank, self.size(), "reduce")
        ops = [reduce_op(opts, np_dtype(t), "reduce") for t in tensors]
        return self._launch("reduce", tensors, collectives.reduce, tensors, root, ops,
                            opts=opts)

    # ---- allgather
    def allgather(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i]``: ``size`` tensors receiving every rank's ``input_tensors[i]``.

        Args:
            output_tensors (list[list[torch.Tensor]]): Per input, ``size`` tensors of its shape and
                dtype.
            input_tensors (list[torch.Tensor]): This rank's tensors.
            opts (dist.AllgatherOptions | None): c10d's options (``asyncOp=False`` may run the call
                on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).

        Examples:
            >>> dist.all_gather(outs, t)  # doctest: +SKIP
        """
        inputs = check_list(input_tensors, "allgather")
        outputs = [check_list(o, "allgather", self.size()) for o in output_tensors]
        if len(outputs) != len(inputs):
            raise ValueError(f"allgather: {len(outputs)} output lists for {len(inputs)} inputs")
        for o, i in zip(outputs, inputs):
            check_sizes(o, self.rank(), i, "allgather")     # sizes may differ: allgatherv
        return self._launch("allgather", [t for o in outputs for t in o],
                            collectives.allgather, outputs, inputs, opts=opts)

    def all_gather_single(self, output, input, opts=None):
        """``all_gather_into_tensor``: ``output`` holds the ``size`` inputs end to end.

        Args:
            output (torch.Tensor): ``size`` times the input's elements.
            input (torch.Tensor): This rank's tensor.
            opts (dist.AllgatherOptions | None): c10d's options (``asyncOp=False`` may run the call
                on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).

        Examples:
            >>> dist.all_gather_into_tensor(out, t)  # doctest: +SKIP
        """
        what = "all_gather_into_tensor"
        check_tensor(output, what)
        check_tensor(input, what)
        check_blocks(output, input, self.size(), what, "output")
        return self._launch(what, [output], collectives.all_gather_single, output, input,
                            opts=opts)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """One allgather per input; the work of the last (the queue is FIFO).

        Args:
            output_lists (list[list[torch.Tensor]]): Per input, ``size`` output tensors.
            input_list (list[torch.Tensor]): This rank's tensors.
            opts (dist.AllgatherOptions | None): c10d's options (``asyncOp=False`` may run the call
                on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        works = [self.allgather([o], [i], opts) for o, i in zip(output_lists, input_list)]
        return works[-1] if works else DoneWork([])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """One ``all_gather_into_tensor`` per pair, in one ``comm.group()``; one work.

        Args:
            outputs (list[torch.Tensor]): Per input, ``size`` times its elements.
            inputs (list[torch.Tensor]): This rank's tensors.
            opts (dist.AllgatherOptions | None): c10d's options (``asyncOp=False`` may run the call
                on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        what = "all_gather_into_tensor_coalesced"
        for o, i in zip(outputs, inputs):
            check_tensor(o, what)
            check_tensor(i, what)
            check_blocks(o, i, self.size(), what, "output")
        return self._launch(what, list(outputs), collectives.all_gather_single_coalesced,
                            list(outputs), list(inputs), opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce_scatter
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i]`` gets the reduction of every rank's ``input_tensors[i][rank]``.

        Args:
            output_tensors (list[torch.Tensor]): The results.
            input_tensors (list[list[torch.Tensor]]): Per output, ``size`` tensors of its shape.
            opts (dist.ReduceScatterOptions | None): c10d's options: ``reduceOp`` (``asyncOp=False``
                may run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        outputs = check_list(output_tensors, "reduce_scatter")
        inputs = [check_list(i, "reduce_scatter", self.size()) for i in input_tensors]
        if len(outputs) != len(inputs):
            raise ValueError(f"reduce_scatter: {len(inputs)} input lists for {len(outputs)} outputs")
        for o, i in zip(outputs, inputs):
            check_same(i, o, "reduce_scatter")
        ops = [reduce_op(opts, np_dtype(o), "reduce_scatter") for o in outputs]
        return self._launch("reduce_scatter", outputs, collectives.reduce_scatter, outputs,
                            inputs, ops, opts=opts)

    def reduce_scatter_single(self, output, input, opts=None):
        """``reduce_scatter_tensor``: ``input`` holds ``size`` blocks end to end.

        Args:
            output (torch.Tensor): The reduced block of this rank.
            input (torch.Tensor): ``size`` times the output's elements.
            opts (dist.ReduceScatterOptions | None): c10d's options: ``reduceOp`` (``asyncOp=False``
                may run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).

        Examples:
            >>> dist.reduce_scatter_tensor(out, t)  # doctest: +SKIP
        """
        what = "reduce_scatter_tensor"
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        check_tensor(output, what)
        check_tensor(input, what)
        check_blocks(input, output, self.size(), what, "input")
        reduction = reduce_op(opts, np_dtype(output), what)
        return self._launch(what, [output], collectives.reduce_scatter_single, output, input,
                            reduction, opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """One ``reduce_scatter_tensor`` per pair, in one ``comm.group()``; one work.

        Args:
            outputs (list[torch.Tensor]): The results.
            inputs (list[torch.Tensor]): Per output, ``size`` times its elements.
            opts (dist.ReduceScatterOptions | None): c10d's options: ``reduceOp`` (``asyncOp=False``
                may run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        what = "reduce_scatter_tensor_coalesced"
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        ops = []
        for o, i in zip(outputs, inputs):
            check_tensor(o, what)
            check_tensor(i, what)
            check_blocks(i, o, self.size(), what, "input")
            ops.append(reduce_op(opts, np_dtype(o), what))
        return self._launch(what, list(outputs), collectives.reduce_scatter_single_coalesced,
                            list(outputs), list(inputs), ops, opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- alltoall
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``all_to_all_single``: splits count rows of dimension 0 (empty: equal splits).

        Args:
            output (torch.Tensor): The rows received, rank by rank.
            input (torch.Tensor): The rows sent, rank by rank.
            output_split_sizes (list[int]): Rows received from each rank (empty: equal).
            input_split_sizes (list[int]): Rows sent to each rank (empty: equal).
            opts (dist.AllToAllOptions | None): c10d's options (``asyncOp=False`` may run the call
                on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).

        Examples:
            >>> dist.all_to_all_single(out, t)  # doctest: +SKIP
        """
        what = "all_to_all_single"
        check_tensor(output, what)
        check_tensor(input, what)
        if output.dtype != input.dtype:
            raise ValueError(f"all_to_all_single: output dtype {output.dtype} is not the "
                             f"input's {input.dtype}")
        out_layout = check_splits(output, output_split_sizes, self.size(), "output")
        in_layout = check_splits(input, input_split_sizes, self.size(), "input")
        if out_layout[1] != in_layout[1] and output.numel() and input.numel():
            raise ValueError(f"all_to_all_single: input rows have {in_layout[1]} elements, "
                             f"output rows {out_layout[1]}")
        even = not output_split_sizes and not input_split_sizes
        layouts = None if even else (out_layout, in_layout)
        return self._launch(what, [output], collectives.all_to_all_single, output, input,
                            layouts, opts=opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """List all-to-all: ``output_tensors[j]`` receives rank j's ``input_tensors[rank]``.

        Args:
            output_tensors (list[torch.Tensor]): ``size`` tensors, one from each rank.
            input_tensors (list[torch.Tensor]): ``size`` tensors, one to each rank.
            opts (dist.AllToAllOptions | None): c10d's options (``asyncOp=False`` may run the call
                on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        outputs = check_list(output_tensors, "alltoall", self.size())
        inputs = check_list(input_tensors, "alltoall", self.size())
        dts = {t.dtype for t in outputs + inputs}
        if len(dts) > 1:
            raise ValueError(f"alltoall: tensors of several dtypes {sorted(map(str, dts))}")
        return self._launch("alltoall", outputs, collectives.alltoall, outputs, inputs,
                            opts=opts)

    # ---- gather / scatter
    def gather(self, output_tensors, input_tensors, opts=None):
        """Root: ``output_tensors[0]`` is ``size`` tensors; other ranks pass ``[]``.

        Args:
            output_tensors (list[list[torch.Tensor]]): At the root ``[size tensors]``, else ``[]``.
            input_tensors (list[torch.Tensor]): This rank's one tensor.
            opts (dist.GatherOptions | None): c10d's options: ``rootRank`` (``asyncOp=False`` may
                run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        opts = opts if opts is not None else dist.GatherOptions()
        inputs = check_list(input_tensors, "gather", 1)
        root = check_root(opts.rootRank, self.size(), "gather")
        outs = check_rooted_list(output_tensors, self.rank(), root, self.size(), inputs[0],
                                 "gather", "output")
        return self._launch("gather", outs, collectives.gather, outs, inputs[0], root,
                            opts=opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Root: ``input_tensors[0]`` is ``size`` tensors; other ranks pass ``[]``.

        Args:
            output_tensors (list[torch.Tensor]): This rank's one tensor.
            input_tensors (list[list[torch.Tensor]]): At the root ``[size tensors]``, else ``[]``.
            opts (dist.ScatterOptions | None): c10d's options: ``rootRank`` (``asyncOp=False`` may
                run the call on this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).
        """
        opts = opts if opts is not None else dist.ScatterOptions()
        outputs = check_list(output_tensors, "scatter", 1)
        root = check_root(opts.rootRank, self.size(), "scatter")
        ins = check_rooted_list(input_tensors, self.rank(), root, self.size(), outputs[0],
                                "scatter", "input", uneven=True)
        return self._launch("scatter", outputs, collectives.scatter, outputs[0], ins, root,
                            opts=opts)

    # ---- barrier
    def barrier(self, opts=None):
        """Returns once every rank of the group has entered the barrier.

        Args:
            opts (dist.BarrierOptions | None): c10d's options (``asyncOp=False`` may run the call on
                this thread).

        Returns:
            (MinicommWork): Its ``wait()`` returns True once done (or raises the collective's
                error); ``get_future()`` completes with the output tensors.

        Raises:
            ValueError: Tensors not on the CPU, of the wrong sizes, or a root outside the group.
            TypeError: Not a tensor, a dtype minicomm cannot move, or a sparse tensor.
            CommError: The group is broken or shut down (a failure of the collective itself fails
                the work instead).

        Examples:
            >>> dist.barrier()  # doctest: +SKIP
        """
        return self._launch("barrier", [], collectives.barrier, opts=opts)

    # ---- dist._coalescing_manager(device=...): torch records the ops and calls the coalesced
    # methods above itself; these two only bracket them (the C++ ones need a C++ backend)
    def _start_coalescing(self, device=None) -> None:
        pass

    def _end_coalescing(self, device=None):
        """A work that completes once everything issued before it has (the queue is FIFO)."""
        return self._launch("end of coalescing", [], collectives.nothing)

    # ---- point to point (caller's thread, second communicator)
    def send(self, tensors, dst: int, tag: int = 0):
        """Post a send of the one tensor to group rank ``dst``; it moves when waited on.

        Args:
            tensors (list[torch.Tensor]): One tensor (staged now: it may be reused at once).
            dst (int): The destination's rank in the group.
            tag (int): The tag the receiver matches on.

        Returns:
            (P2PWork): Its ``wait()`` moves the message and returns True.

        Raises:
            ValueError: Not one CPU tensor, or a bad tag.
            TypeError: Not a tensor, or a dtype minicomm cannot move.
            CommTimeout: Another thread held the group's send/recv too long.

        Examples:
            >>> dist.send(t, dst=1)  # doctest: +SKIP
        """
        t = check_list(tensors, "send", 1)[0]
        tag = check_tag(tag, "send")
        b = FlatView(t)                         # staged now: the caller may reuse t at once
        with self._p2p_held("send"):
            mc = self._p2p_comm.isend(b.array, int(dst), tag)
        return P2PWork(f"send to rank {dst} (tag {tag})", self._p2p_wait, mc, keep=b)

    def recv(self, tensors, src: int, tag: int = 0):
        """Post a receive into the one tensor from group rank ``src``.

        Args:
            tensors (list[torch.Tensor]): One tensor, filled when the work is waited on.
            src (int): The source's rank in the group.
            tag (int): The tag to match.

        Returns:
            (P2PWork): Its ``wait()`` moves the message and returns True.

        Raises:
            ValueError: Not one CPU tensor, or a bad tag.
            TypeError: Not a tensor, or a dtype minicomm cannot move.
            CommTimeout: Another thread held the group's send/recv too long.

        Examples:
            >>> dist.recv(t, src=0)  # doctest: +SKIP
        """
        return self._recv(tensors, int(src), tag, "recv")

    def recv_anysource(self, tensors, tag: int = 0):
        """Post a receive from whichever rank sends first.

        Args:
            tensors (list[torch.Tensor]): One tensor, filled when the work is waited on.
            tag (int): The tag to match.

        Returns:
            (P2PWork): Its ``wait()`` moves the message; ``work._source_rank()`` says who sent it.

        Raises:
            ValueError: Not one CPU tensor, or a bad tag.
            TypeError: Not a tensor, or a dtype minicomm cannot move.
        """
        return self._recv(tensors, ANY_SOURCE, tag, "recv_anysource")

    def _recv(self, tensors, src: int, tag: int, what: str):
        t = check_list(tensors, what, 1)[0]
        tag = check_tag(tag, what)
        b = FlatView(t, load=False)
        with self._p2p_held(what):
            mc = self._p2p_comm.irecv(src, tag, out=b.array)
        source = "any source" if src == ANY_SOURCE else f"rank {src}"
        return P2PWork(f"recv from {source} (tag {tag})", self._p2p_wait, mc, on_done=b.store,
                       keep=b)

    @contextlib.contextmanager
    def _p2p_held(self, what: str):
        """Hold the group's send/recv lock, acquired within a bound (``CommTimeout`` otherwise)."""
        if not self._p2p_lock.acquire(timeout=self._timeout + 60.0):
            raise CommTimeout(f"{what}: another thread held this group's send/recv for "
                              f"{self._timeout + 60.0:g} s")
        try:
            yield
        finally:
            self._p2p_lock.release()

    def _p2p_wait(self, work: P2PWork, secs: Optional[float]) -> None:
        with self._p2p_held(work.description):
            work.complete(secs)

    # ---- lifetime
    def shutdown(self) -> None:
        """``destroy_process_group``: run what is queued, then close the communicators.

        Returns:
            (None): A second call does nothing.
        """
        if self._shut:
            return
        self._shut = True
        finished = self._runner.close(self._timeout + 30.0)
        for comm in self._owned:
            try:
                if not finished:
                    comm.abort("process group destroyed while a collective was running")
                comm.close()
            except CommError:
                pass

    def abort(self) -> None:
        """Fail what runs and what is queued now; later calls raise.

        Returns:
            (None): Once the group is shut down.
        """
        for comm in self._owned:
            try:
                comm.abort("torch.distributed process group aborted")
            except CommError:
                pass
        self.shutdown()

