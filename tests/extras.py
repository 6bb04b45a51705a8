"""Tests of an optional extra (plot: matplotlib; peers: mpi4py + MPICH; torch, CPU build) skip,
naming what is missing, where it is not installed — except in CI (``MINICOMM_REQUIRE_EXTRAS=1``,
set by .ci/run, which installs every extra), where a missing extra fails the test instead."""
import importlib.util
import os
from typing import Optional

import pytest


def require(missing: Optional[str]) -> None:
    """``missing``: None when the extra is usable, else why not (shown as the skip reason)."""
    if missing is None:
        return
    if os.environ.get("MINICOMM_REQUIRE_EXTRAS") == "1":
        pytest.fail(f"an extra CI installs is missing: {missing}")
    pytest.skip(missing)


def module_missing(module: str, extra: str) -> Optional[str]:
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install -e '.[{extra}]')"
    return None
