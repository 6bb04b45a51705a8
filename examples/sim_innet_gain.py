"""What in-network reduction buys: allreduce with and without it, 8 B to 1 GiB, on one DGX H100
(NVLink SHARP) and on 16 DGX H100 whose fat-tree switches reduce (dgx-h100-sharp: SHARP).

    python examples/sim_innet_gain.py [--out docs/sim-innet-gain] [--sizes 8:1G]

Writes OUT.json (every size: the fastest of ring, tree, rhd and hier, and innet, with their
times, busbw and the gain) and OUT.png (busbw with and without, and the gain, per topology).
The same table for one topology: ``minicomm sim --innet-gain --topology dgx-h100-sharp``.
"""
import argparse
import json

from minicomm.algorithms import FAMILIES
from minicomm.sim import get_topology
from minicomm.sim.cli import innet_gain, innet_gain_summary, plot_innet_gain
from minicomm.sim.units import parse_sizes

SETUPS = (("dgx-h100", 1, "1 x DGX H100, NVLink SHARP"),
          ("dgx-h100-sharp", 16, "16 x DGX H100, NVLS + SHARP fat-tree"))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/sim-innet-gain")
    ap.add_argument("--sizes", default="8:1G")
    a = ap.parse_args()
    sizes = parse_sizes(a.sizes)
    series = []
    for name, servers, title in SETUPS:
        topo = get_topology(name, nodes=servers)
        rows = innet_gain(topo, "allreduce", sizes, list(FAMILIES))
        summary = innet_gain_summary(topo, "allreduce", rows)
        print(summary)
        series.append({"title": title, "topology": name, "servers": servers,
                       "description": topo.describe(), "families": list(FAMILIES),
                       "summary": summary, "rows": rows})
    with open(a.out + ".json", "w") as f:
        json.dump({"command": f"python examples/sim_innet_gain.py --out {a.out} --sizes "
                              f"{a.sizes}", "series": series}, f, indent=1)
        f.write("\n")
    plot_innet_gain([(s["title"], s["rows"]) for s in series], a.out + ".png")
    print(f"wrote {a.out}.json and {a.out}.png")


if __name__ == "__main__":
    main()
