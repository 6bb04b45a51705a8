"""Regenerate the collective benchmark tables and plot of docs/benchmarks.md on this machine.

    python examples/bench_readme.py [--out docs/bench] [--plot docs/bench.png] [--prefix CMD]
    python examples/bench_readme.py --from docs/bench [--plot FILE]    # re-render, measure nothing

Runs ``minicomm bench`` for each case of the table (with ``--peers mpi,gloo`` where mpi4py + MPICH
and torch are installed: ``pip install -e '.[peers,plot]' torch``), keeps every run's JSON under
``--out``, draws the plot from them, measures peak memory of a 64 MiB allreduce, and prints the
table in Markdown. ``--prefix`` is put before every bench command (for example
``"flock /tmp/minicomm-bench.lock"`` to keep other jobs off the cores while it runs).

Every figure is out-of-place, float32 sum, median over 5 interleaved batches of the slowest rank;
ratios compare figures of the same run (minicomm ``auto`` against the peer). The ``-registered``
run allocates every library's buffers with ``comm.empty`` (``minicomm bench --registered``).
The load average of the machine is printed with the table: on a shared machine, it says how far
to trust the figures.

Provenance: a measuring run writes ``provenance.json`` under ``--out`` (the machine's CPU model
and cores, kernel, libc, the date, the git commit -- ``provenance.stamp`` -- the load average
and the peak-memory figures) and prints it above the tables. ``--from DIR`` renders the tables
and the plot again from the runs' JSON in DIR without measuring; its provenance line comes from
DIR's ``provenance.json`` when there is one, else from the runs' own ``created`` dates.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from minicomm.tools.benchspec import format_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import describe, stamp  # noqa: E402

ALGOS = "ring,rhd,tree,hier,auto"
SWEEP = "8,64,512,4K,32K,256K,1M,4M,16M,64M"
RUNS = {   # name: bench arguments
    "allreduce-shm-n2": ["allreduce", "--sizes", SWEEP, "-n", "2", "--transport", "shm",
                         "--algorithms", ALGOS],
    "allreduce-shm-n4": ["allreduce", "--sizes", SWEEP, "-n", "4", "--transport", "shm",
                         "--algorithms", ALGOS],
    # every collective at the sizes of the bandwidth targets (MPICH only: it is the target)
    "all-shm-n2": ["all", "--sizes", "1M,64M", "-n", "2", "--transport", "shm", "--only-mpi"],
    "all-shm-n4": ["all", "--sizes", "1M,64M", "-n", "4", "--transport", "shm", "--only-mpi"],
    "all-shm-n2-registered": ["all", "--sizes", "1M,64M", "-n", "2", "--transport", "shm",
                              "--registered", "--only-mpi"],
    "allreduce-tcp-n2": ["allreduce", "--sizes", "8,64M", "-n", "2", "--transport", "tcp",
                         "--algorithms", ALGOS],
}
# auto is judged on the median of 3 runs: two more sweeps of every algorithm, minicomm alone
# (the first of the 3 is the run above, with the peers)
AUTO_REPEATS = 2
RUNS.update({f"allreduce-shm-n{n}-run{k}": ["allreduce", "--sizes", SWEEP, "-n", n, "--transport",
                                            "shm", "--algorithms", ALGOS, "--no-peers"]
             for n in ("2", "4") for k in range(2, 2 + AUTO_REPEATS)})
MiB = 1 << 20


def _peers() -> list:
    from minicomm.tools import peers
    return [p for p, why in (("mpi", peers.mpi_available()), ("gloo", peers.gloo_available()))
            if why is None]


def run_all(out: str, prefix: str) -> dict:
    os.makedirs(out, exist_ok=True)
    peer_list = _peers()
    rows = {}
    for name, args in RUNS.items():
        path = os.path.join(out, f"{name}.json")
        only_mpi, alone = "--only-mpi" in args, "--no-peers" in args
        args = [a for a in args if a not in ("--only-mpi", "--no-peers")]
        cmd = shlex.split(prefix) + [sys.executable, "-m", "minicomm.cli", "bench", *args,
                                     "--json", path]
        use = [p for p in peer_list if (p == "mpi" or not only_mpi) and not alone]
        if use:
            cmd += ["--peers", ",".join(use)]
        print("$", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
        for attempt in range(3):
            # a job's setup can fail on a loaded machine (a rank's connect refused with EAGAIN):
            # run it again rather than lose the table; a failure of the third try is final
            done = subprocess.run(cmd, stdout=sys.stderr)
            if done.returncode == 0:
                break
            print(f"# {name}: bench exited {done.returncode}; attempt {attempt + 2} of 3",
                  file=sys.stderr, flush=True)
        else:
            raise SystemExit(f"{name}: the bench run failed three times")
        with open(path) as f:
            rows[name] = json.load(f)["rows"]
    return rows


def peak_memory(nbytes: int = 64 * MiB, world: int = 2) -> list:
    """Per rank: (peak resident memory during one allreduce of ``nbytes`` - resident memory of
    the connected interpreter before the buffers exist) / nbytes. Counts the input, the result
    and everything the library holds (shared-memory rings, scratch)."""
    import minicomm as mc
    return mc.spawn(_peak_rank, world, args=(nbytes,), transport="shm")


def _peak_rank(comm, nbytes):
    import numpy as np

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(field)
    comm.allreduce(np.ones(1024, dtype=np.float32))      # connections and plans in place
    comm.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                     # resets the peak (VmHWM) to now
    base = status("VmRSS")
    x = np.ones(nbytes // 4, dtype=np.float32)
    y = comm.allreduce(x)
    peak = status("VmHWM")
    assert float(y[0]) == comm.size
    return (peak - base) / nbytes


def _row(rows, coll, size, library, algo="auto"):
    for r in rows:
        if r["collective"] == coll and r["size"] == size and r["library"] == library and \
                (library != "minicomm" or r["algo"].split(">")[0] == algo):
            return r
    return None


def _t(r):
    if r is None or r.get("time_us") is None:
        return "—"
    us = r["time_us"]
    return f"{us / 1000:.1f} ms" if us >= 1000 else f"{us:.1f} us"


def _auto_vs_best(runs):
    """Over ``runs`` (the rows of each of several runs of one sweep), per size the median over
    the runs of: the auto row's time / the best fixed algorithm's of that run (what a user gets),
    and the time of the algorithm auto picked, in its own fixed row / the best (the quality of
    the choice alone, free of the noise between two rows that run the same schedule); returns
    the worst size of each, with the picks and bests of every run."""
    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    worst_row, worst_pick = (0.0, ""), (0.0, "")
    for size in sorted({r["size"] for r in runs[0]}):
        row_r, pick_r, said = [], [], []
        for rows in runs:
            auto = _row(rows, "allreduce", size, "minicomm")
            fixed = {r["algo"]: r["time_us"] for r in rows if r["size"] == size
                     and r["library"] == "minicomm" and not r["algo"].startswith("auto")}
            best = min(fixed, key=fixed.get)
            picked = auto["algo"].split(">")[1]
            row_r.append(auto["time_us"] / fixed[best])
            pick_r.append(fixed[picked] / fixed[best])
            said.append(f"{picked}/{best}")
        at = f"{format_size(size)}: picked/best {', '.join(said)}"
        worst_row = max(worst_row, (median(row_r), at))
        worst_pick = max(worst_pick, (median(pick_r), at))
    return worst_row, worst_pick


COLLECTIVES = ("broadcast", "reduce", "allreduce", "allgather", "reduce_scatter", "gather",
               "scatter", "alltoall")


def bandwidth_table(rows: dict) -> str:
    """Issue 15's bandwidth rows: every collective at 1 MiB and 64 MiB, n=2 and n=4, MPICH's
    time ÷ minicomm's (plain numpy buffers; and registered buffers at n=2)."""
    n2, n4, reg = rows["all-shm-n2"], rows["all-shm-n4"], rows["all-shm-n2-registered"]
    lines = ["| collective, size | n=2: minicomm | n=2: MPICH | n=2: MPICH ÷ minicomm | "
             "n=4: minicomm | n=4: MPICH | n=4: MPICH ÷ minicomm | n=2, registered buffers: "
             "MPICH ÷ minicomm | target |",
             "|---|---|---|---|---|---|---|---|---|"]

    def ratio(p):
        return f"{p['ratio']:.2f}" if p and p.get("ratio") else "—"
    for coll in COLLECTIVES:
        for size in (MiB, 64 * MiB):
            cells = []
            for rs in (n2, n4):
                mc, mpi = _row(rs, coll, size, "minicomm"), _row(rs, coll, size, "mpi")
                cells += [_t(mc), _t(mpi), ratio(mpi)]
            cells.append(ratio(_row(reg, coll, size, "mpi")))
            lines.append(f"| {coll} {format_size(size)} | " + " | ".join(cells) + " | ≥ 1.0 |")
    return "\n".join(lines)


def table(rows: dict, mem) -> str:
    n2, n4, tcp = rows["allreduce-shm-n2"], rows["allreduce-shm-n4"], rows["allreduce-tcp-n2"]
    a4 = rows["all-shm-n4"]
    lines = ["| case | minicomm (auto) | MPICH | gloo | MPICH ÷ minicomm | gloo ÷ minicomm | target |",
             "|---|---|---|---|---|---|---|"]

    def add(label, rs, coll, size, target):
        mc, mpi, gloo = (_row(rs, coll, size, lib) for lib in ("minicomm", "mpi", "gloo"))
        ratio = (lambda p: f"{p['ratio']:.2f}" if p and p.get("ratio") else "—")
        busbw = f" (busbw {mc['busbw']:.2f} GB/s)" if mc and size >= MiB else ""
        lines.append(f"| {label} | {_t(mc)}{busbw} | {_t(mpi)} | {_t(gloo)} | {ratio(mpi)} | "
                     f"{ratio(gloo)} | {target} |")
    add("shm allreduce 64 MiB, n=2", n2, "allreduce", 64 * MiB, "≥ 1.0× MPICH")
    add("shm allreduce 1 MiB, n=2", n2, "allreduce", MiB, "≥ 1.0× MPICH")
    add("shm allreduce 8 B, n=2", n2, "allreduce", 8, "≤ 6 us and ≤ 2× MPICH")
    add("shm allreduce 8 B, n=4 (2 cores)", n4, "allreduce", 8, "≤ 1.5× MPICH")
    add("shm barrier, n=4 (2 cores)", a4, "barrier", 0, "≤ 1.5× MPICH")
    add("shm allreduce 64 MiB, n=4 (2 cores)", n4, "allreduce", 64 * MiB, "≥ 1.0× MPICH")
    add("tcp allreduce 64 MiB, n=2 (MPICH over UCX tcp)", tcp, "allreduce", 64 * MiB,
        "≥ 1.0× MPICH, ≥ 1.5× gloo")
    add("tcp allreduce 8 B, n=2", tcp, "allreduce", 8, "")
    for n in ("2", "4"):
        runs = [rows[f"allreduce-shm-n{n}"]] + [rows[f"allreduce-shm-n{n}-run{k}"]
                                                 for k in range(2, 2 + AUTO_REPEATS)]
        (row, row_at), (pick, pick_at) = _auto_vs_best(runs)
        lines.append(f"| auto ÷ best fixed algorithm, allreduce 8 B–64 MiB, n={n}, median of "
                     f"{len(runs)} runs | worst {row:.2f} ({row_at}); the pick alone: worst "
                     f"{pick:.2f} ({pick_at}) | | | | | within 1.10 |")
    if mem:                               # measured by this run (not with --from)
        lines.append(f"| peak memory per rank above baseline, 64 MiB allreduce | "
                     f"{max(mem):.2f}× the buffer (the input and the result themselves: 2×) "
                     f"| | | | | ≤ 2× |")
    return "\n".join(lines)


def load_runs(folder: str) -> dict:
    """The rows of every run of ``RUNS`` recorded under ``folder`` (``--from``)."""
    rows = {}
    for name in RUNS:
        with open(os.path.join(folder, f"{name}.json")) as f:
            rows[name] = json.load(f)["rows"]
    return rows


def recorded_provenance(folder: str) -> str:
    """The provenance line of a recorded set of runs: its provenance.json, else the span of the
    runs' ``created`` dates and their hostname (runs made before provenance was recorded)."""
    path = os.path.join(folder, "provenance.json")
    if os.path.exists(path):
        with open(path) as f:
            rec = json.load(f)
        return (f"{describe(rec)}; load average after the runs "
                f"{' '.join(f'{x:.2f}' for x in rec['load_average'])}")
    metas = []
    for name in RUNS:
        with open(os.path.join(folder, f"{name}.json")) as f:
            metas.append(json.load(f)["meta"])
    dates = sorted(m["created"] for m in metas)
    return (f"runs of {dates[0]} .. {dates[-1]} on host {metas[0].get('hostname', '?')} "
            f"(no provenance.json: machine and commit as docs/benchmarks.md records them)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/bench", help="folder for the runs' JSON")
    ap.add_argument("--plot", default="docs/bench.png")
    ap.add_argument("--prefix", default="", help="command put before every bench run")
    ap.add_argument("--from", dest="source", metavar="DIR",
                    help="render the tables and plot from the runs recorded in DIR; no benchmark")
    a = ap.parse_args(argv)
    if a.source:
        rows, mem = load_runs(a.source), None
        prov = os.path.join(a.source, "provenance.json")
        if os.path.exists(prov):
            with open(prov) as f:
                mem = json.load(f).get("peak_memory_per_rank")
        print(f"recorded: {recorded_provenance(a.source)}")
    else:
        record = stamp()                  # the commit and machine the runs are made with
        rows = run_all(a.out, a.prefix)
    from minicomm.tools.bench import plot
    plot(rows["allreduce-shm-n2"] + rows["allreduce-shm-n4"] + rows["all-shm-n2"], a.plot,
         title="minicomm bench over shm: busbw vs size (out-of-place)")
    if not a.source:
        mem = peak_memory()
        record.update(load_average=list(os.getloadavg()), peak_memory_per_rank=mem,
                      runs=sorted(RUNS))
        with open(os.path.join(a.out, "provenance.json"), "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"measured: {describe(record)}")
        print(f"load average after the runs: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(table(rows, mem))
    print()
    print(bandwidth_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
