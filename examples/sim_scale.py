"""How fast the simulator runs at 1,024 ranks (dgx-h100, 128 servers), measured in one run.

    python examples/sim_scale.py [--nodes 128] [--size 1G] [--json]

Each timing is cold: the compiled-schedule cache is emptied first, so building the schedules
(and, for ring, the rank-symmetry check) is included. Targets (issue 13): ring allreduce of 1 GiB
under 10 s; all four families together for one size under 60 s.
"""
import argparse
import json
import platform
import time

from minicomm.sim import engine, get_topology
from minicomm.sim.cli import parse_size


def timed(collective, algo, topo, nbytes):
    t = time.perf_counter()
    r = engine.simulate(collective, algo, topo, nbytes=nbytes)
    return time.perf_counter() - t, r


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    topo = get_topology("dgx-h100", nodes=a.nodes)
    nbytes = parse_size(a.size)
    rows = []
    engine._programs.clear()
    wall, r = timed("allreduce", "ring", topo, nbytes)
    rows.append({"what": "ring allreduce alone", "wall_s": wall, "predicted_s": r.time_s,
                 "busbw": r.busbw, "messages": r.messages, "events": r.events,
                 "derived_by": r.derived_by})
    engine._programs.clear()
    total = 0.0
    for algo in ("ring", "tree", "rhd", "hier"):
        wall, r = timed("allreduce", algo, topo, nbytes)
        total += wall
        rows.append({"what": f"{algo} (four families)", "wall_s": wall, "predicted_s": r.time_s,
                     "busbw": r.busbw, "messages": r.messages, "events": r.events,
                     "derived_by": r.derived_by})
    rows.append({"what": "four families together", "wall_s": total})
    if a.json:
        print(json.dumps({"ranks": topo.endpoints, "bytes": nbytes, "python": platform.python_version(),
                          "rows": rows}, indent=1))
        return
    print(f"# {topo.describe()}")
    print(f"# allreduce {a.size} on {topo.endpoints} ranks; wall = simulator run time on this machine")
    print(f"{'':<24} {'wall s':>8} {'predicted':>12} {'busbw':>7} {'messages':>9} {'events':>7}  schedules")
    for x in rows:
        if "predicted_s" in x:
            print(f"{x['what']:<24} {x['wall_s']:8.2f} {x['predicted_s'] * 1e3:9.2f} ms "
                  f"{x['busbw']:7.1f} {x['messages']:9d} {x['events']:7d}  {x['derived_by']}")
        else:
            print(f"{x['what']:<24} {x['wall_s']:8.2f}")


if __name__ == "__main__":
    main()
