"""examples/moe.py: a mixture-of-experts layer whose dispatch and combine are alltoallv, checked
against the same layer computed in one process."""
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
import moe  # noqa: E402


@pytest.mark.parametrize("transport,ranks,k", [("inproc", 4, 2), ("shm", 3, 1), ("tcp", 2, 3)])
def test_the_layer_matches_one_process(transport, ranks, k):
    import minicomm as mc
    res = mc.spawn(moe.run, ranks, args=(7, 40, 8, 16, 2, k), transport=transport, timeout=60)
    for err, sent in res:
        assert err < 1e-12
        assert sum(sent) == 40 * k                 # every (token, expert) pair went somewhere
    assert len({tuple(s) for _, s in res}) > 1 or ranks == 1   # the routing is uneven


def test_the_reference_is_not_the_layer_itself():
    """The reference computes each expert on its tokens directly: a routing mistake (experts
    shifted by one) is caught."""
    params = moe.parameters(1, 8, 16, 4)
    x = moe.tokens_of(0, 1, 20, 8)
    gate, w1, w2 = params
    good = moe.reference([x], params, 2)[0]
    shifted = moe.reference([x], (gate, np.roll(w1, 1, axis=0), np.roll(w2, 1, axis=0)), 2)[0]
    assert np.max(np.abs(good - shifted)) > 1e-3


def test_the_command_prints_the_check():
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "moe.py"), "--ranks",
                          "2", "--tokens", "16", "--transport", "shm"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MoE layer matches the single-process reference" in out.stdout
