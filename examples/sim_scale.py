"""How fast the simulator runs at 1,024 ranks (dgx-h100, 128 servers), measured in one run.

    python examples/sim_scale.py [--nodes 128] [--size 1G] [--json]

Each timing is cold: the compiled-schedule cache is emptied first, so building the schedules
(and, for ring, the rank-symmetry check) is included. Targets: ring allreduce of 1 GiB under
10 s; all four families together for one size under 60 s (docs/decisions/simulator-speed.md).
"""
import argparse
import json
import os
import platform
import time

from minicomm.sim import engine, get_topology
from minicomm.sim.cli import parse_size


def timed(collective, algo, topo, nbytes):
    """(wall s, this process's CPU s, result): on a machine shared with other jobs the CPU time
    is the simulator's own cost, the wall time includes waiting for a core."""
    t, c = time.perf_counter(), time.process_time()
    r = engine.simulate(collective, algo, topo, nbytes=nbytes)
    return time.perf_counter() - t, time.process_time() - c, r


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
    load = os.getloadavg()
    wall, cpu, r = timed("allreduce", "ring", topo, nbytes)
    rows.append({"what": "ring allreduce alone", "wall_s": wall, "cpu_s": cpu,
                 "predicted_s": r.time_s,
                 "busbw": r.busbw, "messages": r.messages, "events": r.events,
                 "derived_by": r.derived_by})
    engine._programs.clear()
    total = total_cpu = 0.0
    for algo in ("ring", "tree", "rhd", "hier"):
        wall, cpu, r = timed("allreduce", algo, topo, nbytes)
        total += wall
        total_cpu += cpu
        rows.append({"what": f"{algo} (four families)", "wall_s": wall, "cpu_s": cpu,
                     "predicted_s": r.time_s,
                     "busbw": r.busbw, "messages": r.messages, "events": r.events,
                     "derived_by": r.derived_by})
    rows.append({"what": "four families together", "wall_s": total, "cpu_s": total_cpu})
    if a.json:
        print(json.dumps({"ranks": topo.endpoints, "bytes": nbytes, "python": platform.python_version(),
                          "load_average": [load, os.getloadavg()], "rows": rows}, indent=1))
        return
    print(f"# {topo.describe()}")
    print(f"# allreduce {a.size} on {topo.endpoints} ranks; wall = simulator run time on this machine, "
          f"cpu = its process's CPU time; load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores")
    print(f"{'':<24} {'wall s':>8} {'cpu s':>8} {'predicted':>12} {'busbw':>7} {'messages':>9} "
          f"{'events':>7}  schedules")
    for x in rows:
        if "predicted_s" in x:
            print(f"{x['what']:<24} {x['wall_s']:8.2f} {x['cpu_s']:8.2f} "
                  f"{x['predicted_s'] * 1e3:9.2f} ms {x['busbw']:7.1f} {x['messages']:9d} "
                  f"{x['events']:7d}  {x['derived_by']}")
        else:
            print(f"{x['what']:<24} {x['wall_s']:8.2f} {x['cpu_s']:8.2f}")


if __name__ == "__main__":
    main()
