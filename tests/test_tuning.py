"""The auto-tuner: link measurement and agreement, the tuned table, and what auto follows.

Every test points the cache at its own directory (MINICOMM_CACHE_DIR, inherited by spawned ranks),
so nothing here reads or writes the user's ~/.cache/minicomm.
"""
import json
import os
import re
import socket

import numpy as np
import pytest

import minicomm as mc
from minicomm import cost, tuning
from minicomm.schedule import Recv, Send


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINICOMM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINICOMM_ALGO", raising=False)
    monkeypatch.delenv("MINICOMM_TUNE", raising=False)
    return tmp_path


def entry(coll, world, nbytes, best, topology=None, intra="shm", inter="tcp"):
    return {"collective": coll, "world": world, "topology": topology or [0] * world,
            "intra": intra, "inter": inter, "bytes": nbytes, "best": best,
            "seconds": {best: 1e-5}}


def test_table_round_trip_and_merge(cache):
    first = [entry("allreduce", 2, 8, "rhd"), entry("allreduce", 2, 1 << 20, "ring"),
             entry("broadcast", 4, 64, "tree", topology=[0, 0, 1, 1])]
    path = tuning.write_table(first)
    assert path == str(cache / f"tune-{socket.gethostname()}.json")
    assert json.load(open(path))["format"] == tuning.TABLE_FORMAT
    assert sorted(map(tuning.cache._entry_key, tuning.load_table())) == \
        sorted(map(tuning.cache._entry_key, first))
    # a second measurement of one key replaces it; the others stay
    tuning.write_table([entry("allreduce", 2, 8, "tree")])
    got = {tuning.cache._entry_key(e): e["best"] for e in tuning.load_table()}
    assert len(got) == 3 and got[("allreduce", 2, (0, 0), "shm", "tcp", 8)] == "tree"
    with pytest.raises(ValueError, match="not a tuned-table entry"):
        tuning.write_table([{"collective": "allreduce", "world": 2, "nbytes": 8}])
    assert len(tuning.load_table()) == 3                   # nothing written


def test_table_lookup_is_nearest_within_factor_two():
    m = cost.LinkModel.for_transports("shm", "tcp", table=cost.table_index(
        [entry("allreduce", 2, 1024, "rhd"), entry("allreduce", 2, 4096, "ring")]))
    look = lambda n: cost.table_choice(m, "allreduce", 2, n, (0, 0))   # noqa: E731
    assert [look(n) for n in (512, 1024, 1500, 2048, 3000, 8192)] == \
        ["rhd", "rhd", "rhd", "rhd", "ring", "ring"]       # 2048: as near to both, the smaller
    assert look(256) is None and look(16384) is None       # beyond a factor of 2: the model
    assert cost.table_choice(m, "allreduce", 4, 1024, (0,) * 4) is None
    other = cost.LinkModel.for_transports("tcp", "tcp", table=m.table)
    assert cost.table_choice(other, "allreduce", 2, 1024, (0, 0)) is None   # other transports


def test_corrupt_files_are_ignored_with_a_warning(cache):
    links, table = tuning.links_path(), tuning.table_path()
    for path, text in ((links, "{not json"), (table, '{"format": "minicomm-tune/1", '
                                                       '"entries": [{"collective": "nope"}]}')):
        with open(path, "w") as f:
            f.write(text)
    with pytest.warns(UserWarning, match="corrupt link cache"):
        assert tuning.load_links() == {"links": {}}
    with pytest.warns(UserWarning, match="corrupt tuned table"):
        assert tuning.load_table() == []
    with open(links, "w") as f:
        json.dump({"format": tuning.LINKS_FORMAT, "links": {"shm": {"alpha": -1}}}, f)
    with pytest.warns(UserWarning, match="corrupt link cache"):
        assert tuning.load_links() == {"links": {}}


def _auto_choices(comm, sizes):
    return [cost.choose("allreduce", comm.size, n, comm.topology, comm.link_model)
            for n in sizes]


def test_processes_measure_once_then_use_the_cache(cache, monkeypatch):
    with open(tuning.links_path(), "w") as f:
        f.write("garbage")                                   # corrupt: measured anew
    sizes = [8 << k for k in range(0, 24, 3)]
    first = mc.spawn(lambda c: (c.link_model, _auto_choices(c, sizes)), world_size=4,
                     transport="shm")
    saved = tuning.load_links()
    assert set(saved["links"]) == {"shm"} and set(tuning.cache._MACHINE_FIELDS) <= set(saved)
    model = first[0][0]
    assert model.alpha_intra == saved["links"]["shm"]["alpha"] and model.cores >= 1
    # the memory by working set is measured too, its contention left out (as calibrated)
    assert [list(r) for r in model.memory] == [r[:3] + [0.0] for r in saved["memory"]]
    assert all(r == first[0] for r in first)                  # every rank: rank 0's model
    # a second job reads the cache instead of measuring (the file is not rewritten)
    stamp = os.stat(tuning.links_path()).st_mtime_ns
    second = mc.spawn(lambda c: c.link_model, world_size=2, transport="shm")
    assert second[0] == model and os.stat(tuning.links_path()).st_mtime_ns == stamp
    # MINICOMM_TUNE=0: the constants, and nothing is measured or written (whether shm reads
    # single-copy is the transport's fact, not a measurement)
    os.unlink(tuning.links_path())
    monkeypatch.setenv("MINICOMM_TUNE", "0")
    off = mc.spawn(lambda c: c.link_model, world_size=2, transport="shm")[0]
    assert off == cost.LinkModel.for_transports("shm", "tcp", cores=off.cores,
                                                single_copy=off.single_copy)
    assert not os.path.exists(tuning.links_path())


def test_every_rank_takes_rank_zero_s_links_and_table(cache, monkeypatch):
    """Ranks whose own measurements (and files) would differ still agree, so they pick alike."""
    def measured(comm, near, far, intra, inter):      # a different link on every rank
        return {"alpha_intra": 1e-6 * 10 ** comm.rank, "beta_intra": 1e-10 * (comm.rank + 1)}
    monkeypatch.setattr(tuning.links, "_measure_links", measured)
    tuning.write_table([entry("allreduce", 4, 8, "ring")])
    sizes = [8 << k for k in range(0, 24, 3)]

    def body(comm):
        m = tuning.agree_link_model(comm, "shm", "tcp")
        return m.alpha_intra, m.beta_intra, [cost.choose("allreduce", 4, n, comm.topology, m)
                                             for n in sizes]
    got = mc.spawn(body, world_size=4, transport="inproc")
    assert all(g == got[0] for g in got)
    assert got[0][:2] == (1e-6, 1e-10) and got[0][2][0] == "ring"     # rank 0's values, table


def _logged_algorithms(err: str, coll: str):
    # ranks' lines may interleave on the shared stderr: match records, not lines
    return re.findall(rf"\] {coll} #\d+ count=\d+ dtype=\w+ -> (\w+)", err)


def test_auto_follows_the_table_and_minicomm_algo_overrides_it(cache, monkeypatch, capfd):
    # 8 bytes: the model picks recursive doubling; the table says ring, so auto must take ring
    assert cost.choose("allreduce", 2, 8, (0, 0),
                         cost.LinkModel.for_transports("shm", "tcp")) != "ring"
    tuning.write_table([entry("allreduce", 2, 8, "ring"), entry("allgather", 2, 8, "tree")])
    monkeypatch.setenv("MINICOMM_TUNE", "0")
    monkeypatch.setenv("MINICOMM_DEBUG", "info")
    x = np.arange(2, dtype=np.float32)

    def body(comm):
        return comm.allreduce(x).tolist(), comm.allgather(x).tolist()
    assert mc.spawn(body, world_size=2, transport="shm")[0][0] == [0.0, 2.0]
    err = capfd.readouterr().err
    assert set(_logged_algorithms(err, "allreduce")) == {"ring"}
    assert set(_logged_algorithms(err, "allgather")) == {"tree"}
    monkeypatch.setenv("MINICOMM_ALGO", "allreduce:hier")
    mc.spawn(body, world_size=2, transport="shm")
    err = capfd.readouterr().err
    assert set(_logged_algorithms(err, "allreduce")) == {"hier"}       # the env var wins
    assert set(_logged_algorithms(err, "allgather")) == {"tree"}       # the table still counts


def test_measure_table_writes_what_auto_then_follows(cache, monkeypatch):
    monkeypatch.setenv("MINICOMM_TUNE", "0")
    entries = tuning.measure_table({"world_size": 2, "transport": "shm"},
                                   ["allreduce", "barrier"], [8, 4096], batch_seconds=0.001,
                                   batches=1)
    assert [(e["collective"], e["bytes"]) for e in entries] == \
        [("allreduce", 8), ("allreduce", 4096), ("barrier", 0)]
    for e in entries:
        assert set(e["seconds"]) == set(cost.FAMILIES)
        assert e["best"] == min(e["seconds"], key=e["seconds"].get)
    tuning.write_table(entries)
    got = mc.spawn(lambda c: [cost.choose(e["collective"], 2, e["bytes"], c.topology,
                                            c.link_model) for e in entries],
                   world_size=2, transport="shm")
    assert got[0] == got[1] == [e["best"] for e in entries]


def test_simulator_follows_the_schedule():
    """Two ranks, o per message op and latency L (α = 3o + L): an exchange step costs 3o + L;
    tree allreduce is two one-way hops, 4o + 2L; ring allreduce two exchanges, 6o + 2L."""
    o, lat = 1e-6, 5e-6
    m = cost.LinkModel(3 * o + lat, 0.0, 3 * o + lat, 0.0, 0.0, 0.0, o, o, 0.0, 0)
    t = {f: cost.schedule_time(c, f, 2, 2, (0, 0), m)
         for c, f in (("allgather", "rhd"), ("allreduce", "tree"), ("allreduce", "ring"))}
    assert t == pytest.approx({"rhd": 3 * o + lat, "tree": 4 * o + 2 * lat,
                               "ring": 6 * o + 2 * lat})
    # a message is copied in by its sender and out by its receiver, β/2 per byte each side
    beta = 1e-9
    mb = cost.LinkModel(0.0, beta, 0.0, beta, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    sends = [[(Send(1, "in", 0, 1000),)], [(Recv(0, "out", 0, 1000),)]]
    assert cost.simulate(sends, (0, 0), mb) == pytest.approx(1000 * 4 * beta)
