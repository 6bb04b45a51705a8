"""Tree family: symbolic verification of every collective, step counts, and negative controls."""
import dataclasses

import pytest

from family_cases import SIZES, ceil_lg, roots, verify_every_root_and_count, verify_large_world
from minicomm.algorithms import build_all, tree
from minicomm.schedule import COLLECTIVES, Recv, Send
from minicomm.verifier import VerificationError, verify

TWO_PHASE = {"allreduce", "allgather", "reduce_scatter", "barrier"}   # up the tree, then down





def build_direct(collective, p, n, root=0):
    """Bypasses build_schedule's cache: for schedules a test mutates."""
    return [tree.build(collective, r, p, n, root, (0,) * p) for r in range(p)]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_verifies_every_size_root_count(collective, p):
    verify_every_root_and_count("tree", collective, p)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [31, 64])
def test_verifies_large_worlds(collective, p):
    verify_large_world("tree", collective, p)


def expected_steps(collective, p):
    """Binomial tree: ceil(lg p) steps per tree pass; Bruck: ceil(lg p) exchanges."""
    return (2 if collective in TWO_PHASE else 1) * ceil_lg(p)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 33])
def test_step_counts(collective, p):
    n = 0 if collective == "barrier" else 2 * p + 3
    for root in sorted({0, p // 3, p - 1} & set(roots(collective, p))):
        stats = verify(build_all(collective, "tree", p, n, root))
        assert stats["max_comm_steps"] == expected_steps(collective, p)
        assert stats["rounds"] == expected_steps(collective, p)   # the critical path, too


@pytest.mark.parametrize("p", [2, 5, 8, 13])
def test_bruck_sends_one_packed_message_per_step(p):
    n = 3
    for s in build_all("alltoall", "tree", p, n):
        sends = [o for st in s.steps for o in st if isinstance(o, Send)]
        assert [o.peer for o in sends] == [(s.rank + (1 << k)) % p for k in range(ceil_lg(p))]
        assert all(o.count <= -(-p // 2) * n for o in sends)


@pytest.mark.parametrize("collective", ["gather", "scatter"])
def test_root_stages_only_the_wrapping_subtree(collective):
    p, n = 13, 2
    for root in range(p):
        s = build_all(collective, "tree", p, n, root)[root]
        # Root 0 never wraps; otherwise one subtree of at most p/2 blocks goes through tmp.
        assert (s.tmp_count == 0) if root == 0 else (s.tmp_count <= (p // 2) * n)


# --- negative controls: the verifier rejects broken variants of these schedules ---------------

def test_dropped_step_is_rejected():
    scheds = build_direct("reduce", 6, 5, root=2)
    victim = scheds[3]
    victim.steps = victim.steps[:-1]   # rank 3 never sends its partial sum to its parent
    with pytest.raises(VerificationError):
        verify(scheds)


def test_wrong_offset_is_rejected():
    scheds = build_direct("gather", 7, 4, root=3)
    victim = scheds[3]
    for i, st in enumerate(victim.steps):
        if any(isinstance(o, Recv) for o in st):
            victim.steps[i] = tuple(dataclasses.replace(o, offset=o.offset + 4)
                                    if isinstance(o, Recv) else o for o in st)
            break
    with pytest.raises(VerificationError):
        verify(scheds)


def test_overwriting_receive_in_reduce_is_rejected():
    scheds = build_direct("allreduce", 5, 3)
    victim = scheds[0]
    victim.steps = [tuple(dataclasses.replace(o, reduce=False) if isinstance(o, Recv) else o
                          for o in st) for st in victim.steps]   # loses the root's own value
    with pytest.raises(VerificationError):
        verify(scheds)


def test_bruck_with_wrong_partner_is_rejected():
    scheds = build_direct("alltoall", 6, 2)
    victim = scheds[1]
    victim.steps = [tuple(dataclasses.replace(o, peer=(o.peer + 1) % 6) if isinstance(o, Send)
                          and o.peer != 0 else o for o in st) for st in victim.steps]
    with pytest.raises(VerificationError):
        verify(scheds)
