"""Symbolic interpreter: proves a set of per-rank schedules correct and deadlock-free.

Every element of every buffer carries a symbolic value instead of a number:
  * ``src``   — the index, in the contributors' ``in`` buffers, of the element it was made from
                (-1: never written / undefined, -2: mixed from different indices — always wrong);
  * ``mask``  — the set of contributing ranks, as a bitset (a Python int, so any world size);
  and ``src`` becomes -3 once a reduction combined two values that shared a contributor (the
  result would count that contribution twice).
So a correct allreduce ends with, on every rank and element e: (src, mask) == (e, all ranks). This is exact (a multiset check), not a probabilistic test with random numbers.

A switch of an in-network reduction is a participant too: its schedule (numbered from the world
size on, no ``in`` or ``out``) receives, reduces in ``tmp`` and forwards like any rank's, so a
switch that counts a child twice or misses one fails the same checks.

Timing follows *rendezvous* semantics, the strictest a transport may have: a Send completes only
when its matching Recv is posted, so a schedule that passes cannot deadlock on any transport,
whatever its buffering. Steps run as documented in ``minicomm.schedule``.

For ``barrier`` (no data) the verifier propagates knowledge instead: a message carries the set of
ranks its sender knows have entered; every rank must know all ranks before it leaves.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import repeat
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .schedule import (
    IN,
    OUT,
    ROOTED,
    TMP,
    Copy,
    Recv,
    Reduce,
    Schedule,
    Send,
    blocks_of,
    call_buffer_counts,
    matrix_of,
)

# ``verify``'s optional hook: (rank, step, op) for every op as the verifier runs it
Trace = Callable[[int, int, object], None]


class VerificationError(AssertionError):
    """A schedule set is wrong: the message names the rank, step and what is wrong."""


# An element's symbolic value is a pair (src, mask): the input element index it was made from and
# the bitset (a Python int) of contributing ranks. Special src values:
UNDEFINED, MIXED, DOUBLE = -1, -2, -3   # never written / different indices combined / counted twice


def _combine(a, b):
    """The symbolic value of reducing elements a and b."""
    sa, ma = a
    sb, mb = b
    if ma & mb:
        return (DOUBLE, ma | mb)
    if sa != sb or sa < 0:
        return (min(sa, sb, MIXED) if sa < 0 or sb < 0 else MIXED, ma | mb)
    return (sa, ma | mb)


def _reduce_into(dst: list, doff: int, src: list, soff: int, n: int) -> None:
    # the common case (same defined index, disjoint contributors) inline: _combine's last branch
    dst[doff:doff + n] = [(sa, ma | mb) if sa == sb and sa >= 0 and not ma & mb
                          else _combine((sa, ma), (sb, mb))
                          for (sa, ma), (sb, mb) in zip(dst[doff:doff + n], src[soff:soff + n])]


def _regions_overlap(a: Tuple[str, int, int], b: Tuple[str, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2] and a[2] > 0 and b[2] > 0


def _check_structure(s: Schedule, participants: int) -> None:
    sizes = {IN: s.in_count, OUT: s.out_count, TMP: s.tmp_count}
    ein, eout = (call_buffer_counts(s.collective, s.rank, s.size, s.count, s.counts)
                 if s.rank < s.size else (0, 0))
    if (s.in_count, s.out_count) != (ein, eout):
        raise VerificationError(f"rank {s.rank}: buffer sizes {(s.in_count, s.out_count)} "
                                f"!= {(ein, eout)} for {s.collective}")

    def region(buf, off, cnt, i, write):
        if buf in sizes and 0 <= off and 0 <= cnt and off + cnt <= sizes[buf] \
                and not (write and buf == IN):
            return (buf, off, cnt)
        where = f"rank {s.rank} step {i}"
        if buf not in sizes:
            raise VerificationError(f"{where}: unknown buffer {buf!r}")
        if cnt < 0 or off < 0 or off + cnt > sizes[buf]:
            raise VerificationError(f"{where}: {buf}[{off}:{off + cnt}] out of bounds "
                                    f"(size {sizes[buf]})")
        if write and buf == IN:
            raise VerificationError(f"{where}: writes the caller's input buffer")
        return (buf, off, cnt)

    me = s.rank
    for i, step in enumerate(s.steps):
        reads, writes = [], []   # communication regions of this step
        for o in step:
            cls = o.__class__
            if cls is Send or cls is Recv:
                peer, buf, off, cnt = o.peer, o.buf, o.offset, o.count
                if not (0 <= peer < participants) or peer == me:
                    raise VerificationError(f"rank {me} step {i}: bad peer {peer} in {o}")
                size = sizes.get(buf, -1)
                if not (0 <= off and 0 <= cnt and off + cnt <= size) or \
                        (cls is Recv and buf == IN):
                    region(buf, off, cnt, i, cls is Recv)     # raises, naming the fault
                (writes if cls is Recv else reads).append(((buf, off, cnt), o))
            else:
                region(o.src, o.src_offset, o.count, i, False)
                region(o.dst, o.dst_offset, o.count, i, True)
        if not writes or len(writes) + len(reads) < 2:
            continue
        for j, (w, wo) in enumerate(writes):
            for r, _ in reads:
                if _regions_overlap(w, r):
                    raise VerificationError(f"rank {s.rank} step {i}: {wo} writes what a Send of the same step reads")
            for w2, wo2 in writes[j + 1:]:
                if _regions_overlap(w, w2) and not (wo.reduce and wo2.reduce):
                    raise VerificationError(f"rank {s.rank} step {i}: {wo} and {wo2} write the same elements")


def verify(schedules: Sequence[Schedule], *, topology=None,
           trace: Optional[Trace] = None) -> Dict[str, int]:
    """Verify the schedules of all ranks of one call. Raises VerificationError; returns stats.

    ``trace(rank, step, op)``, if given, is called for every op as this interpreter runs it:
    a step's local ops when the rank enters the step, a Send and its Recv when the pair
    completes (the conformance test compares it with the other interpreters)."""
    _check_call(schedules)
    run = _SymbolicRun(schedules, trace)
    messages = run.messages
    rounds = run.run()
    run.raise_if_stuck()
    try:
        _check_results(schedules, run.state, run.knows)
    except VerificationError as e:
        if getattr(e, "element", None) is None:
            raise
        raise VerificationError(f"{e}; {_last_writer(schedules, *e.element)}") from None
    return {"ranks": len(schedules), "rounds": rounds,
            "max_comm_steps": max(s.comm_steps for s in schedules), "messages": messages}


def _check_call(schedules: Sequence[Schedule]) -> None:
    """Every schedule is one participant's of the same call, and well formed
    (``_check_structure``): ranks 0..size-1, then any switches (in-network reduction: numbered
    from size on, with no ``in`` or ``out``, only ``tmp``)."""
    if not schedules:
        raise VerificationError("no schedules")
    s0 = schedules[0]
    coll, count, root, p = s0.collective, s0.count, s0.root, s0.size
    if len(schedules) < p:
        raise VerificationError(f"{len(schedules)} schedules for a world of {p} ranks")
    for r, s in enumerate(schedules):
        if s.rank != r or s.size != p or (s.collective, s.count, s.root, s.counts) != (
                coll, count, root, s0.counts):
            raise VerificationError(f"schedule {r} is for another call: {s.summary()}")
        _check_structure(s, len(schedules))


def _pair_fifo(ops_tab: List[list], sends: Dict[Tuple[int, int], List[int]],
               recvs: Dict[Tuple[int, int], List[int]]) -> None:
    """FIFO matching per ordered pair: the k-th send a->b pairs with the k-th recv on b from a
    (``sends`` / ``recvs``: the ids of each pair's ops in order); sets each op's partner id."""
    for pair in sends.keys() | recvs.keys():
        sl, rl = sends.get(pair, ()), recvs.get(pair, ())
        if len(sl) != len(rl):
            raise VerificationError(f"{len(sl)} sends {pair[0]}->{pair[1]} but {len(rl)} receives")
        for ks, kr in zip(sl, rl):
            es, er = ops_tab[ks], ops_tab[kr]
            if es[2].count != er[2].count:
                raise VerificationError(f"send {pair[0]}->{pair[1]} step {es[1]} has "
                                        f"{es[2].count} elements, matching recv step {er[1]} "
                                        f"expects {er[2].count}")
            es[3], er[3] = kr, ks


class _Input:
    """A rank's ``in`` buffer, never written (``_check_structure``): element e holds
    (e, the rank's bit), made only for the slices read (``mask`` None: undefined)."""
    __slots__ = ("mask",)

    def __init__(self, mask: Optional[int]):
        self.mask = mask

    def __getitem__(self, sl: slice) -> list:
        if self.mask is None:
            return [(UNDEFINED, 0)] * (sl.stop - sl.start)
        return list(zip(range(sl.start, sl.stop), repeat(self.mask)))


class _SymbolicRun:
    """The symbolic state of every rank (``state``: buffer name -> list of symbolic values;
    ``knows``: barrier knowledge) and the walk of the schedules under rendezvous sends.

    Every communication op gets an integer id: ``ops_tab[id]`` = [rank, step, op, partner id];
    ``plan[rank][step]`` = (local ops, ids of its communication ops)."""

    def __init__(self, schedules: Sequence[Schedule], trace: Optional[Trace]):
        s0 = schedules[0]
        coll, root, p = s0.collective, s0.root, len(schedules)
        undefined = (UNDEFINED, 0)
        self.state: List[Dict[str, list]] = []
        for s in schedules:
            bufs = {OUT: [undefined] * s.out_count, TMP: [undefined] * s.tmp_count}
            # a non-root's input is never read: using it is a bug
            unread = coll in ("broadcast", "scatter", "scatterv") and s.rank != root
            bufs[IN] = _Input(None if unread else 1 << s.rank)
            self.state.append(bufs)
        # barrier knowledge: who is known to have entered (a switch enters nothing itself)
        self.knows = [1 << r if r < s0.size else 0 for r in range(p)]
        ops_tab: List[list] = []
        sends: Dict[Tuple[int, int], List[int]] = defaultdict(list)
        recvs: Dict[Tuple[int, int], List[int]] = defaultdict(list)
        self.plan = []
        for s in schedules:
            steps, r = [], s.rank
            for i, step in enumerate(s.steps):
                local, comm = [], []
                for o in step:
                    cls = o.__class__
                    if cls is Send or cls is Recv:
                        k = len(ops_tab)
                        comm.append(k)
                        ops_tab.append([r, i, o, None])
                        if cls is Send:
                            sends[(r, o.peer)].append(k)
                        else:
                            recvs[(o.peer, r)].append(k)
                    else:
                        local.append(o)
                steps.append((local, comm))
            self.plan.append(steps)
        _pair_fifo(ops_tab, sends, recvs)
        self.ops_tab = ops_tab
        self.messages = sum(len(v) for v in sends.values())
        self.done = bytearray(len(self.ops_tab))
        self.pc = [0] * p
        self.left = [0] * p                 # communication ops of the current step not yet complete
        self.entry_knows = list(self.knows)  # what a rank knew when it entered its current step
        self.trace = trace

    def enter(self, r: int) -> None:
        """Run the local ops of the steps rank r enters, skipping purely local steps."""
        steps, st, pc, trace = self.plan[r], self.state[r], self.pc, self.trace
        while pc[r] < len(steps):
            local, comm = steps[pc[r]]
            for o in local:
                if trace is not None:
                    trace(r, pc[r], o)
                if isinstance(o, Copy):
                    st[o.dst][o.dst_offset:o.dst_offset + o.count] = \
                        st[o.src][o.src_offset:o.src_offset + o.count]
                else:
                    _reduce_into(st[o.dst], o.dst_offset, st[o.src], o.src_offset, o.count)
            self.entry_knows[r] = self.knows[r]
            if comm:
                self.left[r] = len(comm)
                return
            pc[r] += 1

    def complete(self, k: int) -> int:
        """Complete communication op ``k`` (of a rank in its step) with its partner, whose
        rank is in the partner's step; returns the partner's rank."""
        r, i, o, kp = self.ops_tab[k]
        q, t, po, _ = self.ops_tab[kp]
        snd, rcv, sr, rr = (po, o, q, r) if isinstance(o, Recv) else (o, po, r, q)
        if self.trace is not None:
            self.trace(sr, self.pc[sr], snd)
            self.trace(rr, self.pc[rr], rcv)
        data = self.state[sr][snd.buf][snd.offset:snd.offset + snd.count]
        self.knows[rr] |= self.entry_knows[sr]
        dst = self.state[rr][rcv.buf]
        if rcv.reduce:
            _reduce_into(dst, rcv.offset, data, 0, rcv.count)
        else:
            dst[rcv.offset:rcv.offset + rcv.count] = data
        self.done[k] = self.done[kp] = 1
        self.left[r] -= 1
        self.left[q] -= 1
        return q

    def run(self) -> int:
        """Walk until every rank finished or none can move; returns the rounds taken.

        Rendezvous: a Send/Recv pair completes as soon as both ranks are in the steps holding
        it (whatever else those steps still wait for); a rank leaves a step when all its pairs
        are done. The sender's region cannot change during its step (same-step overlap is
        banned), so reading it at completion time equals reading it when the send was posted."""
        plan, pc, left, done, ops_tab = self.plan, self.pc, self.left, self.done, self.ops_tab
        for r in range(len(plan)):
            self.enter(r)
        rounds = 0
        candidates = set(range(len(plan)))
        while candidates:
            advanced = []
            for r in candidates:
                if pc[r] >= len(plan[r]):
                    continue
                for k in plan[r][pc[r]][1]:
                    if done[k] or pc[ops_tab[ops_tab[k][3]][0]] != ops_tab[ops_tab[k][3]][1]:
                        continue
                    q = self.complete(k)
                    if left[q] == 0:
                        advanced.append(q)
                if left[r] == 0:
                    advanced.append(r)
            if not advanced:
                break
            rounds += 1
            candidates = set()
            for r in set(advanced):
                if pc[r] < len(plan[r]) and left[r] == 0:
                    pc[r] += 1
                    self.enter(r)
                    candidates.add(r)
                    if pc[r] < len(plan[r]):
                        candidates.update(ops_tab[ops_tab[k][3]][0] for k in plan[r][pc[r]][1])
        return rounds

    def raise_if_stuck(self) -> None:
        """Raise VerificationError naming the ranks that cannot finish, if any."""
        plan, pc, ops_tab = self.plan, self.pc, self.ops_tab
        stuck = [r for r in range(len(plan)) if pc[r] < len(plan[r])]
        if not stuck:
            return
        r = stuck[0]
        waits = [(ops_tab[ops_tab[k][3]][0], ops_tab[ops_tab[k][3]][1], pc[ops_tab[ops_tab[k][3]][0]])
                 for k in plan[r][pc[r]][1] if not self.done[k]]
        raise VerificationError(
            f"deadlock under rendezvous sends: ranks {stuck} cannot finish; rank {r} is stuck in "
            f"step {pc[r]} waiting for (peer, peer's matching step, step the peer is in) {waits[:3]}")


def _check_results(schedules, state, knows) -> None:
    s0 = schedules[0]
    coll, p, n, root = s0.collective, s0.size, s0.count, s0.root
    full = (1 << p) - 1

    def expect(r: int, lo: int, first_src: int, mask: int, what: str, n: int = n):
        got = state[r][OUT][lo:lo + n]
        want = list(zip(range(first_src, first_src + n), repeat(mask)))
        if got != want:
            e = next(i for i in range(n) if got[i] != want[i])
            (gs, gm), (ws, wm) = got[e], want[e]
            how = {UNDEFINED: "nothing (never written, or undefined input)",
                   MIXED: "a mix of different elements",
                   DOUBLE: "a sum that counts a contribution twice"}.get(gs, f"element {gs}")
            err = VerificationError(
                f"{coll}/{s0.algorithm} p={p} n={n} root={root}: rank {r} out[{lo + e}] ({what}) "
                f"holds {how} from ranks {_ranks(gm)}; expected element {ws} from ranks {_ranks(wm)}")
            err.element = (r, lo + e)
            raise err

    if coll == "barrier":
        for r in range(p):
            if knows[r] != full:
                raise VerificationError(f"barrier/{s0.algorithm} p={p}: rank {r} leaves knowing only "
                                        f"ranks {_ranks(knows[r])} entered")
        return
    for r in range(p):
        if coll == "allreduce" or (coll == "reduce" and r == root):
            expect(r, 0, 0, full, "reduced")
        elif coll == "broadcast":
            expect(r, 0, 0, 1 << root, "broadcast")
        elif coll == "reduce_scatter":
            expect(r, 0, r * n, full, "reduced block")
        elif coll == "scatter":
            expect(r, 0, r * n, 1 << root, "scattered block")
        elif coll == "allgather" or (coll == "gather" and r == root):
            for j in range(p):
                expect(r, j * n, 0, 1 << j, f"block of rank {j}")
        elif coll == "alltoall":
            for j in range(p):
                expect(r, j * n, r * n, 1 << j, f"block from rank {j}")
        elif coll == "allgatherv" or (coll == "gatherv" and r == root):
            for j, (o, c) in enumerate(blocks_of(s0.counts)):
                expect(r, o, 0, 1 << j, f"block of rank {j}", c)
        elif coll in ("scatterv", "reduce_scatterv"):
            o, c = blocks_of(s0.counts)[r]
            expect(r, 0, o, 1 << root if coll == "scatterv" else full,
                   "scattered block" if coll == "scatterv" else "reduced block", c)
        elif coll == "alltoallv":
            rows = matrix_of(s0.counts, p)
            recv_at = blocks_of([rows[i][r] for i in range(p)])
            for i in range(p):
                expect(r, recv_at[i][0], blocks_of(rows[i])[r][0], 1 << i,
                       f"block from rank {i}", rows[i][r])
        elif coll == "scan" or (coll == "exscan" and r > 0):
            expect(r, 0, 0, (1 << (r + (coll == "scan"))) - 1, "prefix")


def _ranks(mask: int) -> List[int]:
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


def _last_writer(schedules: Sequence[Schedule], rank: int, element: int) -> str:
    """Where rank ``rank``'s out[element] was last written (the verifier run again with a trace:
    only on this error path), for a wrong result's counter-example."""
    last = []

    def trace(r, step, op):
        if r != rank:
            return
        if isinstance(op, (Copy, Reduce)):
            buf, off = op.dst, op.dst_offset
        elif isinstance(op, Recv):
            buf, off = op.buf, op.offset
        else:
            return
        if buf == OUT and off <= element < off + op.count:
            last[:] = [(step, op)]
    run = _SymbolicRun(schedules, trace)
    run.run()
    if not last:
        steps = len(schedules[rank].steps)
        return (f"no step of rank {rank} writes it (its steps 0..{steps - 1} end without it)"
                if steps else f"rank {rank} has no steps")
    step, op = last[0]
    return f"last written at rank {rank} step {step} by {op}"


def check_structure(s: Schedule, participants: int) -> None:
    """One schedule's buffers, offsets and peers (what ``verify`` checks first, per rank):
    VerificationError naming the rank, the step and the op."""
    _check_structure(s, participants)


def prove_family(name: str, collectives: Sequence[str], max_world: int) -> None:
    """Prove algorithm ``name`` (built-in or registered) for every collective of
    ``collectives``, world sizes 1..max_world, counts {0, 1, 5, p+1}, every root, one node and
    two: VerificationError with the first counter-example (world size, rank, step, what)."""
    from .algorithms import build_all
    for p in range(1, max_world + 1):
        for topo in sorted({(0,) * p, tuple(r * 2 // p for r in range(p))}):
            for coll in collectives:
                roots = range(p) if coll in ROOTED else [0]
                for n in ([0] if coll == "barrier" else sorted({0, 1, 5, p + 1})):
                    for root in roots:
                        try:
                            verify(build_all(coll, name, p, n, root, topo))
                        except VerificationError as e:
                            raise VerificationError(
                                f"{coll} p={p} count={n} root={root} topology={topo}: "
                                f"{e}") from None
