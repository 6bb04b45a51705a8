"""The executor's compile-time shortcuts give the results the plain schedule semantics give:
a copy folded into a reduce-receive (``_fusable``), and in-place calls that skip copying the input
aside when the plan is ``alias_safe``."""
import dataclasses

import numpy as np
import pytest

import minicomm as mc
from minicomm.algorithms import build_schedule
from minicomm.executor import FUSE_MIN_COUNT, Plan, alias_safe
from minicomm.schedule import IN, OUT, Copy, Recv, ScheduleBuilder, Send

FAMILIES = ("ring", "tree", "rhd", "hier")
COUNTS = (1, 7, FUSE_MIN_COUNT + 3)      # the last one takes the fused path


def _in_place_vs_out_of_place(comm, algo):
    """Every collective whose input and output can share memory (nccl-tests' in-place layouts:
    the same buffer, or a rank's block of the other), against the out-of-place call."""
    p, r = comm.size, comm.rank
    bad = []
    for n in COUNTS:
        x = (np.arange(n, dtype=np.float64) % 97 + 1) * (r + 1)
        blocks = (np.arange(p * n, dtype=np.float64) % 89 + 1).reshape(p, n) * (r + 2)
        for coll, root in (("allreduce", 0), ("broadcast", 0), ("broadcast", p - 1),
                           ("reduce", 0), ("reduce", p - 1), ("alltoall", 0),
                           ("allgather", 0), ("gather", p - 1), ("reduce_scatter", 0),
                           ("scatter", p - 1)):
            kw = {"algorithm": algo}
            if coll in ("broadcast", "reduce", "gather", "scatter"):
                kw["root"] = root
            f = getattr(comm, coll)
            if coll in ("allgather", "gather"):
                ref = f(x.copy(), **kw)
                buf = np.zeros((p, n))
                buf[r] = x
                got = f(buf[r], out=buf, **kw) if coll == "allgather" or r == root else \
                    f(buf[r], **kw)
                got = buf if got is not None else None
            elif coll in ("reduce_scatter", "scatter"):
                ref = f(blocks.copy(), **kw)
                buf = blocks.copy()
                got = f(buf, out=buf[r], **kw)
            elif coll == "alltoall":
                ref = f(blocks.copy(), **kw)
                buf = blocks.copy()
                got = f(buf, out=buf, **kw)
            else:
                ref = f(x.copy(), **kw)
                y = x.copy()
                got = f(y, **kw) if coll == "reduce" and r != root else f(y, out=y[:], **kw)
            if ref is not None and not np.array_equal(ref, got):
                bad.append((coll, root, n))
    return bad


@pytest.mark.parametrize("algo", FAMILIES)
def test_in_place_matches_out_of_place(algo):
    for p in (1, 2, 3, 4, 6):
        nodes = 2 if algo == "hier" and p >= 4 else 1
        assert mc.spawn(_in_place_vs_out_of_place, p, args=(algo,), transport="inproc",
                        nodes=nodes, timeout=60) == [[]] * p


def _fused_allreduce(comm):
    n = FUSE_MIN_COUNT * 3 + 1
    x = np.arange(n, dtype=np.float32) + comm.rank
    return comm.allreduce(x, algorithm="rhd")


def test_fused_copy_reduce_receive_over_shm():
    plan = Plan(build_schedule("allreduce", "rhd", 0, 2, FUSE_MIN_COUNT * 3 + 1), [0, 1])
    assert any(post[7] >= 0 for _, _, posts in plan.steps for post in posts)   # it is fused
    n = FUSE_MIN_COUNT * 3 + 1
    want = 2 * np.arange(n, dtype=np.float32) + 1
    for got in mc.spawn(_fused_allreduce, 2, transport="shm", timeout=60):
        assert np.array_equal(got, want)


def _posted(plan):
    """Per step: the peers of the early sends and of the sends posted after the local ops."""
    return [([s[1] for s in early], [s[1] for s in posts if s[0]])
            for early, _, posts in plan.steps]


def test_sends_independent_of_local_ops_go_before_them():
    # a scatter root copies its own block and sends the others' blocks from `in`: the send
    # need not wait for the copy
    root = Plan(build_schedule("scatter", "tree", 0, 4, 64), [0, 1, 2, 3])
    assert _posted(root)[0] == ([2], [])
    assert root.steps[0][1], "the root's copy of its own block stays a local op"
    # ring allgather's first send reads the block the step's copy writes: it must wait
    ag = Plan(build_schedule("allgather", "ring", 1, 3, 64), [0, 1, 2])
    assert _posted(ag)[0] == ([], [2])


def test_early_sends_keep_each_peers_order():
    b = ScheduleBuilder("scatter", "ring", 0, 3, 4)
    # to peer 1: the first send reads `out` where the copy writes, so the second (independent)
    # one may not overtake it; the send to peer 2 goes first
    b.step(Copy(IN, 0, OUT, 0, 4), Send(1, OUT, 0, 4), Send(1, IN, 4, 4), Send(2, IN, 8, 4))
    plan = Plan(b.build(), [0, 1, 2])
    assert _posted(plan) == [([2], [1, 1])]
    assert [s[3] for s in plan.steps[0][2]] == [0, 4]         # peer 1's sends in schedule order


def test_alias_safe_negative_controls():
    # out[0:4] is written from a receive, then in[0:4] is read: unsafe when in is out
    assert not alias_safe([(Recv(1, OUT, 0, 4),), (Send(1, IN, 0, 4),)])
    # a send from in and a receive into out on the same region run at once
    assert not alias_safe([(Send(1, IN, 0, 4), Recv(1, OUT, 0, 4))])
    # a copy into another place of out, then that place of in is read
    assert not alias_safe([(Copy(IN, 0, OUT, 4, 4),), (Send(1, IN, 4, 4),)])
    # copying in[a:] onto out[a:] is a no-op in place; sends of other regions are fine
    assert alias_safe([(Copy(IN, 0, OUT, 0, 8), Send(1, IN, 4, 4), Recv(1, OUT, 0, 4, True)),
                       (Send(1, OUT, 0, 4), Recv(1, OUT, 4, 4))])


def test_separate_tells_the_same_array_from_an_overlap():
    """``Communicator._separate``: a view of the output's own memory is the in-place call (the
    output itself comes back: nothing copied), an overlap at a whole-element offset is the
    shifted in-place view, one at a byte offset is copied, and separate memory is left alone."""
    from minicomm.communicator import Communicator
    from minicomm.communicator.buffers import InPlace as _InPlace
    sep = Communicator._separate
    a = np.arange(8, dtype=np.float32)
    out = a[:]
    assert sep(a, out, out) is out
    assert sep(a[:], a, a) is a
    shifted = sep(a[2:6], a[0:4], a[0:4])
    assert type(shifted) is _InPlace and shifted.shift == 2
    raw = np.zeros(33, dtype=np.uint8)
    odd, even = raw[1:].view(np.float32), raw[:32].view(np.float32)
    copied = sep(odd, even, even)
    assert not np.may_share_memory(copied, raw) and np.array_equal(copied, odd, equal_nan=True)
    other = np.zeros(8, dtype=np.float32)
    assert sep(a, other, other) is a
    assert sep(a, a.view(np.int32), a.view(np.int32)) is not a     # same bytes, other dtype


def test_separate_decides_views_of_two_owners_without_looking_at_memory(monkeypatch):
    """Views of two different arrays that own their memory cannot overlap: decided from their
    bases alone (np.may_share_memory is not called). Views of one owner, or of memory numpy does
    not own (a bytearray), still get the full check, and their overlaps are still found."""
    from minicomm.communicator import Communicator
    from minicomm.communicator.buffers import InPlace as _InPlace
    sep = Communicator._separate
    owner_a, owner_b = np.zeros(16, np.float32), np.zeros(16, np.float32)
    x, y = owner_a[4:12], owner_b[:8]
    calls = []
    real = np.may_share_memory
    monkeypatch.setattr(np, "may_share_memory", lambda *a: calls.append(a) or real(*a))
    assert sep(x, y, y) is x and sep(owner_a, y, y) is owner_a and sep(x, owner_b, owner_b) is x
    assert calls == []
    assert sep(owner_a[4:12], owner_a[4:12][:], x) is not x and calls   # one owner: checked
    assert sep(x, owner_a[4:12], owner_a[4:12]).base is owner_a         # the same memory
    shifted = sep(owner_a[6:14], x, x)
    assert type(shifted) is _InPlace and shifted.shift == 2
    raw = bytearray(64)
    f, g = np.frombuffer(raw, np.float32)[:8], np.frombuffer(raw, np.float32)[:8]
    assert f.base is not g.base and sep(f, g, g) is g                   # not owners: checked


# ------------------------------------------------------------------ local ops on a helper thread
def _steps_background(plan):
    """``plan.background`` spelled out per step (None means no step's ops run on a helper)."""
    return plan.background if plan.background is not None else (-1,) * len(plan.steps)


def _background(coll, algo, rank, p, root=0):
    return _steps_background(Plan(build_schedule(coll, algo, rank, p, 64, root=root),
                                  list(range(p))))


def test_local_ops_run_beside_the_messages_only_where_no_op_sees_the_difference():
    # ring gather / scatter / alltoall, 2 ranks: a copy-only step, then the message step, which
    # touches other blocks: the copy may run while the messages move, joined after step 1
    assert _background("gather", "ring", 0, 2) == (1, -1)
    assert _background("scatter", "ring", 0, 2) == (1, -1)
    assert _background("alltoall", "ring", 1, 2) == (1, -1)
    # tree gather's root copies its block and receives the other in the same step
    assert _background("gather", "tree", 0, 2) == (0,)
    # ring allgather sends the block its copy writes, in the same step: the copy goes first
    assert _background("allgather", "ring", 0, 2) == (-1,)
    # a broadcast root's send reads `in` and already goes before its copy: nothing to gain
    assert _background("broadcast", "tree", 0, 2) == (-1,)
    # a non-root gather rank has no local op
    assert set(_background("gather", "ring", 1, 2)) == {-1}


def test_local_ops_wait_for_a_next_step_that_reads_what_they_write():
    b = ScheduleBuilder("gather", "ring", 0, 2, 4)
    b.step(Copy(IN, 0, OUT, 0, 4))
    b.step(Send(1, OUT, 0, 4))                     # reads the copy's output
    assert Plan(b.build(), [0, 1]).background is None
    b = ScheduleBuilder("gather", "ring", 0, 2, 4)
    b.step(Copy(IN, 0, OUT, 0, 4))
    b.step(Recv(1, IN, 0, 4))                      # writes what the copy reads
    assert Plan(b.build(), [0, 1]).background is None
    b = ScheduleBuilder("gather", "ring", 0, 2, 4)
    b.step(Copy(IN, 0, OUT, 0, 4))
    b.step(Recv(1, OUT, 4, 4))                     # another region: free
    assert _steps_background(Plan(b.build(), [0, 1])) == (1, -1)


def _matrix_with_helpers(comm):
    """The collective matrix over shm with every eligible local op on a helper thread: the
    size threshold at 0, the small path off (so every call runs the executor), and the node
    taken as having a core per helper whatever this machine has."""
    from collective_check import matrix
    from minicomm import executor
    executor.BACKGROUND_MIN_BYTES = 0
    comm.small_path = False
    comm.caps = dataclasses.replace(comm.caps, oversubscribed=False)
    before = executor._Helper.started
    n = 0
    for algo in FAMILIES:
        n += matrix(comm, algo, counts=(1, 7, FUSE_MIN_COUNT + 3), dtypes=("int32", "float64"),
                    all_roots=True, every_op=False)
    return n, executor._Helper.started - before


@pytest.mark.parametrize("p", [2, 3])
def test_results_with_local_ops_on_helper_threads_match_numpy(p):
    res = mc.spawn(_matrix_with_helpers, p, transport="shm", timeout=300)
    assert all(n > 0 for n, _ in res)
    assert sum(started for _, started in res) > 0, "no helper ran: the test checks nothing"
