"""The cost model ``algorithm="auto"`` consults: pure functions of schedules and link parameters.

It imports nothing above the simulator engine (``minicomm.sim``), ``minicomm.algorithms`` and
``minicomm.schedule`` and starts nothing.
Measuring links and timing algorithms (which starts ranks) is ``minicomm.tuning``, above the
communicator and the launcher: it fills in a ``LinkModel`` (and its tuned table) that this module
only reads.

How auto picks a family for (collective, world size p, message bytes, topology):

1. ``MINICOMM_ALGO`` and the per-call ``algorithm=`` win over everything (the communicator checks
   them before asking this module).
2. The tuned table (``minicomm bench --tune``, or ``minicomm.tuning.measure_table`` +
   ``write_table``), when it has an entry for this collective, world size, node layout and
   transports whose size is within a factor of 2 of the call's (the nearest in log scale;
   equally near: the smaller).
3. Otherwise the cost model: every family's schedules for all p ranks are *simulated* (the
   schedule is data: the simulator walks the real steps, so rhd's switch between recursive
   doubling and Rabenseifner, ring broadcast's segments, tree's serial sends and hier's phases
   are costed as they run). p > ``SIM_MAX_RANKS``: the same engine's flow model prices the
   schedules on the LinkModel's network (``fabric_time``: α, 1/β per link class, one NIC per
   node, γ, δ), once per size class, cached. The closed forms ``flat_cost`` / ``hier_cost``
   (Thakur, Rabenseifner, Gropp 2005) are references only: auto never calls them.
   Families priced within ``NEAR`` of the cheapest (p <= ``SIM_MAX_RANKS``) are told apart by
   their messages: the one whose busiest rank sends or receives the fewest wins (``model_choice``).

The simulator (``schedule_time`` / ``simulate``) is the simulator engine's (minicomm.sim.engine,
the same engine ``minicomm sim`` runs clusters on): the schedules are compiled by it and run on
its host machine (``engine.run_host``, minicomm.sim.host: each rank a process that works on a CPU
or waits, its node's cores shared among its ranks; the timing rules are that module's docstring).
``host_model`` maps a LinkModel onto it: α, β, o per link class, γ, δ, wake, contention, cores,
spin, and the fitted constants of sim/host_model.json (``SHARING_LOSS``, ``SHARING_LOSS_DRAM``,
``BALANCE_S``, ``LATENCY_CPU_SHARED``, ``YIELD_SHARE``; their provenance and calibration error:
docs/decisions/host-model-constants.md). The call's time is the last rank's end (``calls`` > 1:
calls back to back, as a benchmark batch runs them, time per call). A rooted call (broadcast,
reduce, gather, scatter) carries the communicator's lazy call check: every rank sends its
24-byte fingerprint to every other first and receives theirs last (``engine.guarded_program``).
Schedules are built with 4-byte elements (auto sees bytes, not the dtype).

Memory by working set (``LinkModel.memory``, probed by ``minicomm.tuning.links.
measure_memory``): δ, γ and contention of the call's buffer size (a small copy runs from the
caches, several times faster than a large one); with it, shm's β is exactly its two copies
(``COPY_TRANSPORTS``: the sender's copy into the ring, the receiver's copy or reduction out);
each copy touches the user's buffer and the ring (``RING_BYTES``, cache-resident), so β is
δ(working set) + δ(ring). ``single_copy``: from that many bytes, a non-reducing call's intra-node
messages are one read by the receiver at δ(working set) (shm's cross-memory attach), and the
sender's step ends when it has been read. tcp's β is the fitted one plus how much slower than a
cache-resident copy the kernel's copies of the call's buffer are.

Link parameters (``LinkModel``): per link class (intra-node, inter-node) α (one exchange step), β
(s/byte) and o (CPU per message operation); γ (in-place add, s/byte of array), δ (memcpy), wake,
contention, the node's cores and the transports' spin before sleeping; ``table``, the tuned
table's lookup (``table_index`` of ``minicomm.tuning.load_table``'s entries). Without a
probe, ``LinkModel.for_transports`` gives the constants ``DEFAULT_LINKS``, ``GAMMA``,
``DELTA``, ``WAKE``. Transport facts the model mirrors (``PIPELINE_CHUNK``, ``RING_BYTES``) are
constants here, not imports (the transports are not below this layer); a test keeps them equal.
The spin times (``SPIN_S``, the long spin for large messages and ``SPIN_SHARED_S``) are shared
with the progress engine through ``minicomm.settings``. Where a node's ranks outnumber its cores
the engine spins longer (``SPIN_SHARED_S``) but yields the core between polls; the model spins
as long there, the spinner holding ``YIELD_SHARE`` of a core, and charges such a node's
sleepers no wake-up (the engine's ``shared`` nodes).

Cost: ``choose`` is one dict lookup after the first call per (collective, p, bytes, topology); a
first call simulates every family's p schedules on the host machine (p <= ``SIM_MAX_RANKS``) or
prices them on the flow model once per size class (four per octave, so a training loop's few
bucket sizes pay it once each); its cost by world size: docs/decisions/cost-model-auto-choice.md.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .algorithms import FAMILIES, registered
from .schedule import COLLECTIVES, ROOTED, buffer_counts
from .settings import SPIN_BYTES_PER_S, SPIN_MAX_S, SPIN_S, SPIN_SHARED_S
from .sim import engine
from .sim.host import HostLink, HostModel, fitted_constants

# Defaults for MINICOMM_TUNE=0 (and before agreement): α = cost of one communicating step (s),
# bytes/s, o = CPU per message operation (s).
DEFAULT_LINKS: Dict[str, Tuple[float, float, float]] = {
    "inproc": (30e-6, 2.0e9, 5e-6),
    "shm": (8e-6, 3.0e9, 2e-6),
    "tcp": (30e-6, 1.2e9, 4e-6),
    "rdma": (10e-6, 3.0e9, 2e-6),
    "ub": (8e-6, 3.0e9, 2e-6),
}
GAMMA = 1 / 6.0e9     # in-place add, s per byte of array
DELTA = 1 / 7.0e9     # memcpy, s per byte
WAKE = 60e-6          # extra latency of a message to a rank asleep in the kernel

ITEMSIZE = 4               # auto sees bytes; schedules are built with float32-sized elements
SIM_MAX_RANKS = 16         # simulate up to this many ranks (a few ms per new size), formulas above
# Families priced this close to the cheapest are tied, and the tie goes to the fewest messages at
# the busiest rank (o is fitted to small calls): docs/decisions/cost-model-auto-choice.md
NEAR = 0.05
# A receiver sees a message piece by piece: shm publishes records of up to 1 MiB (transports/
# shm/layout.py CHUNK), a socket delivers what has arrived.
PIPELINE_CHUNK = {"shm": 1 << 20}
# A shm message crosses its pair's ring (transports/shm/layout.py _default_ring_bytes: 4 MiB up
# to 16 peers): each of its two copies touches the user's buffer and the ring, which stays in cache.
RING_BYTES = {"shm": 4 << 20}
# shm's single-copy reads (transports/cma.py DEFAULT_MIN; a world's LinkModel carries the size
# its pairs' setup probes chose, and this is only the fallback): a non-reducing call's messages
# this large are read by the receiver straight from the sender's memory, where the kernel allows
# it, at the pace of a memcpy of the call's working set: docs/decisions/shm-single-copy-threshold.md
SINGLE_COPY_MIN = {"shm": 256 << 10}
# The small-message path (minicomm.smallpath) runs a call whose every message is at most this
# large (the transport's ``small_bytes``: one shm ring record, a chunk) without the executor's
# request objects, a rooted one with its fingerprint exchange; other calls and every call of a
# world over several transports run through the executor (``LinkModel.exec_overhead``).
SMALL_BYTES = {"shm": 1 << 20}
STREAM_CHUNK = 64 << 10
# The host model's fitted constants (sim/host_model.json, with their provenance): tuned on one
# 2-core VM against recorded runs, docs/decisions/host-model-constants.md.
HOST_MODEL_FIT = fitted_constants()


def _fitted(name: str) -> float:
    return float(HOST_MODEL_FIT["constants"][name]["value"])


# Work on a core shared by several ranks runs at share / (1 + SHARING_LOSS * (1 - share)): time
# slicing costs switches and cache refills.
SHARING_LOSS = _fitted("SHARING_LOSS")
# With a memory table the loss falls linearly with δ(working set) from SHARING_LOSS at cache speed
# to SHARING_LOSS * SHARING_LOSS_DRAM at the table's largest working set (``sharing_loss_at``).
SHARING_LOSS_DRAM = _fitted("SHARING_LOSS_DRAM")
# A piece of work shorter than this runs at the busiest core's pace (3 busy ranks on 2 cores: two
# to a core), a longer one at the fair share: over a long copy the kernel moves ranks between cores.
BALANCE_S = _fitted("BALANCE_S")
# Where a node's ranks outnumber its cores, this fraction of an intra-node message's latency is its
# sender's CPU (HostModel.latency_cpu): a loopback socket's latency is mostly kernel work.
LATENCY_CPU_SHARED = _fitted("LATENCY_CPU_SHARED")
# Where a node's ranks outnumber its cores a waiting rank polls with sched_yield for SPIN_SHARED_S
# (transports/progress.py) before it sleeps; the model spins as long, holding this much of a core.
YIELD_SHARE = _fitted("YIELD_SHARE")

TableKey = Tuple[str, int, Tuple[int, ...], str, str]   # collective, world, topology, intra, inter



@dataclass(frozen=True)
class LinkModel:
    alpha_intra: float     # seconds per communicating step (the formulas' α)
    beta_intra: float      # seconds per byte
    alpha_inter: float
    beta_inter: float
    gamma: float = GAMMA
    delta: float = DELTA
    overhead_intra: float = DEFAULT_LINKS["shm"][2]
    overhead_inter: float = DEFAULT_LINKS["tcp"][2]
    wake: float = WAKE
    contention: float = 0.0    # k ranks working at once on a node each run 1 + c(k-1) slower
    cores: int = 0         # CPU cores of a node (0: as many as ranks, no sharing)
    intra: str = "shm"     # transport names, the tuned table's key
    inter: str = "tcp"
    spin: float = SPIN_S   # a waiting rank spins this long, then sleeps (wake applies)
    # this machine's memory by working set: ((bytes, δ s/B, γ s/B, contention), ...) sorted by
    # bytes (``minicomm.tuning.links.measure_memory``); empty: δ, γ and contention above for all
    memory: Tuple[Tuple[float, float, float, float], ...] = ()
    call_overhead: float = 0.0   # CPU per call per rank (the communicator's Python), s
    single_copy: int = 0         # intra-node single-copy reads from this many bytes (0: none)
    exec_overhead: float = 0.0   # extra CPU per intra message op of an executor-run call, s
    small_bytes: int = -1        # the small path's message limit (-1: SMALL_BYTES[intra])
    background: float = 0.0      # other runnable threads per rank of a node (a loaded machine)
    # (collective, world, topology, intra, inter) -> ((bytes, family), ...) sorted by bytes
    table: Dict[TableKey, Tuple[Tuple[int, str], ...]] = field(default_factory=dict, hash=False)
    _choices: Dict[Tuple, str] = field(default_factory=dict, compare=False, hash=False,
                                       repr=False)

    @classmethod
    def for_transports(cls, intra: str, inter: str, **kw) -> "LinkModel":
        ai, bwi, oi = DEFAULT_LINKS.get(intra, DEFAULT_LINKS["tcp"])
        ae, bwe, oe = DEFAULT_LINKS.get(inter, DEFAULT_LINKS["tcp"])
        return cls(ai, 1 / bwi, ae, 1 / bwe, overhead_intra=oi, overhead_inter=oe,
                   intra=intra, inter=inter, **kw)


# ---------------------------------------------------------------------------------- choosing
def choose(collective: str, p: int, nbytes: int, topology: Sequence[int], m: LinkModel) -> str:
    """The family auto picks (cached per model: the hot path pays one dict lookup)."""
    key = (collective, p, nbytes, tuple(topology))
    fam = m._choices.get(key)
    if fam is None:
        fam = table_choice(m, *key) or _shared_model_choice(key, m)
        if len(m._choices) > 4096:
            m._choices.clear()
        m._choices[key] = fam
    return fam


# model_choice per (model, call) for the whole process: the ranks of an in-process world
# (transport="inproc") hold equal LinkModels, and each would otherwise run the same simulations
# (a 16-rank world's first calls of every size class: 315 model runs where 33 differ). The lock
# makes one thread compute a choice while the others wait for it.
_shared_choices: Dict[Tuple, str] = {}
_shared_lock = threading.Lock()


def _shared_model_choice(key: Tuple, m: LinkModel) -> str:
    with _shared_lock:
        fam = _shared_choices.get((m, key))
        if fam is None:
            fam = model_choice(*key, m)
            if len(_shared_choices) > 4096:
                _shared_choices.clear()
            _shared_choices[(m, key)] = fam
    return fam


def table_choice(m: LinkModel, collective: str, p: int, nbytes: int,
                 topology: Tuple[int, ...]) -> Optional[str]:
    """The tuned table's family for the tuned size nearest ``nbytes`` (within a factor of 2)."""
    rows = m.table.get((collective, p, tuple(topology), m.intra, m.inter))
    if not rows:
        return None
    best, dist = None, None
    for b, fam in rows:
        if nbytes == 0 or b == 0:
            d = 0.0 if nbytes == b else math.inf
        else:
            d = abs(math.log2(nbytes / b))
        if d <= 1.0 and (dist is None or d < dist):
            best, dist = fam, d
    return best


def _order(fam: str) -> int:
    """Ties go to the built-in families in their order, then to registered algorithms."""
    return FAMILIES.index(fam) if fam in FAMILIES else len(FAMILIES)


def model_choice(collective: str, p: int, nbytes: int, topology: Tuple[int, ...],
                 m: LinkModel) -> str:
    """The cheapest family by ``model_costs``; among those within ``NEAR`` of it (p <=
    ``SIM_MAX_RANKS``), the one with the fewest messages at its busiest rank."""
    costs = model_costs(collective, p, nbytes, topology, m)
    best = min(costs, key=lambda f: (costs[f], _order(f)))
    near = [f for f in costs if costs[f] <= costs[best] * (1 + NEAR)]
    if len(near) == 1 or p > SIM_MAX_RANKS:
        return best
    count = nbytes // ITEMSIZE
    return min(near, key=lambda f: (busiest_messages(collective, f, p, count, topology),
                                    costs[f], _order(f)))


def busiest_messages(collective: str, fam: str, p: int, count: int,
                     topology: Tuple[int, ...]) -> int:
    """Messages sent or received (whichever is more) by the rank that has the most, in one
    call of ``fam``'s schedules (the engine's compiled program, cached by the engine)."""
    prog = engine.program_for(collective, fam, p, count, 0, tuple(topology))
    if not len(prog.msg_src):
        return 0
    return int(max(np.bincount(prog.msg_src, minlength=p).max(),
                   np.bincount(prog.msg_dst, minlength=p).max()))


def model_costs(collective: str, p: int, nbytes: int, topology: Tuple[int, ...],
                m: LinkModel) -> Dict[str, float]:
    """Predicted seconds per family, every one priced by the simulator engine. hier competes only
    when it differs from the flat families (more than one node, fewer nodes than ranks).
    p <= ``SIM_MAX_RANKS``: the engine's host machine runs all p ranks' schedules as processes on
    CPUs (``schedule_time``); above: the engine's flow model on the LinkModel's network
    (``fabric_time``), priced once per size class (``SIZE_CLASSES`` per octave) and cached."""
    k = len(set(topology))
    fams = [f for f in FAMILIES if f != "hier" or 1 < k < p] + \
        [r.name for r in registered(auto_only=True) if collective in r.collectives]
    if p > SIM_MAX_RANKS:
        return {f: fabric_time(collective, f, p, size_class(nbytes), tuple(topology), m)
                for f in fams}
    count = nbytes // ITEMSIZE
    return {f: schedule_time(collective, f, p, count, tuple(topology), m) for f in fams}


def innet_time(collective: str, p: int, nbytes: int, m: LinkModel, one_node: bool) -> float:
    """Predicted seconds of an innet call through the emulated switch (launch/switch.py): four
    hops one after another (header, verdict, up, down), each waking a process where the ranks
    and the switch outnumber the cores; the switch is one process, so it handles the 4p
    messages one at a time (an α each), every member's bytes cross its link in and out, and
    it reduces p - 1 inputs into the first."""
    a, b = (m.alpha_intra, m.beta_intra) if one_node else (m.alpha_inter, m.beta_inter)
    n_in, n_out = buffer_counts(collective, p, nbytes)
    reduces = collective in ("allreduce", "reduce", "reduce_scatter")
    wake = m.wake if 0 < m.cores < p + 1 else 0.0
    return 4 * (a + wake) + 4 * p * a + p * (n_in + n_out) * b \
        + reduces * (p - 1) * n_in * m.gamma + m.call_overhead


# ---------------------------------------------------------------------------------- simulator
def memory_at(m: LinkModel, working_set: float) -> Tuple[float, float, float]:
    """(δ, γ, contention) of this machine for a call touching ``working_set`` bytes per buffer:
    log-linear between the probed rows of ``m.memory`` (clamped at its ends). A 64 KiB copy
    runs from the caches at several times the speed of a 64 MiB one, and two ranks copying at
    once slow each other down by the memory bandwidth they share; without a table, the model's
    single δ, γ and contention."""
    rows = m.memory
    if not rows:
        return m.delta, m.gamma, m.contention
    if working_set <= rows[0][0]:
        return rows[0][1:]
    if working_set >= rows[-1][0]:
        return rows[-1][1:]
    for lo, hi in zip(rows, rows[1:]):
        if working_set <= hi[0]:
            w = math.log(working_set / lo[0]) / math.log(hi[0] / lo[0])
            return tuple(a + w * (b - a) for a, b in zip(lo[1:], hi[1:]))   # type: ignore
    return rows[-1][1:]


# Transports whose bytes cross memory as a copy in by the sender and a copy (or reduction) out by
# the receiver, both user-space memcpy (shm's rings; inproc hands over the array and copies out
# once, so it is not here): their β is those two copies when the memory is probed (host_model).
COPY_TRANSPORTS = ("shm",)


def sharing_loss_at(m: LinkModel, working_set: float) -> float:
    """The sharing loss of a call touching ``working_set`` bytes per buffer (SHARING_LOSS_DRAM)."""
    if not m.memory:
        return SHARING_LOSS
    fastest = min(r[1] for r in m.memory)
    dram = m.memory[-1][1]
    if dram <= fastest:
        return SHARING_LOSS
    cached = min(1.0, max(0.0, (dram - memory_at(m, working_set)[0]) / (dram - fastest)))
    return SHARING_LOSS * (SHARING_LOSS_DRAM + (1 - SHARING_LOSS_DRAM) * cached)


def host_model(m: LinkModel, working_set: float = 0.0) -> HostModel:
    """The simulator engine's machine for a LinkModel: ranks are processes on their node's cores
    (minicomm.sim.engine.run_host), with this model's α, β, o per link class, γ, δ, wake,
    contention, cores and spin. With a probed memory table (``LinkModel.memory``) δ, γ,
    contention and the sharing loss (``sharing_loss_at``) are those of the call's working set,
    and a copying transport's β is its two copies (``COPY_TRANSPORTS``: copy-in by the sender,
    copy-out by the receiver, each between the user's buffer and the cache-resident ring:
    δ(working set) + δ(ring))."""
    key = (m, working_set if m.memory else 0.0)
    hm = _host_models.get(key)
    if hm is None:
        delta, gamma, contention = memory_at(m, working_set)

        def beta(kind: str, fitted: float) -> float:
            if m.memory and kind == "tcp":
                # the kernel copies in and out of socket buffers: β was fitted on small, cached
                # buffers, and a large buffer's copies run at its working set's δ
                return fitted + delta - memory_at(m, 0)[0]
            if not (m.memory and kind in COPY_TRANSPORTS):
                return fitted
            # copy-in and copy-out each touch the user's buffer (its working set) and the ring
            ring = memory_at(m, min(working_set, RING_BYTES.get(kind, working_set)))[0]
            return delta + ring
        hm = HostModel(
            HostLink(m.alpha_intra, beta(m.intra, m.beta_intra), m.overhead_intra,
                     PIPELINE_CHUNK.get(m.intra, STREAM_CHUNK)),
            HostLink(m.alpha_inter, beta(m.inter, m.beta_inter), m.overhead_inter,
                     PIPELINE_CHUNK.get(m.inter, STREAM_CHUNK)),
            gamma=gamma, delta=delta, wake=m.wake, contention=contention, cores=m.cores,
            spin=m.spin, spin_rate=SPIN_BYTES_PER_S if m.spin else 0.0, spin_max=SPIN_MAX_S,
            spin_shared=SPIN_SHARED_S if m.spin else 0.0, yield_share=YIELD_SHARE,
            sharing_loss=sharing_loss_at(m, working_set), balance=BALANCE_S,
            latency_cpu=LATENCY_CPU_SHARED,
            call_overhead=m.call_overhead,
            background=m.background, exec_overhead=m.exec_overhead,
            single_min=m.single_copy if m.intra in COPY_TRANSPORTS else 0,
            single_beta=delta)
        if len(_host_models) > 256:
            _host_models.clear()
        _host_models[key] = hm
    return hm


_host_models: Dict[Tuple[LinkModel, float], HostModel] = {}


# a rooted call's lazy call check: 3 int64 per rank to every other (communicator/fingerprints.py
# _post_fingerprints), in ITEMSIZE elements
FINGERPRINT_COUNT = 3 * 8 // ITEMSIZE
_guarded_programs: Dict[int, Tuple[Any, Any]] = {}


def _guarded(prog):
    hit = _guarded_programs.get(id(prog))
    if hit is None or hit[0] is not prog:
        if len(_guarded_programs) > 256:
            _guarded_programs.clear()
        hit = _guarded_programs[id(prog)] = (prog, engine.guarded_program(prog,
                                                                          FINGERPRINT_COUNT))
    return hit[1]


def schedule_time(collective: str, fam: str, p: int, count: int, topology: Tuple[int, ...],
                  m: LinkModel, itemsize: int = ITEMSIZE, calls: int = 1,
                  executor: Optional[bool] = None) -> float:
    """Predicted seconds of one call: the schedules of all p ranks, compiled by the simulator
    engine (its own cache: the executor's schedules are not evicted), run on ``host_model(m)``.
    ``calls`` > 1: the time per call of that many calls issued back to back by every rank (as a
    benchmark's batch or a training loop does: a rank that finished its part of call k starts
    call k + 1, so calls overlap where the schedule lets them). ``executor``: whether the
    executor runs the call (None: ``runs_executor`` decides, as the communicator does)."""
    prog = engine.program_for(collective, fam, p, count, 0, tuple(topology))
    if collective in ROOTED:
        prog = _guarded(prog)
    if calls > 1:
        prog = engine.repeat_program(prog, calls)
    working_set = engine.bytes_for_count(collective, count, p, itemsize)
    hm = host_model(m, working_set)
    if executor is None:
        executor = runs_executor(collective, prog, topology, m, itemsize)
    return engine.run_host(prog, tuple(topology), hm, itemsize, executor=executor
                           ).time_s / max(1, calls)


def runs_executor(collective: str, prog, topology: Sequence[int], m: LinkModel,
                  itemsize: int = ITEMSIZE) -> bool:
    """Whether the communicator runs this call through the executor rather than the
    small-message path (``SMALL_BYTES``): a world on several nodes (several transports), a
    transport without the path, or a message above its limit (a rooted call's fingerprints
    travel on either path)."""
    limit = SMALL_BYTES.get(m.intra, 0) if m.small_bytes < 0 else m.small_bytes
    if not limit or len(set(topology)) > 1:
        return True
    return bool(prog.messages) and float(prog.msg_count.max()) * itemsize > limit


def simulate(scheds: Sequence[Sequence[Sequence[Any]]], topology: Sequence[int], m: LinkModel,
             itemsize: int = ITEMSIZE) -> float:
    """Run explicit per-rank step lists on the model (the engine's host machine, module doc);
    returns the last rank's end (seconds)."""
    prog = engine.compile_schedules(scheds)
    return engine.run_host(prog, tuple(topology), host_model(m), itemsize).time_s


# ---------------------------------------------------------------------------------- large worlds
SIZE_CLASSES = 4          # fabric prices per octave of message size (2^(k/4) bytes)
FABRIC_CACHE_SIZE = 4096


def size_class(nbytes: int) -> int:
    """The size auto prices ``nbytes`` at above ``SIM_MAX_RANKS`` ranks: the nearest of
    ``SIZE_CLASSES`` sizes per octave (a factor of at most 2^(1/8) off), so a few engine runs
    serve all sizes."""
    if nbytes <= ITEMSIZE:
        return max(0, nbytes)
    k = round(math.log2(nbytes) * SIZE_CLASSES)
    return max(ITEMSIZE, int(round(2 ** (k / SIZE_CLASSES))))


def fabric_for(m: LinkModel, topology: Tuple[int, ...]):
    """The engine's network for a LinkModel and a node map: one switch, one server per node of
    ``topology`` (as many accelerator slots as its largest node), the node's ranks on a
    non-blocking intra fabric of the intra link's α and 1/β, one NIC per node (its ranks share
    it) of the inter link's α and 1/β; γ, δ per byte. Returns (Topology, placement)."""
    from .sim.topology import LinkSpec, Topology
    nodes: Dict[Any, int] = {}
    placement = []
    for t in topology:
        idx = nodes.setdefault(t, len(nodes))
        placement.append(idx)
    counts = [0] * len(nodes)
    g = max(list(topology).count(t) for t in nodes)
    for r, idx in enumerate(placement):
        placement[r] = idx * g + counts[idx]
        counts[idx] += 1
    topo = Topology(f"host-{m.intra}-{m.inter}", len(nodes), g, "nvswitch",
                    LinkSpec(m.intra, 1 / max(m.beta_intra, 1e-15), m.alpha_intra),
                    LinkSpec(m.inter, 1 / max(m.beta_inter, 1e-15), m.alpha_inter),
                    nics_per_server=1, gamma=m.gamma, delta=m.delta)
    return topo, np.asarray(placement, dtype=np.int64)


_fabric_prices: Dict[Tuple, float] = {}


def fabric_time(collective: str, fam: str, p: int, nbytes: int, topology: Tuple[int, ...],
                m: LinkModel, itemsize: int = ITEMSIZE) -> float:
    """Predicted seconds of one call of ``nbytes`` (the vector; auto's size) by the engine's flow
    model on ``fabric_for(m, topology)`` (cached per collective, family, ranks, size, node map and
    the model's link figures)."""
    key = (collective, fam, p, nbytes, topology, m.alpha_intra, m.beta_intra, m.alpha_inter,
           m.beta_inter, m.gamma, m.delta)
    t = _fabric_prices.get(key)
    if t is None:
        topo, placement = fabric_for(m, topology)
        count = nbytes // itemsize
        prog = engine.program_for(collective, fam, p, count, 0,
                                  tuple(int(e) // topo.gpus_per_server for e in placement))
        t = engine.run_program(prog, topo, placement, itemsize).time_s
        if len(_fabric_prices) > FABRIC_CACHE_SIZE:
            _fabric_prices.clear()
        _fabric_prices[key] = t
    return t


# ---------------------------------------------------------------------------------- formulas
def _lg(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def flat_cost(collective: str, family: str, p: int, n: float, a: float, b: float,
              g: float) -> float:
    """Closed-form cost of a flat family on one link class: the textbook reference the engine is
    checked against (tests) and examples/multihost_predict.py prints. auto never uses it (every
    price auto sees comes from the engine: ``model_costs``). n = bytes per rank-block."""
    if p <= 1:
        return 0.0
    lg = _lg(p)
    f = (p - 1) / p
    pow2 = p & (p - 1) == 0
    fold = 0.0 if pow2 else 2 * a + n * b
    if collective == "allreduce":
        small = n < 1024 * ITEMSIZE or n < p * ITEMSIZE   # rhd.ALLREDUCE_SMALL_COUNT elements
        return {"ring": 2 * (p - 1) * a + 2 * f * n * b + f * n * g,
                "tree": 2 * lg * (a + n * b) + lg * n * g,
                "rhd": (lg * (a + n * b + n * g) if small
                        else 2 * lg * a + 2 * f * n * b + f * n * g) + fold,
                }[family]
    if collective in ("reduce",):
        return {"ring": (p - 1) * a + f * n * b + f * n * g + (p - 1) * a + f * n * b,
                "tree": lg * (a + n * b + n * g),
                "rhd": 2 * lg * a + 2 * f * n * b + f * n * g + fold}[family]
    if collective == "broadcast":
        seg = max(1, math.ceil(n / (32768 * ITEMSIZE)))          # ring.SEGMENT elements
        return {"ring": (p - 2 + seg) * (a + n / seg * b),
                "tree": lg * (a + n * b),
                "rhd": 2 * lg * a + 2 * f * n * b + fold}[family]
    if collective in ("allgather",):
        return {"ring": (p - 1) * (a + n * b),
                "tree": 2 * lg * a + (p - 1) * n * b + lg * p * n * b,
                "rhd": lg * a + (p - 1) * n * b + fold}[family]
    if collective == "reduce_scatter":
        return {"ring": (p - 1) * (a + n * b + n * g),
                "tree": 2 * lg * a + lg * p * n * (b + g) + (p - 1) * n * b,
                "rhd": lg * a + (p - 1) * n * (b + g) + fold}[family]
    if collective in ("gather", "scatter"):
        return {"ring": (p - 1) * (a + n * b),
                "tree": lg * a + (p - 1) * n * b,
                "rhd": lg * a + (p - 1) * n * b + fold}[family]
    if collective == "alltoall":
        return {"ring": (p - 1) * (a + n * b),
                "tree": lg * (a + p / 2 * n * b) + 2 * p * n * b,   # Bruck: packing copies
                "rhd": (p - 1) * (a + n * b)}[family]
    if collective == "barrier":
        return {"ring": 2 * p * a, "tree": 2 * lg * a, "rhd": lg * a}[family]
    raise ValueError(collective)


def hier_cost(collective: str, p: int, n: float, topology: Sequence[int],
              m: LinkModel) -> Optional[float]:
    """hier's closed form (a reference: auto never calls it), phase after phase. A pipelined
    allreduce (hier.py, S > 1 segments) overlaps the phases: its time lies between the larger
    phase's and this sum, times (1 + 2/S), plus (S+2)Λα; the simulator runs that schedule."""
    nodes = sorted(set(topology))
    k = len(nodes)
    if k <= 1 or k == p:
        return None       # hier degenerates to a flat algorithm: let the flat families compete
    local = max(list(topology).count(x) for x in nodes)
    ai, bi, ae, be, g = m.alpha_intra, m.beta_intra, m.alpha_inter, m.beta_inter, m.gamma
    intra_ring = lambda coll, nn: flat_cost(coll, "ring", local, nn, ai, bi, g)  # noqa: E731
    inter = lambda coll, nn: flat_cost(coll, "rhd", k, nn, ae, be, g)  # noqa: E731
    if collective == "allreduce":
        # the L shard allreduces cross the network at the same time, so they share the host's
        # NIC: each moves n/L bytes at 1/L of the link rate
        shared = flat_cost("allreduce", "rhd", k, n / local, ae, be * local, g)
        return intra_ring("reduce_scatter", n / local) + shared + intra_ring("allgather", n / local)
    if collective == "reduce":
        return intra_ring("reduce", n) + inter("reduce", n)
    if collective == "broadcast":
        return inter("broadcast", n) + intra_ring("broadcast", n)
    if collective in ("allgather", "gather", "scatter"):
        return (intra_ring("gather", n) + inter(collective, n * local)
                + intra_ring("broadcast", n * p))
    if collective == "reduce_scatter":
        return intra_ring("reduce_scatter", n * k) + inter("reduce_scatter", n * local)
    if collective == "alltoall":
        return (intra_ring("gather", n * p) + inter("alltoall", n * local * local)
                + intra_ring("scatter", n * p))
    if collective == "barrier":
        return 2 * flat_cost("barrier", "tree", local, 0, ai, bi, g) + inter("barrier", 0)
    return None



# ---------------------------------------------------------------------------------- tuned table lookup
def table_index(entries: Sequence[Dict[str, Any]]) -> Dict[TableKey, Tuple[Tuple[int, str], ...]]:
    """Entries (``load_table``'s) -> the lookup a ``LinkModel`` holds."""
    idx: Dict[TableKey, Dict[int, str]] = {}
    for e in entries:
        key = (e["collective"], e["world"], tuple(e["topology"]), e["intra"], e["inter"])
        idx.setdefault(key, {})[e["bytes"]] = e["best"]
    return {k: tuple(sorted(v.items())) for k, v in idx.items()}



def parse_algo_env(value: Optional[str] = None) -> Dict[str, str]:
    """MINICOMM_ALGO='allreduce:ring,broadcast:tree' -> {'allreduce': 'ring', ...}.

    ``collective:auto`` means what it says (the cost model chooses; the entry is dropped). A
    malformed entry, an unknown collective or an unknown algorithm is a ValueError naming
    MINICOMM_ALGO, the entry and the valid choices: a typo must not silently mean auto."""
    value = os.environ.get("MINICOMM_ALGO", "") if value is None else value
    colls = list(COLLECTIVES)
    fams = list(FAMILIES) + ["innet", "auto"]     # innet: where the job has a switch
    usage = (f"entries are 'collective:algorithm' separated by commas; collectives: "
             f"{', '.join(colls)}; algorithms: {', '.join(fams)}")
    out = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        coll, sep, fam = (x.strip() for x in item.partition(":"))
        if not sep or not coll or not fam:
            raise ValueError(f"MINICOMM_ALGO={value!r}: entry {item!r} is not "
                             f"'collective:algorithm'; {usage}")
        if coll not in colls:
            raise ValueError(f"MINICOMM_ALGO={value!r}: unknown collective {coll!r} in entry "
                             f"{item!r}; {usage}")
        if fam not in fams:
            raise ValueError(f"MINICOMM_ALGO={value!r}: unknown algorithm {fam!r} in entry "
                             f"{item!r}; {usage}")
        if fam == "auto":
            out.pop(coll, None)
        else:
            out[coll] = fam
    return out
