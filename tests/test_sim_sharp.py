"""In-network reduction across servers in the simulator (SHARP): the fabric-shaped innet tree,
its lanes over every NIC, the switches' port rate and operation size, the published SHARP
figures, and the CLI's questions (--algorithms innet, --compare-interconnects, --advise,
--innet-gain)."""
import argparse
import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout

import pytest

from minicomm.algorithms import innet
from minicomm.sim import cli as sim_cli
from minicomm.sim import engine, presets, validation
from minicomm.sim.engine import simulate
from minicomm.sim.topology import LinkSpec, Topology, topology_from_dict
from minicomm.verifier import verify

GIB = 1 << 30
DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide", "simulator.md")


def _run(argv, rc=0):
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    a = p.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        got = sim_cli.main(a)
    assert got == rc, out.getvalue() + err.getvalue()
    return out.getvalue() + err.getvalue()


def _sharp(name="dgx-h100", nodes=4, **changes):
    return presets.get_topology(name, nodes=nodes).replace(sharp=True, **changes)


def pipelined_algbw(nbytes, bandwidth, alpha, chunks=64, levels=3):
    """innet's pipeline (innet.py): S chunks through ranks, server switches and the root leaf
    switch take S + 2H - 1 steps, each a hop's α plus a chunk at the bound's rate (GB/s)."""
    return nbytes / ((chunks + 2 * levels - 1) * (alpha + nbytes / chunks / bandwidth)) / 1e9


# ------------------------------------------------------------------ bandwidth
def test_sharp_allreduce_reaches_the_servers_nic_bound_not_the_rings():
    """With the NVSwitch and the switch ports out of the way, each server sends the vector once
    through its 8 NICs and gets the result back: algbw near 8 x 47 GB/s, less the pipeline's
    fill and its NIC hop's α per step (``pipelined_algbw``), busbw about twice that; the ring's
    busbw stays under the NICs' 8 x 47 (2(N-1)/N of the vector out of every server)."""
    t = _sharp(nodes=4, nvls_bandwidth=2000e9)
    nics = t.nics_per_server * t.nic_link.bandwidth
    alpha = t.nic_link.latency + t.switch_latency + t.sharp_latency
    r = simulate("allreduce", "innet", t, nbytes=GIB)
    ring = simulate("allreduce", "ring", t, nbytes=GIB)
    assert r.algbw == pytest.approx(pipelined_algbw(GIB, nics, alpha), rel=0.05)
    nics /= 1e9
    assert r.busbw > 1.5 * nics >= 1.5 * ring.busbw
    assert ring.busbw <= nics * 1.001
    # every server's NICs carry the vector once: n x M bytes out in all, M / 8 per NIC
    assert r.link_bytes_by_kind["nic_out"] == pytest.approx(4 * GIB, rel=1e-6)
    assert r.link_bytes_by_kind["nic_in"] == pytest.approx(4 * GIB, rel=1e-6)


def test_the_switch_port_rate_bounds_each_lane():
    """A 10 GB/s SHARP port under a 47 GB/s NIC: 8 lanes of 10 GB/s."""
    t = _sharp(nodes=4, nvls_bandwidth=2000e9, sharp_port_bandwidth=10e9)
    r = simulate("allreduce", "innet", t, nbytes=GIB)
    alpha = t.nic_link.latency + t.switch_latency + t.sharp_latency
    assert r.algbw == pytest.approx(pipelined_algbw(GIB, 80e9, alpha), rel=0.05)
    assert r.busiest_link.startswith("SHARP port of NIC")


def test_without_nvls_the_gpus_chain_carries_the_vector_twice_over_nvlink():
    """DGX A100 (no NVLS): inside a server the GPUs reduce and broadcast as CollNet's chain, the
    vector out and in over every NVLink in each phase, so NVLink's 240 GB/s gives 120 GB/s
    algbw although the 8 x 20 GB/s of SHARP ports would allow 160 (nccl#320's ~110)."""
    t = presets.get_topology("dgx-a100-sharp", nodes=8)
    r = simulate("allreduce", "innet", t, nbytes=GIB)
    assert 0.9 * 120 <= r.algbw <= 120
    assert r.busiest_link.startswith("nvswitch")
    four = t.replace(nics_per_server=4)      # now the 4 x 20 GB/s ports bind
    r4 = simulate("allreduce", "innet", four, nbytes=GIB)
    assert 0.9 * 80 <= r4.algbw <= 80
    assert r4.busiest_link.startswith("SHARP port")


def test_pcie_servers_and_one_switch_fabrics_run_too():
    """PCIe servers (the chain crosses each GPU's PCIe link and the CPU root) under one switch
    (tiers 1), and a 3-tier fabric whose tree reaches the core over the pods' trunks."""
    pcie = presets.get_topology("pcie-8gpu", nodes=4).replace(sharp=True, tiers=1)
    r = simulate("allreduce", "innet", pcie, nbytes=64 << 20)
    assert 0 < r.time_s and r.link_bytes_by_kind["nic_out"] == pytest.approx(4 * (64 << 20))
    assert r.algbw < pcie.intra_link.bandwidth / 2 / 1e9       # the chain: twice over PCIe
    core = presets.get_topology("roce-fat-tree", nodes=64).replace(sharp=True)
    r3 = simulate("allreduce", "innet", core, nbytes=64 << 20)
    assert r3.link_bytes_by_kind["pod_up"] > 0 and r3.link_bytes_by_kind["leaf_up"] > 0


# ------------------------------------------------------------------ latency
def test_small_allreduce_is_the_sum_of_its_hops_and_beats_every_host_family():
    """8 B on 16 DGX H100 with SHARP: up over NVLink (α 1.9 us) and a NIC (α 4 us + a switch
    0.2 us + the reducing switch's 0.6 us), down the same way without the reduction; the
    NVSwitch starts its 8 multicast messages one 0.1 us gap apart. 13.5 us, where the ring
    pays α on 254 steps and rhd on 14."""
    t = presets.get_topology("dgx-h100-sharp", nodes=16)
    r = simulate("allreduce", "innet", t, nbytes=8)
    hops = (2 * t.intra_link.latency + 7 * t.intra_link.gap
            + 2 * (t.nic_link.latency + t.switch_latency) + t.sharp_latency)
    assert r.time_s == pytest.approx(hops, rel=0.01)
    for family in ("ring", "tree", "rhd", "hier"):
        assert r.time_s < 0.7 * simulate("allreduce", family, t, nbytes=8).time_s, family


def test_an_operation_size_limit_slows_large_calls_only():
    """sharp_max_bytes 2 KiB (low-latency trees only): a 64 MiB call's lane messages of 128 KiB
    are 64 operations each, paced one sharp_latency (0.6 us, above the NIC's 0.5 us gap) apart,
    so each of the 64 chunks' up hops starts 63 x 0.6 us later; 8 B is one operation."""
    t = presets.get_topology("dgx-h100-sharp", nodes=4)
    small = t.replace(sharp_max_bytes=2048)
    big = simulate("allreduce", "innet", t, nbytes=64 << 20).time_s
    limited = simulate("allreduce", "innet", small, nbytes=64 << 20).time_s
    assert limited - big >= 0.9 * 64 * 63 * t.sharp_latency
    assert (simulate("allreduce", "innet", small, nbytes=8).time_s
            == simulate("allreduce", "innet", t, nbytes=8).time_s)


# ------------------------------------------------------------------ the tree
def test_the_tree_has_the_fabrics_shape_and_verifies():
    """12 servers of 2, 2 servers per leaf, 2 leaf groups per pod: 12 server switches, 6 leaf
    switches, 3 pod spines, one core; the schedules prove correct."""
    t = presets.get_topology("roce-fat-tree", nodes=12).replace(
        gpus_per_server=2, nics_per_server=2, servers_per_leaf=2, leaves_per_pod=2, sharp=True)
    node_map = t.node_map()
    levels = engine.fabric_levels(t, node_map)
    assert levels == ((2,) * 6, (2, 2, 2), (3,))
    tree = innet.switch_tree(24, node_map, innet.RADIX, levels)
    assert tree.levels == 4 and tree.participants == 24 + 12 + 6 + 3 + 1
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        verify(innet.build_all(collective, 24, 5, 3, node_map, levels=levels))
    assert simulate("allreduce", "innet", t, nbytes=1 << 20).time_s > 0


def test_levels_default_to_the_radix_tree():
    """No levels: the tree innet always built; levels that are the radix's build the same."""
    node_map = tuple(r // 2 for r in range(64))
    assert innet.switch_tree(64, node_map) == innet.switch_tree(64, node_map, levels=())
    assert (innet.switch_tree(64, node_map, levels=((8,) * 4, (4,)))
            == innet.switch_tree(64, node_map))
    with pytest.raises(ValueError, match="do not cover"):
        innet.switch_tree(64, node_map, levels=((8, 8),))


# ------------------------------------------------------------------ published figures
def test_sharp_points_are_within_20_percent_and_the_docs_show_them():
    found, timed = validation.sharp_rows(), validation.sharp_latency_rows()
    assert len(found) >= 2 and len(timed) >= 2
    for r in found:
        assert abs(r.error) <= validation.SHARP_TOLERANCE, (r.point.name, r.model)
    for r in timed:
        assert abs(r.error) <= validation.SHARP_TOLERANCE, (r.point.name, r.model_us)
    assert validation.render_sharp_markdown(found, timed) in open(DOC).read()


def test_the_innet_gain_data_in_the_docs_is_this_runs():
    """docs/sim-innet-gain.json (examples/sim_innet_gain.py) against the current model, at the
    sizes where each curve turns."""
    path = os.path.join(os.path.dirname(DOC), os.pardir, "sim-innet-gain.json")
    with open(path) as f:
        doc = json.load(f)
    for series in doc["series"]:
        topo = presets.get_topology(series["topology"], nodes=series["servers"])
        rows = {r["bytes"]: r for r in series["rows"]}
        for size in (8, 1 << 20, GIB):
            again = sim_cli.innet_gain(topo, "allreduce", [size], list(series["families"]))[0]
            assert again["innet_time_s"] == pytest.approx(rows[size]["innet_time_s"], rel=1e-9)
            assert again["best_time_s"] == pytest.approx(rows[size]["best_time_s"], rel=1e-9)


# ------------------------------------------------------------------ configuration errors
def test_bad_configurations_are_clear_value_errors():
    ln = LinkSpec("l", 10e9, 1e-6)
    with pytest.raises(ValueError, match="fullmesh"):
        Topology("m", 2, 4, "fullmesh", ln, ln, sharp=True)
    with pytest.raises(ValueError, match="sharp_max_bytes"):
        Topology("m", 2, 4, "nvswitch", ln, ln, sharp=True, sharp_max_bytes=-1)
    with pytest.raises(ValueError, match="sharp_port_bandwidth must be >= 0"):
        Topology("m", 2, 4, "nvswitch", ln, ln, sharp=True, sharp_port_bandwidth=-1.0)
    links, topos = presets.links(), presets.topologies()
    with pytest.raises(ValueError, match="needs network.sharp = true"):
        topology_from_dict({"base": "dgx-h100", "network": {"sharp_port_GBps": 40}}, links,
                           topos)
    with pytest.raises(ValueError, match="network.sharp: expected true or false"):
        topology_from_dict({"base": "dgx-h100", "network": {"sharp": "yes"}}, links, topos)
    with pytest.raises(ValueError, match="sharp_max_bytes: expected an integer"):
        topology_from_dict({"base": "dgx-h100", "network": {"sharp": True,
                                                            "sharp_max_bytes": 1.5}}, links, topos)
    t = topology_from_dict({"base": "dgx-h100", "network": {
        "sharp": True, "sharp_port_GBps": 40, "sharp_max_bytes": 4096, "sharp_latency_us": 0.5}},
        links, topos)
    assert (t.sharp, t.sharp_port_bandwidth, t.sharp_max_bytes, t.sharp_latency) == \
        (True, 40e9, 4096, 0.5e-6)
    with pytest.raises(ValueError, match=r"network.sharp = true"):
        simulate("allreduce", "innet", presets.get_topology("dgx-h100", nodes=2), nbytes=8)
    with pytest.raises(ValueError, match="no switch reduces"):
        simulate("allreduce", "innet", presets.get_topology("dgx-a100-sharp", nodes=1),
                 nbytes=8)


# ------------------------------------------------------------------ the CLI
def test_algorithms_innet_runs_on_a_sharp_fat_tree():
    rows = json.loads(_run(["--topology", "dgx-h100-sharp", "--nodes", "4", "--sizes", "8,1G",
                            "--algorithms", "ring,innet", "--json"]))
    t = {(r["algorithm"], r["bytes"]): r["time_s"] for r in rows}
    assert t[("innet", 8)] < t[("ring", 8)] and t[("innet", GIB)] < t[("ring", GIB)]


def test_compare_interconnects_shows_ib_with_and_without_sharp():
    rows = json.loads(_run(["--compare-interconnects", "--nodes", "4", "--sizes", "8,1G",
                            "--algorithms", "ring,hier", "--json"]))
    assert {r["interconnect"] for r in rows} == {"IB NDR 400G", "RoCEv2 400G", "UB 400G"}
    on = [r for r in rows if r["sharp"]]
    assert {r["interconnect"] for r in on} == {"IB NDR 400G"}
    assert {r["algorithm"] for r in on} == {"ring", "hier", "innet"}
    assert all(r["algorithm"] != "innet" for r in rows if not r["sharp"])
    text = _run(["--compare-interconnects", "--nodes", "4", "--sizes", "8,1G",
                 "--algorithms", "ring,hier"])
    assert "IB NDR 400G + SHARP" in text and "no modelled switch of it reduces" in text
    assert "IB NDR 400G + SHARP is the fastest (innet" in text.splitlines()[-1]


def test_advise_weighs_innet_where_a_switch_reduces():
    def advise(topology):
        return json.loads(_run(["--advise", "--model-bytes", "1G", "--servers", "1",
                                "--topology", topology, "--nodes", "4", "--json"]))
    sharp = advise("dgx-h100-sharp")
    assert "innet" in {r["algorithm"] for r in sharp["rows"]}
    assert sharp["winner"] == "innet" and "switches (SHARP)" in sharp["why"]["innet"]
    plain = advise("dgx-h100")
    assert "innet" not in {r["algorithm"] for r in plain["rows"]}


def test_innet_gain_question():
    rows = json.loads(_run(["--innet-gain", "--topology", "dgx-h100-sharp", "--nodes", "16",
                            "--sizes", "8,1G", "--json"]))
    assert [r["bytes"] for r in rows] == [8, GIB]
    assert all(r["gain"] == pytest.approx(r["best_time_s"] / r["innet_time_s"]) for r in rows)
    assert rows[0]["gain"] > 1 and rows[1]["gain"] > 1
    text = _run(["--innet-gain", "--topology", "dgx-h100", "--nodes", "1", "--sizes", "8,1G"])
    assert text.splitlines()[-1].startswith("Summary: in-network reduction on 1 server")
    assert "no switch reduces" in _run(["--innet-gain", "--topology", "dgx-h100", "--nodes",
                                        "2", "--sizes", "8"], rc=2)
    with pytest.raises(SystemExit):           # one question per run, and its own options
        _run(["--innet-gain", "--model-bytes", "1G"])
