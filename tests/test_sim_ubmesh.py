"""UB-Mesh's shape: the n-D full mesh topology (``mesh_dims``), its routes and file keys, the
``mesh`` schedules along the dimensions (proved by the verifier, priced by the simulator against
hand-computed bounds), and the ``ub-mesh`` preset (docs/decisions/ub-mesh-shape.md)."""
import argparse
import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest

from minicomm.algorithms import meshdims
from minicomm.schedule import Recv, Send
from minicomm.sim import cli as sim_cli
from minicomm.sim import presets, simulate, simulate_schedules
from minicomm.sim.engine import mesh_orders
from minicomm.sim.topology import Fabric, LinkSpec, Topology, topology_from_dict
from minicomm.verifier import verify

GB = 1e9


def mesh_unit(dims, bw=60e9, alpha=1e-6, servers=1, nic_bw=10e9, **kw):
    """Servers that are one n-D full mesh each, every link alike, compute free."""
    g = math.prod(dims)
    return Topology("mesh", servers=servers, gpus_per_server=g, intra="fullmesh",
                    intra_link=LinkSpec("mesh", bw, alpha), nic_link=LinkSpec("nic", nic_bw, alpha),
                    nics_per_server=1, tiers=1, mesh_dims=tuple(dims), **kw)


def sent_and_received(sched):
    sent = sum(o.count for st in sched.steps for o in st if isinstance(o, Send))
    got = sum(o.count for st in sched.steps for o in st if isinstance(o, Recv))
    return sent, got


# ------------------------------------------------------------------------- the topology
def test_links_along_each_dimension_share_the_accelerator_bandwidth():
    """4 x 3: an accelerator has 3 + 2 neighbours; 50 GB/s over its 5 ports is 10 GB/s a link."""
    t = mesh_unit((4, 3), bw=50e9, servers=2)
    assert t.mesh_shape == (4, 3) and t.endpoints == 24
    assert t.mesh_port_bandwidth() == pytest.approx((10e9, 10e9))
    fab = Fabric(t)
    for dim, d in enumerate((4, 3)):
        ids = np.nonzero(fab.kind_of == fab.kinds.index(f"mesh{dim}"))[0]
        assert len(ids) == 2 * 12 * d                      # (server, accelerator, coordinate)
        assert np.all(fab.capacity[ids] == 10e9)
    # per-dimension figures: 30 GB/s over 3 ports in dimension 0, 8 over 2 in dimension 1
    t2 = t.replace(mesh_dim_bandwidth=(30e9, 8e9))
    assert t2.mesh_port_bandwidth() == pytest.approx((10e9, 4e9))


def test_routes_are_direct_along_one_dimension_and_dimension_order_otherwise():
    t = mesh_unit((4, 3), alpha=2e-6, servers=2, switch_latency=0.3e-6)
    fab = Fabric(t)
    # local 0 = (0, 0); 1 = (1, 0); 4 = (0, 1); 5 = (1, 1); 12 = server 1's (0, 0)
    links, lat = fab.routes(np.array([0, 0, 0, 5, 0]), np.array([1, 4, 5, 0, 12]))
    names = [[fab.name(x) for x in row if x >= 0] for row in links]
    assert names[0] == ["mesh link 0:0 dim 0 -> 1"]
    assert names[1] == ["mesh link 0:0 dim 1 -> 1"]
    assert names[2] == ["mesh link 0:0 dim 0 -> 1", "mesh link 0:1 dim 1 -> 1"]
    assert names[3] == ["mesh link 0:5 dim 0 -> 0", "mesh link 0:4 dim 1 -> 0"]
    assert names[4] == ["NIC 0.0 out", "NIC 1.0 in"]       # the mesh is not on the way out
    # one hop: the link's α; two: one intermediate accelerator forwards, one switch latency
    assert lat[:4] == pytest.approx([2e-6, 2e-6, 2.3e-6, 2.3e-6])


def test_the_plain_full_mesh_is_unchanged():
    """No mesh_dims: one 'pair' block of g x g links per server, as before the n-D kind."""
    ln = LinkSpec("x", 70e9, 1e-6)
    t = Topology("fm", servers=2, gpus_per_server=8, intra="fullmesh", intra_link=ln,
                 nic_link=ln)
    fab = Fabric(t)
    assert "pair" in fab.kinds and not any(k.startswith("mesh") for k in fab.kinds)
    assert np.all(fab.capacity[fab.kind_of == fab.kinds.index("pair")] == 10e9)
    links, _ = fab.routes(np.array([3]), np.array([6]))
    assert [fab.name(x) for x in links[0] if x >= 0] == ["mesh link 0:3->6"]


def test_topology_file_keys(tmp_path):
    spec = {"name": "pod", "base": "ub-mesh", "gpus_per_server": 32,
            "intra": {"mesh_dims": [8, 4], "mesh_dim_GBps": [196, 84]}}
    path = tmp_path / "pod.json"
    path.write_text(json.dumps(spec))
    t = presets.get_topology(str(path), nodes=3)
    assert (t.mesh_dims, t.servers, t.endpoints) == ((8, 4), 3, 96)
    assert t.mesh_dim_bandwidth == pytest.approx((196e9, 84e9))
    assert t.mesh_port_bandwidth() == pytest.approx((28e9, 28e9))
    # another kind drops the base's mesh; new dims drop the base's per-dimension figures
    ls, ts = presets.links(), presets.topologies()
    nv = topology_from_dict({"base": "ub-mesh", "intra": {"kind": "nvswitch"}}, ls, ts)
    assert (nv.intra, nv.mesh_dims, nv.mesh_dim_bandwidth) == ("nvswitch", (), ())
    flat = topology_from_dict({"base": "ub-mesh", "intra": {"mesh_dims": [64]}}, ls, ts)
    assert flat.mesh_shape == (64,) and flat.mesh_port_bandwidth()[0] == pytest.approx(
        376.32e9 / 63)


@pytest.mark.parametrize("intra, error", [
    ({"mesh_dims": [8, 4]}, "hold 32 accelerators, but a server"),
    ({"mesh_dims": [64, 1]}, "every dimension is an integer >= 2"),
    ({"mesh_dims": [8, 8.0]}, "every dimension is an integer >= 2"),
    ({"mesh_dims": 64}, "one entry per dimension"),
    ({"mesh_dims": []}, "one entry per dimension"),
    ({"mesh_dims": [2] * 6, "mesh_dim_GBps": [1, 2]}, "one positive number per dimension"),
    ({"mesh_dims": [8, 8], "mesh_dim_GBps": [100]}, "one positive number per dimension"),
    ({"mesh_dims": [8, 8], "mesh_dim_GBps": [100, -1]}, "one positive number per dimension"),
    ({"kind": "nvswitch", "mesh_dims": [8, 8]}, "needs intra kind 'fullmesh'"),
])
def test_bad_mesh_dims_raise_clear_errors(intra, error):
    with pytest.raises(ValueError, match=error):
        topology_from_dict({"base": "ub-mesh", "intra": intra}, presets.links(),
                           presets.topologies())


def test_nine_dimensions_are_too_many_for_a_route():
    with pytest.raises(ValueError, match="1 to 8 dimension sizes"):
        mesh_unit((2,) * 9)


# ------------------------------------------------------------------------- the schedules
def _maps(G, m):
    """Units of G consecutive ranks, and units dealt round-robin."""
    p = G * m
    return sorted({tuple(r // G for r in range(p)), tuple(r % m for r in range(p))})


@pytest.mark.parametrize("dims", [(2,), (3,), (2, 2), (2, 3), (3, 2, 2)])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_every_collective_verifies(dims, m):
    G = math.prod(dims)
    p = G * m
    for topo in _maps(G, m):
        for coll in meshdims.COLLECTIVES:
            for n in sorted({0, 1, p - 1, p + 1, 2 * p + 3}):
                for parts in (None, 1):
                    scheds = meshdims.build_all(coll, p, n, 0, topo, dims, parts)
                    assert all(s.algorithm == "mesh" for s in scheds)
                    verify(scheds)
    verify(meshdims.build_all("allreduce", p, 2 * p + 3, 0, _maps(G, m)[0], dims, inter="ring"))


def test_one_dimension_reduce_scatter_is_one_step_of_direct_sends():
    """A 1-D full mesh of d: every rank sends each member its block at once: (d-1)/d of its
    input out, (d-1) blocks in, in one communicating step."""
    d, n = 7, 10
    for s in meshdims.build_all("reduce_scatter", d, n, 0, None, (d,)):
        assert s.comm_steps == 1 and s.tmp_count == 0
        assert sent_and_received(s) == ((d - 1) * n, (d - 1) * n)
        assert (d - 1) * n == (d - 1) / d * s.in_count


def test_allreduce_moves_what_a_ring_does_in_2k_steps():
    """On one unit an allreduce rank sends and receives 2(1 - 1/G) n (the ring's bandwidth
    optimum) in 2k steps; a 4 x 4 x 2 unit, n divisible by G."""
    dims, n = (4, 4, 2), 32 * 12
    G = math.prod(dims)
    for s in meshdims.build_all("allreduce", G, n, 0, None, dims):
        assert s.comm_steps == 2 * len(dims)
        assert sent_and_received(s) == (2 * (G - 1) * n // G,) * 2


def test_orders_of_unequal_dimensions():
    """Dimensions of equal bandwidth rotate among themselves, the fastest first: UB-Mesh's pod
    (rack dimensions at 188 GB/s, rack-to-rack ones at 40) runs two parts, X Y Z W and Y X W Z;
    the schedules with those orders verify."""
    t = presets.get_topology("ub-mesh")
    assert mesh_orders(t) == ((0, 1), (1, 0))
    pod = t.replace(gpus_per_server=1024, servers=1, mesh_dims=(8, 8, 4, 4),
                    mesh_dim_bandwidth=(188e9, 188e9, 40e9, 40e9))
    assert mesh_orders(pod) == ((0, 1, 2, 3), (1, 0, 3, 2))
    slow_first = pod.replace(mesh_dim_bandwidth=(20e9, 20e9, 40e9, 40e9))
    assert mesh_orders(slow_first) == ((2, 3, 0, 1), (3, 2, 1, 0))
    orders = ((0, 1, 2, 3), (1, 0, 3, 2))
    for coll in meshdims.COLLECTIVES:
        for m in (1, 2):
            topo = tuple(r // 16 for r in range(16 * m))
            verify(meshdims.build_all(coll, 16 * m, 16 * m + 5, 0, topo, (2, 2, 2, 2),
                                      orders=orders))
    with pytest.raises(ValueError, match="permutation of the 2 dimensions"):
        meshdims.build("allreduce", 0, 16, 8, 0, None, (4, 4), orders=[(0, 0)])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="integer >= 2"):
        meshdims.check_dims((4, 1))
    with pytest.raises(ValueError, match="at least one dimension"):
        meshdims.check_dims(())
    with pytest.raises(ValueError, match="need units of 16 ranks"):
        meshdims.build("allreduce", 0, 24, 8, 0, (0,) * 16 + (1,) * 8, (4, 4))
    with pytest.raises(ValueError, match="not broadcast"):
        meshdims.build("broadcast", 0, 4, 8, 0, None, (4,))


# ------------------------------------------------------------------------- priced
def test_one_unit_reaches_its_whole_mesh_bandwidth():
    """4 x 4, 60 GB/s per accelerator (10 GB/s a link, 30 per dimension), α = 1 us, compute
    free. Two parts on two dimensions at once: T = 4α + 2 (N/8 + N/32) / 10 GB/s and busbw =
    the accelerator's 60 GB/s; one part uses one dimension at a time: 30 GB/s."""
    t = mesh_unit((4, 4))
    N = 1 << 30
    r = simulate("allreduce", "mesh", t, nbytes=N)
    assert r.time_s == pytest.approx(4e-6 + 2 * (N / 8 + N / 32) / 10e9, rel=1e-3)
    assert r.busbw == pytest.approx(60, rel=0.002)
    one = simulate_schedules(meshdims.build_all("allreduce", 16, N // 4, 0, None, (4, 4), 1), t)
    assert one.time_s == pytest.approx(4e-6 + 2 * (N / 4 + N / 16) / 10e9, rel=1e-3)
    assert N / one.time_s / GB * 2 * 15 / 16 == pytest.approx(30, rel=0.002)


def test_ub_mesh_preset_across_racks_against_the_hand_bound():
    """2 racks of 8 x 8: the mesh phases at the NPU's 376.32 GB/s (two parts), the Clos phase
    (rhd on 2 racks: half of the 1/64 shard each way) at a board port's 860.16 / 8 GB/s."""
    t = presets.get_topology("ub-mesh").replace(gamma=0.0, delta=0.0)
    assert (t.endpoints, t.mesh_dims) == (128, (8, 8))
    N = 1 << 30
    bound = 2 * (1 - 1 / 64) * N / 376.32e9 + 2 * (N / 128) / (860.16e9 / 8)
    r = simulate("allreduce", "mesh", t, nbytes=N)
    assert bound < r.time_s < bound * 1.01
    assert r.busbw == pytest.approx(N / bound / GB * 2 * 127 / 128, rel=0.01)


def test_a_ring_on_the_mesh_runs_at_one_link():
    """A ring's neighbour is one of an NPU's 14 links (376.32 / 14 = 26.88 GB/s), so on ub-mesh
    it is bound by that link, whatever the mesh's other 13 carry."""
    t = presets.get_topology("ub-mesh", nodes=1).replace(gamma=0.0, delta=0.0)
    ring = simulate("allreduce", "ring", t, nbytes=1 << 28)
    assert ring.busbw == pytest.approx(376.32 / 14, rel=0.03)
    mesh = simulate("allreduce", "mesh", t, nbytes=1 << 28)
    assert mesh.time_s < ring.time_s / 10


def test_mesh_on_other_kinds_and_bad_placements():
    """On a server of another kind the mesh is one dimension of g; it needs whole units."""
    t = presets.get_topology("dgx-h100", nodes=2)
    r = simulate("allreduce", "mesh", t, nbytes=1 << 20)
    assert r.algorithm == "mesh" and r.ranks == 16 and r.time_s > 0
    rs = simulate("reduce_scatter", "mesh", t, nbytes=1 << 20)
    assert rs.busbw > 0
    with pytest.raises(ValueError, match="need units of 64 ranks"):
        simulate("allreduce", "mesh", presets.get_topology("ub-mesh"), nbytes=1 << 20, ranks=100)
    with pytest.raises(ValueError, match="not broadcast"):
        simulate("broadcast", "mesh", t, nbytes=1 << 20)


def test_cli_runs_mesh_on_ub_mesh():
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = sim_cli.main(p.parse_args(["--topology", "ub-mesh", "--algorithms", "mesh,ring",
                                        "--sizes", "1M,64M", "--json"]))
    assert rc == 0
    rows = {(r["algorithm"], r["bytes"]): r for r in json.loads(buf.getvalue())}
    assert {a for a, _ in rows} == {"mesh", "ring"} and rows["mesh", 64 << 20]["ranks"] == 128
    assert rows["mesh", 64 << 20]["time_s"] < rows["ring", 64 << 20]["time_s"]
    err = io.StringIO()
    with redirect_stderr(err):
        assert sim_cli.main(p.parse_args(["--algorithms", "mesh", "--collective", "broadcast",
                                          "--sizes", "1M"])) == 2
    assert "mesh builds allreduce" in err.getvalue()
