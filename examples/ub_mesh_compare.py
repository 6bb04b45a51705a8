"""UB-Mesh's shape against the fat-tree presets, at equal accelerator counts (simulated).

    python examples/ub_mesh_compare.py [--gpus 128,1024] [--sizes 1M,64M,1G] [--json]

Allreduce busbw of each topology's fastest algorithm at each size: dgx-h100 and roce-fat-tree
(every family: ring, tree, rhd, hier), ub-mesh (8 x 8 racks under a Clos, the ``mesh``
schedules and every family), the same UB links with each rack's mesh replaced by a rack-wide
crossbar (the paper's Clos baseline: same I/O per NPU, every port into a switch), and, at 1,024
NPUs, UB-Mesh's 4D pod (8 x 8 x 4 x 4: the racks' 2D mesh and a 4 x 4 mesh of racks, no Clos).
The table is the one in docs/guide/simulator.md ("UB-Mesh: an n-D full mesh"); every UB figure
is illustrative (minicomm/sim/presets.json, docs/decisions/ub-mesh-shape.md).
"""
import argparse
import json
import time

from minicomm.sim import get_topology, links, simulate, topologies
from minicomm.sim.topology import topology_from_dict
from minicomm.sim.units import format_size, parse_sizes

FAMILIES = ("ring", "tree", "rhd", "hier")

# The pod: per NPU x28 lanes in each rack dimension (188.16 GB/s effective) and, in each of
# the two rack-to-rack dimensions, x2 to each of 3 neighbour racks (a rack pair's x128 link
# shared by its 64 NPUs: x6, 40.32 GB/s); x4 per NPU to the HRS Clos, unused on one pod.
POD = {"name": "ub-mesh-pod", "base": "ub-mesh", "servers": 1, "gpus_per_server": 1024,
       "description": "UB-Mesh-Pod: 16 racks of 8 x 8 NPUs as a 4D full mesh (8 x 8 x 4 x 4)",
       "intra": {"mesh_dims": [8, 8, 4, 4], "mesh_dim_GBps": [188.16, 188.16, 40.32, 40.32]},
       "nic": {"per_server": 128, "link": {"preset": "ub-x128", "name": "ub-x32",
                                           "bandwidth_GBps": 215.04, "line_rate_GBps": 224}}}

# Share of an accelerator's I/O lanes on direct mesh links, from each shape: none on the
# NVIDIA presets (NVLink into NVSwitch, NICs into leaves) and with the rack-wide crossbar; x56
# of x72 on ub-mesh; x68 of x72 on the 4D pod, whose rack-to-rack links pass the racks'
# low-radix switches, as the paper's mesh links between racks do.
DIRECT = {"dgx-h100": 0.0, "roce-fat-tree": 0.0, "ub-mesh": 56 / 72,
          "ub-mesh, rack crossbar": 0.0, "ub-mesh-pod (4D)": 68 / 72}


def cases(gpus):
    out = [("dgx-h100", get_topology("dgx-h100", nodes=gpus // 8), FAMILIES),
           ("roce-fat-tree", get_topology("roce-fat-tree", nodes=gpus // 8), FAMILIES)]
    ub = get_topology("ub-mesh", nodes=gpus // 64)
    out.append(("ub-mesh", ub, ("mesh",) + FAMILIES))
    out.append(("ub-mesh, rack crossbar", ub.replace(intra="nvswitch", mesh_dims=()),
                ("mesh",) + FAMILIES))
    if gpus == 1024:
        out.append(("ub-mesh-pod (4D)", topology_from_dict(POD, links(), topologies()),
                    ("mesh",)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", default="128,1024")
    ap.add_argument("--sizes", default="1M,64M,1G")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sizes = parse_sizes(a.sizes)
    rows = []
    t0 = time.perf_counter()
    for gpus in (int(x) for x in a.gpus.split(",")):
        for label, topo, algos in cases(gpus):
            assert topo.endpoints == gpus, (label, topo.endpoints)
            for s in sizes:
                res = [simulate("allreduce", algo, topo, nbytes=s) for algo in algos]
                best = min(res, key=lambda r: r.time_s)
                fam = min((r for r in res if r.algorithm in FAMILIES), key=lambda r: r.time_s,
                          default=None)
                rows.append({"gpus": gpus, "topology": label, "bytes": s,
                             "best": best.algorithm, "time_s": best.time_s,
                             "busbw": best.busbw,
                             "best_family": fam.algorithm if fam else None,
                             "family_busbw": fam.busbw if fam else None,
                             "direct_io": DIRECT[label]})
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print("| NPUs/GPUs | topology | I/O on direct links | "
          + " | ".join(f"{format_size(s)} busbw (algorithm)" for s in sizes)
          + " | best family at the largest size |")
    print("|---|---|---|" + "---|" * len(sizes) + "---|")
    for gpus in sorted({r["gpus"] for r in rows}):
        for label in dict.fromkeys(r["topology"] for r in rows if r["gpus"] == gpus):
            mine = [r for r in rows if r["gpus"] == gpus and r["topology"] == label]
            cells = " | ".join(f"{r['busbw']:.1f} ({r['best']})" for r in mine)
            last = mine[-1]
            fam = (f"{last['family_busbw']:.1f} ({last['best_family']})"
                   if last["best_family"] else "-")
            print(f"| {gpus} | {label} | {100 * last['direct_io']:.0f}% | {cells} | {fam} |")
    print(f"\n(simulated in {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
