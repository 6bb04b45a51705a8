"""Regenerate the documentation's demo and simulator figures, and print its recorded tables.

    python examples/docs_figures.py                  # demo + sim figures into docs/ (about 1-2 min)
    python examples/docs_figures.py demo             # docs/demo-loss.png, docs/demo-throughput.png
    python examples/docs_figures.py sim              # docs/sim-dgx-h100-16.png
    python examples/docs_figures.py tables           # Markdown of the one-sided and DDP tables

``demo`` runs ``minicomm demo --out DIR`` with its defaults (2 workers, 2 servers, 400 steps)
and copies its loss-vs-step and throughput plots to ``docs/demo-loss.png`` and
``docs/demo-throughput.png``; the table it printed goes to ``docs/demo-output.txt``. ``sim`` runs
``minicomm sim --topology dgx-h100 --nodes 16 --sizes 1K:1G --algorithms all --json --plot``
(deterministic: the simulator needs no measurement) into ``docs/sim-dgx-h100-16.png`` and
``docs/sim-dgx-h100-16.json``. Each figure's record (the command, the machine, the date and the
commit: ``provenance.stamp``) is merged into ``docs/figures.json``, which docs/benchmarks.md
cites. Needs matplotlib (``pip install -e '.[plot,demo]'``).

``tables`` measures nothing: it renders, from their recorded JSON, the tables that
docs/benchmarks.md shows for one-sided operations (``docs/rma-bench.json``), collectives over
each transport (``docs/transports-64M.json``) and DDP step times (``docs/bench/ddp.json``). To
re-measure those, run the commands that docs/benchmarks.md gives next to each table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import REPO, describe, stamp  # noqa: E402

DOCS = os.path.join(REPO, "docs")
SIM_ARGS = ["sim", "--topology", "dgx-h100", "--nodes", "16", "--sizes", "1K:1G",
            "--algorithms", "all"]


def _minicomm(args, **kw):
    cmd = [sys.executable, "-m", "minicomm.cli", *args]
    print("$ minicomm", " ".join(args), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, cwd=REPO, **kw)


def _record(figures: dict, docs: str) -> None:
    path = os.path.join(docs, "figures.json")
    try:
        with open(path) as f:
            known = json.load(f)
    except FileNotFoundError:
        known = {}
    known.update(figures)
    with open(path, "w") as f:
        json.dump(known, f, indent=1, sort_keys=True)
        f.write("\n")
    for name, rec in figures.items():
        print(f"{name}: {describe(rec)}\n  regenerate: {rec['regenerate']}")


def demo(docs: str, made: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        done = _minicomm(["demo", "--out", tmp], stdout=subprocess.PIPE, text=True)
        for src, dst in (("loss_vs_step.png", "demo-loss.png"),
                         ("throughput.png", "demo-throughput.png")):
            shutil.copyfile(os.path.join(tmp, src), os.path.join(docs, dst))
    with open(os.path.join(docs, "demo-output.txt"), "w") as f:   # the table the plots go with
        f.write(done.stdout.replace(tmp, "DIR"))
    rec = dict(made, regenerate="python examples/docs_figures.py demo",
               made_by="minicomm demo --out DIR (its defaults)")
    return {"demo-loss.png": rec, "demo-throughput.png": rec}


def sim(docs: str, made: dict) -> dict:
    png = os.path.join(docs, "sim-dgx-h100-16.png")
    done = _minicomm(SIM_ARGS + ["--json", "--plot", png], stdout=subprocess.PIPE, text=True)
    with open(os.path.join(docs, "sim-dgx-h100-16.json"), "w") as f:
        f.write(done.stdout)
    rec = dict(made, regenerate="python examples/docs_figures.py sim",
               made_by="minicomm " + " ".join(SIM_ARGS) + " --json --plot FILE")
    return {"sim-dgx-h100-16.png": rec}


# --------------------------------------------------------------------------- recorded tables
MiB = 1 << 20


def _size(n: int) -> str:
    for unit, k in (("MiB", MiB), ("KiB", 1024)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def rma_table(path: str) -> str:
    """One row per (op, size, latency or bandwidth): each library's figure, and minicomm shm's
    against MPICH's Win.Allocate (time ratio for latency rows, bandwidth ratio for bw rows)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    libs = list(dict.fromkeys(r["library"] for r in rows))
    names = {"mc shm": "minicomm shm", "mc rdma": "minicomm rdma", "mc ub": "minicomm ub",
             "mpi Win.Allocate": "MPICH Win.Allocate", "mpi Win.Create": "MPICH Win.Create"}
    out = ["| op | size | | " + " | ".join(names.get(lib, lib) for lib in libs)
           + " | minicomm shm ÷ MPICH Allocate |",
           "|---|---|---|" + "---:|" * (len(libs) + 1)]
    # bandwidth rows below 64 KiB measure latency, not bandwidth: left out
    keys = [k for k in dict.fromkeys((r["op"], r["size"], r["mode"]) for r in rows)
            if k[2] != "bw" or k[1] >= 64 * 1024]
    for op, size, mode in keys:
        got = {r["library"]: r for r in rows if (r["op"], r["size"], r["mode"]) == (op, size, mode)}
        bw = mode == "bw"
        cells = [(f"{got[lib]['bw_GBs']:.1f}" if bw else f"{got[lib]['time_us']:.1f}")
                 if lib in got else "—" for lib in libs]
        mc, mpi = got.get("mc shm"), got.get("mpi Win.Allocate")
        if mc and mpi:
            ratio = (f"{mc['bw_GBs'] / mpi['bw_GBs']:.2f}× bandwidth" if bw
                     else f"{mc['time_us'] / mpi['time_us']:.2f}× time")
        else:
            ratio = "—"
        out.append(f"| {op} | {_size(size)} | {'GB/s' if bw else 'µs'} | " + " | ".join(cells)
                   + f" | {ratio} |")
    return "\n".join(out)


def transports_table(path: str) -> str:
    """Collectives over each transport: ms per call, and each against the first transport."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    ts = list(dict.fromkeys(r["transport"] for r in rows))
    size = _size(rows[0]["size"])
    out = [f"| {size} | " + " | ".join(f"{t} (ms)" for t in ts) + " | "
           + " | ".join(f"{t} ÷ {ts[0]}" for t in ts[1:]) + " |",
           "|---|" + "---:|" * (2 * len(ts) - 1)]
    for op in dict.fromkeys(r["op"] for r in rows):
        got = {r["transport"]: r["time_us"] for r in rows if r["op"] == op}
        out.append(f"| {op} | " + " | ".join(f"{got[t] / 1000:.1f}" for t in ts) + " | "
                   + " | ".join(f"{got[t] / got[ts[0]]:.2f}" for t in ts[1:]) + " |")
    return "\n".join(out)


def ddp_table(path: str) -> str:
    with open(path) as f:
        rows = json.load(f)["rows"]
    out = ["| ranks | minicomm ms/step | gloo ms/step | gloo ÷ minicomm | no-communication ms/step |",
           "|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['ranks']} | {r['minicomm_ms']:.1f} | {r['gloo_ms']:.1f} | "
                   f"{r['ratio']:.2f} | {r['local_ms']:.1f} |")
    return "\n".join(out)


def tables(docs: str) -> None:
    for title, fn, name in (("One-sided operations", rma_table, "rma-bench.json"),
                            ("Collectives over each transport", transports_table,
                             "transports-64M.json"),
                            ("DDP step time", ddp_table, os.path.join("bench", "ddp.json"))):
        print(f"{title} (from docs/{name}):\n")
        print(fn(os.path.join(docs, name)))
        print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="figures", choices=("figures", "demo", "sim", "tables"),
                    help="figures (demo and sim, the default), demo, sim, or tables")
    ap.add_argument("--docs", default=DOCS, help="the docs folder to write into (docs/)")
    a = ap.parse_args(argv)
    if a.what == "tables":
        tables(a.docs)
        return 0
    figures, made = {}, stamp()      # the tree as it was before this run wrote into it
    if a.what in ("figures", "sim"):
        figures.update(sim(a.docs, made))
    if a.what in ("figures", "demo"):
        figures.update(demo(a.docs, made))
    _record(figures, a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
