"""Simulator: closed-form α-β-γ costs, fat-tree oversubscription, presets vs public nccl-tests
figures, the parameter server vs BytePS' closed forms, the dgx-h100 128-node claims, files, CLI."""
import ast
import dataclasses
import functools
import io
import json
import math
import os
from contextlib import redirect_stdout

import numpy as np
import pytest

from minicomm.schedule import Copy, Recv, Send
from minicomm.sim import cli as sim_cli
from minicomm.sim import engine, presets, ps_model
from minicomm.sim.engine import ScheduleError, max_min_rates, program_for, simulate
from minicomm.sim.topology import Fabric, LinkSpec, Topology

ALPHA, BW, GAMMA = 5e-6, 10e9, 1 / 20e9
BETA = 1 / BW
# divisible by every world size below (and by their largest power of two), so chunks are equal
COUNT = 2 ** 12 * 3 * 5 * 7


def flat(p, gamma=GAMMA, alpha=ALPHA, bw=BW, delta=0.0):
    """Contention-free: p single-accelerator servers on one switch, equal links; α = NIC latency."""
    ln = LinkSpec("test", bw, alpha)
    return Topology("flat", servers=p, gpus_per_server=1, intra="nvswitch", intra_link=ln,
                    nic_link=ln, tiers=1, gamma=gamma, delta=delta)


def lg(p):
    return (p - 1).bit_length()


def pow2_below(p):
    return 1 << (p.bit_length() - 1)


def closed_form(coll, fam, p, count):
    """MPICH-style costs from the algorithm headers (ring.py, rhd.py, tree.py); n in bytes."""
    a, b, g = ALPHA, BETA, GAMMA
    n = count * 4
    L = lg(p)
    q = pow2_below(p)
    fold = int(p != q)
    f = (p - 1) / p
    fq = (q - 1) / q
    if fam == "ring":
        seg = max(1, -(-count // 32768))
        return {"allreduce": 2 * (p - 1) * a + 2 * f * n * b + f * n * g,
                "reduce": 2 * (p - 1) * a + 2 * f * n * b + f * n * g,
                "broadcast": (p + seg - 2) * (a + n / seg * b),
                "allgather": (p - 1) * (a + n * b),
                "reduce_scatter": (p - 1) * (a + n * b + n * g),
                "gather": (p - 1) * (a + n * b), "scatter": (p - 1) * (a + n * b),
                "alltoall": (p - 1) * (a + n * b), "barrier": 2 * (p - 1) * a}[coll]
    if fam == "tree":
        return {"broadcast": L * (a + n * b), "reduce": L * (a + n * b + n * g),
                "allreduce": 2 * L * a + 2 * L * n * b + L * n * g,
                "gather": L * a + (p - 1) * n * b, "scatter": L * a + (p - 1) * n * b,
                "barrier": 2 * L * a}[coll]
    if fam == "rhd":
        lq = lg(q)
        return {"allreduce": (2 * lq + 2 * fold) * a + (2 * fq + 2 * fold) * n * b
                + (fq + fold) * n * g,
                "reduce": (2 * lq + fold) * a + (2 * fq + fold) * n * b + (fq + fold) * n * g,
                "broadcast": (2 * lq + fold) * a + (2 * fq + fold) * n * b,
                "allgather": L * a + (p - 1) * n * b,
                "reduce_scatter": lq * a + fq * p * n * (b + g),
                "gather": L * a + (p - 1) * n * b, "scatter": L * a + (p - 1) * n * b,
                "barrier": L * a}[coll]
    raise KeyError(fam)


CASES = ([("ring", c) for c in ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter",
                                 "gather", "scatter", "alltoall", "barrier")]
         + [("tree", c) for c in ("broadcast", "reduce", "allreduce", "gather", "scatter",
                                  "barrier")]
         + [("rhd", c) for c in ("allreduce", "reduce", "broadcast", "allgather", "gather",
                                 "scatter", "barrier")])


@pytest.mark.parametrize("p", [2, 4, 5, 6, 8, 12, 16])
@pytest.mark.parametrize("fam,coll", CASES)
def test_contention_free_matches_closed_forms(fam, coll, p):
    if fam == "ring" and coll == "barrier" and p == 2:
        pytest.skip("2 ranks: the token's second round is the first")
    count = 0 if coll == "barrier" else COUNT
    got = simulate(coll, fam, flat(p), count=count, channels=1).time_s   # tree: the binomial's
    assert got == pytest.approx(closed_form(coll, fam, p, count), rel=0.01)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_rhd_small_allreduce_and_reduce_scatter_closed_forms(p):
    count = 64          # below rhd.ALLREDUCE_SMALL_COUNT: recursive doubling, whole vector
    n = count * 4
    got = simulate("allreduce", "rhd", flat(p), count=count).time_s
    assert got == pytest.approx(lg(p) * (ALPHA + n * BETA + n * GAMMA), rel=0.01)
    got = simulate("reduce_scatter", "rhd", flat(p), count=COUNT).time_s
    assert got == pytest.approx(closed_form("reduce_scatter", "rhd", p, COUNT), rel=0.01)


def test_reduce_overlap_and_copies_are_priced():
    """With the reduction overlapped, ring allreduce's γ term disappears when γ < β; copies cost
    δ per byte."""
    p, n = 8, COUNT * 4
    t = flat(p).replace(reduce_overlap=True)
    got = simulate("allreduce", "ring", t, count=COUNT).time_s
    assert got == pytest.approx(2 * (p - 1) * ALPHA + 2 * (p - 1) / p * n * BETA, rel=1e-6)
    # ring reduce_scatter copies the local block into a scratch slot before each reduce-on-arrival
    d = 1 / 40e9
    base = simulate("reduce_scatter", "ring", flat(p), count=COUNT).time_s
    withcopy = simulate("reduce_scatter", "ring", flat(p, delta=d), count=COUNT).time_s
    assert withcopy == pytest.approx(base + (p - 1) * n * d, rel=1e-6)


def test_max_min_fair_sharing():
    """Three flows: A and B share link 0 (cap 10); B and C share link 1 (cap 4). Progressive
    filling: link 1 is tightest (2 each) -> B = C = 2; then A gets the rest of link 0: 8."""
    cap = np.array([10.0, 4.0, math.inf])
    pad = 2
    links = np.array([[0, pad], [0, 1], [1, pad]])
    assert max_min_rates(links, cap).tolist() == pytest.approx([8.0, 2.0, 2.0])
    # a message with nowhere to be slowed down (padding only) is not limited
    assert max_min_rates(np.array([[pad, pad]]), cap)[0] == math.inf


def test_max_min_rates_per_route_equal_the_rates_per_flow():
    """A row standing for several flows on one route gives each the rate the flows get one row
    each (what the engine does: one row per (src, dst) route)."""
    rng = np.random.default_rng(7)
    cap = np.concatenate((rng.uniform(1, 10, 6), [math.inf]))
    routes = np.array([[0, 1, 6], [0, 6, 6], [2, 3, 6], [1, 2, 4], [5, 6, 6], [4, 5, 3]])
    flows = np.array([3, 1, 2, 4, 1, 2])
    per_flow = max_min_rates(np.repeat(routes, flows, axis=0), cap)
    per_route = max_min_rates(routes, cap, flows)
    assert np.repeat(per_route, flows) == pytest.approx(per_flow)


def test_two_flows_on_one_link_take_twice_as_long():
    """Two ranks send to the same receiver at once: its NIC in-link is shared."""
    n = 1 << 20
    scheds = [[(Send(2, "in", 0, n),)], [(Send(2, "in", 0, n),)],
              [(Recv(0, "out", 0, n), Recv(1, "out", 0, n))]]
    r = engine.simulate_schedules(scheds, flat(3, gamma=0.0))
    assert r.time_s == pytest.approx(ALPHA + 2 * n * 4 * BETA, rel=1e-9)
    assert r.busiest_link == "NIC 2.0 in"
    assert r.busiest_link_utilisation == pytest.approx(2 * n * 4 * BETA / r.time_s)


def test_issue_gap_spaces_the_messages_a_sender_starts_at_once():
    """One rank sends k messages in one step: they start (k-1) gaps later; one message alone
    pays no gap."""
    n, gap = 1000, 2e-6
    ln = LinkSpec("g", BW, ALPHA, gap=gap)
    t = Topology("g", servers=5, gpus_per_server=1, intra="nvswitch", intra_link=ln,
                 nic_link=ln, tiers=1)
    fan = [[tuple(Send(d, "in", 0, n) for d in (1, 2, 3, 4))]] + \
          [[(Recv(0, "out", 0, n),)] for _ in range(4)]
    got = engine.simulate_schedules(fan, t).time_s
    # four flows share rank 0's out link
    assert got == pytest.approx(3 * gap + ALPHA + 4 * n * 4 * BETA, rel=1e-9)
    one = engine.simulate_schedules([[(Send(1, "in", 0, n),)], [(Recv(0, "out", 0, n),)]], t)
    assert one.time_s == pytest.approx(ALPHA + n * 4 * BETA, rel=1e-9)


def test_unmatched_and_deadlocked_schedules_raise():
    with pytest.raises(ScheduleError, match="unmatched"):
        engine.simulate_schedules([[(Send(1, "in", 0, 4),)], []], flat(2))
    with pytest.raises(ScheduleError, match="elements"):
        engine.simulate_schedules([[(Send(1, "in", 0, 4),)], [(Recv(0, "out", 0, 8),)]], flat(2))
    # each waits for the other's second step: a cycle of waits
    cyc = [[(Recv(1, "out", 0, 1),), (Send(1, "in", 0, 1),)],
           [(Recv(0, "out", 0, 1),), (Send(0, "in", 0, 1),)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        engine.simulate_schedules(cyc, flat(2))


@pytest.mark.parametrize("coll,fam", [("allreduce", "ring"), ("allgather", "ring"),
                                      ("reduce_scatter", "ring"), ("alltoall", "ring"),
                                      ("alltoall", "rhd"), ("allreduce", "rhd"),
                                      ("allreduce", "hier"), ("allgather", "hier"),
                                      ("alltoall", "hier"), ("broadcast", "ring"),
                                      ("allreduce", "tree")])
@pytest.mark.parametrize("count", [64 * 5, 64 * 5 + 3])
def test_symmetry_fast_path_is_the_real_schedules(coll, fam, count):
    """At 64 ranks (8 servers of 8) the program derived from the first block's real schedules
    by a rank or server symmetry equals the one built rank by rank (and uneven counts, where
    ring loses its symmetry, fall back to building every rank)."""
    p = 64
    nodes = tuple(r // 8 for r in range(p))
    fast = program_for(coll, fam, p, count, 0, nodes)
    exact = program_for(coll, fam, p, count, 0, nodes, exact=True)
    assert exact.derived_by == "built"
    if count % p == 0 and (coll, fam) in (("allreduce", "ring"), ("allgather", "ring"),
                                          ("alltoall", "rhd"), ("allreduce", "hier"),
                                          ("allgather", "hier")):
        assert fast.derived_by != "built"
    for f in ("rank_first", "step_rank", "step_copy", "step_reduce", "msg_src", "msg_dst",
              "msg_count", "msg_reduce", "msg_send_step", "msg_recv_step", "send_ptr"):
        assert np.array_equal(getattr(fast, f), getattr(exact, f)), f


def _fat_tree(oversub, leaves=4, per_leaf=4):
    ln = LinkSpec("nic", BW, ALPHA)
    return Topology("ft", servers=leaves * per_leaf, gpus_per_server=1, intra="nvswitch",
                    intra_link=ln, nic_link=ln, tiers=2, servers_per_leaf=per_leaf,
                    oversubscription=oversub, switch_latency=0.0, gamma=GAMMA)


def test_oversubscription_slows_a_cross_rack_ring_exactly_where_the_model_says():
    """16 servers, 4 per leaf. A ring's hop crosses racks when neighbours sit in different
    leaves; a leaf's uplink carries (its servers sending out of the rack) flows on a trunk of
    4B/oversub. The per-flow rate is min(B, 4B / (oversub * crossing flows per leaf))."""
    p, count = 16, COUNT
    n = count * 4
    leaves = per_leaf = 4

    def ring(oversub, placement):
        return simulate("allreduce", "ring", _fat_tree(oversub), count=count,
                        placement=placement).time_s

    def model(rate):
        return 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * n / rate + (p - 1) / p * n * GAMMA

    contiguous = list(range(p))                           # 1 crossing flow per leaf
    interleaved = [(r % leaves) * per_leaf + r // leaves for r in range(p)]   # every hop crosses
    half = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]            # 2 cross per leaf

    def crossing_per_leaf(pl):
        out = [0] * leaves
        for r in range(p):
            a, b = pl[r] // per_leaf, pl[(r + 1) % p] // per_leaf
            if a != b:
                out[a] += 1
        return max(out)

    assert [crossing_per_leaf(x) for x in (contiguous, half, interleaved)] == [1, 2, 4]
    for pl in (contiguous, half, interleaved):
        f = crossing_per_leaf(pl)
        for o in (1.0, 2.0, 4.0):
            rate = min(BW, per_leaf * BW / (o * f))
            assert ring(o, pl) == pytest.approx(model(rate), rel=0.01), (pl, o)
    # where the model says: slower only when crossing flows exceed the trunk's share
    assert ring(2.0, contiguous) == pytest.approx(ring(1.0, contiguous), rel=1e-9)
    assert ring(2.0, half) == pytest.approx(ring(1.0, half), rel=1e-9)
    assert ring(4.0, half) > ring(1.0, half)
    # every hop crossing at 2:1: the bandwidth term doubles, nothing else changes
    extra = 2 * (p - 1) / p * n * (2 / BW - 1 / BW)
    assert ring(2.0, interleaved) - ring(1.0, interleaved) == pytest.approx(extra, rel=1e-6)


def test_three_tier_core_oversubscription():
    """Pods of 2 leaves: ranks 0..7 in pod 0, 8..15 in pod 1; an alltoall's cross-pod traffic
    is slowed by the core's 2:1, a pod-local one is not."""
    ln = LinkSpec("nic", BW, ALPHA)
    t = Topology("ft3", servers=16, gpus_per_server=1, intra="nvswitch", intra_link=ln,
                 nic_link=ln, tiers=3, servers_per_leaf=4, leaves_per_pod=2,
                 core_oversubscription=2.0)
    fab = Fabric(t)
    links, lat = fab.routes(np.array([0, 0, 0]), np.array([1, 5, 9]))
    hops = (links >= 0).sum(axis=1)
    assert hops.tolist() == [2, 4, 6]            # leaf; leaf-spine-leaf; through the core
    local = simulate("alltoall", "ring", t, count=COUNT, placement=list(range(8))).time_s
    assert local == pytest.approx(simulate("alltoall", "ring", t.replace(core_oversubscription=1.0),
                                           count=COUNT, placement=list(range(8))).time_s)
    full = simulate("alltoall", "ring", t, count=COUNT).time_s
    assert full > 1.2 * simulate("alltoall", "ring", t.replace(core_oversubscription=1.0),
                                 count=COUNT).time_s


# ------------------------------------------------------------------------- presets vs nccl-tests
def _busbw(topo_name, nodes, placement=None, size=8 << 30, compute=False):
    """Link check: the ring's busbw with local compute free (NCCL fuses copies and reductions
    into its transfer kernels; minicomm's schedules copy the local chunk first)."""
    t = presets.get_topology(topo_name, nodes=nodes)
    if not compute:
        t = t.replace(gamma=0.0, delta=0.0)
    return simulate("allreduce", "ring", t, nbytes=size, placement=placement).busbw


def test_presets_match_public_nccl_tests_figures():
    """Large ring allreduce busbw, against what NVIDIA engineers quote for nccl-tests:
    - 8x H100 NVLink4, ring: ~370 GB/s (https://github.com/NVIDIA/nccl-tests/issues/212)
    - 8x A100 NVLink3: "close to 240 GB/s" (https://github.com/NVIDIA/nccl/issues/1712)
    - one NDR 400G NIC: 46-48 GB/s (https://github.com/NVIDIA/nccl-tests/issues/290)
    - one HDR 200G NIC: 24 GB/s (https://github.com/NVIDIA/nccl-tests/issues/119)
    - 8x H100 PCIe without NVSwitch: 35-45 GB/s (alayanew.com nccl-tests post, a vendor blog)"""
    assert _busbw("dgx-h100", 1) == pytest.approx(370, rel=0.05)
    assert _busbw("dgx-a100", 1) == pytest.approx(240, rel=0.05)
    # one rank on GPU 0 of each of two servers: the ring crosses one NIC each way
    assert 46 * 0.95 <= _busbw("dgx-h100", 2, placement=[0, 8]) <= 48 * 1.05
    assert _busbw("dgx-a100", 2, placement=[0, 8]) == pytest.approx(24, rel=0.05)
    assert 35 <= _busbw("pcie-8gpu", 1) <= 45
    # with the HBM cost of minicomm's local copies priced, the real ring schedule stays within 15%
    assert _busbw("dgx-h100", 1, compute=True) == pytest.approx(370, rel=0.15)
    for name, ln in presets.links().items():
        assert ln.source, name
        assert ln.line_rate >= ln.bandwidth, name


def test_every_preset_runs_every_family():
    for name in presets.topologies():
        t = presets.get_topology(name, nodes=2)
        for fam in ("ring", "tree", "rhd", "hier"):
            r = simulate("allreduce", fam, t, nbytes=1 << 20)
            assert r.time_s > 0 and r.busbw > 0, (name, fam)


def test_dgx_h100_128_nodes_hier_wins_large_rhd_and_tree_win_small():
    t = presets.get_topology("dgx-h100", nodes=128)
    assert t.endpoints == 1024
    # each simulation once (a 1024-rank ring takes seconds): the table is rendered from them too
    res = [simulate("allreduce", f, t, nbytes=s) for s in (4096, 1 << 16, 1 << 30)
           for f in ("ring", "tree", "rhd", "hier")]
    time_of = {(r.algorithm, r.bytes): r.time_s for r in res}
    assert time_of["hier", 1 << 30] < time_of["ring", 1 << 30] / 2
    assert time_of["rhd", 4096] < time_of["ring", 4096] / 10
    assert time_of["tree", 4096] < time_of["ring", 4096] / 10
    text = sim_cli.render_table(t, "allreduce", res, ["ring", "tree", "rhd", "hier"])
    assert "# winner changes: hier -> rhd between 4 KiB and 64 KiB; rhd -> hier between 64 KiB " \
        "and 1 GiB" in text
    assert "tree stops beating ring between 64 KiB and 1 GiB" in text


# ------------------------------------------------------------------------- parameter server
@pytest.mark.parametrize("n,k,colocated", [(8, 2, False), (8, 8, False), (16, 4, False),
                                           (4, 1, False), (8, 8, True), (16, 16, True)])
def test_ps_matches_byteps_closed_forms(n, k, colocated):
    """Contention-free (one switch, every machine bandwidth B, tiny α): within 1% of
    max(M/B, nM/(kB)) (non-colocated) and 2(n-1)M/(nB) (colocated, = allreduce)."""
    M = 1e9
    t = flat(n + (0 if colocated else k), gamma=0.0, alpha=1e-7)
    r = ps_model.simulate_ps(t, n, k, M, colocated=colocated, rounds=256)
    if colocated:
        cf = 2 * (n - 1) * r.model_bytes / (n * BW)
    else:
        cf = max(r.model_bytes / BW, n * r.model_bytes / (k * BW))
    assert r.closed_form_s == pytest.approx(cf)
    assert r.time_s == pytest.approx(cf, rel=0.01)


def test_allreduce_matches_byteps_allreduce_closed_form():
    n, M = 16, 1 << 30
    r = simulate("allreduce", "ring", flat(n, gamma=0.0, alpha=1e-7), nbytes=M)
    assert r.time_s == pytest.approx(ps_model.closed_form_allreduce(n, M, BW), rel=0.01)


def test_ps_cli_prices_both_ways():
    out = _run_cli(["--topology", "dgx-h100", "--nodes", "4", "--architecture", "ps",
                    "--servers", "2,4", "--model-bytes", "256MB", "--json"])
    rows = json.loads(out)
    archs = {r["architecture"] for r in rows}
    assert archs == {"allreduce", "ps", "ps-colocated"}
    assert {r["servers"] for r in rows if r["architecture"] == "ps"} == {2, 4}
    for r in rows:
        assert {"collective", "algorithm", "bytes", "ranks", "time_s", "algbw", "busbw"} <= set(r)
        assert r["bytes"] == 256_000_000 and r["time_s"] > 0


def test_advise_names_winner_margin_and_crossover():
    out = _run_cli(["--advise", "--model-bytes", "1G", "--gpus", "32", "--topology", "dgx-h100"])
    assert "winner on these 32 accelerators" in out and "faster than" in out
    assert "server-count crossover" in out and "model-size crossover" in out
    js = json.loads(_run_cli(["--advise", "--model-bytes", "1G", "--gpus", "32", "--json"]))
    assert js["margin"] >= 1 and js["winner"] and js["gpus"] == 32
    assert len(js["winners_by_model_size"]) >= 4


# ------------------------------------------------------------------------- files, CLI
def _run_cli(argv):
    import argparse
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    a = p.parse_args(argv)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = sim_cli.main(a)
    assert rc == 0, buf.getvalue()
    return buf.getvalue()


def test_sizes_parse_like_nccl_tests():
    assert sim_cli.parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert sim_cli.parse_sizes("1K,4096,1M,1G") == [1024, 4096, 1 << 20, 1 << 30]
    assert sim_cli.parse_size("350GB") == 350_000_000_000     # GB: powers of 1000
    assert sim_cli.parse_size("1GiB") == sim_cli.parse_size("1G") == 1 << 30
    for bad in ("", "1X", "-4", "8K:1K", "1.5"):
        with pytest.raises(ValueError):
            sim_cli.parse_sizes(bad)


def test_cli_json_rows_and_table():
    rows = json.loads(_run_cli(["--topology", "dgx-h100", "--nodes", "2", "--sizes", "1K,1M",
                                "--algorithms", "all", "--json"]))
    assert len(rows) == 8
    for r in rows:
        assert {"collective", "algorithm", "bytes", "ranks", "time_s", "algbw", "busbw"} <= set(r)
        assert r["ranks"] == 16 and r["collective"] == "allreduce"
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * 15 / 16)
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
    text = _run_cli(["--nodes", "2", "--sizes", "1K:4K", "--algorithms", "ring,rhd"])
    assert "winner" in text and "ring time" in text and "rhd time" in text
    rows = json.loads(_run_cli(["--nodes", "2", "--collective", "allgather", "--sizes", "64K",
                                "--json"]))
    assert all(r["bytes"] == 65536 and r["count"] == 65536 // 4 // 16 for r in rows)


def test_cli_reports_bad_input_without_traceback(capsys):
    import argparse
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    for argv in (["--topology", "nope"], ["--collective", "sideways"], ["--algorithms", "ring,x"],
                 ["--sizes", "1Q"], ["--gpus", "12"], ["--topology", "/no/such.toml"]):
        assert sim_cli.main(p.parse_args(argv)) == 2
        assert "minicomm sim:" in capsys.readouterr().err


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "b.png"
    _run_cli(["--nodes", "2", "--sizes", "1K:64K", "--plot", str(out)])
    assert out.stat().st_size > 1000


def test_compare_interconnects():
    rows = json.loads(_run_cli(["--compare-interconnects", "--nodes", "4", "--sizes", "1M,256M",
                                "--algorithms", "hier,rhd", "--json"]))
    inter = {r["interconnect"] for r in rows}
    assert inter == {"IB NDR 400G", "RoCEv2 400G", "UB 400G"}
    t = {(r["interconnect"], r["algorithm"], r["requested_bytes"]): r["time_s"] for r in rows}
    # at 1 MiB latency decides: UB (lowest α) < IB < RoCE
    assert t[("UB 400G", "rhd", 1 << 20)] < t[("IB NDR 400G", "rhd", 1 << 20)] \
        < t[("RoCEv2 400G", "rhd", 1 << 20)]


def test_explain_reproduces_the_seed_figures():
    text = _run_cli(["--explain"])
    assert "350 GB" in text and "699.3 GB" in text          # 2(p-1)/p S per rank
    assert "256 x 350 GB" in text and "89.51 TB" in text and "88.90 TB" in text
    assert "Simulated" in text and "hier" in text


def test_topology_files_toml_and_json(tmp_path):
    spec = {"name": "mine", "base": "dgx-h100", "servers": 4,
            "nic": {"per_server": 4, "link": {"preset": "ib-hdr-200"}},
            "network": {"tiers": 3, "servers_per_leaf": 2, "leaves_per_pod": 1,
                        "core_oversubscription": 2.0},
            "compute": {"reduce_GBps": 500}}
    pj = tmp_path / "t.json"
    pj.write_text(json.dumps(spec))
    t = presets.get_topology(str(pj))
    assert (t.name, t.servers, t.nics_per_server, t.tiers, t.core_oversubscription) == \
        ("mine", 4, 4, 3, 2.0)
    assert t.nic_link.bandwidth == 24e9 and t.intra_link.name == "nvlink4"
    assert t.gamma == pytest.approx(1 / 500e9)
    assert presets.get_topology(str(pj), nodes=8).servers == 8
    try:
        import tomllib  # noqa: F401
    except ImportError:
        pytest.skip("TOML needs Python >= 3.11")
    pt = tmp_path / "t.toml"
    pt.write_text('name = "small"\nservers = 2\ngpus_per_server = 4\n'
                  '[intra]\nkind = "pcie"\nlink = { bandwidth_GBps = 50, latency_us = 2 }\n'
                  '[nic]\nper_server = 1\nlink = "roce-400"\n'
                  '[network]\ntiers = 1\n')
    t = presets.get_topology(str(pt))
    assert (t.servers, t.gpus_per_server, t.intra, t.intra_link.bandwidth) == (2, 4, "pcie", 50e9)
    assert simulate("allreduce", "hier", t, nbytes=1 << 20).time_s > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**spec, "network": {"tier": 2}}))
    with pytest.raises(ValueError, match="unknown keys"):
        presets.get_topology(str(bad))


def test_bad_topologies_and_arguments_raise():
    ln = LinkSpec("x", 1e9, 0.0)
    with pytest.raises(ValueError):
        Topology("t", 0, 1, "nvswitch", ln, ln)
    with pytest.raises(ValueError):
        Topology("t", 1, 1, "optical", ln, ln)
    with pytest.raises(ValueError):
        Topology("t", 2, 1, "nvswitch", ln, ln, tiers=2, oversubscription=0.5)
    with pytest.raises(ValueError):
        LinkSpec("x", 0.0, 0.0)
    t = flat(4)
    with pytest.raises(ValueError, match="unknown algorithm"):
        simulate("allreduce", "butterfly", t, nbytes=64)
    with pytest.raises(ValueError, match="unknown collective"):
        simulate("sideways", "ring", t, nbytes=64)
    with pytest.raises(ValueError, match="do not fit"):
        simulate("allreduce", "ring", t, nbytes=64, ranks=5)
    with pytest.raises(ValueError, match="two ranks"):
        simulate("allreduce", "ring", t, nbytes=64, placement=[0, 0, 1, 2])


def test_busbw_factor_matches_bench():
    from minicomm.tools.bench import busbw_factor
    for c in ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "gather",
              "scatter", "alltoall", "barrier"):
        for n in (1, 2, 7, 1024):
            assert engine.busbw_factor(c, n) == busbw_factor(c, n)


ALLOWED = {"minicomm.schedule", "minicomm.algorithms", "minicomm.errors", "minicomm.ops"}


def test_sim_imports_only_the_layers_below_it():
    """The engine and its siblings import only the schedule IR, the algorithm families,
    errors/ops, numpy and the standard library (nothing that starts processes)."""
    here = os.path.join(os.path.dirname(__file__), "..", "minicomm", "sim")
    for fn in sorted(os.listdir(here)):
        if not fn.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(here, fn)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level == 1:
                    continue                       # minicomm.sim's own modules
                mod = "minicomm." + (node.module or "")
                assert mod in ALLOWED, f"{fn} imports {mod}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module]
                for n in names:
                    assert not n.startswith("minicomm") or n in ALLOWED or \
                        n.startswith("minicomm.sim"), f"{fn} imports {n}"
                    assert n.split(".")[0] not in ("subprocess", "multiprocessing", "socket"), fn


def _host(o=1e-6, lat=5e-6, beta=0.0, **kw):
    hl = engine.HostLink(3 * o + lat, beta, o, 1 << 20)
    return engine.HostModel(hl, hl, gamma=0.0, delta=0.0, **kw)


def test_host_model_follows_the_schedule():
    """The process model auto uses: an exchange step costs 3o + L; tree allreduce on 2 ranks is
    two one-way hops (4o + 2L); ring allreduce two exchanges (6o + 2L); a message is copied in
    by its sender and out by its receiver, β/2 per byte each."""
    o, lat = 1e-6, 5e-6
    t = {f: engine.run_host(program_for(c, f, 2, 2), (0, 0), _host(o, lat)).time_s
         for c, f in (("allgather", "rhd"), ("allreduce", "tree"), ("allreduce", "ring"))}
    assert t == pytest.approx({"rhd": 3 * o + lat, "tree": 4 * o + 2 * lat, "ring": 6 * o + 2 * lat})
    beta = 1e-9
    prog = engine.compile_schedules([[(Send(1, "in", 0, 1000),)], [(Recv(0, "out", 0, 1000),)]])
    assert engine.run_host(prog, (0, 0), _host(0.0, 0.0, beta)).time_s == pytest.approx(4000 * beta)


def test_host_model_processor_sharing():
    """Four ranks, each copying locally, on 2 cores: half speed, less the sharing loss."""
    prog = engine.compile_schedules([[(Copy("in", 0, "out", 0, 1000),)]] * 4)
    one = engine.HostModel(_host().intra, _host().inter, gamma=0.0, delta=1e-9, cores=0)
    two = engine.HostModel(_host().intra, _host().inter, gamma=0.0, delta=1e-9, cores=2,
                           sharing_loss=1.0)
    t1 = engine.run_host(prog, (0,) * 4, one).time_s
    t2 = engine.run_host(prog, (0,) * 4, two).time_s
    assert t1 == pytest.approx(4000e-9)
    assert t2 == pytest.approx(4000e-9 / (0.5 / 1.5))


@pytest.mark.parametrize("n,k,colocated", [(3, 2, False), (4, 4, True), (5, 2, True), (1, 1, False)])
def test_ps_program_is_the_ps_schedules(n, k, colocated):
    """The numpy-built PS program equals the compiled IR schedules; the colocated FIFO order
    pairs pushes with pushes (reducing receives) and pulls with pulls."""
    R = 3
    a = ps_model.ps_program(n, k, 7, R, colocated)
    b = engine.compile_schedules(ps_model.ps_schedules(n, k, 7, R, colocated))
    for f in ("rank_first", "step_rank", "msg_src", "msg_dst", "msg_count", "msg_reduce",
              "msg_send_step", "msg_recv_step", "send_ptr", "recv_order", "recv_ptr"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    # every reducing receive is at a server and comes from a worker's push (sent in the same
    # round index by both sides)
    steps = R + 1
    assert np.array_equal(a.msg_send_step % steps, a.msg_recv_step % steps)
    assert int(a.msg_reduce.sum()) == n * k * R


@pytest.mark.parametrize("coll", ["broadcast", "reduce", "allreduce", "allgather",
                                  "reduce_scatter", "gather", "scatter", "alltoall", "barrier"])
def test_every_collective_and_family_runs_on_a_cluster(coll):
    """Every cell of the matrix, on 3 servers x 8 (hier takes the node map), root not 0; the
    bytes that leave through NICs are at least what crossing servers requires."""
    t = presets.get_topology("dgx-h100", nodes=3)
    for fam in ("ring", "tree", "rhd", "hier"):
        r = simulate(coll, fam, t, nbytes=0 if coll == "barrier" else 3 << 20, root=5)
        assert r.time_s > 0 and math.isfinite(r.time_s), fam
        if coll not in ("barrier",):
            assert r.link_bytes_by_kind["nic_out"] > 0, fam
            assert r.link_bytes_by_kind["nic_out"] == pytest.approx(
                r.link_bytes_by_kind["nic_in"]), fam


# ------------------------------------------------------------------ auto: one cost engine
@pytest.mark.parametrize("p", [4, 64])
def test_auto_prices_every_schedule_through_the_engine(monkeypatch, p):
    """choose() at 4 ranks (the engine's host machine) and at 64 ranks (its flow model) takes
    every family's price from the engine, never from the closed forms: with the engine's runs
    replaced by a sentinel that makes the worst family (by the real prices) the cheapest, auto
    picks that family, and the closed forms are never called."""
    from minicomm import cost
    topo = tuple(r // 8 for r in range(p)) if p > 8 else (0,) * p
    nbytes = 1 << 22
    real = cost.model_costs("allreduce", p, nbytes, topo,
                            cost.LinkModel.for_transports("shm", "tcp", cores=2))
    worst = max(real, key=real.get)
    assert cost.choose("allreduce", p, nbytes, topo,
                       cost.LinkModel.for_transports("shm", "tcp", cores=2)) != worst

    def closed_form_used(*a, **k):
        raise AssertionError("auto priced a schedule with a closed form")
    monkeypatch.setattr(cost, "flat_cost", closed_form_used)
    monkeypatch.setattr(cost, "hier_cost", closed_form_used)
    family_of = {}
    program_for = engine.program_for

    def tagged(collective, algorithm, *a, **k):
        prog = program_for(collective, algorithm, *a, **k)
        family_of[id(prog)] = algorithm
        return prog
    runs = []

    def sentinel(prog, *a, **k):
        runs.append(family_of[id(prog)])
        t = 1.0 if family_of[id(prog)] == worst else 2.0
        return engine.RunStats(t, np.full(prog.size, t), np.zeros(0), 1, np.zeros(0))
    monkeypatch.setattr(engine, "program_for", tagged)
    monkeypatch.setattr(engine, "run_host", sentinel)
    monkeypatch.setattr(engine, "run_program", sentinel)
    monkeypatch.setattr(cost, "_fabric_prices", {})
    monkeypatch.setattr(cost, "_shared_choices", {})
    fresh = cost.LinkModel.for_transports("shm", "tcp", cores=2)    # no cached choices
    assert cost.choose("allreduce", p, nbytes, topo, fresh) == worst
    assert sorted(runs) == sorted(real)          # one engine run per family
    assert cost.choose("allreduce", p, nbytes, topo, fresh) == worst
    assert len(runs) == len(real)                # the second call is the cached choice


def test_ranks_of_one_process_share_autos_model_runs(monkeypatch):
    """The ranks of an in-process world hold equal LinkModels (distinct objects): eight threads
    choosing at once for the same call run the model once and agree; a model that differs runs
    its own."""
    import threading

    from minicomm import cost
    monkeypatch.setattr(cost, "_shared_choices", {})
    runs = []
    real = cost.model_choice

    def counted(*a, **k):
        runs.append(a[:3])
        return real(*a, **k)
    monkeypatch.setattr(cost, "model_choice", counted)
    models = [cost.LinkModel.for_transports("shm", "tcp", cores=2) for _ in range(8)]
    got = []
    threads = [threading.Thread(target=lambda m=m: got.append(
        cost.choose("allreduce", 8, 1 << 16, (0,) * 8, m))) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 8 and len(set(got)) == 1
    assert runs == [("allreduce", 8, 1 << 16)]
    other = cost.LinkModel.for_transports("shm", "tcp", cores=4)
    cost.choose("allreduce", 8, 1 << 16, (0,) * 8, other)
    assert len(runs) == 2


def test_near_tie_goes_to_the_family_with_fewer_messages(monkeypatch):
    """Families priced within NEAR of the cheapest are tied, and the tie goes to the fewest
    messages at the busiest rank (n=2 broadcast of 1 MiB: ring's 8 segments against tree's one
    record); a family cheaper by more than NEAR wins on price alone."""
    from minicomm import cost
    count = (1 << 20) // cost.ITEMSIZE
    assert cost.busiest_messages("broadcast", "ring", 2, count, (0, 0)) == 8
    assert cost.busiest_messages("broadcast", "tree", 2, count, (0, 0)) == 1
    assert cost.busiest_messages("allreduce", "ring", 4, 1024, (0,) * 4) == 6
    m = cost.LinkModel.for_transports("shm", "tcp", cores=2)
    prices = {}
    monkeypatch.setattr(cost, "model_costs", lambda *a: dict(prices))
    prices.update(ring=1.00, tree=1.00 + cost.NEAR * 0.8, rhd=2.0)
    assert cost.model_choice("broadcast", 2, 1 << 20, (0, 0), m) == "tree"
    prices.update(ring=1.00, tree=1.00 + cost.NEAR * 1.2, rhd=2.0)
    assert cost.model_choice("broadcast", 2, 1 << 20, (0, 0), m) == "ring"
    prices.update(ring=1.02, tree=1.00, rhd=1.01)     # all tied: fewest messages, then price
    assert cost.model_choice("broadcast", 2, 1 << 20, (0, 0), m) == "tree"


def test_large_world_prices_are_cached_per_size_class():
    """Above SIM_MAX_RANKS the engine runs once per (collective, family, size class): sizes
    within a class share the price; the class is within 10% of the size."""
    from minicomm import cost
    for n in (5, 100, 1000, 3 << 20, 1 << 30, 12345678):
        c = cost.size_class(n)
        assert abs(c / n - 1) < 0.1
    assert cost.size_class(1 << 20) == cost.size_class((1 << 20) + 4) == 1 << 20
    m = cost.LinkModel.for_transports("shm", "tcp", cores=2)
    topo = tuple(r // 8 for r in range(32))
    a = cost.model_costs("allreduce", 32, 1 << 20, topo, m)
    b = cost.model_costs("allreduce", 32, (1 << 20) + 64, topo, m)
    assert a == b and set(a) == {"ring", "tree", "rhd", "hier"}
    # the engine's price of a contention-free flat layout is the α-β-γ closed form
    flat_m = cost.LinkModel(ALPHA, BETA, ALPHA, BETA, gamma=GAMMA, delta=0.0, intra="x",
                            inter="x")
    t = cost.fabric_time("allreduce", "ring", 32, 32 * 4096 * 4, tuple(range(32)), flat_m)
    assert t == pytest.approx(cost.flat_cost("allreduce", "ring", 32, 32 * 4096 * 4, ALPHA,
                                             BETA, GAMMA), rel=0.01)


# ------------------------------------------------------------------ host machine model
def test_repeat_program_is_the_repeated_schedules():
    """Calls back to back: the program of k calls equals the compiled schedules with every
    rank's steps repeated k times."""
    from minicomm.algorithms import family
    for coll, fam, p in (("allreduce", "ring", 3), ("broadcast", "tree", 4),
                         ("allgather", "rhd", 3)):
        rep = engine.repeat_program(program_for(coll, fam, p, 1000), 3)
        ref = engine.compile_schedules(
            [family(fam).build(coll, r, p, 1000, 0, (0,) * p).steps * 3 for r in range(p)])
        for f in ("rank_first", "step_copy", "step_reduce", "msg_src", "msg_dst", "msg_count",
                  "msg_reduce", "msg_send_step", "msg_recv_step", "send_ptr", "recv_order",
                  "recv_ptr"):
            assert np.array_equal(getattr(rep, f), getattr(ref, f)), f
        assert rep.calls == 3


def test_host_model_single_copy_reads():
    """shm's single-copy path: in a call that reduces nothing, a message of at least
    ``single_min`` bytes costs its sender o and its receiver o + single_beta per byte (no
    copy-in, readable at once); smaller messages and any message of a reducing call keep the
    two copies."""
    o, lat, beta, sb = 1e-6, 5e-6, 1e-9, 0.25e-9
    nbytes = 4 << 20
    bcast = program_for("broadcast", "tree", 2, nbytes // 4)
    two = engine.run_host(bcast, (0, 0), _host(o, lat, beta)).time_s
    one = engine.run_host(bcast, (0, 0), _host(o, lat, beta, single_min=1 << 20,
                                               single_beta=sb)).time_s
    assert two == pytest.approx(2 * o + lat + nbytes * beta / 2 + (1 << 20) * beta / 2)
    assert one == pytest.approx(2 * o + lat + nbytes * sb)
    small = engine.run_host(bcast, (0, 0), _host(o, lat, beta, single_min=nbytes + 1,
                                                 single_beta=sb)).time_s
    assert small == pytest.approx(two)
    red = program_for("reduce", "tree", 2, nbytes // 4)
    assert engine.run_host(red, (0, 0), _host(o, lat, beta, single_min=1 << 20,
                                              single_beta=sb)).time_s == \
        pytest.approx(engine.run_host(red, (0, 0), _host(o, lat, beta)).time_s)


def test_guarded_program_adds_the_call_check_and_repeats_matched():
    """A rooted call's lazy fingerprint check: every rank sends one message to every other
    first and receives every other's last; repeated calls meet their own messages."""
    from minicomm import cost
    for p in (2, 3, 4):
        base = program_for("broadcast", "ring", p, 100)
        g = engine.guarded_program(base, 6)
        assert g.messages == base.messages + p * (p - 1)
        assert g.steps == base.steps + 2 * p
        fp = g.msg_count == 6
        assert sorted(zip(g.msg_src[fp].tolist(), g.msg_dst[fp].tolist())) == \
            [(a, b) for a in range(p) for b in range(p) if a != b]
        assert np.array_equal(g.msg_send_step[fp], g.rank_first[g.msg_src[fp]])
        assert np.array_equal(g.msg_recv_step[fp], g.rank_first[g.msg_dst[fp] + 1] - 1)
        rep = engine.repeat_program(g, 3)
        per = np.diff(g.rank_first)
        # call c's fingerprint from a to b: sent by a's step c*per[a], received by b's last
        # step of call c
        fps = rep.msg_count == 6
        calls_s = (rep.msg_send_step[fps] - rep.rank_first[rep.msg_src[fps]]) // per[rep.msg_src[fps]]
        calls_r = (rep.msg_recv_step[fps] - rep.rank_first[rep.msg_dst[fps]]) // per[rep.msg_dst[fps]]
        assert np.array_equal(calls_s, calls_r)
        t1 = engine.run_host(g, (0,) * p, _host()).time_s
        assert t1 > engine.run_host(base, (0,) * p, _host()).time_s
    # the model prices rooted calls with the check, the others without
    m = cost.LinkModel.for_transports("shm", "shm")
    assert cost.schedule_time("broadcast", "tree", 3, 1000, (0, 0, 0), m) > \
        engine.run_host(program_for("broadcast", "tree", 3, 1000), (0, 0, 0),
                        cost.host_model(m)).time_s


def test_host_model_ranks_beyond_the_cores_run_at_the_busiest_cores_pace():
    """3 ranks on 2 cores: the scheduler runs two of them on one core, and a collective moves at
    its pace (half speed, like 4 ranks on 2 cores), not at a fluid 2/3."""
    work = 1000
    prog = engine.compile_schedules([[(Copy("in", 0, "out", 0, work),)]] * 3)
    hm = engine.HostModel(_host().intra, _host().inter, gamma=0.0, delta=1e-9, cores=2,
                          sharing_loss=0.0)
    assert engine.run_host(prog, (0, 0, 0), hm).time_s == pytest.approx(2 * 4 * work * 1e-9)
    prog4 = engine.compile_schedules([[(Copy("in", 0, "out", 0, work),)]] * 4)
    assert engine.run_host(prog4, (0,) * 4, hm).time_s == pytest.approx(2 * 4 * work * 1e-9)


def test_host_model_long_work_runs_at_the_fair_share_of_the_cores():
    """Past ``balance`` of CPU a piece of work runs at the fair share (3 ranks on 2 cores: 2/3
    of a core each, the kernel moving them between cores), a shorter one at the busiest core's
    pace; 4 ranks on 2 cores share alike either way."""
    work = 1000                                   # 4000 bytes at 1 ns: 4 us of CPU
    prog = engine.compile_schedules([[(Copy("in", 0, "out", 0, work),)]] * 3)
    hm = engine.HostModel(_host().intra, _host().inter, gamma=0.0, delta=1e-9, cores=2,
                          sharing_loss=0.0, balance=4e-6)
    assert engine.run_host(prog, (0, 0, 0), hm).time_s == pytest.approx(1.5 * 4 * work * 1e-9)
    short = dataclasses.replace(hm, balance=4.001e-6)
    assert engine.run_host(prog, (0, 0, 0), short).time_s == pytest.approx(2 * 4 * work * 1e-9)
    prog4 = engine.compile_schedules([[(Copy("in", 0, "out", 0, work),)]] * 4)
    assert engine.run_host(prog4, (0,) * 4, hm).time_s == pytest.approx(2 * 4 * work * 1e-9)
    from minicomm import cost
    assert cost.host_model(cost.LinkModel.for_transports("shm", "tcp")).balance == cost.BALANCE_S


def test_latency_is_the_senders_cpu_only_where_ranks_outnumber_the_cores():
    """``latency_cpu`` of an intra-node message's latency is its sender's CPU on a node whose
    ranks outnumber its cores (loopback socket work competes for them), in flight elsewhere.
    Two ranks exchanging on one core, neither spinning: 6o + L with the latency in flight (the
    two ranks' posts and sends share the core, then both latencies run at once, then the two
    receives), 6o + 2L when it is CPU (the two latencies share the core as well); on two cores
    an exchange step's 3o + L either way."""
    o, lat = 1e-6, 5e-6
    prog = engine.compile_schedules([[(Send(1, "in", 0, 1), Recv(1, "out", 0, 1))],
                                     [(Send(0, "in", 0, 1), Recv(0, "out", 0, 1))]])
    for cores, flight, cpu in ((1, 6 * o + lat, 6 * o + 2 * lat), (2, 3 * o + lat, 3 * o + lat)):
        hm = _host(o, lat, cores=cores, spin=0.0, sharing_loss=0.0)
        assert engine.run_host(prog, (0, 0), hm).time_s == pytest.approx(flight), cores
        hm = dataclasses.replace(hm, latency_cpu=1.0)
        assert engine.run_host(prog, (0, 0), hm).time_s == pytest.approx(cpu), cores
    from minicomm import cost
    assert cost.host_model(cost.LinkModel.for_transports("shm", "tcp")).latency_cpu == \
        cost.LATENCY_CPU_SHARED


def test_a_yielding_spinner_holds_a_share_of_a_core_where_ranks_outnumber_the_cores():
    """Ranks 0 and 1 copy (4 us of CPU each) while rank 2 spins for rank 0's message, 3 ranks
    on 2 cores. A spinner that holds a whole core makes the copies run at 2/3 of a core (6 us);
    the engine's yielding spin (``spin_shared``) holds ``yield_share`` of one (4 * 1.025 us); a
    short piece of work still runs at the busiest core's pace, two ranks to a core (8 us); with
    a core per rank nothing is shared and ``spin_shared`` does not apply (4 us)."""
    work, d = 1000, 1e-9
    prog = engine.compile_schedules([
        [(Copy("in", 0, "out", 0, work),), (Send(2, "in", 0, 1),)],
        [(Copy("in", 0, "out", 0, work),)],
        [(Recv(0, "out", 0, 1),)]])
    cpu = 4 * work * d
    whole = dataclasses.replace(_host(0.0, 0.0), delta=d, cores=2, sharing_loss=0.0,
                                balance=0.0, spin=1.0)
    yielding = dataclasses.replace(whole, spin_shared=1.0, yield_share=0.05)
    assert engine.run_host(prog, (0, 0, 0), whole).time_s == pytest.approx(1.5 * cpu)
    assert engine.run_host(prog, (0, 0, 0), yielding).time_s == pytest.approx(1.025 * cpu)
    short = dataclasses.replace(yielding, balance=math.inf)
    assert engine.run_host(prog, (0, 0, 0), short).time_s == pytest.approx(2 * cpu)
    own = dataclasses.replace(yielding, cores=3)
    assert engine.run_host(prog, (0, 0, 0), own).time_s == pytest.approx(cpu)
    from minicomm import cost
    from minicomm.settings import SPIN_SHARED_S
    hm = cost.host_model(cost.LinkModel.for_transports("shm", "tcp"))
    assert (hm.spin_shared, hm.yield_share) == (SPIN_SHARED_S, cost.YIELD_SHARE)


def test_sharing_loss_falls_to_its_dram_part_where_copies_leave_the_caches():
    """Time slicing costs switches and cache refills; a working set whose copies already run at
    DRAM speed pays only the switches: SHARING_LOSS where δ is the table's fastest,
    SHARING_LOSS * SHARING_LOSS_DRAM at its largest working set, linear in δ between."""
    from minicomm import cost
    mem = ((1 << 16, 1e-10, 1e-10, 0.0), (1 << 20, 0.5e-10, 1e-10, 0.0),
           (1 << 26, 2e-10, 2e-10, 0.0))
    m = cost.LinkModel.for_transports("shm", "tcp", memory=mem)
    full, dram = cost.SHARING_LOSS, cost.SHARING_LOSS * cost.SHARING_LOSS_DRAM
    assert cost.sharing_loss_at(m, 1 << 20) == pytest.approx(full)        # the fastest δ
    assert cost.sharing_loss_at(m, 1 << 26) == pytest.approx(dram)
    assert cost.sharing_loss_at(m, 1 << 16) == pytest.approx(dram + (full - dram) * 1 / 1.5)
    assert cost.host_model(m, 1 << 26).sharing_loss == pytest.approx(dram)
    plain = cost.LinkModel.for_transports("shm", "tcp")
    assert cost.sharing_loss_at(plain, 1 << 26) == cost.SHARING_LOSS == \
        cost.host_model(plain, 1 << 26).sharing_loss


def test_calls_run_by_the_executor_pay_its_extra_cost_per_message():
    """The communicator runs a call on the small-message path when it is on one node over a
    transport with the path and every message fits its limit (a rooted call's fingerprints
    too); every other call runs through the executor and costs ``exec_overhead`` more per
    intra-node message op."""
    from minicomm import cost
    m = cost.LinkModel.for_transports("shm", "tcp")
    slow = dataclasses.replace(m, exec_overhead=5e-6)
    small = cost.SMALL_BYTES["shm"] // 4
    prog = program_for("allreduce", "rhd", 2, 2)
    assert not cost.runs_executor("allreduce", prog, (0, 0), m)
    assert not cost.runs_executor("broadcast", program_for("broadcast", "tree", 2, 2), (0, 0), m)
    assert cost.runs_executor("broadcast", program_for("broadcast", "tree", 2, 2 * small),
                              (0, 0), m)
    assert cost.runs_executor("allreduce", prog, (0, 1), m)               # two nodes
    assert cost.runs_executor("allreduce", prog, (0, 0),
                              cost.LinkModel.for_transports("tcp", "tcp"))
    assert not cost.runs_executor("allgather", program_for("allgather", "rhd", 2, small),
                                  (0, 0), m)
    assert cost.runs_executor("allgather", program_for("allgather", "rhd", 2, 2 * small),
                              (0, 0), m)
    t = lambda mm, c, f, n: cost.schedule_time(c, f, 2, n, (0, 0), mm)      # noqa: E731
    assert t(slow, "allreduce", "rhd", 2) == t(m, "allreduce", "rhd", 2)
    assert t(slow, "broadcast", "tree", 2) == t(m, "broadcast", "tree", 2)
    # a one-way hop run by the executor: the sender's and the receiver's ops pay it, and the
    # fingerprint's
    tx = lambda mm: cost.schedule_time("broadcast", "tree", 2, 2, (0, 0), mm,  # noqa: E731
                                       executor=True)
    assert tx(slow) > tx(m) + 2 * 5e-6
    assert t(slow, "broadcast", "tree", 2 * small) > t(m, "broadcast", "tree", 2 * small) + 2 * 5e-6


def test_host_model_call_overhead_and_background_load():
    """Every call costs each rank ``call_overhead`` of CPU; ``background`` runnable threads of
    other processes share the node's cores with the ranks."""
    o, lat = 1e-6, 5e-6
    prog = engine.repeat_program(program_for("allgather", "rhd", 2, 2), 4)
    base = engine.run_host(prog, (0, 0), _host(o, lat)).time_s
    assert base == pytest.approx(4 * (3 * o + lat))
    c = 7e-6
    assert engine.run_host(prog, (0, 0), _host(o, lat, call_overhead=c)).time_s == \
        pytest.approx(4 * (3 * o + lat + c))
    copy = engine.compile_schedules([[(Copy("in", 0, "out", 0, 1000),)]] * 2)
    hm = engine.HostModel(_host().intra, _host().inter, gamma=0.0, delta=1e-9, cores=2,
                          sharing_loss=0.0, background=1.0)
    # 4000 bytes at 1 ns; 2 ranks + 1 other thread per rank on 2 cores: each gets half a core
    assert engine.run_host(copy, (0, 0), hm).time_s == pytest.approx(2 * 4000e-9)


def test_memory_by_working_set_and_shm_copies():
    """δ, γ and contention follow the call's working set (log-linear between measured rows);
    with a measured memory table shm's β is a copy in plus a copy out, each between the user's
    buffer (the working set) and the cache-resident ring: δ(working set) + δ(ring)."""
    from minicomm import cost
    mem = ((1 << 16, 1e-11, 2e-11, 0.0), (1 << 24, 1e-10, 2e-10, 1.0))
    m = cost.LinkModel.for_transports("shm", "tcp", memory=mem)
    assert cost.memory_at(m, 1 << 10) == mem[0][1:]
    assert cost.memory_at(m, 1 << 30) == mem[1][1:]
    mid = cost.memory_at(m, 1 << 20)          # halfway in log scale
    assert mid == pytest.approx((5.5e-11, 1.1e-10, 0.5))
    hm = cost.host_model(m, 1 << 24)
    ring = cost.memory_at(m, cost.RING_BYTES["shm"])[0]          # 4 MiB: 3/4 of the way
    assert ring == pytest.approx(1e-11 + 0.75 * 9e-11)
    assert hm.intra.beta == pytest.approx(1e-10 + ring) and hm.delta == 1e-10 \
        and hm.contention == 1.0
    assert cost.host_model(m, 1 << 16).intra.beta == pytest.approx(2e-11)   # all in cache
    # tcp: the fitted β (measured on cached buffers) plus how much slower a large buffer's
    # kernel copies run
    assert hm.inter.beta == pytest.approx(m.beta_inter + 1e-10 - 1e-11)
    assert cost.host_model(m, 1 << 16).inter.beta == pytest.approx(m.beta_inter)
    plain = cost.LinkModel.for_transports("shm", "tcp")
    assert cost.host_model(plain, 1 << 24).intra.beta == plain.beta_intra


# ------------------------------------------------------------------ calibration (recorded runs)
CALIBRATION = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "sim-calibration.json")
# a second recording, of reduce_scatter alone (the first has allreduce, allgather, broadcast)
CALIBRATION_RS = os.path.join(os.path.dirname(__file__), os.pardir, "docs",
                              "sim-calibration-reduce-scatter.json")
CALIBRATION_BOUND = 0.25          # issue 13
CALIBRATION_RECORDED = 0.245      # the committed table: 24.0% (docs/sim-calibration.txt)


def test_link_fit_recovers_the_model_that_made_the_probes():
    """fit_links (least squares through the engine) finds o, latency and β again from probe
    rows the engine itself predicted with known values."""
    from minicomm.tuning import calibration as cal
    true = {"overhead": 4e-6, "latency": 25e-6, "beta": 1 / 1.5e9, "call_overhead": 0.0,
            "background": 0.0}
    memory = [[65536, 1 / 30e9, 1 / 30e9, 0.0], [67108864, 1 / 10e9, 1 / 12e9, 0.5]]
    m = cal._link_model("tcp", true, 100e-6, 2, memory, 0)
    probe = []
    for coll, algo in (("broadcast", "tree"), ("allgather", "rhd")):
        for size in (8, 4096, 65536, 524288, 4 << 20):
            count = engine.count_for_bytes(coll, size, 2)
            row = {"collective": coll, "algo": algo, "nranks": 2, "size": size, "count": count,
                   "iters": 10, "library": "minicomm"}
            row["batches_us"] = [cal.predict_row(row, m) * 1e6]
            probe.append(row)
    got = cal.fit_links(probe, "tcp", memory, 100e-6, 2,
                        {"overhead": 1e-6, "latency": 5e-6, "beta": 1 / 4e9},
                        ("overhead", "latency", "beta"))
    for k in ("overhead", "latency", "beta"):
        assert got[k] == pytest.approx(true[k], rel=0.05), k


@functools.lru_cache(maxsize=2)
def _calibration_cells(path=CALIBRATION):
    """The committed runs, rounds merged and links fitted by the current engine (once)."""
    from minicomm.tuning import calibration as cal
    with open(path) as f:
        raw = json.load(f)
    return cal.merge_rounds(raw)


@functools.lru_cache(maxsize=2)
def _calibration_rows(path=CALIBRATION):
    """The committed runs predicted by the current engine (computed once)."""
    from minicomm.tuning import calibration as cal
    return cal.calibration_rows(None, _calibration_cells(path))


def test_calibration_against_recorded_runs():
    """The committed raw runs (examples/sim_calibrate.py --run: minicomm bench on this project's
    shared 2-core box, shm and tcp, 2-4 ranks, allreduce / allgather / broadcast, ring / tree /
    rhd, 64 KiB-64 MiB), links fitted and every row predicted by the CURRENT engine: the
    geometric-mean error does not grow past what the committed table reports (docs/
    sim-calibration.txt), so a model change that breaks calibration fails here. Runs no
    benchmark."""
    from minicomm.tuning import calibration as cal
    rows = _calibration_rows()
    cells = {(r["transport"], r["ranks"]) for r in rows}
    assert cells == {(t, n) for t in ("shm", "tcp") for n in (2, 3, 4)}
    assert {r["collective"] for r in rows} == {"allreduce", "allgather", "broadcast"}
    assert {r["algorithm"] for r in rows} == {"ring", "tree", "rhd"}
    assert len(rows) == 6 * 3 * 3 * 4
    assert cal.geomean_error(rows) < CALIBRATION_RECORDED


# auto's picks on the committed runs (docs/sim-calibration.txt, last lines): 72 cases, the
# fastest family picked in 46, geometric-mean regret 1.025, 5 above 1.10
PICK_REGRET_RECORDED = 1.03
PICK_MISSES_RECORDED = 5


def test_auto_picks_on_recorded_runs_do_not_get_worse():
    """What auto (the cost model, no tuned table) picks on every recorded case, against the
    family that ran fastest there: a model change that prices the recorded runs as well but
    ranks the families worse fails here (the error test above cannot see a ranking)."""
    from minicomm.tuning import calibration as cal
    picks = cal.pick_rows(_calibration_cells())
    assert len(picks) == 6 * 3 * 4                      # cells x collectives x sizes
    for p in picks:
        assert p["regret"] == pytest.approx(p["median_s"][p["pick"]] / min(p["median_s"].values()))
        assert p["regret"] >= 1.0
        assert (p["regret"] == 1.0) == (p["median_s"][p["pick"]] == p["median_s"][p["best"]])
    assert cal.geomean_regret(picks) < PICK_REGRET_RECORDED
    assert sum(p["regret"] > 1.10 for p in picks) <= PICK_MISSES_RECORDED


# The reduce_scatter recording (docs/sim-calibration-reduce-scatter.txt): 72 rows at 15.7%;
# picks: 24 cases, the fastest family in 18, geometric-mean regret 1.015, 1 above 1.10
CALIBRATION_RS_RECORDED = 0.165
PICK_REGRET_RS_RECORDED = 1.02
PICK_MISSES_RS_RECORDED = 1


def test_calibration_against_recorded_reduce_scatter_runs():
    """The second recording, reduce_scatter alone (the same script and estimator, shm and tcp,
    2-4 ranks, ring / tree / rhd, 64 KiB-64 MiB, 8 rounds): predicted by the current engine with
    links fitted to its own probe sweeps, within the error its committed table reports, and
    inside the issue's 25% target."""
    from minicomm.tuning import calibration as cal
    rows = _calibration_rows(CALIBRATION_RS)
    assert {(r["transport"], r["ranks"]) for r in rows} == {(t, n) for t in ("shm", "tcp")
                                                           for n in (2, 3, 4)}
    assert {r["collective"] for r in rows} == {"reduce_scatter"}
    assert {r["algorithm"] for r in rows} == {"ring", "tree", "rhd"}
    assert len(rows) == 6 * 3 * 4
    assert cal.geomean_error(rows) < min(CALIBRATION_RS_RECORDED, CALIBRATION_BOUND)


def test_auto_picks_on_recorded_reduce_scatter_runs_do_not_get_worse():
    """auto's reduce_scatter picks on the second recording, as for the first."""
    from minicomm.tuning import calibration as cal
    picks = cal.pick_rows(_calibration_cells(CALIBRATION_RS))
    assert len(picks) == 6 * 4
    assert cal.geomean_regret(picks) < PICK_REGRET_RS_RECORDED
    assert sum(p["regret"] > 1.10 for p in picks) <= PICK_MISSES_RS_RECORDED


def test_pick_regret_is_the_picked_family_against_the_fastest():
    """pick_rows on a made-up cell: the model's pick is whatever model_choice says, the regret
    is the measured median of that family over the measured best."""
    from minicomm import cost
    from minicomm.tuning import calibration as cal
    cell = {"transport": "shm", "ranks": 2, "cores": 2, "single_copy": 0, "small_bytes": -1,
            "memory": [], "wake": 50e-6,
            "links": {"overhead": 2e-6, "latency": 1e-6, "beta": 1e-10, "call_overhead": 0.0,
                      "background": 0.0, "exec_overhead": 0.0},
            "rows": []}
    times = {"ring": [100.0, 120.0, 300.0], "tree": [90.0, 95.0, 99.0], "rhd": [200.0] * 3}
    for algo, med in times.items():
        cell["rows"].append({"collective": "allreduce", "algo": algo, "size": 4096,
                             "count": 1024, "medians_us": med, "batches_us": med})
    (p,) = cal.pick_rows([cell])
    m = cal.run_model(cell)
    assert p["pick"] == cost.model_choice("allreduce", 2, 4096, (0, 0), m)
    assert p["best"] == "tree"
    assert p["regret"] == pytest.approx({"ring": 120.0, "tree": 95.0, "rhd": 200.0}[p["pick"]]
                                        / 95.0)
    assert cal.geomean_regret([{"regret": 1.0}, {"regret": 4.0}]) == pytest.approx(2.0)


def test_calibration_meets_the_issue_target():
    """Issue 13's target, 25%, on the committed runs: 25.9% until a loopback socket's latency
    counted partly as its sender's CPU where ranks outnumber cores (cost.LATENCY_CPU_SHARED),
    24.8% since; 24.0% since the model spins as long as the engine where ranks outnumber cores
    (cost.YIELD_SHARE)."""
    from minicomm.tuning import calibration as cal
    assert cal.geomean_error(_calibration_rows()) < CALIBRATION_BOUND


def test_a_wait_for_a_large_message_spins_through_its_copy_time():
    """A receiver whose message takes longer than ``spin`` to arrive falls asleep and pays
    ``wake``; with ``spin_rate`` it spins about the message's copy time first (up to
    ``spin_max``), as the progress engine does, and pays no wake-up unless the wait is longer;
    ranks that share a core never spin longer."""
    n = 1 << 18                                   # 1 MiB of float32
    prog = engine.compile_schedules([[(Send(1, "in", 0, n),)], [(Recv(0, "out", 0, n),)]])
    beta, wake = 2e-10, 100e-6                    # 1 MiB in, then out: ~105 us each
    fixed = _host(0.0, 0.0, beta, wake=wake, spin=50e-6)
    longer = _host(0.0, 0.0, beta, wake=wake, spin=50e-6, spin_rate=4e9, spin_max=1e-3)
    t_fixed = engine.run_host(prog, (0, 0), fixed).time_s
    t_long = engine.run_host(prog, (0, 0), longer).time_s
    assert t_long == pytest.approx(4 * n * beta)            # copy-in, then copy-out
    assert t_fixed == pytest.approx(t_long + wake)          # asleep after 50 us
    capped = _host(0.0, 0.0, beta, wake=wake, spin=50e-6, spin_rate=4e9, spin_max=60e-6)
    assert engine.run_host(prog, (0, 0), capped).time_s == pytest.approx(t_fixed)
    shared = _host(0.0, 0.0, beta, wake=wake, spin=50e-6, spin_rate=4e9, spin_max=1e-3,
                   cores=1)
    assert engine.run_host(prog, (0, 0), shared).time_s > t_long


# ------------------------------------------------------------------ published figures
def test_the_model_is_within_15_percent_of_every_published_figure():
    from minicomm.sim import validation
    found = validation.rows()
    assert len(found) >= 7
    for r in found:
        assert abs(r.error) <= validation.TOLERANCE, (r.point.name, r.busbw, r.point.published)
    assert validation.geometric_mean_error(found) < validation.MEAN_TOLERANCE
    ring_points = [r for r in found if r.point.algorithm == "ring" and r.point.servers > 1]
    assert all(r.channels == validation.machine(r.point).nics_per_server for r in ring_points)
    doc = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide",
                            "simulator.md")).read()
    assert validation.render_markdown(found) in doc      # the docs' table is this run's


def test_a_channelled_ring_derived_by_rotation_is_the_built_one():
    node_map = tuple(r // 8 for r in range(64))
    for collective, count in (("allreduce", 64 * 8 * 5), ("allreduce", 64 * 8 * 5 + 37),
                              ("allgather", 64 * 8 * 5), ("reduce_scatter", 64 * 8 * 3 + 11)):
        fast = engine.program_for(collective, "ring", 64, count, 0, node_map, False, 8)
        built = engine.program_for(collective, "ring", 64, count, 0, node_map, True, 8)
        assert fast.derived_by == "channel rotation" and built.derived_by == "built"
        for f in ("rank_first", "step_copy", "step_reduce", "step_staged", "msg_src", "msg_dst",
                  "msg_count", "msg_reduce", "msg_send_step", "msg_recv_step"):
            assert np.array_equal(getattr(fast, f), getattr(built, f)), (collective, f)


def test_channels_use_every_nic_of_a_server():
    t = presets.get_topology("dgx-a100", nodes=3)
    one = simulate("allreduce", "ring", t, nbytes=1 << 30, channels=1)
    eight = simulate("allreduce", "ring", t, nbytes=1 << 30)
    assert eight.channels == 8 and one.channels == 1
    assert one.busbw == pytest.approx(24, rel=0.05)            # one HDR NIC's 24 GB/s
    assert eight.busbw > 6.5 * one.busbw                      # eight of them, minus α


def test_the_small_message_table_in_the_docs_is_this_runs():
    from minicomm.sim import validation
    found = validation.latency_rows()
    assert len(found) >= 2
    doc = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide",
                            "simulator.md")).read()
    assert validation.render_latency_markdown(found) in doc
    for r in found:      # the reference is NCCL's own model, which the protocols follow
        assert r.protocols_us == pytest.approx(r.nccl_model_us, rel=0.10), r.point.name


# ------------------------------------------------------------------ NCCL's protocols
def test_nccl_model_latency_is_tunings_formula():
    from minicomm.sim import protocols
    # ring, LL, 2 ranks on 2 nodes: 6.6 + 2 network hops of 2.7
    assert protocols.nccl_model_latency("ring", 2, 2, "nvswitch") == pytest.approx(12.0e-6)
    # tree, LL, 32 nodes of 8: 6.8 + 2 (7 x 0.6 x 1.8 + 5 x 5.0)
    assert protocols.nccl_model_latency("tree", 256, 32, "nvswitch") == pytest.approx(
        (6.8 + 2 * (7 * 0.6 * 1.8 + 5 * 5.0)) * 1e-6)


def _two_servers_of_one(**kw):
    return presets.get_topology("dgx-a100", nodes=2).replace(gpus_per_server=1,
                                                             nics_per_server=1, **kw)


def test_protocols_price_a_small_message_with_ll_and_a_launch():
    plain = simulate("allreduce", "ring", _two_servers_of_one(), nbytes=8)
    nccl = simulate("allreduce", "ring", _two_servers_of_one(protocols="nccl"), nbytes=8)
    # the launch (6.6 us) and two network hops of LL (2.7 us each), a few bytes at a quarter
    # of the NIC's bandwidth
    assert nccl.time_s == pytest.approx(12.0e-6, rel=0.01)
    assert nccl.time_s > plain.time_s


def test_protocols_move_a_large_message_with_simple_at_full_bandwidth():
    t = _two_servers_of_one(protocols="nccl")
    big = simulate("allreduce", "ring", t, nbytes=1 << 30)
    # Simple: no byte overhead; the NIC's 24 GB/s less the 14 us hops and 8.4 us launch
    assert big.busbw == pytest.approx(24, rel=0.01)
    assert big.busbw < simulate("allreduce", "ring", _two_servers_of_one(), nbytes=1 << 30).busbw


def test_protocols_are_named_or_refused():
    with pytest.raises(ValueError, match="protocols must be 'nccl'"):
        _two_servers_of_one(protocols="ll")
    from minicomm.sim.topology import topology_from_dict
    t = topology_from_dict({"base": "dgx-h100", "protocols": "nccl"}, presets.links(),
                           presets.topologies())
    assert t.protocols == "nccl"


# ------------------------------------------------------------------ NCCL's double binary tree
def test_on_two_servers_the_double_binary_tree_passes_the_rings_network_bound():
    """Each server's NICs carry about half what a ring's do (nccl#946): busbw above the NICs'
    total, which bounds the ring."""
    t = presets.get_topology("dgx-h100", nodes=2).replace(nics_per_server=4)
    ring = simulate("allreduce", "ring", t, nbytes=1 << 30)
    dbt = simulate("allreduce", "tree", t, nbytes=1 << 30, channels=8)
    bound = 4 * t.nic_link.bandwidth / 1e9
    assert dbt.channels == 8 and ring.busbw <= bound * 1.001
    assert dbt.busbw > 1.3 * bound
    five = t.with_servers(5)        # past two servers the tree stays under the ring
    assert (simulate("allreduce", "tree", five, nbytes=1 << 30, channels=8).busbw
            < simulate("allreduce", "ring", five, nbytes=1 << 30).busbw)


# ------------------------------------------------------------------ in-network reduction (NVLS)
NVLS_PUBLISHED = {8: 480.0, 7: 460.0, 6: 440.0, 5: 420.0}   # nccl-tests#212, nccl#1455 (GB/s)


def test_nvls_innet_allreduce_is_within_5_percent_of_the_published_busbw():
    """One DGX H100: NVIDIA's ~480 GB/s busbw on 8 GPUs (algbw ~275, the preset's NVLS port),
    and a user's 420-460 GB/s on 5-7 GPUs, which the port rate alone predicts."""
    t = presets.get_topology("dgx-h100", nodes=1)
    for gpus, busbw in NVLS_PUBLISHED.items():
        r = simulate("allreduce", "innet", t, nbytes=8 << 30, ranks=gpus)
        assert r.busbw == pytest.approx(busbw, rel=0.05), gpus


def test_innet_beats_the_ring_at_both_ends_on_an_nvswitch_server():
    t = presets.get_topology("dgx-h100", nodes=1)
    for size in (8, 1 << 30):
        assert (simulate("allreduce", "innet", t, nbytes=size).time_s
                < simulate("allreduce", "ring", t, nbytes=size).time_s)


def test_innet_needs_a_switch_that_reduces():
    with pytest.raises(ValueError, match="no switch reduces"):
        simulate("allreduce", "innet", presets.get_topology("dgx-a100", nodes=1), nbytes=1 << 20)
    with pytest.raises(ValueError, match="SHARP"):
        simulate("allreduce", "innet", presets.get_topology("dgx-h100", nodes=2), nbytes=1 << 20)
    with pytest.raises(ValueError, match="nvswitch"):
        presets.get_topology("pcie-8gpu", nodes=1).replace(nvls_bandwidth=1e11)
