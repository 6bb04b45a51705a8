"""The shipped example algorithms against the built-in families, simulated at 1,024 ranks.

Loads every example of this directory (each registers itself), prices each one's collectives
with the simulator on dgx-h100 and roce-fat-tree (128 servers x 8), next to ring, tree, rhd and
hier, and writes a JSON file and a plot (busbw against size, a panel per topology and
collective). Run:

    python examples/algorithms/compare.py --out docs/sim-own-algorithms --sizes 1M,64M,1G
"""
import argparse
import glob
import json
import os
import runpy
import sys

import minicomm as mc
from minicomm.sim import presets
from minicomm.sim.cli import parse_sizes
from minicomm.sim.engine import simulate

HERE = os.path.dirname(os.path.abspath(__file__))
BUILT_IN = ("ring", "tree", "rhd", "hier")
TOPOLOGIES = ("dgx-h100", "roce-fat-tree")


def load_examples():
    for path in sorted(glob.glob(os.path.join(HERE, "*.py"))):
        if os.path.basename(path) != "compare.py":
            runpy.run_path(path, run_name="__minicomm_load__")
    return [a for a in mc.algorithms.registered()]


def rows(sizes, servers):
    out = []
    examples = load_examples()
    colls = sorted({c for a in examples for c in a.collectives})
    for topo_name in TOPOLOGIES:
        topo = presets.get_topology(topo_name, nodes=servers)
        for coll in colls:
            algos = list(BUILT_IN) + [a.name for a in examples if coll in a.collectives]
            for s in sizes:
                for algo in algos:
                    r = simulate(coll, algo, topo, nbytes=s)
                    out.append({"topology": topo_name, "collective": coll, "algorithm": algo,
                                "bytes": r.bytes, "ranks": r.ranks, "time_s": r.time_s,
                                "busbw": r.busbw, "example": algo not in BUILT_IN})
                    print(f"{topo_name:14} {coll:15} {algo:8} {r.bytes:>11} B "
                          f"{r.time_s * 1e3:10.3f} ms {r.busbw:8.1f} GB/s", flush=True)
    return out


def plot(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(d["topology"], d["collective"]) for d in data})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (topo, coll) in zip(axes[0], panels):
        pts = [d for d in data if d["topology"] == topo and d["collective"] == coll]
        for algo in dict.fromkeys(d["algorithm"] for d in pts):
            xs = sorted((d["bytes"], d["busbw"]) for d in pts if d["algorithm"] == algo)
            ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", ms=3, label=algo,
                    linestyle="-" if algo in BUILT_IN else "--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{coll}, {topo}", fontsize=9)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="sim-own-algorithms")
    ap.add_argument("--sizes", default="1M,64M,1G")
    ap.add_argument("--servers", type=int, default=128)
    a = ap.parse_args(argv)
    data = rows(parse_sizes(a.sizes), a.servers)
    command = "python examples/algorithms/compare.py " + " ".join(sys.argv[1:])
    with open(a.out + ".json", "w") as f:
        json.dump({"command": command.strip(), "rows": data}, f, indent=1)
    plot(data, a.out + ".png")
    print(f"wrote {a.out}.json and {a.out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
