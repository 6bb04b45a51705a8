"""The flight recorder: what each communicator keeps of its calls, its bound, its
dumps (on demand, on SIGUSR1, on a failure), ``stats()`` and ``monitored_barrier``."""
import json
import os
import signal
import time

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401  (autouse fixture)
from minicomm import flightrecord


def _calls(path):
    with open(path) as f:
        doc = json.load(f)
    assert doc["format"] == flightrecord.FORMAT
    return doc, {c["comm_id"]: c["calls"] for c in doc["communicators"]}


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_records_name_each_call_the_same_way_on_every_rank(transport, tmp_path):
    def prog(comm):
        comm.allreduce(np.ones(5, dtype=np.float32), algorithm="ring")
        comm.broadcast(np.arange(3), root=1)
        if comm.rank == 0:
            comm.send(np.ones(2), 1, tag=4)
        else:
            comm.recv(0, tag=4)
        return comm.dump_flight_record(str(tmp_path / f"r{comm.rank}"))

    paths = mc.spawn(prog, 2, transport=transport, timeout=20)
    user = []
    for r, [path] in enumerate(paths):
        doc, comms = _calls(path)
        assert doc["rank"] == r and doc["reason"] == "dump_flight_record()"
        calls = comms[1]
        assert all(c["state"] == "done" and c["ended"] >= c["entered"] for c in calls)
        user.append(calls[-3:])
    for r, (ar, bc, p2p) in enumerate(user):
        assert (ar["kind"], ar["op"], ar["algorithm"], ar["count"], ar["dtype"], ar["root"]) == \
            ("collective", "allreduce", "ring", 5, "float32", None)
        assert (bc["op"], bc["count"], bc["root"]) == ("broadcast", 3, 1)
        assert bc["number"] > ar["number"]
        assert (p2p["kind"], p2p["op"], p2p["peer"], p2p["tag"], p2p["number"]) == \
            ("p2p", "send" if r == 0 else "recv", 1 - r, 4, 1)
        assert p2p["count"] == 2
    # a collective's number is the same on both ranks
    assert [c["number"] for c in user[0][:2]] == [c["number"] for c in user[1][:2]]


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_the_ring_is_bounded_and_stats_count_the_calls_it_holds(monkeypatch, transport):
    monkeypatch.setenv("MINICOMM_FLIGHT_RECORDS", "8")

    def prog(comm):
        for _ in range(30):                      # alternating: no two records merge
            comm.allreduce(np.ones(4), algorithm="tree")
            comm.allgather(np.ones(2), algorithm="ring")
        rows = {(r["op"], r["algorithm"]): r for r in comm.stats()}
        return len(comm._flight.calls), rows[("allreduce", "tree")]

    for held, row in mc.spawn(prog, 2, transport=transport, timeout=20):
        assert held == 8
        assert row["calls"] == 4 and row["bytes"] == 4 * 4 * 8
        assert row["mean_us"] > 0 and row["predicted_us"] > 0


def test_repeats_of_one_call_share_a_record_and_are_all_counted():
    def prog(comm):
        x = np.ones(4)
        for _ in range(30):
            comm.allreduce(x, algorithm="ring")
        [rec] = [c for c in comm._flight.snapshot()["calls"] if c["op"] == "allreduce"]
        row = next(r for r in comm.stats() if r["op"] == "allreduce")
        return rec["repeats"], rec["number"], row["calls"], row["bytes"], row["mean_us"] > 0

    for repeats, number, calls, nbytes, timed in mc.spawn(prog, 2, transport="inproc"):
        assert (repeats, calls, nbytes, timed) == (30, 30, 30 * 32, True)
        assert number >= 30                   # the latest call's (inproc checks: 2 each)


def test_off_records_nothing_and_dumps_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("MINICOMM_FLIGHT_RECORDS", "0")

    def prog(comm):
        comm.allreduce(np.ones(2))
        return comm._flight, comm.dump_flight_record(str(tmp_path)), comm.stats()

    assert mc.spawn(prog, 2, transport="inproc") == [(None, [], [])] * 2
    assert list(tmp_path.iterdir()) == []


def test_a_bad_record_count_is_a_named_error(monkeypatch):
    monkeypatch.setenv("MINICOMM_FLIGHT_RECORDS", "-3")
    with pytest.raises(ValueError, match="MINICOMM_FLIGHT_RECORDS"):
        mc.spawn(lambda comm: None, 2, transport="inproc")


def test_sigusr1_dumps_a_running_rank(monkeypatch, tmp_path):
    monkeypatch.setenv("MINICOMM_FLIGHT_DIR", str(tmp_path))

    def prog(comm):
        comm.allreduce(np.ones(3))
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        path = os.path.join(os.environ["MINICOMM_FLIGHT_DIR"], f"rank-{comm.rank}.json")
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)          # the handler runs between bytecodes of this thread
        return path

    for r, path in enumerate(mc.spawn(prog, 2, transport="shm", timeout=20)):
        doc, comms = _calls(path)
        assert doc["reason"] == "SIGUSR1" and doc["rank"] == r
        assert comms[1][-1]["op"] == "allreduce" and comms[1][-1]["state"] == "done"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_timeout_dumps_the_record_of_the_failed_call(transport, monkeypatch, tmp_path):
    monkeypatch.setenv("MINICOMM_FLIGHT_DIR", str(tmp_path))

    def prog(comm):
        if comm.rank == 1:
            time.sleep(4)
        comm.allreduce(np.ones(3), algorithm="ring")

    with pytest.raises(mc.SpawnError):
        mc.spawn(prog, 2, transport=transport, timeout=1.5)
    doc, comms = _calls(tmp_path / "rank-0.json")
    assert doc["reason"].startswith("CommTimeout")
    last = comms[1][-1]
    assert (last["op"], last["algorithm"], last["state"]) == ("allreduce", "ring", "failed")
    assert last["error"].startswith("CommTimeout") and last["peer"] == 1


def test_async_calls_are_recorded_queued_then_started():
    def prog(comm):
        works = [comm.allreduce(np.ones(2), async_op=True) for _ in range(3)]
        for w in works:
            w.wait()
        return [(c["op"], c["state"], c["repeats"]) for c in comm._flight.snapshot()["calls"]]

    for calls in mc.spawn(prog, 2, transport="inproc"):
        queued = [c for c in calls if c[1] == "started"]
        assert len(queued) == 3 and all(op.startswith("allreduce") for op, _, _ in queued)
        assert [c for c in calls if c[0] == "allreduce" and c[1] != "started"] == \
            [("allreduce", "done", 3)]           # the three ran back to back: one record


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_monitored_barrier_passes_and_names_who_did_not_arrive(transport):
    def prog(comm):
        comm.monitored_barrier(timeout=5)          # everyone arrives
        if comm.rank in (2, 3):
            time.sleep(3)
        try:
            comm.monitored_barrier(timeout=1)
            return "passed"
        except mc.CommTimeout as e:
            return str(e)

    with pytest.raises(mc.SpawnError) as info:   # the late ranks find the world broken
        mc.spawn(prog, 4, transport=transport, timeout=20, on_failure="continue")
    for text in info.value.results[:2]:
        assert "ranks 2, 3 did not arrive within 1s" in text


def test_a_rank_whose_communicator_cannot_be_built_fails_instead_of_hanging(monkeypatch):
    """Found with the record-count check: an error in an inproc rank's Communicator() left
    spawn waiting for a thread that had died."""
    from minicomm.communicator import core

    def broken(self, *args, **kwargs):
        raise RuntimeError("the communicator could not be built")

    monkeypatch.setattr(core.Communicator, "__init__", broken)
    with pytest.raises(mc.SpawnError, match="root cause: rank 0: RuntimeError: the communicator"):
        mc.spawn(lambda comm: None, 2, transport="inproc", timeout=5)
