"""The host model's fitted constants live in a data file (minicomm/sim/host_model.json) with their
provenance; the cost model loads them at import and every HostModel it builds uses them."""
import json
import os

import pytest

from minicomm import cost
from minicomm.sim import host

PROVENANCE = ("machine", "date", "commit", "calibration_error")


def test_the_file_loads_with_its_provenance():
    data = host.fitted_constants()
    prov = data["provenance"]
    for key in PROVENANCE:
        assert prov.get(key), f"host_model.json has no provenance field {key!r}"
    for coll in ("allreduce", "allgather", "broadcast", "reduce_scatter"):
        err = prov["calibration_error"][coll]
        assert 0 < err < 1, (coll, err)
    assert os.path.exists(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs",
                                       "decisions", "host-model-constants.md"))
    assert set(data["constants"]) == {"SHARING_LOSS", "SHARING_LOSS_DRAM", "BALANCE_S",
                                      "LATENCY_CPU_SHARED", "YIELD_SHARE"}


def test_the_cost_model_uses_the_loaded_values():
    consts = host.fitted_constants()["constants"]
    for name, entry in consts.items():
        assert getattr(cost, name) == entry["value"], name
    hm = cost.host_model(cost.LinkModel.for_transports("shm", "tcp"))
    assert hm.sharing_loss == consts["SHARING_LOSS"]["value"]      # no memory table
    assert hm.balance == consts["BALANCE_S"]["value"]
    assert hm.latency_cpu == consts["LATENCY_CPU_SHARED"]["value"]
    assert hm.yield_share == consts["YIELD_SHARE"]["value"]
    # with a memory table, the loss at the largest (DRAM-speed) working set is SHARING_LOSS x
    # SHARING_LOSS_DRAM
    memory = ((64 << 10, 3e-11, 3e-11, 0.1), (64 << 20, 1e-10, 8e-11, 0.2))
    m = cost.LinkModel.for_transports("shm", "tcp", memory=memory)
    assert cost.host_model(m, 64 << 20).sharing_loss == pytest.approx(
        consts["SHARING_LOSS"]["value"] * consts["SHARING_LOSS_DRAM"]["value"])


@pytest.mark.parametrize("broken", [
    lambda d: d.update(format="minicomm-host-model/0"),
    lambda d: d.pop("provenance"),
    lambda d: d["constants"]["BALANCE_S"].pop("value"),
    lambda d: d["constants"]["YIELD_SHARE"].update(value="0.05"),
])
def test_a_broken_file_is_an_error_naming_it(tmp_path, broken):
    data = host.fitted_constants()
    broken(data)
    path = tmp_path / "host_model.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="host_model.json"):
        host.fitted_constants(str(path))
