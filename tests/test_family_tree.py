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


# ------------------------------------------------------------------ NCCL's double binary tree
def _servers(p, per):
    return tuple(r // per for r in range(p))


@pytest.mark.parametrize("p,per", [(2, 1), (5, 1), (8, 4), (12, 4), (10, 2), (16, 8), (7, 3),
                                   (6, 6)])
@pytest.mark.parametrize("k", [2, 3, 4, 16])
def test_double_binary_tree_verifies_with_several_chunks_per_channel(p, per, k, monkeypatch):
    monkeypatch.setattr(tree, "TREE_MIN_CHUNK", 2)      # so that small counts pipeline
    for n in (0, 1, 7, 2 * p + 1, 40 * k + 3, 200 * k):
        verify(build_all("allreduce", "tree", p, n, 0, _servers(p, per), k))


def test_the_two_trees_complement_each_other():
    """Most servers that are leaves of tree A are inner servers of tree B (NCCL's point: each
    server sends and receives about as much in both trees together)."""
    for n in (4, 5, 8, 9, 16, 31, 32):
        a, b = tree.double_tree(n, 0), tree.double_tree(n, 1)
        for t in (a, b):
            assert sorted(t).count(-1) == 1                     # one root
        leaves_a = set(range(n)) - set(a)
        leaves_b = set(range(n)) - set(b)
        assert len(leaves_a & leaves_b) <= 1, (n, leaves_a, leaves_b)


def test_each_pair_of_tree_channels_enters_a_server_at_its_own_rank():
    topo = _servers(32, 8)
    heads = set()
    for c in range(16):
        parent, _, depth, _ = tree.channel_tree(topo, 16, c)
        server_heads = [r for r in range(8) if parent[r] < 0 or parent[r] // 8 != 0]
        assert len(server_heads) == 1                           # one rank of server 0 leaves it
        heads.add((c // 2, server_heads[0]))
    assert sorted(h for _, h in heads) == list(range(8))        # pair q at local rank q


def test_one_channel_is_the_binomial_tree_and_other_collectives_ignore_channels():
    assert build_all("allreduce", "tree", 6, 9, 0, None, 1) == build_all("allreduce", "tree", 6, 9)
    assert (build_all("broadcast", "tree", 6, 9, 2, _servers(6, 3), 4)
            == build_all("broadcast", "tree", 6, 9, 2))
