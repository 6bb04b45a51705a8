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

Every op is visited once: the walk checks it (bounds, peers, same-step overlap, message pairing)
when it reaches it. Once it meets a fault, or cannot finish, the reference checks
(``_check_call``, ``_pair_fifo``) go over every schedule in rank and step order, so the fault
reported is the first in that order, whichever the walk met first.
"""
from __future__ import annotations

import gc
from collections import defaultdict, deque
from contextlib import contextmanager
from itertools import repeat
from typing import Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from .schedule import (
    IN,
    OUT,
    PREFIX,
    ROOTED,
    TMP,
    UNEVEN,
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


def _reduce_into(dst: list, start: int, end: int, data: list) -> None:
    """dst[start:end] op= data, symbolically."""
    # the common case (same defined index, disjoint contributors) inline: _combine's last branch
    dst[start:end] = [(sa, ma | mb) if sa == sb and sa >= 0 and not ma & mb
                      else _combine((sa, ma), (sb, mb))
                      for (sa, ma), (sb, mb) in zip(dst[start:end], data)]


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
    with collector_paused():
        return _verify(schedules, trace)   # its symbolic state is freed while it is paused


def _verify(schedules: Sequence[Schedule], trace: Optional[Trace]) -> Dict[str, int]:
    run = _SymbolicRun(schedules, trace)
    rounds = run.run()
    run.raise_if_stuck()
    try:
        _check_results(schedules, run.state, run.knows)
    except VerificationError as e:
        if getattr(e, "element", None) is None:
            raise
        raise VerificationError(f"{e}; {_last_writer(schedules, *e.element)}") from None
    return {"ranks": len(schedules), "rounds": rounds,
            "max_comm_steps": max(run.comm_steps), "messages": run.messages}


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for a run (a context; the verify command holds it
    over a whole cell): schedules and the symbolic state are millions of small acyclic objects,
    which it would otherwise traverse again and again for nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


def _pair_fifo(schedules: Sequence[Schedule]) -> List[List[List[Tuple[int, int]]]]:
    """FIFO matching per ordered pair: the k-th send a->b pairs with the k-th recv on b from a,
    with the same count. Returns, for every rank, step and communication op of it (in order),
    the (rank, step) of its partner."""
    ops_tab: List[list] = []          # [rank, step, op, partner id]
    sends: Dict[Tuple[int, int], List[int]] = defaultdict(list)
    recvs: Dict[Tuple[int, int], List[int]] = defaultdict(list)
    ids = []
    for s in schedules:
        r, steps = s.rank, []
        for i, step in enumerate(s.steps):
            comm = []
            for o in step:
                if o.__class__ is Send or o.__class__ is Recv:
                    comm.append(len(ops_tab))
                    (sends[(r, o.peer)] if o.__class__ is Send else recvs[(o.peer, r)]).append(
                        len(ops_tab))
                    ops_tab.append([r, i, o, None])
            steps.append(comm)
        ids.append(steps)
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
    return [[[tuple(ops_tab[ops_tab[k][3]][:2]) for k in comm] for comm in steps]
            for steps in ids]


def _diagnose(schedules: Sequence[Schedule], fault: str) -> NoReturn:
    """The walk found a fault: raise the first one in rank and step order (the reference
    checks'), or ``fault`` itself."""
    _check_call(schedules)
    _pair_fifo(schedules)
    raise VerificationError(fault)


class _Input:
    """A rank's ``in`` buffer, never written (checked): element e holds (e, the rank's bit),
    made only for the slices read (``mask`` None: undefined)."""
    __slots__ = ("mask",)

    def __init__(self, mask: Optional[int]):
        self.mask = mask

    def __getitem__(self, sl: slice) -> list:
        if self.mask is None:
            return [(UNDEFINED, 0)] * (sl.stop - sl.start)
        return list(zip(range(sl.start, sl.stop), repeat(self.mask)))


class _SymbolicRun:
    """The symbolic state of every rank (``state``: buffer name -> list of symbolic values;
    ``knows``: barrier knowledge) and the walk of the schedules under rendezvous sends, which
    checks every op as it reaches it (module doc)."""

    def __init__(self, schedules: Sequence[Schedule], trace: Optional[Trace]):
        if not schedules:
            raise VerificationError("no schedules")
        s0 = schedules[0]
        coll, count, root, size, counts = s0.collective, s0.count, s0.root, s0.size, s0.counts
        if len(schedules) < size:
            raise VerificationError(f"{len(schedules)} schedules for a world of {size} ranks")
        # a non-root's input is never read: using it is a bug
        rooted_input = coll in ("broadcast", "scatter", "scatterv")
        undefined = (UNDEFINED, 0)
        self.schedules = schedules
        self.state: List[Dict[str, object]] = []
        self.sizes: List[Dict[str, int]] = []
        for r, s in enumerate(schedules):
            ein, eout = (call_buffer_counts(coll, r, size, count, counts) if r < size
                         else (0, 0))
            if s.rank != r or s.size != size or (s.collective, s.count, s.root, s.counts) != (
                    coll, count, root, counts) or (s.in_count, s.out_count) != (ein, eout):
                _diagnose(schedules, f"schedule {r} is for another call: {s.summary()}")
            self.state.append({IN: _Input(None if rooted_input and r != root else 1 << r),
                               OUT: [undefined] * s.out_count, TMP: [undefined] * s.tmp_count})
            self.sizes.append({IN: s.in_count, OUT: s.out_count, TMP: s.tmp_count})
        # barrier knowledge: who is known to have entered (a switch enters nothing itself)
        p = len(schedules)
        self.knows = [1 << r if r < size else 0 for r in range(p)]
        self.entry_knows = list(self.knows)  # what a rank knew when it entered its current step
        self.pc = [-1] * p                   # the step each rank is in (-1: not started)
        self.comm_steps = [0] * p            # steps that communicate, per rank
        self.left = [0] * p                  # communication ops of its step not yet complete
        self.entered = [0] * p               # the round it entered its step
        self.leaves = [0] * p                # the round its step ends, as far as known
        # the posted ops of ordered pair (a, b) not yet paired, at a * p + b
        self.queues: List[Optional[deque]] = [None] * (p * p)
        self.messages = 0
        self.trace = trace

    def run(self) -> int:
        """Walk until every rank finished or none can move; returns the rounds taken.

        Rendezvous: a Send/Recv pair completes as soon as both ranks are in the steps holding
        it (whatever else those steps still wait for); a rank leaves a step when all its pairs
        are done. A rank entering a step runs its local ops, then posts its messages: each
        completes with the partner's op waiting at the head of that ordered pair's queue, if
        any (so the k-th send a->b pairs with the k-th recv on b from a), or waits there. The
        sender's region cannot change during its step (same-step overlap is banned), so
        reading it at completion time equals reading it when the send was posted, and the order
        in which ranks are walked changes nothing.

        Rounds are those of a lockstep walk, in which every pair whose two ranks are in its
        steps at the start of a round completes in it: a pair completes in round
        max(rounds its two steps were entered) + 1, a rank enters its next step in the round
        its step's last pair completed."""
        schedules, state, sizes, trace = self.schedules, self.state, self.sizes, self.trace
        pc, knows, entry_knows, comm_steps = self.pc, self.knows, self.entry_knows, self.comm_steps
        left, entered, leaves, queues = self.left, self.entered, self.leaves, self.queues
        # ready: the ranks whose current step is complete (all of them, to start)
        p, messages, ready = len(schedules), 0, list(range(len(schedules) - 1, -1, -1))
        while ready:
            r = ready.pop()
            steps, bufs, size = schedules[r].steps, state[r], sizes[r]
            i, n = pc[r], len(steps)
            while True:                      # the steps rank r walks through without waiting
                i += 1
                posts = []
                while i < n:                 # local ops, through any purely local steps
                    for o in steps[i]:
                        cls = o.__class__
                        if cls is Send or cls is Recv:
                            posts.append(o)
                            continue
                        src, so, dst, do, cnt = o.src, o.src_offset, o.dst, o.dst_offset, o.count
                        if not (0 <= so and 0 <= do and 0 <= cnt and so + cnt <= size.get(src, -1)
                                and do + cnt <= size.get(dst, -1)) or dst == IN:
                            _diagnose(schedules, f"rank {r} step {i}: {o} is out of its buffers")
                        if trace is not None:
                            trace(r, i, o)
                        if cls is Copy or (cls is not Reduce and isinstance(o, Copy)):
                            bufs[dst][do:do + cnt] = bufs[src][so:so + cnt]
                        else:
                            _reduce_into(bufs[dst], do, do + cnt, bufs[src][so:so + cnt])
                    if posts:
                        break
                    i += 1
                pc[r] = i
                if not posts:
                    break                    # finished
                comm_steps[r] += 1
                e = entered[r] = leaves[r]
                entry_knows[r] = knows[r]
                waiting = len(posts)
                messages += waiting
                if waiting == 2:             # the common step, one Send and one Recv, inline
                    a, b = posts
                    overlap = a.buf == b.buf and a.offset < b.offset + b.count and \
                        b.offset < a.offset + a.count and a.count > 0 and b.count > 0 and (
                            a.__class__ is not b.__class__ or a.__class__ is Recv and not (
                                a.reduce and b.reduce))
                else:
                    overlap = waiting > 2 and _same_step_overlap(posts)
                if overlap:
                    _diagnose(schedules, f"rank {r} step {i}: two messages' regions overlap")
                for o in posts:
                    peer, buf, off, cnt = o.peer, o.buf, o.offset, o.count
                    is_send = o.__class__ is Send
                    if not (0 <= peer < p) or peer == r or not (
                            0 <= off and 0 <= cnt and off + cnt <= size.get(buf, -1)) or (
                            buf == IN and not is_send):
                        _diagnose(schedules, f"rank {r} step {i}: bad {o}")
                    key = r * p + peer if is_send else peer * p + r
                    mine, q = (r, i, o, bufs[buf]), queues[key]
                    if not q or q[0][0] != peer:     # the partner's op is not posted: it waits
                        if q is None:
                            q = queues[key] = deque()
                        q.append(mine)
                        continue
                    (sr, si, snd, sb), (rr, ri, rcv, db) = \
                        (mine, q.popleft()) if is_send else (q.popleft(), mine)
                    if snd.count != rcv.count:
                        _diagnose(schedules, f"{snd} of rank {sr} and {rcv} differ in count")
                    if trace is not None:
                        trace(sr, si, snd)
                        trace(rr, ri, rcv)
                    so, do = snd.offset, rcv.offset
                    if rcv.reduce:
                        _reduce_into(db, do, do + cnt, sb[so:so + cnt])
                    else:
                        db[do:do + cnt] = sb[so:so + cnt]
                    knows[rr] |= entry_knows[sr]
                    c = (e if e > entered[peer] else entered[peer]) + 1
                    if c > leaves[peer]:
                        leaves[peer] = c
                    if c > leaves[r]:
                        leaves[r] = c
                    waiting -= 1
                    left[peer] -= 1
                    if not left[peer]:
                        ready.append(peer)
                if waiting:
                    left[r] = waiting
                    break
        self.messages = messages // 2      # every op of a rank that finished is paired
        return max(leaves, default=0)

    def raise_if_stuck(self) -> None:
        """Raise VerificationError naming the ranks that cannot finish, if any (a fault the
        reference checks find first, if there is one: an op never reached was never checked)."""
        schedules, pc = self.schedules, self.pc
        stuck = [r for r, s in enumerate(schedules) if pc[r] < len(s.steps)]
        if not stuck:
            return
        _check_call(schedules)
        partners = _pair_fifo(schedules)
        r = stuck[0]
        # a pair whose two ranks are in its steps has completed: waiting are those whose
        # partner has not reached its step yet
        waits = [(q, t, pc[q]) for q, t in partners[r][pc[r]] if pc[q] < t]
        raise VerificationError(
            f"deadlock under rendezvous sends: ranks {stuck} cannot finish; rank {r} is stuck in "
            f"step {pc[r]} waiting for (peer, peer's matching step, step the peer is in) {waits[:3]}")


def _same_step_overlap(posts: list) -> bool:
    """Whether a Recv of a step writes what a Send of it reads, or what another Recv writes
    (two reducing Recvs may: they combine)."""
    for j, a in enumerate(posts):
        ab, ao, ae = a.buf, a.offset, a.offset + a.count
        for b in posts[j + 1:]:
            if b.buf == ab and b.offset < ae and ao < b.offset + b.count and a.count > 0 \
                    and b.count > 0 and (a.__class__ is Recv or b.__class__ is Recv) \
                    and not (a.__class__ is b.__class__ and a.reduce and b.reduce):
                return True
    return False


def _check_results(schedules, state, knows) -> None:
    s0 = schedules[0]
    coll, p, n, root = s0.collective, s0.size, s0.count, s0.root
    full = (1 << p) - 1

    def expect(r: int, lo: int, first_src: int, mask: int, what: str, k: int, n: int = n):
        got = state[r][OUT][lo:lo + n]
        want = list(zip(range(first_src, first_src + n), repeat(mask)))
        if got != want:
            e = next(i for i in range(n) if got[i] != want[i])
            (gs, gm), (ws, wm) = got[e], want[e]
            how = {UNDEFINED: "nothing (never written, or undefined input)",
                   MIXED: "a mix of different elements",
                   DOUBLE: "a sum that counts a contribution twice"}.get(gs, f"element {gs}")
            err = VerificationError(
                f"{coll}/{s0.algorithm} p={p} n={n} root={root}: rank {r} out[{lo + e}] "
                f"({what.format(k)}) "
                f"holds {how} from ranks {_ranks(gm)}; expected element {ws} from ranks {_ranks(wm)}")
            err.element = (r, lo + e)
            raise err

    if coll == "barrier":
        for r in range(p):
            if knows[r] != full:
                raise VerificationError(f"barrier/{s0.algorithm} p={p}: rank {r} leaves knowing only "
                                        f"ranks {_ranks(knows[r])} entered")
        return
    expected, same = _result_blocks(s0)
    # every rank with a result expects the same: compared as one list (block by block on a miss)
    whole = _contents(next((b for b in expected if b), [])) if same else None
    for r, blocks in enumerate(expected):
        out = state[r][OUT]
        if blocks and whole is not None and (
                out if len(out) == len(whole) else out[:len(whole)]) == whole:
            continue
        for k, (lo, first_src, mask, cnt, what) in enumerate(blocks):
            expect(r, lo, first_src, mask, what, k, cnt)


def _result_blocks(s0: Schedule) -> Tuple[List[list], bool]:
    """What each rank's ``out`` must hold, as blocks (offset, first input element, contributing
    ranks, count, what it is: formatted with the block's index, the rank it comes from; none
    where ``out`` is scratch), and whether every rank that has a result has the same."""
    coll, p, n, root = s0.collective, s0.size, s0.count, s0.root
    full = (1 << p) - 1
    if coll in ("allreduce", "reduce", "broadcast"):
        whole = [(0, 0, 1 << root if coll == "broadcast" else full, n,
                  "broadcast" if coll == "broadcast" else "reduced")]
        return [whole if coll != "reduce" or r == root else [] for r in range(p)], True
    if coll in ("reduce_scatter", "scatter"):
        mask, what = (full, "reduced block") if coll == "reduce_scatter" else (1 << root,
                                                                               "scattered block")
        return [[(0, r * n, mask, n, what)] for r in range(p)], False
    if coll in ("allgather", "gather", "allgatherv", "gatherv"):
        blocks = blocks_of(s0.counts) if coll in UNEVEN else [(j * n, n) for j in range(p)]
        every = [(o, 0, 1 << j, c, "block of rank {}") for j, (o, c) in enumerate(blocks)]
        return [every if coll.startswith("all") or r == root else [] for r in range(p)], True
    if coll == "alltoall":
        return [[(j * n, r * n, 1 << j, n, "block from rank {}") for j in range(p)]
                for r in range(p)], False
    if coll in ("scatterv", "reduce_scatterv"):
        mask, what = (1 << root, "scattered block") if coll == "scatterv" else (full,
                                                                                "reduced block")
        return [[(0, o, mask, c, what)] for o, c in blocks_of(s0.counts)], False
    if coll == "alltoallv":
        rows = matrix_of(s0.counts, p)
        sent_at = [blocks_of(row) for row in rows]
        return [[(at, sent_at[i][r][0], 1 << i, rows[i][r], "block from rank {}")
                 for i, (at, _) in enumerate(blocks_of([row[r] for row in rows]))]
                for r in range(p)], False
    if coll in PREFIX:
        return [[(0, 0, (1 << (r + (coll == "scan"))) - 1, n, "prefix")]
                if coll == "scan" or r > 0 else [] for r in range(p)], False
    return [[] for _ in range(p)], False


def _contents(blocks: list) -> Optional[list]:
    """The symbolic values of ``blocks`` one after the other, if they tile ``out`` from its
    start (else None)."""
    want: list = []
    for lo, first_src, mask, cnt, _ in blocks:
        if lo != len(want):
            return None
        want += zip(range(first_src, first_src + cnt), repeat(mask))
    return want


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
