"""Where a published figure came from: the machine, the date and the commit, as one record.

    from provenance import stamp, describe
    record = stamp()            # {"machine": {...}, "date": ..., "commit": ..., "dirty": ...}
    print(describe(record))     # one line for the Markdown a script prints

The scripts that regenerate the documentation's tables and figures (examples/bench_readme.py,
examples/docs_figures.py) write this record next to their output, so docs/benchmarks.md can say
for every table and plot which machine, date and commit it belongs to.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_model() -> str:
    """The model name, with family and model numbers (a VM's model name can be as vague as
    "Intel(R) Xeon(R) Processor")."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break                        # the first processor is enough
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def stamp() -> dict:
    """The machine (CPU model, cores this process may use, kernel, libc, Python, numpy), the
    UTC date and time, and the git commit, with ``dirty`` when the work tree has changes
    (figures made from uncommitted code say so)."""
    import numpy
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    libc = " ".join(platform.libc_ver()).strip()
    return {
        "machine": {"cpu": _cpu_model(), "cores": cores, "hostname": platform.node(),
                    "kernel": f"{platform.system()} {platform.release()}", "libc": libc,
                    "python": platform.python_version(), "numpy": numpy.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
        if sys.argv and sys.argv[0] else "",
    }


def describe(record: dict) -> str:
    """One line: machine, date, commit (``+ local changes`` when the tree was dirty)."""
    m = record["machine"]
    commit = record["commit"] + (" + local changes" if record.get("dirty") else "")
    return (f"{m['cpu']}, {m['cores']} cores, {m['kernel']}, {m['libc']}, Python {m['python']}, "
            f"numpy {m['numpy']}; {record['date']}; commit {commit}")


if __name__ == "__main__":
    import json
    print(json.dumps(stamp(), indent=1))
