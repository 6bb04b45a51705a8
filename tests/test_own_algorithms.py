"""The shipped example algorithms (examples/algorithms/), written only through the public
registry: each is proved for p <= 64 by `minicomm verify --load` and passes the collective
matrix over shm and tcp."""
import glob
import os
import runpy
import subprocess
import sys

import pytest

import minicomm as mc
from collective_check import matrix
from leaks import nothing_left_behind  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(p for p in glob.glob(os.path.join(REPO, "examples", "algorithms", "*.py"))
               if os.path.basename(p) != "compare.py")


def _registered(path):
    """(name, collectives) of what ``path`` registers, in a scratch registry."""
    before = set(mc.algorithms.names())
    runpy.run_path(path, run_name="__minicomm_load__")
    new = [a for a in mc.algorithms.registered() if a.name not in before]
    for a in new:
        mc.algorithms.unregister(a.name)
    return [(a.name, a.collectives) for a in new]


CASES = [(os.path.basename(p), p, name, colls) for p in FILES for name, colls in _registered(p)]


@pytest.mark.parametrize("file,path,name,colls", CASES, ids=[c[0] for c in CASES])
def test_proved_for_every_world_size_up_to_64(file, path, name, colls):
    args = [sys.executable, "-m", "minicomm.cli", "verify", "--load", path, "--algorithms", name,
            "--max-world", "64"]
    for c in colls:
        args += ["--collective", c]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(colls)}/{len(colls)} cells pass" in out.stdout, out.stdout


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("file,path,name,colls", CASES, ids=[c[0] for c in CASES])
def test_the_collective_matrix(file, path, name, colls, transport):
    runpy.run_path(path, run_name="__minicomm_load__")
    try:
        n = mc.spawn(lambda comm: matrix(comm, name, colls=colls, all_roots=False,
                                         barrier="barrier" in colls), 3,
                     transport=transport, timeout=60)
        assert n[0] == n[1] == n[2] > 10
    finally:
        mc.algorithms.unregister(name)
