"""algorithm="auto": a tuned table when one was measured, else the α-β-γ cost of each schedule.

How auto picks a family for (collective, world size p, message bytes, topology):

1. ``MINICOMM_ALGO`` and the per-call ``algorithm=`` win over everything (the communicator checks
   them before asking this module).
2. The tuned table (``minicomm bench --tune``, or ``measure_table`` + ``write_table``), when it has
   an entry for this collective, world size, node layout and transports whose size is within a
   factor of 2 of the call's (the nearest in log scale; equally near: the smaller).
3. Otherwise the cost model: every family's schedules for all p ranks are *simulated* (the
   schedule is data: the simulator walks the real steps, so rhd's switch between recursive
   doubling and Rabenseifner, ring broadcast's segments, tree's serial sends and hier's phases
   are costed as they run). p > ``SIM_MAX_RANKS`` uses the closed-form costs ``flat_cost`` /
   ``hier_cost`` (Thakur, Rabenseifner, Gropp 2005) instead.

The simulator (``schedule_time`` / ``simulate``). Each rank is a process that works on a CPU or
waits, and runs its steps as the executor does: local ops (Copy δ, Reduce γ per byte) and posting
its receives (o each); its sends, eager (shm rings and socket buffers take them): o plus the
copy-in, β/2 per byte, the message visible to its receiver ``lat`` = α - 3o after its first piece
(shm: 1 MiB records; so small messages are store-and-forward, large ones pipelined); then its
receives in arrival order: o plus the copy-out, β/2 per byte (a reducing receive max(β/2, γ): it
reduces straight out of the landing memory), the last piece no earlier than the sender copied it
in. FIFO matching per pair. A waiting rank spins for the transport's ``SPIN_S``, then sleeps: the
message that wakes it costs ``wake`` more when the rank has a core to itself (an idle core must be
woken). A node's ranks share its ``cores`` (fluid processor sharing among working and spinning
ranks; work on a shared core is ``SHARING_LOSS`` less efficient; k ranks working at once slow
each other down by 1 + contention·(k-1): shared memory bandwidth, or virtual CPUs that are not
independent), so an algorithm that keeps few ranks busy at once (tree) is costed as it runs. The
call's time is the last rank's end. Schedules are built with 4-byte elements (auto sees bytes,
not the dtype).

Link parameters (``LinkModel``): per link class (intra-node, inter-node) α (one exchange step), β
(s/byte) and o (CPU per message operation); γ (in-place add, s/byte of array), δ (memcpy), wake,
contention and the node's cores. At communicator start (``agree_link_model``, called by
``connect_world``) rank 0 reads ``links-<hostname>.json`` from the cache directory, or measures
what it lacks, on a two-rank communicator of rank 0 and a peer over that link (``probe_link``:
three 8-byte calls whose differences, against the simulator's prediction for the same schedules,
give o and α, then ``PROBE_BYTES`` exchanged and sent one way for β; ``probe_contention``: copies
by one rank, then by two at once; ``probe_wake``: a message to a sleeping rank; ``measure_local``:
γ and δ with numpy on 32 MiB). It writes the cache (so a machine measures once: delete the file
to measure again, best on an idle machine) and sends its values, and the tuned-table entries of
this world's transports, to every rank: the choice is identical on every rank even when their
own measurements or files would differ. ``MINICOMM_TUNE=0`` measures nothing (the constants
``DEFAULT_LINKS``, ``GAMMA``, ``DELTA``, ``WAKE``; a tuned table is still followed). A corrupt
cache file is ignored with a warning (and measured anew). The cache directory is
``$MINICOMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/minicomm``, else ``~/.cache/minicomm``. Link
cache format (JSON; seconds, seconds per byte)::

    {"format": "minicomm-links/3", "host": "box1",
     "links": {"shm": {"alpha": 1.0e-05, "beta": 1.6e-10, "overhead": 3.5e-06},
               "tcp": {...}, "tcp>box2": {...}},            # ">host": the link to another host
     "gamma": 8.1e-11, "delta": 7.9e-11, "wake": 2.3e-04, "contention": 0.33}

Tuned table API (for ``minicomm bench --tune``)::

    entries = measure_table(target, collectives, sizes, algorithms=FAMILIES,
                            batch_seconds=0.02, batches=5, max_iters=1000)
        target: a Communicator (call it on every rank, like a collective; every rank gets the same
                entries) or a dict of ``mc.spawn`` keyword arguments, e.g.
                {"world_size": 4, "transport": "shm", "nodes": 1} (it starts the ranks itself).
        sizes: message sizes in bytes *as auto sees them*: the per-rank block, count x itemsize,
                i.e. the vector for broadcast / reduce / allreduce, one rank's input for
                allgather / gather, one block (a 1/p of the input) for reduce_scatter / alltoall /
                scatter. (nccl-tests' size is p times that for the block collectives.) Each is
                rounded down to whole float32 elements (at least one); barrier is measured once,
                at 0 bytes, whatever ``sizes`` says.
        Timing: float32 sum, root 0, each family called explicitly (so no table or env var
        decides); a batch is ``k`` back-to-back calls after a barrier, k chosen so a batch takes
        ``batch_seconds`` (1..max_iters); one untimed batch each first; families are interleaved
        batch by batch (drift hits all alike); a batch's time is the slowest rank's; an entry's
        time is the median over ``batches`` batches. ``time_algorithms(comm, collective, bytes,
        algorithms, ...)`` does this for one size (any of FAMILIES and "auto") and returns
        {algorithm: seconds}, the same on every rank.
    path = write_table(entries, path=None)   # merge into tune-<hostname>.json (entries with the
                                             # same key are replaced), atomically; returns the path
    entries = load_table(path=None)          # [] when missing; a corrupt file: warning and []

Table file format (JSON), one entry per measured (key, size)::

    {"format": "minicomm-tune/1", "host": "box1",
     "entries": [{"collective": "allreduce", "world": 4, "topology": [0, 0, 0, 0],
                  "intra": "shm", "inter": "tcp", "bytes": 1024,
                  "seconds": {"ring": 3.1e-05, "tree": 2.9e-05, "rhd": 2.2e-05, "hier": 3.1e-05},
                  "best": "rhd"}, ...]}

    key = (collective, world, topology, intra, inter): ``topology`` is the node index of every
    rank (nodes numbered by first appearance, as ``comm.topology``); ``intra`` / ``inter`` are the
    transports inside a node / between nodes (as ``comm.link_model`` names them: shm+tcp for
    transport "shm" or "auto", tcp+tcp for "tcp"). ``best`` is the family auto follows;
    ``seconds`` is informational (median seconds per call).
"""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .schedule import Copy, Recv, Reduce, Send
from .transports.progress import SPIN_S      # how long a waiting rank spins before it sleeps

FAMILIES = ("ring", "tree", "rhd", "hier")

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
# A receiver sees a message piece by piece: shm publishes records of up to 1 MiB (transports/
# shm.py CHUNK), a socket delivers what has arrived.
PIPELINE_CHUNK = {"shm": 1 << 20}
STREAM_CHUNK = 64 << 10
PROBE_BYTES = 1 << 20      # for β: one shm record, so a one-way hop is not pipelined
PROBE_REPS = (30, 10)      # repetitions of the small and the large probes (the minimum counts)
CONTENTION_COPIES = 100    # 1 MiB copies per contention probe (a few ms)
MAX_CONTENTION = 2.0
LOCAL_PROBE_BYTES = 32 << 20
WAKE_PROBE_SLEEP = 2e-3    # long enough for the waiting rank to give up spinning and sleep
# Work on a core shared by several ranks runs at share / (1 + SHARING_LOSS * (1 - share)): time
# slicing costs switches and cache refills. Fitted on the 2-core reference box (4 ranks on 2
# cores: any value in 0.5..2 makes the model pick the measured best); not measured at start.
SHARING_LOSS = 1.0


LINKS_FORMAT = "minicomm-links/3"
TABLE_FORMAT = "minicomm-tune/1"

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
        fam = table_choice(m, *key) or model_choice(*key, m)
        if len(m._choices) > 4096:
            m._choices.clear()
        m._choices[key] = fam
    return fam


def table_choice(m: LinkModel, collective: str, p: int, nbytes: int,
                 topology: Tuple[int, ...]) -> Optional[str]:
    """The tuned table's family for the measured size nearest ``nbytes`` (within a factor of 2)."""
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


def model_choice(collective: str, p: int, nbytes: int, topology: Tuple[int, ...],
                 m: LinkModel) -> str:
    costs = model_costs(collective, p, nbytes, topology, m)
    return min(costs, key=lambda f: (costs[f], FAMILIES.index(f)))


def model_costs(collective: str, p: int, nbytes: int, topology: Tuple[int, ...],
                m: LinkModel) -> Dict[str, float]:
    """Predicted seconds per family. hier competes only when it differs from the flat families
    (more than one node, fewer nodes than ranks)."""
    k = len(set(topology))
    fams = [f for f in FAMILIES if f != "hier" or 1 < k < p]
    if p > SIM_MAX_RANKS:
        crosses = k > 1
        a, b = (m.alpha_inter, m.beta_inter) if crosses else (m.alpha_intra, m.beta_intra)
        out = {f: flat_cost(collective, f, p, nbytes, a, b, m.gamma) for f in fams if f != "hier"}
        h = hier_cost(collective, p, nbytes, topology, m)
        if h is not None and "hier" in fams:
            out["hier"] = h
        return out
    count = nbytes // ITEMSIZE
    return {f: schedule_time(collective, f, p, count, tuple(topology), m) for f in fams}


# ---------------------------------------------------------------------------------- simulator
def schedule_time(collective: str, fam: str, p: int, count: int, topology: Tuple[int, ...],
                  m: LinkModel, itemsize: int = ITEMSIZE) -> float:
    """Predicted seconds of one call: the schedules of all p ranks run on the model (module doc)."""
    from .algorithms import family
    build = family(fam).build     # uncached: the model must not evict the executor's schedules
    scheds = [build(collective, r, p, count, 0, topology).steps for r in range(p)]
    return simulate(scheds, topology, m, itemsize)


class _Link:
    """One link class as the simulator uses it."""
    __slots__ = ("lat", "bs", "br", "chunk", "o")

    def __init__(self, alpha: float, beta: float, o: float, kind: str):
        self.o = o
        self.lat = max(0.0, alpha - 3 * o)       # α is a whole exchange step: 3 ops + latency
        self.bs = self.br = beta / 2             # the sender copies in, the receiver copies out
        self.chunk = PIPELINE_CHUNK.get(kind, STREAM_CHUNK)


class _Msg:
    """A message in flight: when its first piece and its last are visible to the receiver."""
    __slots__ = ("first", "last", "nbytes", "link")

    def __init__(self, nbytes: int, link: _Link):
        self.first = self.last = math.inf
        self.nbytes, self.link = nbytes, link


def simulate(scheds: Sequence[Sequence[Sequence[Any]]], topology: Sequence[int], m: LinkModel,
             itemsize: int = ITEMSIZE) -> float:
    """Run the steps of every rank on the model; returns the last rank's end (seconds).

    Each rank is a process: CPU work, then waits. Per step, as the executor does: local ops (Copy
    δ, Reduce γ per byte) and posting every receive (o each); each send (o, then its copy-in, β/2
    per byte; the message is visible ``lat`` after its first piece is in, complete ``lat`` after
    its last); then the receives in arrival order (o plus the copy-out, β/2 per byte, or the
    reduce, max(β/2, γ); the last piece only after the sender copied it in). A waiting rank spins
    for the transport's SPIN_S, then sleeps: a message that wakes it costs ``m.wake`` more when it
    has a core to itself. A node's ranks share its ``m.cores`` cores (fluid processor sharing:
    working and spinning ranks each get cores / runnable of a core, at most one), and work on a
    shared core is ``SHARING_LOSS`` less efficient (switches, cold caches)."""
    p = len(scheds)
    g, d = m.gamma, m.delta
    intra = _Link(m.alpha_intra, m.beta_intra, m.overhead_intra, m.intra)
    inter = _Link(m.alpha_inter, m.beta_inter, m.overhead_inter, m.inter)
    nodes: Dict[Any, int] = {}
    for t in topology:
        nodes[t] = nodes.get(t, 0) + 1
    cores = {n: (min(m.cores, k) if m.cores else k) for n, k in nodes.items()}
    shared = {n: cores[n] < k for n, k in nodes.items()}

    def link(a: int, b: int) -> _Link:
        return intra if topology[a] == topology[b] else inter

    sent: Dict[Tuple[int, int], List[_Msg]] = {}
    taken: Dict[Tuple[int, int], int] = {}
    step = [-1] * p
    # per rank: ("cpu", seconds, stamp when done) or ("last", message to wait for, None)
    todo: List[List[Tuple[str, Any, Any]]] = [[] for _ in range(p)]
    recvs: List[List[Tuple[Recv, int, int]]] = [[] for _ in range(p)]   # (op, peer, FIFO index)
    cpu = [0.0] * p                  # CPU seconds left of the current work item
    mark: List[Any] = [None] * p     # (field, msg) to stamp when the work item ends
    waiting: List[Any] = [None] * p  # None, ("first", None): any receive, ("last", message)
    wait_since = [0.0] * p
    wake_at: List[Optional[float]] = [None] * p
    done = [False] * p
    end = [0.0] * p
    now = 0.0

    def msg(src: int, dst: int, k: int) -> Optional[_Msg]:
        q = sent.get((src, dst), ())
        return q[k] if k < len(q) else None

    def begin_step(r: int) -> None:
        step[r] += 1
        if step[r] >= len(scheds[r]):
            done[r], end[r] = True, now
            return
        ops = scheds[r][step[r]]
        work = 0.0
        items: List[Tuple[str, Any, Any]] = []
        seen: Dict[int, int] = {}
        for o in ops:
            if isinstance(o, Copy):
                work += o.count * itemsize * d
            elif isinstance(o, Reduce):
                work += o.count * itemsize * g
            elif isinstance(o, Recv):
                work += link(o.peer, r).o
                k = taken.get((o.peer, r), 0) + seen.get(o.peer, 0)
                seen[o.peer] = seen.get(o.peer, 0) + 1
                recvs[r].append((o, o.peer, k))
        for peer, n in seen.items():
            taken[(peer, r)] = taken.get((peer, r), 0) + n
        items.append(("cpu", work, None))
        for o in ops:
            if isinstance(o, Send):
                ln = link(r, o.peer)
                mg = _Msg(o.count * itemsize, ln)
                sent.setdefault((r, o.peer), []).append(mg)
                head = min(mg.nbytes, ln.chunk) * ln.bs
                items.append(("cpu", ln.o + head, ("first", mg)))
                items.append(("cpu", mg.nbytes * ln.bs - head, ("last", mg)))
        todo[r] = items
        advance(r)

    def advance(r: int) -> None:
        """Start the rank's next work item, or make it wait."""
        while True:
            if todo[r]:
                kind, what, stamp = todo[r].pop(0)
                if kind == "cpu":
                    if what > 0:
                        cpu[r], mark[r] = what, stamp
                        return
                    finish(stamp)
                    continue
                if what.last > now:          # "last": the sender's final piece is not in yet
                    waiting[r], wait_since[r] = ("last", what), now
                    return
                continue
            ready = [(mg.first, i, mg) for i, (o, peer, k) in enumerate(recvs[r])
                     if (mg := msg(peer, r, k)) is not None and mg.first <= now]
            if ready:
                _, i, mg = min(ready, key=lambda x: (x[0], x[1]))
                o = recvs[r].pop(i)[0]
                ln = mg.link
                per = max(ln.br, g) if o.reduce else ln.br
                tail = min(mg.nbytes, ln.chunk) * per
                todo[r] = [("cpu", ln.o + mg.nbytes * per - tail, None), ("last", mg, None),
                           ("cpu", tail, None)]
                continue
            if recvs[r]:
                waiting[r], wait_since[r] = ("first", None), now
                return
            begin_step(r)
            return

    def finish(stamp: Any) -> None:
        if stamp is not None:
            setattr(stamp[1], stamp[0], now + stamp[1].link.lat)

    def satisfied(r: int) -> bool:
        kind, mg = waiting[r]
        if kind == "last":
            return mg.last <= now
        return any((x := msg(peer, r, k)) is not None and x.first <= now
                   for _, peer, k in recvs[r])

    def pending_times(r: int):
        kind, mg = waiting[r]
        if kind == "last":
            yield mg.last
            return
        for _, peer, k in recvs[r]:
            x = msg(peer, r, k)
            if x is not None:
                yield x.first

    for r in range(p):
        begin_step(r)
    while not all(done):
        moved = True
        while moved:                     # wake every rank whose message has arrived
            moved = False
            for r in range(p):
                if done[r] or waiting[r] is None or not satisfied(r):
                    continue
                if wake_at[r] is None and now - wait_since[r] > SPIN_S \
                        and not shared[topology[r]] and m.wake > 0:
                    wake_at[r] = now + m.wake    # it fell asleep: the kernel wakes it
                if wake_at[r] is not None and wake_at[r] > now:
                    continue
                wake_at[r], waiting[r] = None, None
                advance(r)
                moved = True
        if all(done):
            break
        busy = dict.fromkeys(nodes, 0)       # working or spinning: they hold a core
        working = dict.fromkeys(nodes, 0)
        for r in range(p):
            if done[r]:
                continue
            if waiting[r] is None:
                working[topology[r]] += 1
                busy[topology[r]] += 1
            elif wake_at[r] is None and now - wait_since[r] <= SPIN_S:
                busy[topology[r]] += 1
        rate = {}
        for n in nodes:
            share = min(1.0, cores[n] / busy[n]) if busy[n] else 1.0
            rate[n] = share / (1 + SHARING_LOSS * (1 - share)) \
                / (1 + m.contention * max(0, min(working[n], cores[n]) - 1))
        nxt = math.inf
        for r in range(p):
            if done[r]:
                continue
            if waiting[r] is None:
                nxt = min(nxt, now + cpu[r] / rate[topology[r]])
                continue
            if wake_at[r] is not None:
                nxt = min(nxt, wake_at[r])
                continue
            if now - wait_since[r] <= SPIN_S:
                nxt = min(nxt, wait_since[r] + SPIN_S * (1 + 1e-9) + 1e-12)
            for t in pending_times(r):
                if t > now:
                    nxt = min(nxt, t)
        if nxt == math.inf:
            raise RuntimeError("schedules deadlock in the cost model (an unmatched receive)")
        for r in range(p):
            if not done[r] and waiting[r] is None:
                cpu[r] -= (nxt - now) * rate[topology[r]]
        now = nxt
        for r in range(p):
            if not done[r] and waiting[r] is None and cpu[r] <= 1e-15:
                stamp, mark[r] = mark[r], None
                finish(stamp)
                advance(r)
    return max(end)


# ---------------------------------------------------------------------------------- formulas
def _lg(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def flat_cost(collective: str, family: str, p: int, n: float, a: float, b: float,
              g: float) -> float:
    """Closed-form cost of a flat family on one link class (used above ``SIM_MAX_RANKS``).
    n = bytes per rank-block."""
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


# ---------------------------------------------------------------------------------- cache files
def cache_dir() -> str:
    env = os.environ.get("MINICOMM_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "minicomm")


def links_path() -> str:
    return os.path.join(cache_dir(), f"links-{socket.gethostname()}.json")


def table_path() -> str:
    return os.path.join(cache_dir(), f"tune-{socket.gethostname()}.json")


def _write_json(path: str, obj: Any) -> None:
    """Write atomically: concurrent jobs of one machine never see a half-written file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read_json(path: str, fmt: str, what: str) -> Optional[Dict[str, Any]]:
    """The file's object, None when it is missing; a corrupt one is ignored with a warning."""
    try:
        with open(path) as f:
            obj = json.load(f)
        if not isinstance(obj, dict) or obj.get("format") != fmt:
            raise ValueError(f"not a {fmt} file")
        return obj
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"minicomm: ignoring corrupt {what} {path}: {e}", stacklevel=3)
        return None


def load_links(path: Optional[str] = None) -> Dict[str, Any]:
    """The link cache: {"links": {name: {"alpha", "beta", "overhead"}}, "gamma", "delta", "wake"}
    (missing keys: not measured yet). Invalid values make the whole file corrupt (warned,
    ignored)."""
    path = path or links_path()
    obj = _read_json(path, LINKS_FORMAT, "link cache")
    if obj is None:
        return {"links": {}}
    try:
        links = {str(k): {f: _nonnegative(v[f]) for f in _LINK_FIELDS}
                 for k, v in dict(obj.get("links", {})).items()}
        out: Dict[str, Any] = {"links": links}
        for k in _MACHINE_FIELDS:
            if k in obj:
                out[k] = _nonnegative(obj[k])
        return out
    except (KeyError, TypeError, ValueError) as e:
        warnings.warn(f"minicomm: ignoring corrupt link cache {path}: {e!r}", stacklevel=2)
        return {"links": {}}


_LINK_FIELDS = ("alpha", "beta", "overhead")
_MACHINE_FIELDS = ("gamma", "delta", "wake", "contention")


def _nonnegative(v: Any) -> float:
    x = float(v)
    if not (x >= 0 and math.isfinite(x)):
        raise ValueError(f"{v!r} is not a non-negative number")
    return x


def save_links(data: Dict[str, Any], path: Optional[str] = None) -> str:
    path = path or links_path()
    _write_json(path, {"format": LINKS_FORMAT, "host": socket.gethostname(), **data})
    return path


# ---------------------------------------------------------------------------------- measuring links
def _probe_min(call, reps: int) -> float:
    call()                                        # warm-up: schedules built, pages touched
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def _probe_model(kind: str, o: float, lat: float, beta: float, gamma: float,
                 delta: float, contention: float) -> LinkModel:
    a = 3 * o + lat
    return LinkModel(a, beta, a, beta, gamma, delta, o, o, 0.0, contention, 0, kind, kind)


def probe_link(pair, kind: str, gamma: float, delta: float, contention: float) -> Dict[str, float]:
    """α, β and o of the link between the two ranks of ``pair`` (a 2-rank communicator; both
    call; rank 0's values count). Each probe is the fastest of ``PROBE_REPS`` calls; every value
    is fitted so that the simulator, run on the very schedules probed, predicts what was measured.

    Three 8-byte calls: rhd allgather (one exchange step), ring allreduce (two exchange steps),
    tree allreduce (two one-way hops): their differences cancel the per-call cost and give o and
    the latency (the prediction is linear in both). Then ``PROBE_BYTES`` through the same rhd
    allgather (both ranks copy at once) and tree allreduce (one copies at a time), less their
    8-byte times: β by least squares (no less than δ/4: a byte is copied in and out)."""
    small = np.zeros(2, dtype=np.float32)
    large = np.zeros(PROBE_BYTES // 4, dtype=np.float32)
    one = _probe_min(lambda: pair.allgather(small, algorithm="rhd"), PROBE_REPS[0])
    two = _probe_min(lambda: pair.allreduce(small, algorithm="ring"), PROBE_REPS[0])
    hops = _probe_min(lambda: pair.allreduce(small, algorithm="tree"), PROBE_REPS[0])
    big_x = _probe_min(lambda: pair.allgather(large, algorithm="rhd"), PROBE_REPS[1])
    big_h = _probe_min(lambda: pair.allreduce(large, algorithm="tree"), PROBE_REPS[1])
    probes = (("allgather", "rhd"), ("allreduce", "ring"), ("allreduce", "tree"))

    def sim(i: int, o: float, lat: float, beta: float = 0.0, count: int = 2,
            g: float = 0.0, d: float = 0.0) -> float:
        return schedule_time(*probes[i], 2, count, (0, 0),
                             _probe_model(kind, o, lat, beta, g, d, contention))

    coef = np.array([[sim(i, 1.0, 0.0) - sim(0, 1.0, 0.0), sim(i, 0.0, 1.0) - sim(0, 0.0, 1.0)]
                     for i in (1, 2)])
    o, lat = np.linalg.lstsq(coef, np.array([two - one, hops - one]), rcond=None)[0]
    o, lat = max(float(o), 0.1e-6), max(float(lat), 0.0)
    n = PROBE_BYTES // 4

    def grow(i: int, beta: float) -> float:       # the probe's growth from 8 bytes to n floats
        return sim(i, o, lat, beta, n, gamma, delta) - sim(i, o, lat, beta, 2, gamma, delta)
    # the growth is linear in β: fit both probes at once
    base = np.array([grow(0, 0.0), grow(2, 0.0)])
    slope = (np.array([grow(0, 1e-9), grow(2, 1e-9)]) - base) / 1e-9
    excess = np.array([big_x - one, big_h - hops]) - base
    beta = float(slope @ excess / (slope @ slope))
    return {"alpha": 3 * o + lat, "beta": max(beta, delta / 4), "overhead": o}


def probe_contention(pair, reps: int = 5) -> float:
    """How much two ranks of one host working at once slow each other down (rank 0's value
    counts): rank 0 times ``CONTENTION_COPIES`` copies of 1 MiB alone (rank 1 sleeps in a
    barrier), then both do at the same time; fastest of ``reps`` each; ratio - 1, at least 0."""
    a = np.ones(1 << 18, dtype=np.float32)
    b = np.ones(1 << 18, dtype=np.float32)

    def copies() -> float:
        t = time.perf_counter()
        for _ in range(CONTENTION_COPIES):
            np.copyto(a, b)
        return time.perf_counter() - t
    alone = together = math.inf
    for _ in range(reps):
        pair.barrier(algorithm="rhd")
        if pair.rank == 0:
            alone = min(alone, copies())
        pair.barrier(algorithm="rhd")
        together = min(together, copies())
    return min(MAX_CONTENTION, max(0.0, together / alone - 1)) if pair.rank == 0 else 0.0


def probe_wake(pair, reps: int = 5) -> float:
    """Extra latency of a message to a rank asleep in the kernel (two ranks of one host; rank 0's
    value counts): rank 1 sleeps, stamps the clock, then joins an allgather rank 0 has been
    waiting in; rank 0 compares that stamp (CLOCK_MONOTONIC, shared by the host) with the end of
    its call, less the same call's time against a spinning peer."""
    x = np.zeros(1, dtype=np.float64)
    spinning = _probe_min(lambda: pair.allgather(x, algorithm="rhd"), PROBE_REPS[0])
    delays = []
    for _ in range(reps):
        if pair.rank == 1:
            time.sleep(WAKE_PROBE_SLEEP)
            x[0] = time.perf_counter()
        y = pair.allgather(x, algorithm="rhd")
        delays.append(time.perf_counter() - y[1, 0])
    return max(0.0, min(delays) - spinning)


_local_cache: Dict[str, Tuple[float, float]] = {}


def measure_local() -> Tuple[float, float]:
    """(γ, δ) of this machine: numpy in-place add and memcpy of 32 MiB (beyond the caches, as
    large messages are), s per byte, fastest of 5."""
    if "gd" not in _local_cache:
        a = np.ones(LOCAL_PROBE_BYTES // 4, dtype=np.float32)
        b = np.ones(LOCAL_PROBE_BYTES // 4, dtype=np.float32)
        g = _probe_min(lambda: np.add(a, b, out=a), 5) / a.nbytes
        d = _probe_min(lambda: np.copyto(a, b), 5) / a.nbytes
        _local_cache["gd"] = (max(g, 1e-12), max(d, 1e-12))
    return _local_cache["gd"]


def _tune_enabled() -> bool:
    return os.environ.get("MINICOMM_TUNE", "1").strip().lower() not in ("0", "off", "false", "no")


_AGREED = ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma", "delta",
           "overhead_intra", "overhead_inter", "wake", "contention", "cores")


def agree_link_model(comm, intra: str, inter: str) -> LinkModel:
    """Every rank of a new world communicator calls this (collective). Rank 0's cached or freshly
    measured link parameters, and its tuned-table entries for these transports, become every
    rank's ``LinkModel`` (module doc). Uses only explicit-algorithm collectives, so it does not
    depend on the model it is building."""
    rank, size, topo = comm.rank, comm.size, comm.topology
    near = next((r for r in range(1, size) if topo[r] == topo[0]), None)
    far = next((r for r in range(1, size) if topo[r] != topo[0]), None)
    want = np.array([_tune_enabled() if rank == 0 else 0], dtype=np.int64)
    want = comm.broadcast(want, root=0, algorithm="tree")
    values: Dict[str, float] = {}
    if want[0]:
        values = _measure_links(comm, near, far, intra, inter)
    if rank == 0:
        default = LinkModel.for_transports(intra, inter)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        payload: Dict[str, Any] = {f: values.get(f, getattr(default, f)) for f in _AGREED}
        payload["cores"] = int(cores or 0)
        payload["table"] = [e for e in load_table() if e["intra"] == intra and e["inter"] == inter]
        data = np.frombuffer(json.dumps(payload).encode(), dtype=np.uint8)
    else:
        data = np.empty(0, dtype=np.uint8)
    n = comm.broadcast(np.array([data.size], dtype=np.int64), root=0, algorithm="tree")
    if rank != 0:
        data = np.empty(int(n[0]), dtype=np.uint8)
    agreed = json.loads(comm.broadcast(data, root=0, algorithm="tree").tobytes().decode())
    m = LinkModel(**{f: agreed[f] for f in _AGREED}, intra=intra, inter=inter,
                  table=table_index(agreed["table"]))
    comm._log(f"links: intra {intra} α {m.alpha_intra * 1e6:.1f} us o "
              f"{m.overhead_intra * 1e6:.1f} us {1e-9 / m.beta_intra:.2f} GB/s; inter {inter} "
              f"α {m.alpha_inter * 1e6:.1f} us o {m.overhead_inter * 1e6:.1f} us "
              f"{1e-9 / m.beta_inter:.2f} GB/s; wake {m.wake * 1e6:.0f} us; {m.cores} cores; "
              f"{len(agreed['table'])} tuned-table entries")
    return m


# Communicator ids of the two-rank probe communicators: the world is 1 and split() ids end in
# the byte 2, so these never meet another communicator's messages.
_PAIR_IDS = (3, 4)


def _pair(comm, peer: int, comm_id: int):
    """The two-rank communicator (world rank 0, ``peer``) over the world's transport. Only the two
    build it: unlike split(), the other ranks take no part."""
    from .communicator import Communicator
    ranks = (0, peer)
    return Communicator(comm.transport, ranks.index(comm.rank), 2, group=ranks,
                        topology=[comm.topology[r] for r in ranks], comm_id=comm_id,
                        timeout=comm.timeout, link_model=comm.link_model, _owner=False)


def _measure_links(comm, near: Optional[int], far: Optional[int], intra: str,
                   inter: str) -> Dict[str, float]:
    """Rank 0's values (LinkModel field names): from its cache, or probed now with the peer of
    each link (the peers learn from rank 0 what to probe). Returns {} on other ranks."""
    rank = comm.rank
    cache = load_links() if rank == 0 else {"links": {}}
    if rank == 0 and not ("gamma" in cache and "delta" in cache):
        cache["gamma"], cache["delta"] = measure_local()
    out: Dict[str, float] = {}
    dirty = False
    for peer, kind, side, pair_id in ((near, intra, "intra", _PAIR_IDS[0]),
                                      (far, inter, "inter", _PAIR_IDS[1])):
        if peer is None or rank not in (0, peer):
            continue
        pair = _pair(comm, peer, pair_id)
        # the peer tells rank 0 where it runs: a link to another host has its own cache entry
        host = pair.broadcast_object(socket.gethostname(), root=1)
        local = host == socket.gethostname()
        name = kind if local else f"{kind}>{host}"
        # host-wide values are measured by a pair on this host, the link by its own pair
        todo = [local and "contention" not in cache, cache["links"].get(name) is None,
                local and "wake" not in cache] if rank == 0 else [0, 0, 0]
        todo = pair.broadcast(np.array(todo, dtype=np.int64), root=0, algorithm="tree")
        if todo[0]:
            contention = probe_contention(pair)
            if rank == 0:
                cache["contention"], dirty = contention, True
        if todo[1]:
            got = probe_link(pair, kind, cache.get("gamma", DELTA), cache.get("delta", DELTA),
                             cache.get("contention", 0.0))
            if rank == 0:
                cache["links"][name], dirty = got, True
        if todo[2]:
            wake = probe_wake(pair)
            if rank == 0:
                cache["wake"], dirty = wake, True
        if rank == 0:
            for f in _LINK_FIELDS:
                out[f"{f}_{side}"] = cache["links"][name][f]
        pair.close()
    if rank != 0:
        return {}
    for f in _MACHINE_FIELDS:
        if f in cache:
            out[f] = cache[f]
    if dirty:
        try:
            save_links(cache)
        except OSError as e:      # a read-only home must not stop a job: measure again next time
            warnings.warn(f"minicomm: could not write the link cache: {e}", stacklevel=2)
    return out


# ---------------------------------------------------------------------------------- tuned table
def table_index(entries: Sequence[Dict[str, Any]]) -> Dict[TableKey, Tuple[Tuple[int, str], ...]]:
    """Entries (``load_table``'s) -> the lookup a ``LinkModel`` holds."""
    idx: Dict[TableKey, Dict[int, str]] = {}
    for e in entries:
        key = (e["collective"], e["world"], tuple(e["topology"]), e["intra"], e["inter"])
        idx.setdefault(key, {})[e["bytes"]] = e["best"]
    return {k: tuple(sorted(v.items())) for k, v in idx.items()}


def _entry_key(e: Dict[str, Any]) -> Tuple:
    return (e["collective"], e["world"], tuple(e["topology"]), e["intra"], e["inter"], e["bytes"])


def _check_entry(e: Any) -> Dict[str, Any]:
    from .schedule import COLLECTIVES
    if not isinstance(e, dict):
        raise ValueError(f"entry {e!r} is not an object")
    out = {"collective": str(e["collective"]), "world": int(e["world"]),
           "topology": [int(t) for t in e["topology"]], "intra": str(e["intra"]),
           "inter": str(e["inter"]), "bytes": int(e["bytes"]), "best": str(e["best"]),
           "seconds": {str(k): float(v) for k, v in dict(e.get("seconds", {})).items()}}
    if out["collective"] not in COLLECTIVES:
        raise ValueError(f"unknown collective {out['collective']!r}")
    if out["best"] not in FAMILIES:
        raise ValueError(f"unknown algorithm {out['best']!r}")
    if len(out["topology"]) != out["world"] or out["bytes"] < 0:
        raise ValueError(f"entry {e!r}: topology does not name every rank, or bytes < 0")
    return out


def load_table(path: Optional[str] = None) -> List[Dict[str, Any]]:
    """The tuned table's entries ([] when there is none); a corrupt file warns and gives []."""
    path = path or table_path()
    obj = _read_json(path, TABLE_FORMAT, "tuned table")
    if obj is None:
        return []
    try:
        return [_check_entry(e) for e in obj["entries"]]
    except (KeyError, TypeError, ValueError) as e:
        warnings.warn(f"minicomm: ignoring corrupt tuned table {path}: {e!r}", stacklevel=2)
        return []


def write_table(entries: Sequence[Dict[str, Any]], path: Optional[str] = None) -> str:
    """Merge ``entries`` into the table file (same key and size: replaced); returns its path."""
    path = path or table_path()
    merged = {_entry_key(e): e for e in load_table(path)}
    for e in entries:
        try:
            e = _check_entry(e)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a tuned-table entry ({err!r}): {e!r}; the fields are "
                             f"documented in minicomm.tuning's module docstring") from None
        merged[_entry_key(e)] = e
    _write_json(path, {"format": TABLE_FORMAT, "host": socket.gethostname(),
                       "entries": sorted(merged.values(), key=_entry_key)})
    return path


def _call(comm, collective: str, nbytes: int):
    """A zero-argument function doing one float32 call of ``collective`` with ``algorithm=``."""
    n = max(1, nbytes // 4)
    p = comm.size
    if collective == "barrier":
        return lambda algo: comm.barrier(algorithm=algo)
    if collective in ("reduce_scatter", "alltoall", "scatter"):
        x = np.ones((p, n), dtype=np.float32)
        out = np.empty(n if collective != "alltoall" else (p, n), dtype=np.float32)
    else:
        x = np.ones(n, dtype=np.float32)
        out = np.empty((p, n) if collective in ("allgather", "gather") else n, dtype=np.float32)
    fn = getattr(comm, collective)
    if collective in ("reduce", "gather"):
        mine = out if comm.rank == 0 else None
        return lambda algo: fn(x, root=0, algorithm=algo, out=mine)
    if collective in ("broadcast", "scatter"):
        return lambda algo: fn(x, root=0, algorithm=algo, out=out)
    return lambda algo: fn(x, algorithm=algo, out=out)


def time_algorithms(comm, collective: str, nbytes: int, algorithms: Sequence[str] = FAMILIES,
                    batch_seconds: float = 0.02, batches: int = 5,
                    max_iters: int = 1000) -> Dict[str, float]:
    """Median seconds per call of each algorithm (the slowest rank per batch); collective: every
    rank calls it and gets the same numbers."""
    call = _call(comm, collective, nbytes)
    est = np.zeros(len(algorithms))
    for i, algo in enumerate(algorithms):
        call(algo)                                     # warm-up
        t = time.perf_counter()
        call(algo)
        est[i] = time.perf_counter() - t
    est = comm.allreduce(est, op="max", algorithm="rhd")
    iters = [int(min(max_iters, max(1, batch_seconds / max(e, 1e-9)))) for e in est]
    times = np.zeros((len(algorithms), batches))
    for i, algo in enumerate(algorithms):
        for _ in range(iters[i]):   # an untimed batch: ranks that just started run cold
            call(algo)
    for j in range(batches):
        for i, algo in enumerate(algorithms):
            comm.barrier(algorithm="rhd")
            t = time.perf_counter()
            for _ in range(iters[i]):
                call(algo)
            times[i, j] = (time.perf_counter() - t) / iters[i]
    times = comm.allreduce(times, op="max", algorithm="rhd")
    return {algo: float(statistics.median(times[i])) for i, algo in enumerate(algorithms)}


def measure_table(target, collectives: Sequence[str], sizes: Sequence[int],
                  algorithms: Sequence[str] = FAMILIES, batch_seconds: float = 0.02,
                  batches: int = 5, max_iters: int = 1000) -> List[Dict[str, Any]]:
    """Time every algorithm per (collective, size) on ``target`` (a Communicator, or spawn
    keyword arguments); returns table entries (module doc)."""
    if isinstance(target, dict):
        from .launch import spawn
        kw = dict(target)
        world = kw.pop("world_size")
        return spawn(measure_table, world, args=(collectives, sizes, algorithms, batch_seconds,
                                                 batches, max_iters), **kw)[0]
    comm = target
    m = comm.link_model
    entries = []
    for coll in collectives:
        for nbytes in ([0] if coll == "barrier" else sorted({max(1, s // 4) * 4 for s in sizes})):
            secs = time_algorithms(comm, coll, nbytes, algorithms, batch_seconds, batches,
                                   max_iters)
            entries.append({"collective": coll, "world": comm.size,
                            "topology": list(comm.topology), "intra": m.intra, "inter": m.inter,
                            "bytes": nbytes, "seconds": secs,
                            "best": min((a for a in secs if a in FAMILIES),
                                        key=lambda a: (secs[a], FAMILIES.index(a)))})
    return entries


def parse_algo_env(value: Optional[str] = None) -> Dict[str, str]:
    """MINICOMM_ALGO='allreduce:ring,broadcast:tree' -> {'allreduce': 'ring', ...}."""
    value = os.environ.get("MINICOMM_ALGO", "") if value is None else value
    out = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        coll, _, fam = item.partition(":")
        if not fam:
            raise ValueError(f"MINICOMM_ALGO entry {item!r} is not 'collective:algorithm'")
        out[coll.strip()] = fam.strip()
    return out
