"""Recursive halving / doubling family: symbolic verification of every collective, step counts,
both allreduce variants, the exchange structure of alltoall, and negative controls."""
import dataclasses
import time

import pytest

from family_cases import (
    SIZES,
    ceil_lg,
    counts,
    roots,
    verify_every_root_and_count,
    verify_large_world,
)
from minicomm.algorithms import build_all, rhd
from minicomm.schedule import COLLECTIVES, Recv, Send
from minicomm.verifier import VerificationError, verify


def lg_pow2_floor(p):
    return p.bit_length() - 1


def build_direct(collective, p, n, root=0):
    """Bypasses build_schedule's cache: for schedules a test mutates or a patched threshold."""
    return [rhd.build(collective, r, p, n, root, (0,) * p) for r in range(p)]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_verifies_every_size_root_count(collective, p):
    verify_every_root_and_count("rhd", collective, p)


@pytest.mark.parametrize("p", SIZES)
def test_rabenseifner_allreduce_every_size(p, monkeypatch):
    # The test counts are all below the small-message threshold: lower it to reach the
    # reduce-scatter + allgather variant (still recursive doubling where n < p').
    monkeypatch.setattr(rhd, "ALLREDUCE_SMALL_COUNT", 0)
    for n in counts("allreduce", p):
        verify(build_direct("allreduce", p, n))


@pytest.mark.parametrize("p", [2, 3, 8, 12])
def test_allreduce_variant_switches_at_threshold(p):
    small, large = rhd.ALLREDUCE_SMALL_COUNT - 1, rhd.ALLREDUCE_SMALL_COUNT
    lg2, fold = lg_pow2_floor(p), int(p & (p - 1) != 0)
    assert verify(build_all("allreduce", "rhd", p, small))["max_comm_steps"] == lg2 + 2 * fold
    assert verify(build_all("allreduce", "rhd", p, large))["max_comm_steps"] == 2 * lg2 + 2 * fold


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [31, 64])
def test_verifies_large_worlds(collective, p):
    verify_large_world("rhd", collective, p)


def expected_steps(collective, p, n):
    """lg p' rounds per halving / doubling pass, +1 per fold direction; binomial and
    dissemination passes ⌈lg p⌉; pairwise exchange p-1."""
    lg2, fold, lg = lg_pow2_floor(p), int(p & (p - 1) != 0), ceil_lg(p)
    if collective == "allreduce":
        small = n < rhd.ALLREDUCE_SMALL_COUNT or n < (1 << lg2)
        return (lg2 if small else 2 * lg2) + 2 * fold
    return {"broadcast": 2 * lg2 + fold, "reduce": 2 * lg2 + fold,
            "reduce_scatter": lg2 + 2 * fold, "alltoall": p - 1,
            "allgather": lg, "gather": lg, "scatter": lg, "barrier": lg}[collective]


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 33])
def test_step_counts(collective, p):
    n = 0 if collective == "barrier" else 2 * p + 3
    for root in sorted({0, p // 3, p - 1} & set(roots(collective, p))):
        stats = verify(build_all(collective, "rhd", p, n, root))
        assert stats["max_comm_steps"] == expected_steps(collective, p, n)


@pytest.mark.parametrize("p", [2, 3, 6, 7, 8, 16])
def test_alltoall_is_a_pairwise_exchange(p):
    n = 2
    for s in build_all("alltoall", "rhd", p, n):
        partners = []
        for st in s.steps:
            peers = {o.peer for o in st if isinstance(o, (Send, Recv))}
            assert len(peers) == 1 and len([o for o in st if isinstance(o, (Send, Recv))]) == 2
            partners.append(peers.pop())
        if p & (p - 1) == 0:
            assert partners == [s.rank ^ k for k in range(1, p)]
        assert sorted(partners) == [q for q in range(p) if q != s.rank]


def test_every_schedule_generates_fast_at_64_ranks():
    # Generous bound (shared CPUs): the target is well under 50 ms per collective.
    for collective in COLLECTIVES:
        t0 = time.perf_counter()
        build_direct(collective, 64, 1000, 5)
        assert time.perf_counter() - t0 < 0.5, collective


# ------------------------------------------------------------------------- negative controls

def test_dropped_halving_step_is_rejected(monkeypatch):
    monkeypatch.setattr(rhd, "ALLREDUCE_SMALL_COUNT", 0)
    scheds = build_direct("allreduce", 8, 16)
    # Rank 0 and its first halving partner both skip their exchange: the counts still match,
    # so only the result check can catch it (half the vector misses a contribution).
    for r in (0, 4):
        scheds[r] = dataclasses.replace(scheds[r], steps=scheds[r].steps[1:])
    with pytest.raises(VerificationError, match="rank 0 out"):
        verify(scheds)


def test_wrong_block_offset_is_rejected():
    scheds = build_direct("allgather", 8, 3)
    s = scheds[5]
    first = tuple(dataclasses.replace(o, offset=o.offset - 3) if isinstance(o, Recv) else o
                  for o in s.steps[0])
    scheds[5] = dataclasses.replace(s, steps=[first] + s.steps[1:])
    with pytest.raises(VerificationError, match="block of rank 4"):
        verify(scheds)


def test_missing_fold_out_is_rejected():
    scheds = build_direct("reduce_scatter", 6, 2)
    # Ranks 0/1 fold; drop the Send of rank 1's block from rank 0's last step, and its receive.
    last = tuple(o for o in scheds[0].steps[-1] if not isinstance(o, Send))
    scheds[0] = dataclasses.replace(scheds[0], steps=scheds[0].steps[:-1] + [last])
    scheds[1] = dataclasses.replace(scheds[1], steps=scheds[1].steps[:-1])
    with pytest.raises(VerificationError, match="rank 1 out"):
        verify(scheds)
