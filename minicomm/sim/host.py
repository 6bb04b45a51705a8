"""The host machine: a call's ranks as processes on the CPU cores of their node.

This is the machine ``algorithm="auto"`` prices minicomm's own transports on (``minicomm.cost``
maps a LinkModel onto a ``HostModel``); the flow model of ``engine.run_program`` prices
accelerator clusters. Both run the same compiled ``engine.Program``, and ``engine.run_host`` is
the entry point that returns the engine's ``RunStats``.

Timing rules. Each rank works on a CPU or waits, and runs its steps as the executor does:

  - local ops (Copy δ, Reduce γ per byte) and posting its receives (o each);
  - its sends, eager (shm rings and socket buffers take them): o plus the copy-in, β/2 per byte;
    the message is visible to its receiver ``lat`` = α - 3o after its first piece is in
    (``chunk``: small messages are store-and-forward, large ones pipelined) and complete ``lat``
    after its last;
  - then its receives in arrival order: o plus the copy-out, β/2 per byte (a reducing receive
    max(β/2, γ): it reduces straight out of the landing memory), the last piece no earlier than
    the sender copied it in.

Waiting. A waiting rank spins for ``spin``, then sleeps: the message that wakes it costs
``wake`` more when the rank has a core to itself (such a rank spins longer for a large message:
its bytes at ``spin_rate``, up to ``spin_max``). On a node whose ranks outnumber its cores a rank
spins ``spin_shared`` instead (when set), yielding its core between polls, and holds
``yield_share`` of a core meanwhile.

Cores. A node's ranks share its ``cores`` (processor sharing among working and spinning ranks):
a piece of work shorter than ``balance`` runs at the busiest core's pace, ceil(ranks / cores) to
a core, a longer one at the fair share, ranks / cores; work on a shared core is ``sharing_loss``
less efficient; k ranks working at once slow each other down by 1 + contention (k - 1);
``background`` other runnable threads per rank share the cores too (a loaded machine).

Calls and paths. Every call (``prog.calls`` of them back to back) costs each rank
``call_overhead`` of CPU at its start; ``executor``: the call runs through the executor, each
intra-node message op costing ``exec_overhead`` more. On a node whose ranks outnumber its cores,
``latency_cpu`` of an intra-node message's latency is its sender's CPU. Single copy
(``single_min``): in a call that reduces nothing, an intra-node message that large costs its
sender o and its receiver o plus ``single_beta`` per byte, readable as soon as it is posted; the
sender's step ends only once it has been read (its buffer is in use until then).

The last rank's end is the time of all calls. The fitted constants ``minicomm.cost`` gives every
HostModel live in ``host_model.json`` next to this file (``fitted_constants``), with their
provenance: docs/decisions/host-model-constants.md.

Restrictions: one event loop over all ranks (fine up to the cost model's few dozen ranks); no
caches, NUMA or memory bandwidth beyond ``contention``; messages between one ordered pair match
in FIFO order (the compiled program's matching).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

FITTED_CONSTANTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "host_model.json")
FITTED_FORMAT = "minicomm-host-model/1"


@dataclass(frozen=True)
class HostLink:
    """A link class between processes of minicomm's own transports: α is a whole exchange step
    (3 message ops + latency), β s/byte (the sender copies in β/2, the receiver out β/2), o the
    CPU per message op, ``chunk`` the piece a receiver sees at once (shm records; a socket's
    stream)."""
    alpha: float
    beta: float
    overhead: float
    chunk: int


@dataclass(frozen=True)
class HostModel:
    """The machine of ``run_host``: ranks are processes on the CPU cores of their node."""
    intra: HostLink
    inter: HostLink
    gamma: float            # in-place add, s per byte of array
    delta: float            # memcpy, s per byte
    wake: float = 0.0       # extra latency of a message to a rank asleep in the kernel
    contention: float = 0.0  # k ranks working at once on a node each run 1 + c(k-1) slower
    cores: int = 0          # cores of a node (0: as many as ranks, no sharing)
    spin: float = 50e-6     # a waiting rank spins this long, then sleeps ...
    spin_shared: float = 0.0  # ... or this long on a node whose ranks outnumber its cores,
    yield_share: float = 1.0  # yielding between polls: such a spinner holds this much of a core
    spin_rate: float = 0.0  # ... or, with a core to itself, as long as the largest message it
    spin_max: float = 0.0   # waits for takes at this many bytes/s, at most spin_max (0: spin)
    sharing_loss: float = 1.0   # work on a shared core runs at share / (1 + loss (1 - share))
    balance: float = math.inf   # a piece of work this long (CPU s) runs at the cores' fair
                                # share, a shorter one at the busiest core's pace (run_host)
    call_overhead: float = 0.0  # CPU of a rank at the start of every call (argument checks,
                                # plan lookup, sequence tags: the communicator's Python)
    background: float = 0.0     # runnable threads besides the ranks, per rank of a node (its
                                # transport's helpers, other jobs), sharing the node's cores
    # single copy (shm over cross-memory attach): an intra-node message of at least this many
    # bytes of a call that reduces nothing is read by its receiver straight from the sender's
    # buffer, ``single_beta`` s/byte, the sender paying only o (0: never)
    single_min: int = 0
    single_beta: float = 0.0
    # extra CPU per intra-node message op of a call that runs through the executor (request
    # objects, matching queues) instead of the small-message path (``run_host(executor=True)``)
    exec_overhead: float = 0.0
    # on a node whose ranks outnumber its cores, this fraction of an intra-node message's
    # latency is its sender's CPU instead of time in flight (a loopback socket's kernel work
    # runs on the node's cores, which other ranks then wait for)
    latency_cpu: float = 0.0


def fitted_constants(path: str = FITTED_CONSTANTS_FILE) -> Dict[str, Any]:
    """The host model's fitted constants and their provenance (``host_model.json``): a dict with
    ``provenance`` (machine, date, commit, calibration error) and ``constants`` (name -> {value,
    meaning, ...}). A missing field is a ValueError naming the file: the cost model must not run
    on a silently absent constant."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("format") != FITTED_FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {FITTED_FORMAT!r}")
    for key in ("provenance", "constants"):
        if not isinstance(data.get(key), dict):
            raise ValueError(f"{path}: no {key!r} object")
    for name, entry in data["constants"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), (int, float)):
            raise ValueError(f"{path}: constant {name!r} has no numeric 'value'")
    return data


class HostDeadlock(ValueError):
    """Ranks wait for messages that are never sent (``engine.run_host`` raises it as the
    engine's ``ScheduleError``)."""


# Link classes of a message: within a node, between nodes, and a single-copy read (intra-node).
INTRA, INTER, SINGLE_COPY = 0, 1, 2


class LinkCost(NamedTuple):
    """What a message of one link class costs its two ranks."""
    op_cpu: float       # o: CPU of each message op (post, send, receive)
    latency: float      # a piece is visible this long after its sender copied it in
    copy_in: float      # sender's CPU per byte
    copy_out: float     # receiver's CPU per byte
    chunk: int          # the piece a receiver sees at once


# A work item of a rank: ("cpu", seconds, stamp) runs on a core and, done, sets ``stamp``
# (None, ("first", m), ("last", m) or ("read", m)); ("last", m, None) waits until message m's
# last piece is visible.
WorkItem = Tuple[str, Any, Any]


class _Messages:
    """Per message of the program: what it is (bytes, link class, reducing) and when its pieces
    are visible to the receiver."""

    def __init__(self, prog, node_of: Sequence[Any], hm: HostModel, links: List[LinkCost],
                 shared: Dict[Any, bool], itemsize: int):
        n = prog.messages
        src, dst = prog.msg_src.tolist(), prog.msg_dst.tolist()
        self.bytes = (prog.msg_count * itemsize).tolist()
        single = hm.single_min > 0 and not (prog.msg_reduce.any() or prog.step_reduce.any())
        self.link = [(SINGLE_COPY if single and nb >= hm.single_min else INTRA)
                     if node_of[a] == node_of[b] else INTER
                     for a, b, nb in zip(src, dst, self.bytes)]
        self.reduce = prog.msg_reduce.tolist()
        # the part of its latency the sender spends on a core (nodes whose ranks outnumber cores)
        self.latency_cpu = [hm.latency_cpu * links[k].latency
                            if k != INTER and shared[node_of[a]] else 0.0
                            for a, k in zip(src, self.link)]
        self.first = [math.inf] * n     # when the first piece / the last piece is visible
        self.last = [math.inf] * n
        self.started = [False] * n      # its sender has begun the step that sends it
        self.read = [math.inf] * n      # when its receiver has it all (a single copy ends then)


class _Rank:
    """One process: where it is in its schedule, what it is doing, and how it waits."""
    __slots__ = ("node", "shared", "first_step", "end_step", "steps_per_call", "step", "todo",
                 "receives", "unread", "cpu_left", "piece", "stamp", "waiting", "wait_since",
                 "wake_at", "spin", "spin_hold", "done", "end", "rate")

    def __init__(self, node: Any, shared: bool, first_step: int, end_step: int, calls: int,
                 spin: float, spin_hold: float):
        self.node, self.shared = node, shared
        self.first_step, self.end_step = first_step, end_step
        self.steps_per_call = max(1, (end_step - first_step) // max(1, calls))
        self.step = first_step - 1
        self.todo: List[WorkItem] = []
        self.receives: List[int] = []   # posted receives not yet taken, message ids in op order
        self.unread: List[int] = []     # this step's single-copy sends not yet read
        self.cpu_left = 0.0             # CPU still to run of the work item in progress
        self.piece = 0.0                # that item's whole CPU length
        self.stamp: Any = None          # what its end marks
        self.waiting: Any = None        # None, ("first", None): any receive, ("last"|"read", m)
        self.wait_since = 0.0
        self.wake_at: Optional[float] = None
        self.spin, self.spin_hold = spin, spin_hold
        self.done, self.end = False, 0.0
        self.rate = 1.0                 # share of a core this event (cores_rates)


class HostRun:
    """One run of a compiled program on a ``HostModel``: ``HostRun(...).run()`` then ``time_s``,
    ``rank_end``, ``events`` and ``last_visible`` (per message)."""

    def __init__(self, prog, node_of: Sequence[Any], hm: HostModel, itemsize: int = 4,
                 executor: bool = False):
        p = prog.size
        if len(node_of) != p:
            raise ValueError(f"node map names {len(node_of)} ranks, not {p}")
        self.hm = hm
        self.links = self._link_costs(hm, executor)
        self.nodes: Dict[Any, int] = {}         # node -> its ranks
        for t in node_of:
            self.nodes[t] = self.nodes.get(t, 0) + 1
        self.cores = {n: (min(hm.cores, k) if hm.cores and not hm.background else hm.cores or k)
                      for n, k in self.nodes.items()}
        self.shared = {n: (hm.cores or k) < k for n, k in self.nodes.items()}
        self.msgs = _Messages(prog, node_of, hm, self.links, self.shared, itemsize)
        # the steps: CSR ranges of sent and received messages, local bytes copied and reduced
        self.send_ptr, self.recv_ptr = prog.send_ptr.tolist(), prog.recv_ptr.tolist()
        self.recv_order = prog.recv_order.tolist()
        self.copy_bytes = (prog.step_copy * itemsize).tolist()
        self.reduce_bytes = (prog.step_reduce * itemsize).tolist()
        self.long_spin = hm.spin_rate > 0 and hm.spin_max > hm.spin
        rank_first = prog.rank_first.tolist()
        self.ranks = [self._new_rank(node_of[r], rank_first[r], rank_first[r + 1], prog.calls)
                      for r in range(p)]
        self.running = p
        self.now = 0.0
        self.events = 0

    @staticmethod
    def _link_costs(hm: HostModel, executor: bool) -> List[LinkCost]:
        """The cost of a message by link class (INTRA, INTER, SINGLE_COPY)."""
        links = []
        for hl in (hm.intra, hm.inter):
            lat = max(0.0, hl.alpha - 3 * hl.overhead)
            # a call run by the executor (not the small-message path) costs more per message op
            o = hl.overhead + (hm.exec_overhead if executor and hl is hm.intra else 0.0)
            links.append(LinkCost(o, lat, hl.beta / 2, hl.beta / 2, hl.chunk))
        # the single-copy read: the sender publishes its buffer's address; the whole message is
        # readable at once, so ``chunk`` is unbounded
        links.append(LinkCost(links[INTRA].op_cpu, links[INTRA].latency, 0.0, hm.single_beta,
                              1 << 62))
        return links

    def _new_rank(self, node: Any, first_step: int, end_step: int, calls: int) -> _Rank:
        hm = self.hm
        # on a node whose ranks outnumber its cores a waiting rank polls with sched_yield between
        # passes: it spins longer and holds only part of a core
        yielding = bool(hm.spin_shared) and self.shared[node]
        return _Rank(node, self.shared[node], first_step, end_step, calls,
                     hm.spin_shared if yielding else hm.spin,
                     hm.yield_share if yielding else 1.0)

    # ------------------------------------------------------------------ results
    @property
    def time_s(self) -> float:
        """The last rank's end (0 for an empty world)."""
        return max(self.rank_end) if self.ranks else 0.0

    @property
    def rank_end(self) -> List[float]:
        return [rk.end for rk in self.ranks]

    @property
    def last_visible(self) -> List[float]:
        """Per message: when its last piece was visible to the receiver."""
        return self.msgs.last

    # ------------------------------------------------------------------ the event loop
    def run(self) -> "HostRun":
        """Run every rank to its end; raises ``HostDeadlock`` when ranks wait for ever."""
        for rank in self.ranks:
            self.begin_step(rank)
        while self.running:
            self.events += 1
            self.wake_satisfied()
            if not self.running:
                break
            self.core_rates()
            nxt = self.next_instant()
            self.run_cores_until(nxt)
        return self

    def wake_satisfied(self) -> None:
        """Move on every waiting rank whose wait is over (its message arrived), after the
        wake-up of a rank that fell asleep; repeat until none moves."""
        hm, now = self.hm, self.now
        moved = True
        while moved:
            moved = False
            for rank in self.ranks:
                if rank.done or rank.waiting is None or not self.satisfied(rank):
                    continue
                if rank.wake_at is None and now - rank.wait_since > rank.spin \
                        and not rank.shared and hm.wake > 0:
                    rank.wake_at = now + hm.wake   # it fell asleep: the kernel wakes it
                if rank.wake_at is not None and rank.wake_at > now:
                    continue
                rank.wake_at, rank.waiting = None, None
                self.advance(rank)
                moved = True

    def core_rates(self) -> None:
        """Each running rank's share of a core for this event (``rank.rate``): processor sharing
        among a node's working and spinning ranks (module docstring, Cores)."""
        hm, now = self.hm, self.now
        busy = dict.fromkeys(self.nodes, 0.0)     # working or spinning: they hold a core
        working = dict.fromkeys(self.nodes, 0)
        for rank in self.ranks:
            if rank.done:
                continue
            if rank.waiting is None:
                working[rank.node] += 1
                busy[rank.node] += 1
            elif rank.wake_at is None and now - rank.wait_since <= rank.spin:
                busy[rank.node] += rank.spin_hold
        pinned, spread = {}, {}
        for n in self.nodes:
            # A short piece of work runs at the busiest core's pace: ceil(busy / cores) ranks
            # time-slice it (the scheduler places whole processes; 3 ranks on 2 cores run two
            # to a core). A long one at the fair share, busy / cores to a core: over its length
            # the kernel moves the ranks between cores (wake-up placement, load balancing).
            # Other runnable threads take their share of every core either way.
            slow = 1 + hm.contention * max(0, min(working[n], self.cores[n]) - 1)
            others = hm.background * self.nodes[n] / self.cores[n]
            # (busy counts a yielding spinner as a fraction of a rank: round before the ceil)
            for rates, per_core in ((pinned, math.ceil(round(busy[n] / self.cores[n], 9))),
                                    (spread, busy[n] / self.cores[n])):
                share = min(1.0, 1.0 / (per_core + others)) if busy[n] else 1.0
                rates[n] = share / (1 + hm.sharing_loss * (1 - share)) / slow
        for rank in self.ranks:
            rank.rate = (spread if rank.piece >= hm.balance else pinned)[rank.node]

    def next_instant(self) -> float:
        """The next instant anything happens: a piece of work ends, a sleeper wakes, a spin ends
        or an awaited message piece becomes visible."""
        now, nxt = self.now, math.inf
        for rank in self.ranks:
            if rank.done:
                continue
            if rank.waiting is None:
                nxt = min(nxt, now + rank.cpu_left / rank.rate)
                continue
            if rank.wake_at is not None:
                nxt = min(nxt, rank.wake_at)
                continue
            if now - rank.wait_since <= rank.spin:
                nxt = min(nxt, rank.wait_since + rank.spin * (1 + 1e-9) + 1e-12)
            for t in self.pending_times(rank):
                if t > now:
                    nxt = min(nxt, t)
        if nxt == math.inf:
            stuck = [r for r, rank in enumerate(self.ranks) if not rank.done][:8]
            raise HostDeadlock(f"the schedules deadlock: ranks {stuck} wait for messages that "
                               f"are never sent")
        return nxt

    def run_cores_until(self, nxt: float) -> None:
        """Run every working rank at its rate until ``nxt``; a rank whose work is done then
        marks its stamp and moves on."""
        for rank in self.ranks:
            if not rank.done and rank.waiting is None:
                rank.cpu_left -= (nxt - self.now) * rank.rate
        self.now = nxt
        for rank in self.ranks:
            if not rank.done and rank.waiting is None and rank.cpu_left <= 1e-15:
                stamp, rank.stamp = rank.stamp, None
                self.finish(stamp)
                self.advance(rank)

    # ------------------------------------------------------------------ one rank's schedule
    def begin_step(self, rank: _Rank) -> None:
        """Start the rank's next step (or end the rank): its local work and posted receives as
        one piece of CPU, then each send's copy-in, and run on."""
        rank.step += 1
        s = rank.step
        if s >= rank.end_step:
            rank.done, rank.end = True, self.now
            self.running -= 1
            return
        hm, msgs = self.hm, self.msgs
        work = self.copy_bytes[s] * hm.delta + self.reduce_bytes[s] * hm.gamma
        if (s - rank.first_step) % rank.steps_per_call == 0:
            work += hm.call_overhead
        for m in self.recv_order[self.recv_ptr[s]:self.recv_ptr[s + 1]]:
            work += self.links[msgs.link[m]].op_cpu
            rank.receives.append(m)
        items: List[WorkItem] = [("cpu", work, None)]
        for m in range(self.send_ptr[s], self.send_ptr[s + 1]):
            o, lat, bs, br, chunk = self.links[msgs.link[m]]
            msgs.started[m] = True
            if msgs.link[m] == SINGLE_COPY:
                rank.unread.append(m)
            head = min(msgs.bytes[m], chunk) * bs
            items.append(("cpu", o + head + msgs.latency_cpu[m], ("first", m)))
            items.append(("cpu", msgs.bytes[m] * bs - head, ("last", m)))
        rank.todo = items
        self.advance(rank)

    def advance(self, rank: _Rank) -> None:
        """Run the rank on until it holds a piece of CPU work or waits: its work items, then its
        arrived receives in arrival order, then (its sends read) its next step."""
        while True:
            if rank.todo:
                if self._take_item(rank):
                    return
                continue
            if self._take_arrived_receive(rank):
                continue
            if rank.receives:
                self.wait_for(rank, ("first", None),
                              max(self.msgs.bytes[m] for m in rank.receives))
                return
            unread, read = rank.unread, self.msgs.read
            while unread and read[unread[-1]] <= self.now:
                unread.pop()
            if unread:                   # a single-copy send completes once it has been read
                self.wait_for(rank, ("read", unread[-1]), self.msgs.bytes[unread[-1]])
                return
            self.begin_step(rank)
            return

    def _take_item(self, rank: _Rank) -> bool:
        """Take the rank's next work item; True when it now works or waits."""
        kind, what, stamp = rank.todo.pop(0)
        if kind == "cpu":
            if what > 0:
                rank.cpu_left = rank.piece = what
                rank.stamp = stamp
                return True
            self.finish(stamp)
            return False
        if self.msgs.last[what] > self.now:       # the sender's final piece is not in yet
            self.wait_for(rank, ("last", what), self.msgs.bytes[what])
            return True
        return False

    def _take_arrived_receive(self, rank: _Rank) -> bool:
        """Queue the copy-out of the earliest arrived receive (o plus β/2 per byte, the last piece
        after its sender's); False when none has arrived."""
        msgs, now = self.msgs, self.now
        ready = [(msgs.first[m], i, m) for i, m in enumerate(rank.receives)
                 if msgs.started[m] and msgs.first[m] <= now]
        if not ready:
            return False
        _, i, m = min(ready, key=lambda x: (x[0], x[1]))
        rank.receives.pop(i)
        o, lat, bs, br, chunk = self.links[msgs.link[m]]
        per = max(br, self.hm.gamma) if msgs.reduce[m] else br
        tail = min(msgs.bytes[m], chunk) * per
        rank.todo = [("cpu", o + msgs.bytes[m] * per - tail, None), ("last", m, None),
                     ("cpu", tail, ("read", m))]
        return True

    def wait_for(self, rank: _Rank, state: Tuple[str, Optional[int]], nbytes: float) -> None:
        """The rank waits (``state``); with a core to itself it spins as long as ``nbytes`` take
        at ``spin_rate`` (at most ``spin_max``) before it sleeps."""
        rank.waiting, rank.wait_since = state, self.now
        if self.long_spin and not rank.shared:
            hm = self.hm
            rank.spin = min(hm.spin_max, max(hm.spin, nbytes / hm.spin_rate))

    def finish(self, stamp: Any) -> None:
        """A piece of work ended: the message piece it sent is visible after the link's latency
        (less what the sender spent of it on a core), or the message it read is read."""
        if stamp is None:
            return
        field_, m = stamp
        msgs = self.msgs
        if field_ == "read":
            msgs.read[m] = self.now
            return
        visible = self.now + self.links[msgs.link[m]].latency - msgs.latency_cpu[m]
        (msgs.first if field_ == "first" else msgs.last)[m] = visible

    def satisfied(self, rank: _Rank) -> bool:
        """Whether what the rank waits for has happened."""
        kind, m = rank.waiting
        msgs, now = self.msgs, self.now
        if kind == "last":
            return msgs.last[m] <= now
        if kind == "read":
            return msgs.read[m] <= now
        return any(msgs.started[x] and msgs.first[x] <= now for x in rank.receives)

    def pending_times(self, rank: _Rank):
        """The instants at which what the rank waits for may happen."""
        kind, m = rank.waiting
        msgs = self.msgs
        if kind == "last":
            yield msgs.last[m]
            return
        if kind == "read":
            yield msgs.read[m]
            return
        for x in rank.receives:
            if msgs.started[x]:
                yield msgs.first[x]
