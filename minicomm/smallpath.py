"""The small-message path: latency-bound calls run a schedule compiled to a flat list of ops.

A call whose every message is small (at most the transport's ``small_bytes``, the size its
``send_now`` / ``recv_now`` move on the spot: for shm one ring record, up to a 1 MiB chunk) is
latency-bound or close to it: interpreting the schedule, request objects and matching queues cost
the same at any size, and below a chunk they are what separates a call from its copies (why up
to a chunk: docs/decisions/small-message-path.md). For those calls
the schedule is compiled once per (collective, algorithm, world size, rank, count, dtype, op,
root) into a ``SmallPlan``: per step, the step index, the local ops, the sends and the receives
as plain tuples with world ranks and buffer indices resolved. ``run_small`` walks that
list and hands each message straight to the transport: ``send_now(peer, view, tag)`` writes it
into the peer's ring (False: no room now, it is posted with ``isend`` instead);
``recv_now(peer, view, tag, reduce, spin)`` takes (or reduces) the next record of the peer's ring
if it is this receive's message, waiting for it at most ``spin`` seconds (False: it is posted
with ``irecv`` and waited for by the transport's ordinary ``wait_all``, which sleeps, times out
and reports failed peers and mismatched calls). No request object, no queue, no lock held while
waiting.

The communicator runs the plan as generated straight-line code (``straight_line``: the same
walk unrolled, a rooted call's fingerprint exchange included); ``run_small`` is the reference
form that the tests compare the generated code against, call for call.

Still the same schedule. ``compile_small`` compiles from the ``Schedule`` itself, and
``decompile`` turns a ``SmallPlan`` back into a ``Schedule`` (communicator ranks, buffer names,
each step's ops in the order the compiled form runs them: local ops, then receives, then sends).
``check_compiled`` proves the compiled form *is* the schedule: the decompiled steps equal the
schedule's steps (taken in that execution order) op for op; ``compile_small`` runs it on every
plan it builds, and ``verify_compiled`` runs the symbolic verifier on the decompiled forms of all
ranks. Execution order within a step is the executor's (local ops, receives, sends, complete);
sends go out before the receives are *waited* for, which is what eager rings allow and what the
verifier's rendezvous semantics already prove deadlock-free. As in the executor, a step whose
local ops are large issues first the sends that no local op writes into (``early_sends``): the
same bytes, moving while a root copies its own block.

Guarded calls. A rooted call exchanges call fingerprints (``Communicator._post_fingerprints``:
every rank sends its 24-byte fingerprint to every other before any data, and learns of a
disagreement, on the root above all, before it returns). On this path that exchange is a
``Guard``: the fingerprints go out with ``send_now`` before step 0; a peer's fingerprint is
received right before the first data receive from that peer (it is the first record that peer
sent on this communicator, so FIFO order puts it there) and compared on arrival, so a rank
never waits for data from a peer that disagrees; the fingerprints of peers it receives no data
from are received at the end. Same messages and tags as the executor's ``LazyCheck``, so ranks
on either path interoperate; the fingerprints are outside the schedule in both.

Restrictions: only schedules whose steps receive from distinct peers (a peer's messages arrive in
FIFO order, so two receives of one step from one peer would need an ordering this path does not
track), whose messages all fit ``small_bytes`` and whose local ops stay under the size the
executor may hand to a helper thread (``executor.BACKGROUND_MIN_BYTES``); everything else runs
through the executor. Local copies are the executor's (``executor.local_copy``: bytecopy's
skew-safe copy, in pieces when large) wherever they can reach bytecopy's slow case.
Cost: per message one header write or read and one copy or reduce of the payload.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from .executor import BACKGROUND_MIN_BYTES, local_copy, writes_region
from .schedule import IN, OUT, TMP, Copy, Recv, Reduce, Schedule, Send
from .transports.base import Tag
from .transports.bytecopy import TRAP_MIN
from .verifier import VerificationError, verify

_BUFS = (IN, OUT, TMP)
_INDEX = {IN: 0, OUT: 1, TMP: 2}
_new_tag = tuple.__new__
_MAX_ITEMSIZE = 32            # np.clongdouble's: a local op of n elements has at most 32n bytes
# The longest a receive waits on the spot for its message before it is posted and the transport's
# wait (which spins briefly, then sleeps) takes over: a peer that is running answers well within.
SMALL_SPIN_S = 40e-6
# stands in a decompiled step for a "whole buffer" flag that does not describe its op (so the
# step can never equal the schedule's)
_WRONG_WHOLE = Copy("whole-flag", 0, "whole-flag", 0, -1)


class SmallPlan:
    """A schedule compiled for the small-message path (module doc).

    ``steps``: per communicating or local step ``(index, local, sends, recvs)``; ``local`` holds
    ``(reduce?, src buffer, src offset, dst buffer, dst offset, count, whole)``, ``sends``
    ``(world peer, buffer, lo, hi, whole)``, ``recvs`` ``(world peer, buffer, lo, hi, reduce?,
    whole)``; buffers are indices into (in, out, tmp), offsets in elements; ``whole`` says the
    regions are entire buffers (no view to cut). ``first_from[k]``: the communicator ranks
    whose first message to this rank step k receives, ``never_from`` those it receives nothing
    from (where a ``Guard`` takes their fingerprints)."""
    __slots__ = ("steps", "tmp_count", "group", "schedule", "first_from", "never_from")

    def __init__(self, steps, tmp_count: int, group: Tuple[int, ...], schedule: Schedule):
        self.steps, self.tmp_count, self.group, self.schedule = steps, tmp_count, group, schedule
        rank_of = {w: r for r, w in enumerate(group)}
        seen = {schedule.rank}
        first = []
        for _, _, _, recvs in steps:
            new = tuple(rank_of[r[0]] for r in recvs if rank_of[r[0]] not in seen)
            seen.update(new)
            first.append(new)
        self.first_from = tuple(first)
        self.never_from = tuple(r for r in range(len(group)) if r not in seen)


class Guard:
    """The fingerprint exchange of a guarded call on this path (module doc): ``tag`` (the
    fingerprints' own), ``mine`` (this rank's fingerprint, int64[3]), ``rows`` (one per
    communicator rank, filled as they arrive; rows not yet received hold ``mine``), and
    ``check()``, which raises ``MismatchError`` naming the ranks whose row differs."""
    __slots__ = ("tag", "mine", "rows", "check")

    def __init__(self, tag: Tag, mine, rows, check):
        self.tag, self.mine, self.rows, self.check = tag, mine, rows, check


def eligible(schedule: Schedule, itemsize: int, small_bytes: int) -> bool:
    """True if ``schedule`` may run on the small-message path (module doc: restrictions)."""
    limit = small_bytes // max(itemsize, 1)
    local_limit = BACKGROUND_MIN_BYTES // max(itemsize, 1)
    for st in schedule.steps:
        peers = set()
        for o in st:
            if isinstance(o, (Send, Recv)) and o.count > limit:
                return False
            if isinstance(o, (Copy, Reduce)) and o.count >= local_limit:
                return False          # the executor may run it on a helper thread
            if isinstance(o, Recv):
                if o.peer in peers:
                    return False
                peers.add(o.peer)
    return True


def compile_small(schedule: Schedule, group: Sequence[int]) -> SmallPlan:
    """Compile ``schedule`` (communicator ranks) for the communicator whose world ranks are
    ``group``; the result is checked against the schedule (``check_compiled``)."""
    group = tuple(group)
    sizes = {IN: schedule.in_count, OUT: schedule.out_count, TMP: schedule.tmp_count}

    def whole(buf: str, off: int, n: int) -> bool:
        return off == 0 and n == sizes[buf]
    steps = []
    for i, st in enumerate(schedule.steps):
        local, sends, recvs = [], [], []
        for o in st:
            if isinstance(o, Send):
                sends.append((group[o.peer], _INDEX[o.buf], o.offset, o.offset + o.count,
                              whole(o.buf, o.offset, o.count)))
            elif isinstance(o, Recv):
                recvs.append((group[o.peer], _INDEX[o.buf], o.offset, o.offset + o.count,
                              bool(o.reduce), whole(o.buf, o.offset, o.count)))
            else:
                local.append((isinstance(o, Reduce), _INDEX[o.src], o.src_offset,
                              _INDEX[o.dst], o.dst_offset, o.count,
                              whole(o.src, o.src_offset, o.count)
                              and whole(o.dst, o.dst_offset, o.count)))
        steps.append((i, tuple(local), tuple(sends), tuple(recvs)))
    plan = SmallPlan(tuple(steps), schedule.tmp_count, group, schedule)
    check_compiled(plan, schedule)
    return plan


def decompile(plan: SmallPlan) -> Schedule:
    """The schedule ``plan`` runs: communicator ranks, buffer names, every step's ops in the
    order ``run_small`` issues them (local ops, receives, sends)."""
    s = plan.schedule
    rank_of = {w: r for r, w in enumerate(plan.group)}
    steps = []
    for _, local, sends, recvs in plan.steps:
        ops = []
        sizes = (s.in_count, s.out_count, plan.tmp_count)
        for red, sb, so, db, do, n, whole in local:
            ops.append((Reduce if red else Copy)(_BUFS[sb], so, _BUFS[db], do, n))
            if whole and not (so == do == 0 and n == sizes[sb] == sizes[db]):
                ops.append(_WRONG_WHOLE)
        for peer, b, lo, hi, red, whole in recvs:
            ops.append(Recv(rank_of[peer], _BUFS[b], lo, hi - lo, red))
            if whole != (lo == 0 and hi == sizes[b]):
                ops.append(_WRONG_WHOLE)
        for peer, b, lo, hi, whole in sends:
            ops.append(Send(rank_of[peer], _BUFS[b], lo, hi - lo))
            if whole != (lo == 0 and hi == sizes[b]):
                ops.append(_WRONG_WHOLE)
        steps.append(tuple(ops))
    return Schedule(s.collective, s.algorithm, s.rank, s.size, s.count, s.root, steps,
                    s.in_count, s.out_count, plan.tmp_count)


def _execution_order(step) -> Tuple:
    """A step's ops as the executors issue them: local ops, receives, sends (each in order)."""
    return (tuple(o for o in step if isinstance(o, (Copy, Reduce)))
            + tuple(o for o in step if isinstance(o, Recv))
            + tuple(o for o in step if isinstance(o, Send)))


def check_compiled(plan: SmallPlan, schedule: Schedule) -> None:
    """Raise ``VerificationError`` unless ``plan`` runs exactly ``schedule``: same steps, same
    step indices (they travel in the tags), same ops in execution order, same scratch size."""
    got = decompile(plan)
    if [i for i, *_ in plan.steps] != list(range(len(schedule.steps))):
        raise VerificationError(f"{schedule.summary()}: compiled step indices "
                                f"{[i for i, *_ in plan.steps]} do not follow the schedule")
    if got.tmp_count != schedule.tmp_count:
        raise VerificationError(f"{schedule.summary()}: compiled plan uses tmp of "
                                f"{got.tmp_count} elements, the schedule {schedule.tmp_count}")
    for i, (mine, theirs) in enumerate(zip(got.steps, schedule.steps)):
        want = _execution_order(theirs)
        if mine != want:
            raise VerificationError(f"{schedule.summary()}: compiled step {i} is {list(mine)}, "
                                    f"the schedule's is {list(want)}")


def early_sends(local, sends) -> Tuple[tuple, tuple]:
    """A step's sends split as (issued before its local ops, the rest), as the executor splits
    them (``executor._early_sends``: a send no local op of the step writes into, to a peer no
    such send goes to, carries the same bytes either way and moves while the ops run), but only
    where the local ops are large enough to matter (a root's copy of its own block beside its
    messages); a latency-bound step keeps its order: local ops, then sends."""
    if not sends or all(n * _MAX_ITEMSIZE < TRAP_MIN for _, _, _, _, _, n, _ in local):
        return (), tuple(sends)
    late_peers = {peer for peer, b, lo, hi, _ in sends if writes_region(local, b, lo, hi)}
    return (tuple(sd for sd in sends if sd[0] not in late_peers),
            tuple(sd for sd in sends if sd[0] in late_peers))


def verify_compiled(plans: Sequence[SmallPlan], *, topology=None):
    """Symbolic verification (``minicomm.verifier.verify``) of what the compiled plans of all
    ranks of one call run, plus ``check_compiled`` of each against its own schedule."""
    for p in plans:
        check_compiled(p, p.schedule)
    return verify([decompile(p) for p in plans], topology=topology)


def run_small(plan: SmallPlan, transport, bufs, kernel, tag: Tag, deadline: float, what: str,
              spin: Optional[float] = None, guard: Optional[Guard] = None) -> None:
    """Run ``plan`` on flat buffers ``bufs`` = (in, out, tmp) through ``transport``'s
    ``send_now`` / ``recv_now``, falling back per message to ``isend`` / ``irecv`` +
    ``wait_all`` (module doc). ``kernel(dst, src)`` reduces in place; ``tag`` is the call's;
    ``guard``: the call's fingerprint exchange (module doc, "Guarded calls")."""
    send_now, recv_now = transport.send_now, transport.recv_now
    comm, seq, call, count = tag[0], tag[1], tag[3], tag[4]
    if spin is None:
        spin = SMALL_SPIN_S
    if guard is not None:
        group, me = plan.group, plan.schedule.rank
        late = None                   # fingerprint sends that did not fit the ring now
        for r in range(len(group)):
            if r != me and not send_now(group[r], guard.mine, guard.tag):
                if late is None:
                    late = []
                late.append(transport.isend(group[r], guard.mine, guard.tag))
        first = plan.first_from
    def send_all(ops, t: Tag, reqs: Optional[list]) -> Optional[list]:
        for peer, b, lo, hi, whole in ops:
            v = bufs[b] if whole else bufs[b][lo:hi]
            if not send_now(peer, v, t):
                if reqs is None:
                    reqs = []
                reqs.append(transport.isend(peer, v, t))
        return reqs
    for i, local, sends, recvs in plan.steps:
        t = _new_tag(Tag, (comm, seq, i, call, count))
        early, sends = early_sends(local, sends)
        reqs = send_all(early, t, None)
        for red, sb, so, db, do, n, whole in local:
            if whole:
                d, src = bufs[db], bufs[sb]
            else:
                d, src = bufs[db][do:do + n], bufs[sb][so:so + n]
            if red:
                kernel(d, src)
            else:
                local_copy(d, src)
        if not (early or sends or recvs):
            continue
        reqs = send_all(sends, t, reqs)
        if guard is not None and first[i]:
            _take_fingerprints(guard, first[i], group, transport, deadline, what, spin)
        if len(recvs) == 1:
            peer, b, lo, hi, red, whole = recvs[0]
            v = bufs[b] if whole else bufs[b][lo:hi]
            k = kernel if red else None
            if not recv_now(peer, v, t, k, spin if reqs is None else 0.0):
                if reqs is None:
                    reqs = []
                reqs.append(transport.irecv(peer, v, t, k))
        elif recvs:
            # several peers: take whichever has arrived, for at most ``spin`` in all
            waiting = [(peer, bufs[b][lo:hi], kernel if red else None)
                       for peer, b, lo, hi, red, _ in recvs]
            waiting = transport.recv_now_many(waiting, t, spin if reqs is None else 0.0)
            if waiting:
                if reqs is None:
                    reqs = []
                for peer, v, k in waiting:
                    reqs.append(transport.irecv(peer, v, t, k))
        if reqs is not None:
            transport.wait_all(reqs, deadline, what)
    if guard is not None:
        if plan.never_from:
            _take_fingerprints(guard, plan.never_from, group, transport, deadline, what, spin)
        if late is not None:
            transport.wait_all(late, deadline, what)


def _take_fingerprints(guard: Guard, ranks, group, transport, deadline: float, what: str,
                       spin: float) -> None:
    """Receive the fingerprints of communicator ranks ``ranks`` and compare them on arrival."""
    rows, t = guard.rows, guard.tag
    for r in ranks:
        row = rows[r]
        if not transport.recv_now(group[r], row, t, None, spin):
            transport.wait_all([transport.irecv(group[r], row, t)], deadline, what)
    mine = guard.mine.tobytes()
    for r in ranks:
        if rows[r].tobytes() != mine:
            guard.check()


# ---------------------------------------------------------------------------- straight-line form
def straight_line(plan: SmallPlan, exchange: bool = False, guarded: bool = False):
    """``run_small`` for ``plan`` as one generated function: the plan's loop unrolled into
    straight-line code whose buffer indices, regions, peers and step indices are constants (a
    latency-bound call spends most of its time interpreting the loop). Generated from
    ``plan.steps`` -- the tuples ``check_compiled`` proved equal to the schedule -- op for op in
    ``run_small``'s order; ``tests/test_smallpath.py`` checks that both issue the same transport
    calls. Signature: ``run(bufs, transport, kernel, comm, seq, call, count, deadline, what,
    spin)``, and a last argument ``guard`` when ``guarded`` (a rooted call's fingerprint
    exchange, module doc: sent before step 0, each peer's received before the first step that
    receives from it, the rest at the end, as ``run_small`` does). ``exchange``: the transport
    has ``sendrecv_now`` (shm), which a step whose one send and one receive are with the same
    peer calls instead of the two (the same calls, in one: ``send_now``, then ``recv_now`` only
    if the send went) -- unless a fingerprint must be received between the two."""
    src = _Unrolled(plan, exchange, guarded).source()
    scope = {"Tag": Tag, "_new_tag": _new_tag, "_take_fingerprints": _take_fingerprints,
             "_GROUP": plan.group, "local_copy": local_copy}
    exec(compile(src, f"<smallpath {plan.schedule.summary()}>", "exec"), scope)
    return scope["run"]


class _Unrolled:
    """The source of ``straight_line``'s function, built step by step (``source()``)."""
    _NAMES = ("i", "o", "t")

    def __init__(self, plan: SmallPlan, exchange: bool, guarded: bool):
        self.plan, self.exchange, self.guarded = plan, exchange, guarded
        self.used = set()             # the transport's methods the body calls
        self.lines = ["def run(bufs, transport, kernel, comm, seq, call, count, deadline, what, "
                      "spin" + (", guard):" if guarded else "):"),
                      "    i, o, t = bufs",
                      None]           # their look-up (filled in by ``source``)

    def source(self) -> str:
        plan, lines = self.plan, self.lines
        if self.guarded:
            self._send_fingerprints()
        for j, (k, local, sends, recvs) in enumerate(plan.steps):
            self._step(j, k, local, sends, recvs)
        if self.guarded:
            if plan.never_from:
                lines += self._fingerprints(plan.never_from)
            lines += ["    if late is not None:",
                      "        transport.wait_all(late, deadline, what)"]
        # look up only the methods the body calls: a latency-bound call pays for every line
        used = sorted(self.used)
        lines[2] = (f"    {', '.join(used)} = {', '.join('transport.' + m for m in used)}"
                    if used else "    pass")
        return "\n".join(lines) + "\n"

    def _send_fingerprints(self) -> None:
        group, me = self.plan.group, self.plan.schedule.rank
        self.lines += ["    gm, gt = guard.mine, guard.tag",
                       "    late = None"]
        for r in range(len(group)):
            if r != me:
                self.used.add("send_now")
                self.lines += [f"    if not send_now({group[r]}, gm, gt):",
                               "        if late is None:",
                               "            late = []",
                               f"        late.append(transport.isend({group[r]}, gm, gt))"]

    @staticmethod
    def _fingerprints(ranks) -> list:
        return [f"    _take_fingerprints(guard, {tuple(ranks)!r}, _GROUP, transport, deadline, "
                "what, spin)"]

    def _region(self, b: int, lo: int, hi: int, whole: bool) -> str:
        return self._NAMES[b] if whole else f"{self._NAMES[b]}[{lo}:{hi}]"

    def _send(self, peer: int, b: int, lo: int, hi: int, whole: bool) -> list:
        self.used.add("send_now")
        return [f"    v = {self._region(b, lo, hi, whole)}",
                f"    if not send_now({peer}, v, tag):",
                "        if reqs is None:",
                "            reqs = []",
                f"        reqs.append(transport.isend({peer}, v, tag))"]

    def _local(self, local) -> None:
        names = self._NAMES
        for red, sb, so, db, do, n, whole in local:
            d = names[db] if whole else f"{names[db]}[{do}:{do + n}]"
            s = names[sb] if whole else f"{names[sb]}[{so}:{so + n}]"
            if red:
                self.lines.append(f"    kernel({d}, {s})")
            elif n * _MAX_ITEMSIZE < TRAP_MIN:       # too small for bytecopy's slow case
                self.lines.append(f"    {d}[...] = {s}")
            else:
                self.lines.append(f"    local_copy({d}, {s})")

    def _step(self, j: int, k: int, local, sends, recvs) -> None:
        lines = self.lines
        early, sends = early_sends(local, sends)
        if early:
            lines += [f"    tag = _new_tag(Tag, (comm, seq, {k}, call, count))",
                      "    reqs = None"]
            for sd in early:
                lines += self._send(*sd)
        self._local(local)
        if not (early or sends or recvs):
            return
        first = self.plan.first_from[j] if self.guarded else ()
        if not early:
            lines.append(f"    tag = _new_tag(Tag, (comm, seq, {k}, call, count))")
        if self.exchange and not early and len(sends) == 1 and len(recvs) == 1 \
                and sends[0][0] == recvs[0][0] and not first:
            self._sendrecv(sends[0], recvs[0])
            return
        if not early:
            lines.append("    reqs = None")
        for sd in sends:
            lines += self._send(*sd)
        if first:
            lines += self._fingerprints(first)
        if len(recvs) == 1:
            self._recv(*recvs[0])
        elif recvs:
            self._recv_many(recvs)
        lines += ["    if reqs is not None:",
                  "        transport.wait_all(reqs, deadline, what)"]

    def _sendrecv(self, send, recv) -> None:
        peer, b, lo, hi, whole = send
        _, rb, rlo, rhi, red, rwhole = recv
        sv, rv = self._region(b, lo, hi, whole), self._region(rb, rlo, rhi, rwhole)
        k_ = "kernel" if red else "None"
        self.used.add("sendrecv_now")
        self.lines += [f"    r = sendrecv_now({peer}, {sv}, {rv}, tag, {k_}, spin)",
                       "    if r != 3:",
                       "        if r == 0:",
                       f"            reqs = [transport.isend({peer}, {sv}, tag)]",
                       f"            if not transport.recv_now({peer}, {rv}, tag, {k_}, 0.0):",
                       f"                reqs.append(transport.irecv({peer}, {rv}, tag, {k_}))",
                       "        else:",
                       f"            reqs = [transport.irecv({peer}, {rv}, tag, {k_})]",
                       "        transport.wait_all(reqs, deadline, what)"]

    def _recv(self, peer: int, b: int, lo: int, hi: int, red: bool, whole: bool) -> None:
        k_ = "kernel" if red else "None"
        self.used.add("recv_now")
        self.lines += [f"    v = {self._region(b, lo, hi, whole)}",
                       f"    if not recv_now({peer}, v, tag, {k_}, spin if reqs is None else 0.0):",
                       "        if reqs is None:",
                       "            reqs = []",
                       f"        reqs.append(transport.irecv({peer}, v, tag, {k_}))"]

    def _recv_many(self, recvs) -> None:
        names = self._NAMES
        items = ", ".join(f"({peer}, {names[b]}[{lo}:{hi}], {'kernel' if red else 'None'})"
                          for peer, b, lo, hi, red, _ in recvs)
        self.lines += [f"    waiting = transport.recv_now_many([{items}], tag, "
                       "spin if reqs is None else 0.0)",
                       "    if waiting:",
                       "        if reqs is None:",
                       "            reqs = []",
                       "        for peer, v, k in waiting:",
                       "            reqs.append(transport.irecv(peer, v, tag, k))"]
