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


# ------------------------------------------------------------------------------ channels
def _node_maps(p):
    """One node, two equal nodes, nodes of 4 (the last one short), and uneven 2,2,rest."""
    return sorted({(0,) * p, tuple(r * 2 // p for r in range(p)), tuple(r // 4 for r in range(p)),
                   tuple(min(r // 2, 2) for r in range(p))})


@pytest.mark.parametrize("collective", sorted(ring.CHANNELLED))
@pytest.mark.parametrize("p", [2, 3, 5, 8, 12, 16, 32, 64])
def test_channelled_rings_verify(collective, p):
    counts = [0, 1, 5, 3 * p + 2, 8 * p + 5] if p <= 16 else [8 * p + 5]
    for node_map in _node_maps(p) if p <= 16 else [tuple(r // 8 for r in range(p))]:
        for k in (2, 3, 8):
            for n in counts:
                stats = verify(build_all(collective, "ring", p, n, 0, node_map, k))
                assert stats["max_comm_steps"] == (expected_comm_steps(collective, p)
                                                   if n else stats["max_comm_steps"])


def test_each_channel_crosses_a_node_boundary_on_its_own_rail():
    orders = ring.channel_orders(tuple(r // 8 for r in range(32)), 8)
    for order in orders:
        assert sorted(order) == list(range(32))
        for a, b in zip(order, order[1:]):
            if a // 8 != b // 8:                  # a node boundary: the same local index
                assert a % 8 == b % 8
    for node in range(4):                          # node i left on a different rank per channel
        exits = [order[8 * node + 7] % 8 for order in orders]
        assert sorted(exits) == list(range(8))


def test_channels_split_the_data_and_keep_the_steps():
    one = build_all("allreduce", "ring", 8, 64, 0, (0,) * 8)
    four = build_all("allreduce", "ring", 8, 64, 0, (0,) * 8, 4)
    assert [len(s.steps) for s in four] == [len(s.steps) for s in one]
    sends = [o for st in four[0].steps for o in st if isinstance(o, Send)]
    assert len(sends) == 4 * 14 and sum(o.count for o in sends) == 2 * 7 * 64 // 8


def test_channels_are_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match="only the ring and tree families"):
        build_all("allreduce", "rhd", 4, 8, 0, None, 2)
    with pytest.raises(ValueError, match="channels must be an integer"):
        build_all("allreduce", "ring", 4, 8, 0, None, 0)
    assert build_all("broadcast", "ring", 4, 8, 0, None, 4) == build_all("broadcast", "ring", 4, 8)
