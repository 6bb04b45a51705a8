"""innet: in-network reduction schedules, switches included, proved by the verifier."""
import dataclasses

import pytest

from minicomm.algorithms import innet
from minicomm.schedule import IN, OUT, Recv, Reduce, Send
from minicomm.verifier import VerificationError, verify


def _maps(p):
    """One server, servers of 4 (the last one short), and ranks dealt round-robin over 3."""
    return sorted({(0,) * p, tuple(r // 4 for r in range(p)), tuple(r % 3 for r in range(p))})


@pytest.fixture
def short_chunks(monkeypatch):
    monkeypatch.setattr(innet, "CHUNK_SCALE", 1)    # so that small counts pipeline


@pytest.mark.parametrize("collective", innet.COLLECTIVES)
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 9, 12, 16, 17, 33, 64])
def test_every_collective_verifies_with_its_switches(collective, p, short_chunks):
    counts = [0] if collective == "barrier" else ([0, 1, 5, 11] if p <= 17 else [7])
    roots = sorted({0, p // 2, p - 1}) if collective in ("reduce", "broadcast") else [0]
    for topo in _maps(p):
        for n in counts:
            for root in roots:
                scheds = innet.build_all(collective, p, n, root, topo)
                assert len(scheds) == innet.participants(p, topo) > p
                verify(scheds)


def test_aggregation_trees_of_several_levels():
    """Servers of 2 ranks, 32 servers: 32 leaf switches, 4 above them, one root (SHARP's tree
    over a fat-tree's leaves and spines)."""
    topo = tuple(r // 2 for r in range(64))
    tree = innet.switch_tree(64, topo)
    assert tree.levels == 3 and tree.participants == 64 + 32 + 4 + 1
    for collective in innet.COLLECTIVES:
        verify(innet.build_all(collective, 64, 0 if collective == "barrier" else 3, 5, topo))


def _traffic(scheds, rank):
    sent = sum(o.count for st in scheds[rank].steps for o in st if isinstance(o, Send))
    got = sum(o.count for st in scheds[rank].steps for o in st if isinstance(o, Recv))
    return sent, got


def test_an_endpoint_sends_and_receives_the_vector_once():
    n, p = 1000, 16
    scheds = innet.build_all("allreduce", p, n, 0, tuple(r // 8 for r in range(p)))
    assert all(_traffic(scheds, r) == (n, n) for r in range(p))
    ag = innet.build_all("allgather", p, n, 0, (0,) * p)
    assert all(_traffic(ag, r) == (n, p * n) for r in range(p))
    rs = innet.build_all("reduce_scatter", p, n, 0, (0,) * p)
    assert all(_traffic(rs, r) == (p * n, n) for r in range(p))


def test_long_calls_are_cut_into_chunks_that_pipeline(short_chunks):
    scheds = innet.build_all("allreduce", 4, 36, 0, (0,) * 4)      # sqrt(36) = 6 chunks
    sends = [o for st in scheds[0].steps for o in st if isinstance(o, Send)]
    assert len(sends) == 6 and all(o.count == 6 for o in sends)
    assert len(scheds[0].steps) == 6 + 1      # chunk t up at t, down at t + 1
    verify(scheds)


def test_the_chunk_count_minimises_the_lock_step_pipeline():
    """S = sqrt((2H-1) n / CHUNK_SCALE) minimises (S + 2H - 1)(α + (n/S)β) when CHUNK_SCALE
    is α/β: checked against a brute-force minimum over S, for one and three levels."""
    for levels in (1, 3):
        for n in (innet.CHUNK_SCALE * 100, innet.CHUNK_SCALE * 600):
            alpha, beta = innet.CHUNK_SCALE * 1.0, 1.0        # α/β = CHUNK_SCALE elements
            best = min(range(1, 200), key=lambda s: (s + 2 * levels - 1) * (alpha + n / s * beta))
            got = len(innet.chunks(n, levels))
            assert abs(got - best) <= 1, (levels, n, got, best)


def test_collectives_a_switch_cannot_help_are_refused():
    for collective in ("gather", "scatter", "alltoall"):
        with pytest.raises(ValueError, match="innet has no " + collective):
            innet.build(collective, 0, 4, 8, 0, (0,) * 4)


def test_a_switch_that_drops_a_childs_sum_is_caught():
    scheds = innet.build_all("allreduce", 4, 6, 0, (0,) * 4)
    switch = scheds[4]
    dropped = [tuple(o for o in st if not (isinstance(o, Reduce) and o.src_offset == 6))
               for st in switch.steps]
    with pytest.raises(VerificationError, match=r"expected element 0 from ranks \[0, 1, 2, 3\]"):
        verify(scheds[:4] + [dataclasses.replace(switch, steps=dropped)])


def test_a_switch_that_counts_a_child_twice_is_caught():
    scheds = innet.build_all("allreduce", 3, 4, 0, (0,) * 3)
    switch = scheds[3]
    steps = list(switch.steps)
    k = next(i for i, st in enumerate(steps) if any(isinstance(o, Reduce) for o in st))
    twice = next(o for o in steps[k] if isinstance(o, Reduce))
    steps[k] = (twice,) + steps[k]
    with pytest.raises(VerificationError, match="counts a contribution twice"):
        verify(scheds[:3] + [dataclasses.replace(switch, steps=steps)])


def test_ranks_may_not_write_past_a_switch_or_skip_it():
    scheds = innet.build_all("allreduce", 4, 2, 0, (0,) * 4)
    with pytest.raises(VerificationError, match=r"1 sends \d->4 but 0 receives"):
        verify(scheds[:4] + [dataclasses.replace(scheds[4], steps=[])])
    with pytest.raises(VerificationError, match="3 schedules for a world of 4"):
        verify(scheds[:3])
    bad = dataclasses.replace(scheds[0], steps=[(Send(9, IN, 0, 2),), (Recv(4, OUT, 0, 2),)])
    with pytest.raises(VerificationError, match="bad peer 9"):
        verify([bad] + scheds[1:])


def test_minicomm_verify_proves_innet_when_named():
    import io

    from minicomm.tools import verify as verify_tool
    coll, fam, p, cases, err = verify_tool.verify_cell(("allreduce", "innet", 12, False))
    assert err is None and cases > 0
    assert verify_tool.verify_cell(("gather", "innet", 4, False))[3:] == (0, None)
    out = io.StringIO()
    assert verify_tool.run_matrix(4, jobs=1, collectives=["allreduce", "alltoall"],
                                  families=["innet"], out=out)
    text = out.getvalue()
    assert "n/a" in text and "1/1 cells pass" in text
