"""Hierarchical family: symbolic verification over node maps, step counts, negative controls."""
import random
from dataclasses import replace

import numpy as np
import pytest

import minicomm as mc
from minicomm.algorithms import build_all, build_schedule, hier
from minicomm.algorithms.hier import INTER, INTRA, node_map
from minicomm.schedule import COLLECTIVES, ROOTED, Copy
from minicomm.verifier import VerificationError, verify


def topologies(p):
    """Node maps: one node, two blocks, uneven blocks with arbitrary labels, one rank per node,
    round-robin (non-contiguous; equal nodes when the modulus divides p), and a shuffled uneven
    map."""
    sizes, uneven, k = (3, 1, 2), [], 0
    while len(uneven) < p:
        uneven += [10 * (5 - k)] * sizes[k % 3]   # descending labels: node ids are just names
        k += 1
    uneven = uneven[:p]
    shuffled = uneven[:]
    random.Random(p).shuffle(shuffled)
    maps = [(0,) * p, tuple(r * 2 // p for r in range(p)), tuple(uneven),
            tuple(range(p - 1, -1, -1)), tuple(r % 2 for r in range(p)),
            tuple(r % 3 for r in range(p)), tuple(shuffled)]
    return list(dict.fromkeys(maps))


def counts(p, coll):
    return [0] if coll == "barrier" else [0, 1, 3, p + 1, 2 * p + 3]


def check(coll, p, topo, roots, ns):
    for n in ns:
        for root in roots:
            try:
                verify(build_all(coll, "hier", p, n, root, topo))
            except VerificationError as e:
                raise AssertionError(f"{coll} p={p} n={n} root={root} topology={topo}: {e}") from e


@pytest.mark.parametrize("coll", COLLECTIVES)
@pytest.mark.parametrize("p", range(1, 13))
def test_verified_every_map_root_count(coll, p):
    roots = range(p) if coll in ROOTED else [0]
    for topo in topologies(p):
        check(coll, p, topo, roots, counts(p, coll))


@pytest.mark.parametrize("coll", COLLECTIVES)
@pytest.mark.parametrize("p", range(13, 21))
def test_verified_large_worlds(coll, p):
    # Every root on the two maps with most structure (uneven blocks, shuffled); fewer counts.
    maps = topologies(p)
    roots = range(p) if coll in ROOTED else [0]
    for topo in (maps[2], maps[-1]):
        check(coll, p, topo, roots, counts(p, coll)[2:4])
    for topo in maps:
        check(coll, p, topo, [0, p - 1] if coll in ROOTED else [0], counts(p, coll)[-1:])


def test_node_map_structure():
    nm = node_map((7, 3, 3, 7, 1))
    assert nm.nodes == ((0, 3), (1, 2), (4,))
    assert (nm.lmax, nm.equal, nm.blocked, nm.cyclic) == (2, False, False, False)
    assert node_map((0, 0, 1, 1)).blocked and node_map((0, 1, 0, 1)).cyclic
    assert not node_map((0, 1, 1, 0)).blocked and not node_map((0, 1, 1, 0)).cyclic


def test_degenerate_maps_are_the_flat_schedules():
    for coll in COLLECTIVES:
        for topo, fam in (((0,) * 6, INTRA), ((5, 4, 3, 2, 1, 0), INTER)):
            for r in range(6):
                hier = build_schedule(coll, "hier", r, 6, 7, 2, topo)
                flat = build_schedule(coll, fam, r, 6, 7, 2)
                assert hier.algorithm == "hier" and hier.steps == flat.steps


def test_topology_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        build_schedule("allreduce", "hier", 0, 4, 3, 0, (0, 0, 1))


# ---------------------------------------------------------------- step counts
def phases(coll, rank, p, n, root, topo):
    """The flat phases rank takes part in: (collective, family, group, count, group root), worked
    out here from the documented design, independently of hier.py's code."""
    groups = {}
    for r, node in enumerate(topo):
        groups.setdefault(node, []).append(r)
    nodes = list(groups.values())
    if len(nodes) in (1, p):
        return [(coll, INTRA if len(nodes) == 1 else INTER, list(range(p)), n, root)]
    mine = next(g for g in nodes if rank in g)
    rooted = coll in ROOTED
    leaders = [root if rooted and root in g else g[0] for g in nodes]
    lead = leaders[nodes.index(mine)]
    top = leaders.index(root) if rooted else 0   # the root's node among the leaders
    i, lmax, m = mine.index(rank), max(map(len, nodes)), len(nodes)
    equal = all(len(g) == lmax for g in nodes)
    shard = [g[i] for g in nodes] if equal else None   # ranks of my local index, one per node
    intra = lambda c, cnt: (c, INTRA, mine, cnt, mine.index(lead))
    inter = lambda c, cnt: (c, INTER, leaders, cnt, top)
    on_leader = lambda *ph: list(ph) if rank == lead else []
    if coll == "broadcast":
        return on_leader(inter("broadcast", n)) + [intra("broadcast", n)]
    if coll == "reduce":
        return [intra("reduce", n)] + on_leader(inter("reduce", n))
    if coll == "allreduce" and equal:
        c = -(-n // lmax)
        return [intra("reduce_scatter", c), ("allreduce", INTER, shard, max(0, min(c, n - i * c)), 0),
                intra("allgather", c)]
    if coll == "allreduce":
        return [intra("reduce", n)] + on_leader(inter("allreduce", n)) + [intra("broadcast", n)]
    if coll == "allgather":
        return [intra("gather", n)] + on_leader(inter("allgather", lmax * n)) + \
            [intra("broadcast", p * n)]
    if coll == "reduce_scatter" and equal:
        return [intra("reduce_scatter", m * n), ("reduce_scatter", INTER, shard, n, 0)]
    if coll == "reduce_scatter":
        return [intra("reduce", p * n)] + on_leader(inter("reduce_scatter", lmax * n)) + \
            [intra("scatter", n)]
    if coll == "gather":
        return [intra("gather", n)] + on_leader(inter("gather", lmax * n))
    if coll == "scatter":
        return on_leader(inter("scatter", lmax * n)) + [intra("scatter", n)]
    if coll == "alltoall":
        return [intra("gather", p * n)] + on_leader(inter("alltoall", lmax * lmax * n)) + \
            [intra("scatter", p * n)]
    return [intra("gather", 0)] + on_leader(inter("barrier", 0)) + [intra("broadcast", 0)]


STEP_CASES = [(6, (0, 0, 0, 1, 1, 1)), (8, (0, 0, 1, 1, 2, 2, 3, 3)), (5, (0, 0, 0, 1, 1)),
              (4, (0, 1, 1, 1)), (9, (2, 0, 1, 2, 0, 1, 2, 0, 1)), (7, (0, 1, 1, 0, 2, 1, 0)),
              (6, (0, 1, 2, 3, 4, 4)), (12, tuple(r // 4 for r in range(12)))]


@pytest.mark.parametrize("p,topo", STEP_CASES)
@pytest.mark.parametrize("coll", COLLECTIVES)
def test_steps_are_the_sum_of_the_phases(coll, p, topo):
    for n in (0, 5, 2000):
        for root in (range(p) if coll in ROOTED else [0]):
            scheds = build_all(coll, "hier", p, n, root, topo)
            want = []
            for r in range(p):
                subs = [build_schedule(c, fam, group.index(r), len(group), cnt, groot)
                        for c, fam, group, cnt, groot in phases(coll, r, p, n, root, topo)]
                want.append(sum(s.comm_steps for s in subs))
            assert [s.comm_steps for s in scheds] == want, (coll, p, n, root, topo)


def test_step_count_closed_forms():
    def steps(coll, p, n, topo, root=0):
        return max(s.comm_steps for s in build_all(coll, "hier", p, n, root, topo))

    assert (INTRA, INTER) == ("ring", "rhd")   # the formulas below are for this pairing
    for L, m in ((2, 2), (3, 4), (4, 2), (2, 8)):
        p, lg = L * m, m.bit_length() - 1        # m is a power of two
        blocks = tuple(r // L for r in range(p))
        # ring reduce-scatter L-1, rhd recursive-doubling allreduce lg m, ring allgather L-1
        assert steps("allreduce", p, 8 * L, blocks) == 2 * (L - 1) + lg
        # ring reduce 2(L-1), then Rabenseifner reduce 2 lg m among the leaders
        assert steps("reduce", p, 8, blocks) == 2 * (L - 1) + 2 * lg
        # ring gather L-1, rhd gather lg m
        assert steps("gather", p, 3, blocks) == (L - 1) + lg
        # ring gather L-1, pairwise alltoall m-1 among leaders, ring scatter L-1
        assert steps("alltoall", p, 2, blocks) == 2 * (L - 1) + (m - 1)
        # ring reduce-scatter L-1 of node segments, recursive halving lg m
        assert steps("reduce_scatter", p, 2, blocks) == (L - 1) + lg


# ---------------------------------------------------------------- negative controls
def test_dropped_inter_step_is_rejected():
    topo = (0, 0, 1, 1, 1, 2)
    scheds = build_all("allreduce", "hier", 6, 5, 0, topo)
    leader = scheds[2]
    inter = [k for k, st in enumerate(leader.steps) if any(getattr(o, "peer", 2) in (0, 5)
                                                             for o in st)]
    broken = replace(leader, steps=[st for k, st in enumerate(leader.steps) if k != inter[0]])
    with pytest.raises(VerificationError):
        verify(scheds[:2] + [broken] + scheds[3:])


def test_wrong_permutation_offset_is_rejected():
    topo = (0, 1, 0, 1)   # round-robin nodes: the root must put node blocks back in rank order
    scheds = build_all("gather", "hier", 4, 2, 0, topo)
    root = scheds[0]
    last = root.steps[-1]
    assert all(isinstance(o, Copy) for o in last)
    bad = tuple(replace(o, dst_offset=o.dst_offset + 1) if k == 0 else o
                for k, o in enumerate(last))
    with pytest.raises(VerificationError):
        verify([replace(root, steps=root.steps[:-1] + [bad])] + scheds[1:])


def test_ranks_disagreeing_on_the_node_map_are_rejected():
    a = build_all("allgather", "hier", 6, 3, 0, (0, 0, 0, 1, 1, 1))
    b = build_all("allgather", "hier", 6, 3, 0, (0, 0, 1, 1, 2, 2))
    with pytest.raises(VerificationError):
        verify(a[:3] + b[3:])


# ---------------------------------------------------------------- pipelined allreduce
SMALL_SEGMENT = 4   # a PIPELINE_MIN_SEGMENT that pipelines counts a verifier proves quickly


@pytest.fixture
def small_segments(monkeypatch):
    """Pipelining from SMALL_SEGMENT elements on; build through hier.build, not the cached
    build_schedule, so no schedule built under the patch outlives it."""
    monkeypatch.setattr(hier, "PIPELINE_MIN_SEGMENT", SMALL_SEGMENT)


def equal_node_maps(p):
    """Blocked and round-robin maps of m equal nodes, m = 2..8 dividing p (one rank per node
    aside: that is the flat INTER schedule)."""
    return [topo for m in range(2, 9) if p % m == 0 and m < p
            for topo in (tuple(r // (p // m) for r in range(p)), tuple(r % m for r in range(p)))]


def pipelined_counts(p, topo):
    """Counts giving S > 1: fewer elements than a large node has ranks (empty segments), a padded
    last segment, and S = PIPELINE_MAX_SEGMENTS over whole multiples of the node size."""
    L = p // len(set(topo))
    return [2 * SMALL_SEGMENT + 1, 5 * L + 3, L * -(-32 * SMALL_SEGMENT // L)]


def build_hier_allreduce(p, n, topo):
    return [hier.build("allreduce", r, p, n, 0, topo) for r in range(p)]


def test_segment_rule_depends_on_the_count_alone():
    seg = hier.PIPELINE_MIN_SEGMENT
    assert [hier.pipeline_segments(n) for n in (0, 1, seg, 2 * seg - 1)] == [1, 1, 1, 1]
    assert hier.pipeline_segments(2 * seg) == 2
    assert hier.pipeline_segments(32 * seg) == hier.PIPELINE_MAX_SEGMENTS == 8
    assert hier.pipeline_segments(1 << 40) == 8
    rule = [hier.pipeline_segments(n) for n in range(0, 40 * seg, seg // 8)]
    assert rule == sorted(rule)
    for n in (2 * seg, 3 * seg + 5, 17 * seg - 1, 32 * seg + 7, 1 << 33):
        for L in (2, 3, 8):
            bounds = hier._segment_bounds(n, L, hier.pipeline_segments(n))
            assert sum(ln for _, ln in bounds) == n and bounds[0][0] == 0
            assert all(a + la == b for (a, la), (b, _) in zip(bounds, bounds[1:]))
            assert all(ln % L == 0 for _, ln in bounds[:-1])
            assert min(ln for _, ln in bounds) >= seg - L   # only L-rounding below the minimum


@pytest.mark.parametrize("p", [4, 6, 8, 12, 16, 32, 64])
def test_pipelined_allreduce_verified(p, small_segments):
    maps = equal_node_maps(p)
    assert maps
    for topo in maps:
        counts = pipelined_counts(p, topo)
        assert hier.pipeline_segments(counts[-1]) == hier.PIPELINE_MAX_SEGMENTS
        for n in counts:
            assert hier.pipeline_segments(n) > 1
            try:
                verify(build_hier_allreduce(p, n, topo))
            except VerificationError as e:
                raise AssertionError(f"p={p} n={n} topology={topo}: {e}") from e


def test_uneven_nodes_keep_the_unpipelined_allreduce(small_segments):
    topo, n = (0, 0, 0, 1, 1, 2, 2, 2), 200
    scheds = build_hier_allreduce(8, n, topo)
    verify(scheds)
    # reduce to the leader, allreduce among leaders, broadcast: as many steps as before
    want = [s.comm_steps for s in [build_schedule("allreduce", "hier", r, 8, n, 0, topo)
                                   for r in range(8)]]
    assert [s.comm_steps for s in scheds] == want


@pytest.mark.parametrize("p,m", [(8, 2), (12, 3), (16, 4)])
def test_pipelined_phases_share_steps(p, m, small_segments):
    """The point of pipelining: steps that talk inside the node and across nodes at once, and
    fewer steps than the segments would take one after another."""
    topo = tuple(r // (p // m) for r in range(p))
    nm, n = node_map(topo), 64 * p
    S = hier.pipeline_segments(n)
    assert S == 8
    for s in build_hier_allreduce(p, n, topo):
        peers = [{nm.node_of[o.peer] == nm.node_of[s.rank] for o in st if hasattr(o, "peer")}
                 for st in s.steps]
        assert sum(kinds == {True, False} for kinds in peers) >= S - 1
        seg_steps = build_schedule("allreduce", "hier", s.rank, p, n // S, 0, topo).comm_steps
        assert s.comm_steps < S * seg_steps


def test_pipelined_dropped_step_is_rejected(small_segments):
    topo = (0, 0, 0, 1, 1, 1)
    scheds = build_hier_allreduce(6, 64, topo)
    victim = scheds[4]
    mixed = next(k for k, st in enumerate(victim.steps) if len(st) > 3)
    broken = replace(victim, steps=victim.steps[:mixed] + victim.steps[mixed + 1:])
    with pytest.raises(VerificationError):
        verify(scheds[:4] + [broken] + scheds[5:])


def _pipelined_allreduce(comm, segment):
    # spawn's ranks are fresh processes: patch before the first call, whose plan is cached
    hier.PIPELINE_MIN_SEGMENT = segment
    results = []
    for n in (1000, 1001, 37):   # S = 8; S = 8 with a padded last segment; S = 4
        assert hier.pipeline_segments(n) > 1
        sched = build_schedule("allreduce", "hier", comm.rank, comm.size, n, 0, comm.topology)
        assert any(len({comm.topology[o.peer] for o in st if hasattr(o, "peer")}) == 2
                   for st in sched.steps), "no step talks inside and across nodes at once"
        x = np.arange(n, dtype=np.float64) * (comm.rank + 1) + comm.rank
        results.append(comm.allreduce(x, algorithm="hier"))
    return results


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pipelined_allreduce_runs(transport):
    p = 4
    got = mc.spawn(_pipelined_allreduce, p, args=(SMALL_SEGMENT,), transport=transport, nodes=2,
                   timeout=60)
    for n, per_rank in zip((1000, 1001, 37), zip(*got)):
        want = sum(np.arange(n, dtype=np.float64) * (r + 1) + r for r in range(p))
        for r, res in enumerate(per_rank):
            np.testing.assert_array_equal(res, want, err_msg=f"{transport} n={n} rank {r}")


def test_minicomm_verify_proves_the_pipelined_paths():
    """``minicomm verify`` cuts the pipelines short so that its small counts run the many-segment
    code of large calls, and restores the thresholds after."""
    from minicomm.algorithms import tree
    from minicomm.tools import verify as verify_tool
    saved = hier.PIPELINE_MIN_SEGMENT, tree.TREE_MIN_CHUNK
    with verify_tool.short_segments():
        for p in (8, 40):
            n = verify_tool.pipelined_counts(p)[0]
            assert hier.pipeline_segments(n) > 1
            assert n // 3 // tree.TREE_MIN_CHUNK > 1          # chunks of a 3-channel tree
    assert (hier.PIPELINE_MIN_SEGMENT, tree.TREE_MIN_CHUNK) == saved
    plain = verify_tool.verify_cell(("allreduce", "hier", 8, False))
    assert plain[4] is None and plain[3] > 0
