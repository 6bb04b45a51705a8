"""Ring family: symbolic verification of every collective, step counts, and negative controls."""
import dataclasses

import pytest

from family_cases import SIZES, verify_every_root_and_count, verify_large_world
from minicomm.algorithms import build_all, ring
from minicomm.schedule import COLLECTIVES, ROOTED, Copy, Recv, Send
from minicomm.verifier import VerificationError, verify


def build_direct(collective, p, n, root=0):
    """Bypasses build_schedule's cache: for schedules a test mutates or builds under a patch."""
    return [ring.build(collective, r, p, n, root, (0,) * p) for r in range(p)]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_verifies_every_size_root_count(collective, p):
    verify_every_root_and_count("ring", collective, p)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [31, 64])
def test_verifies_large_worlds(collective, p):
    verify_large_world("ring", collective, p)


def expected_comm_steps(collective, p):
    if p == 1:
        return 0
    return {"reduce": 2 * (p - 1), "allreduce": 2 * (p - 1),
            "broadcast": 1 if p == 2 else 2,          # one segment: receive, then forward
            "barrier": min(p, 4)}.get(collective, p - 1)


def expected_rounds(collective, p):
    """Length of the critical path (verifier rounds): the α term of each cost formula."""
    if p == 1:
        return 0
    return {"reduce": 2 * (p - 1), "allreduce": 2 * (p - 1), "barrier": 2 * p - 2}.get(collective, p - 1)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 13, 16])
def test_step_counts(collective, p):
    root = p // 2 if collective in ROOTED else 0
    scheds = build_all(collective, "ring", p, 2 * p + 3, root)
    stats = verify(scheds)
    assert stats["max_comm_steps"] == expected_comm_steps(collective, p)
    assert stats["rounds"] == expected_rounds(collective, p)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_broadcast_pipelines_segments(monkeypatch, p):
    monkeypatch.setattr(ring, "SEGMENT", 3)
    for n in (0, 1, 7, 20):
        segments = max(1, -(-n // 3))
        for root in range(p):
            stats = verify(build_direct("broadcast", p, n, root))
            assert stats["rounds"] == p - 1 + segments - 1
            assert stats["max_comm_steps"] == segments + (p > 2)


def test_dropped_step_is_rejected():
    scheds = build_direct("allreduce", 5, 11)
    scheds[2] = dataclasses.replace(scheds[2], steps=scheds[2].steps[:-1])
    with pytest.raises(VerificationError, match="sends .* but .* receives"):
        verify(scheds)


def test_wrong_recv_offset_is_rejected():
    # Rank 1 lands block 3 on block 2's place at step 1: block 3 is never written there.
    p, n = 4, 3
    scheds = build_direct("allgather", p, n)
    steps = list(scheds[1].steps)
    steps[1] = tuple(dataclasses.replace(o, offset=o.offset - n) if isinstance(o, Recv)
                     else o for o in steps[1])
    scheds[1] = dataclasses.replace(scheds[1], steps=steps)
    with pytest.raises(VerificationError, match="allgather"):
        verify(scheds)


def test_early_release_barrier_is_rejected():
    # The last rank passes the token on before it arrives: rank 0 then leaves knowing too little.
    p = 5
    scheds = build_direct("barrier", p, 0)
    last = scheds[-1]
    assert [type(s[0]) for s in last.steps] == [Recv, Send]
    scheds[-1] = dataclasses.replace(last, steps=last.steps[::-1])
    with pytest.raises(VerificationError, match="leaves knowing only"):
        verify(scheds)


def test_reduce_scatter_wrong_local_block_is_rejected():
    # Each rank adds its input block one place off the chunk it receives: the sums mix blocks.
    p, n = 4, 2
    scheds = []
    for s in build_direct("reduce_scatter", p, n):
        steps = [tuple(dataclasses.replace(o, src_offset=(o.src_offset + n) % (p * n))
                       if isinstance(o, Copy) else o for o in st) for st in s.steps]
        scheds.append(dataclasses.replace(s, steps=steps))
    with pytest.raises(VerificationError, match="a mix of different elements"):
        verify(scheds)
