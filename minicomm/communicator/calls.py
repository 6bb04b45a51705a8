"""Call signatures bound to plans: everything a call's arguments determine, computed once.

A call's signature is (collective, op, algorithm, dtype, count, root). ``_prepare`` turns it
into a ``Call``: the family chosen (per-call ``algorithm=``, else ``MINICOMM_ALGO``, else the
α-β model), the packed signature every message carries, the executor's ``Plan`` and, where the
transport has an eager channel and every message fits it, the plan compiled for the
small-message path (minicomm.smallpath) as straight-line code. ``_run_call`` runs a bound call:
the sequence number, the fingerprint check where one is due, in-place aliasing, then the
compiled plan or the executor. Calls, plans and scratch are kept in ``BoundedCache``s.
"""
from __future__ import annotations

import time

import numpy as np

from .. import ops as _ops
from ..algorithms import FAMILIES, build_schedule, innet
from ..algorithms import names as algorithm_names
from ..cost import LinkModel, choose, innet_time, model_costs
from ..errors import CommError, pack_call
from ..executor import Plan, run_plan
from ..flightrecord import ENDED
from ..schedule import PREFIX, ROOTED, UNEVEN
from ..settings import env_flag
from ..smallpath import SMALL_SPIN_S, compile_small, eligible, straight_line
from ..trace import tracing_enabled
from ..transports.base import Tag
from .buffers import LAYOUT, NONE, RESULT_AT_ROOT, STACKED, InPlace
from .cache import BoundedCache
from .switchlink import BUSY, OK, SwitchRefused, operation_bytes

# MINICOMM_SMALL_PATH=0: every call runs through the executor (the small path's off switch,
# docs/decisions/small-message-path.md)
SMALL_OFF = not env_flag("MINICOMM_SMALL_PATH", True)
HOT_TMP_BYTES = 64 << 10        # a hot call keeps its own scratch up to this size
CACHE_ENTRIES = 1024            # signatures (calls, plans, fingerprints) a communicator keeps
# auto prices an uneven or prefix call as its even counterpart with the same bytes per block
# (the total over size ** k): (even collective, k)
PRICED_AS = {"allgatherv": ("allgather", 1), "gatherv": ("gather", 1),
             "scatterv": ("scatter", 1), "reduce_scatterv": ("reduce_scatter", 1),
             "alltoallv": ("alltoall", 2), "scan": ("allreduce", 0),
             "exscan": ("allreduce", 0)}
new_tag = tuple.__new__         # Tag(...) without the namedtuple's Python-level __new__


class Call:
    """What ``_prepare`` derives from a call's signature (module doc). ``run``: the compiled
    small plan as straight-line code (None: the executor runs it); ``run_guarded``: the same
    with a rooted call's fingerprint exchange. ``hot``: an unrooted small call the fast path
    may run with its own scratch ``tmp``, ``alias0`` saying whether its input may alias its
    output. ``no_result``, ``out_count``, ``separate``, ``avg``: what the fast path needs of
    the collective on this rank (None returned, the scratch output's size then, whether in and
    out may share memory, the avg division)."""
    __slots__ = ("coll", "algo", "call", "plan", "kernel", "rooted", "label", "requested",
                 "small", "run", "run_guarded", "hot", "tmp", "alias0", "count", "no_result",
                 "out_count", "separate", "avg", "root", "key")

    def __init__(self, coll, algo, call, plan, kernel, label, requested, count):
        self.coll, self.algo, self.call, self.plan, self.kernel = coll, algo, call, plan, kernel
        self.rooted, self.label, self.requested = coll in ROOTED, label, requested
        self.count = count
        self.root = None              # a rooted call's root (the flight record names it)
        self.small = self.run = self.run_guarded = self.tmp = None
        self.hot = self.alias0 = False


class SmallIO:
    """What the compiled small plans call when the eager channel is not the transport itself:
    its methods and the transport's two-sided ones, bound once (no extra call per message)."""
    __slots__ = ("send_now", "recv_now", "sendrecv_now", "recv_now_many", "isend", "irecv",
                 "wait_all")

    def __init__(self, transport, eager):
        self.send_now, self.recv_now = eager.send_now, eager.recv_now
        self.sendrecv_now, self.recv_now_many = eager.sendrecv_now, eager.recv_now_many
        self.isend, self.irecv, self.wait_all = transport.isend, transport.irecv, transport.wait_all


class CallPlans:
    """Binding signatures to plans and running them (module doc)."""

    def _init_calls(self, link_model) -> None:
        eager = self.caps.eager
        self._small_io = eager if eager is None or eager is self.transport \
            else SmallIO(self.transport, eager)
        self._calls = BoundedCache(CACHE_ENTRIES)       # signature -> Call
        self._plans = BoundedCache(CACHE_ENTRIES)       # (coll, algo, count, root) -> Plan
        self._scratch = BoundedCache(64)                # dtype -> tmp buffer
        # False: every call runs through the executor (what the link probe times against the
        # small-message path; MINICOMM_SMALL_PATH=0 does it for the whole process; a traced
        # process too, since only the executor traces a call's steps)
        self.small_path = not tracing_enabled()
        self.link_model = link_model or LinkModel.for_transports("shm", "tcp")

    @property
    def link_model(self) -> LinkModel:
        """The α-β link model ``algorithm="auto"`` chooses by.

        Setting it drops every choice made under the old one (a new world sets the model its
        ranks agreed on, from probed or cached link parameters).

        Returns:
            (LinkModel): The model in use.

        Examples:
            >>> model = comm.link_model
            >>> comm.link_model = model
        """
        return self._link_model

    @link_model.setter
    def link_model(self, model: LinkModel) -> None:
        """Use ``model`` from now on. Returns None; Raises nothing. ``>>> comm.link_model = m``"""
        self._link_model = model
        self._forget_calls()          # cached algorithm choices followed the old model

    def _forget_calls(self) -> None:
        """Drop every call derived from a signature (``_prepare``'s, and the scatter header
        plans that hold them): the next call of each chooses and compiles again."""
        self._calls.clear()
        self._scatter_headers.clear()

    def _resolve_algorithm(self, coll: str, algorithm, nbytes: int, count: int = 0,
                           itemsize: int = 1) -> str:
        if algorithm is None or algorithm == "auto":
            fam = self._algo_env.get(coll)
            if fam == "innet" and self._innet_refused:
                fam = None            # the switch declined it: the model chooses a host family
            if fam is None and coll in PRICED_AS:
                even, per = PRICED_AS[coll]
                return choose(even, self.size, nbytes // self.size ** per, self.topology,
                              self.link_model)
            if fam is None:
                fam = choose(coll, self.size, nbytes, self.topology, self.link_model)
                return "innet" if self._innet_pays(coll, fam, nbytes, count, itemsize) else fam
            algorithm = fam
        if algorithm == "innet":
            self._check_innet(coll, count, itemsize)
            return algorithm
        if algorithm not in algorithm_names():
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of "
                             f"{', '.join(algorithm_names())} or 'auto'")
        return algorithm

    def _check_innet(self, coll: str, count: int, itemsize: int) -> None:
        """``algorithm="innet"`` asked for by name: a ValueError where it cannot run, a
        ``SwitchRefused`` where the call is over the switch's limit (switchlink.py)."""
        sw = self._switch
        if sw is None:
            raise ValueError("algorithm='innet' needs an in-network switch, and this job has "
                             "none: start one with mc.spawn(..., switch=True), `minicomm run "
                             "--switch`, or MINICOMM_SWITCH=1 under another launcher")
        if coll not in innet.COLLECTIVES:
            raise ValueError(f"algorithm='innet' has no {coll}: a switch reduces and "
                             f"multicasts; innet runs {', '.join(innet.COLLECTIVES)}")
        nbytes = operation_bytes(coll, self.size, count, itemsize)
        if nbytes > sw.max_bytes:
            raise SwitchRefused(f"{coll} (innet): {nbytes} bytes is over {sw.describe()}'s "
                                f"limit of {sw.max_bytes} bytes per operation "
                                f"(MINICOMM_SWITCH_MAX_BYTES); use algorithm='auto' to fall "
                                f"back to a host family")

    def _innet_pays(self, coll: str, fam: str, nbytes: int, count: int, itemsize: int) -> bool:
        """Under auto: innet where the job has a switch that takes this call, and the model
        prices it below the host family ``fam`` (cost.innet_time)."""
        sw = self._switch
        if sw is None or self._innet_refused or coll not in innet.COLLECTIVES \
                or operation_bytes(coll, self.size, count, itemsize) > sw.max_bytes \
                or self.size < 2:
            return False
        m = self.link_model
        host = model_costs(coll, self.size, nbytes, self.topology, m)[fam]
        return innet_time(coll, self.size, nbytes, m, self.num_nodes == 1) < host

    def _plan(self, coll: str, algo: str, count: int, root: int, counts: tuple = ()) -> Plan:
        key = (coll, algo, count, root, counts)
        plan = self._plans.get(key)
        if plan is None and algo == "innet":     # one switch above the group (switch.py)
            sched = innet.build(coll, self.rank, self.size, count, root, (0,) * self.size,
                                radix=max(2, self.size))
            return self._plans.put(key, Plan(sched, self.world_ranks + (self._switch.switch_rank,)))
        if plan is None:
            channels = self.channels if algo in ("ring", "tree") else 1
            topo = self.topology if algo not in FAMILIES or algo == "hier" or channels > 1 \
                else None
            if coll in UNEVEN or coll in PREFIX:
                channels, topo = 1, self.topology
            sched = build_schedule(coll, algo, self.rank, self.size, count, root, topo, channels,
                                   counts)
            plan = self._plans.put(key, Plan(sched, self.world_ranks))
        return plan

    def _small(self, plan: Plan, dtype: np.dtype):
        """The plan compiled for the small-message path (minicomm.smallpath) if the transport
        has an eager channel and every message of the call fits it, else None."""
        eager = self.caps.eager
        if eager is None or SMALL_OFF or \
                not eligible(plan.schedule, dtype.itemsize, eager.small_bytes):
            return None
        return compile_small(plan.schedule, self.world_ranks)

    def _tmp(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < count:
            buf = self._scratch.put(dtype, np.empty(max(count, 1), dtype=dtype))
        return buf[:count]

    def _prepare(self, coll: str, op: str, algorithm, dtype: np.dtype, count: int,
                 root: int, counts: tuple = ()) -> Call:
        """The ``Call`` of a signature, bound on its first call (module doc): calls repeat, and
        choosing, packing and plan lookup cost more than a small message. ``counts``: an
        uneven collective's blocks (schedule.py's doc)."""
        key = (coll, op, algorithm, dtype, count, root, counts) if counts else \
            (coll, op, algorithm, dtype, count, root)
        c = self._calls.get(key)
        if c is None:
            c = self._bind_call(coll, op, algorithm, dtype, count, root, counts)
            c.key = key               # what a fallback from innet prepares again
            self._calls.put(key, c)
        return c

    def _bind_call(self, coll: str, op: str, algorithm, dtype: np.dtype, count: int,
                   root: int, counts: tuple = ()) -> Call:
        algo = self._resolve_algorithm(coll, algorithm, count * dtype.itemsize, count,
                                       dtype.itemsize)
        plan = self._plan(coll, algo, count, root, counts)
        rooted = coll in ROOTED
        # the label is what wait_all names in errors (they add the step and the call's number)
        c = Call(coll, algo, pack_call(coll, op, algo, dtype, root if rooted else -1), plan,
                 _ops.get_kernel(op) if op != "none" else None, f"{coll} ({algo})",
                 algorithm not in (None, "auto"), count)
        if rooted:
            c.root = root
        # through the switch's link: no small path, no hot path
        c.small = self._small(plan, dtype) if algo != "innet" else None
        if c.small is not None:
            c.run = straight_line(c.small, True)          # an eager channel has sendrecv_now
            if rooted:
                c.run_guarded = straight_line(c.small, True, guarded=True)
        c.hot = (c.run is not None and not rooted and self.size > 1 and self.check != "full"
                 and not self.debug_info and plan.tmp_count * dtype.itemsize <= HOT_TMP_BYTES)
        if c.hot:
            c.tmp, c.alias0 = np.empty(plan.tmp_count, dtype=dtype), plan.alias_safe(0)
        # no result here: barrier, and reduce and gather off the root (they get None and
        # write a scratch output of out_count elements)
        layout = LAYOUT.get(coll)     # None: an uneven or prefix call (never on the fast path)
        c.no_result = layout == NONE or (coll in RESULT_AT_ROOT and self.rank != root)
        c.out_count = 0 if layout == NONE else count * self.size \
            if layout == STACKED else count
        c.separate = coll != "broadcast" or self.rank == root   # a non-root never reads its x
        c.avg = op == _ops.AVG and not c.no_result     # the division, where there is a result
        return c

    def _execute(self, coll: str, inb: np.ndarray, outb: np.ndarray, count: int, op: str,
                 root: int, algorithm, shape, fingerprint: bool = True) -> None:
        """Run the call of this signature on flat buffers (the general path's last step)."""
        dtype = outb.dtype if outb is not None else inb.dtype
        c = self._calls.get((coll, op, algorithm, dtype, count, root)) \
            or self._prepare(coll, op, algorithm, dtype, count, root)
        self._run_call(c, inb, outb, count, shape, fingerprint)

    def _run_call(self, c: Call, inb: np.ndarray, outb: np.ndarray, count: int, shape,
                  fingerprint: bool = True) -> None:
        try:
            self._run_call_unchecked(c, inb, outb, count, shape, fingerprint)
        except CommError as e:
            self._fail(e)

    def _run_call_unchecked(self, c: Call, inb: np.ndarray, outb: np.ndarray, count: int,
                            shape, fingerprint: bool) -> None:
        # Headers catch a disagreement whenever the disagreeing ranks exchange a message. Ranks
        # that disagree on the *root* may never do so (each "root" only sends): rooted calls
        # therefore always exchange fingerprints first; check="full" does it for every call.
        guard = small_guard = rec = None
        flight = self._flight
        if flight is not None:        # numbered by its first exchange: the same on every rank
            rec = flight.repeat(self._seq + 1, c)
        if c.algo == "innet":         # the switch compares the group's calls itself
            fingerprint = fingerprint and self.check == "full"
        if fingerprint and self.size > 1 and (c.rooted or self.check == "full"):
            if self.check == "full":
                self._fingerprint_check(c.call, count, shape)
            elif c.small is not None and self.small_path:
                small_guard = self._small_guard(c.call, count, shape)
            else:
                guard = self._post_fingerprints(c.call, count, shape, c.plan)
        self._seq += 1
        seq = self._seq
        if self.debug_info:
            self._log(f"{c.coll} #{seq} count={count} dtype={outb.dtype} -> {c.algo} "
                      f"({'requested' if c.requested else 'auto'})")
        plan = c.plan
        if inb is outb:
            if not plan.alias_safe(0):
                inb = inb.copy()
        elif inb.__class__ is InPlace:
            inb = inb.view(np.ndarray) if plan.alias_safe(inb.shift) else np.array(inb)
        n = plan.tmp_count
        tmp = self._scratch.get(outb.dtype)
        if tmp is None or tmp.size < n:
            tmp = self._tmp(outb.dtype, n)
        bufs = (inb, outb, tmp[:n])
        if c.algo == "innet":
            if not self._run_innet(c, bufs, count, seq):
                # auto, and the switch declined: this call and the later ones go to the host
                # families (every member got the same verdict)
                self._innet_refused = True
                self._forget_calls()
                self._run_call_unchecked(self._prepare(*c.key), inb, outb, count, shape, False)
        elif c.run is not None and guard is None and self.small_path:
            # latency-bound: the compiled plan, unrolled; a rooted call's fingerprints travel
            # with it (small_guard)
            if small_guard is None:
                c.run(bufs, self._small_io, c.kernel, self._ctx, seq, c.call, count,
                      time.monotonic() + self.timeout, c.label, SMALL_SPIN_S)
            else:
                c.run_guarded(bufs, self._small_io, c.kernel, self._ctx, seq, c.call, count,
                              time.monotonic() + self.timeout, c.label, SMALL_SPIN_S,
                              small_guard)
        else:
            # a guarded (rooted, lazily fingerprinted) call checks fingerprints while it waits
            run_plan(plan, self.transport, bufs, c.kernel,
                     new_tag(Tag, (self._ctx, seq, 0, c.call, count)),
                     time.monotonic() + self.timeout, c.label, guard,
                     oversubscribed=self.caps.oversubscribed)
        if rec is not None:
            rec[ENDED] = time.monotonic()

    def _run_innet(self, c: Call, bufs, count: int, seq: int) -> bool:
        """One operation through the switch (switchlink.py): its verdict, then the rank's half
        of the innet schedule. False: auto's call was declined (BUSY, TOO_LARGE)."""
        sw = self._switch
        deadline = time.monotonic() + self.timeout
        with sw.lock:
            status, detail = sw.admit(self._ctx, seq, c.call, count,
                                      c.root if c.rooted else -1, self.world_ranks, deadline,
                                      c.label)
            if status != OK:
                why = (f"{sw.describe()} holds its {detail} aggregation groups "
                       f"(MINICOMM_SWITCH_GROUPS)" if status == BUSY
                       else f"over {sw.describe()}'s {detail} bytes per operation")
                if c.requested:
                    raise SwitchRefused(f"{c.label}: the switch declined it: {why}; use "
                                        f"algorithm='auto' to fall back to a host family")
                if self.debug_info:
                    self._log(f"{c.coll} #{seq}: the switch declined innet ({why}); falling "
                              f"back to a host family for this communicator")
                return False
            self._innet_used = True
            try:
                run_plan(c.plan, sw.transport, bufs, c.kernel,
                         new_tag(Tag, (self._ctx, seq, 0, c.call, count)), deadline, c.label)
            except CommError as e:
                if getattr(e, "peer", None) == sw.switch_rank:
                    raise sw.failure(e) from None
                raise
        return True
