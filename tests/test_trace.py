"""Timelines: MINICOMM_TRACE writes one Chrome trace per rank with every call and
every schedule step; minicomm sim --trace writes the same events for the modelled cluster;
minicomm trace merge joins them. The reference both are checked against is the schedule the
algorithm builder makes for each rank."""
import json
import os

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401
from minicomm import cli, trace
from minicomm.algorithms import build_schedule
from minicomm.schedule import Copy, Recv, Reduce, Send

P = 4
COUNT = 1001                  # ring blocks of unequal size: bytes differ from step to step
ITEMSIZE = 4                  # float32
TOPOLOGY = {"base": "pcie-8gpu", "name": "pcie-4gpu", "servers": 1, "gpus_per_server": P}


def _traced_ring_allreduce(comm):
    y = comm.allreduce(np.arange(COUNT, dtype=np.float32), algorithm="ring")
    return comm.rank, comm.small_path, float(y[1])


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The trace directory of one 4-rank ring allreduce over shm, traced."""
    out = tmp_path_factory.mktemp("traces")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINICOMM_TRACE", str(out))
        res = mc.spawn(_traced_ring_allreduce, world_size=P, transport="shm", timeout=120)
    assert [r[0] for r in res] == list(range(P))
    assert all(small is False for _, small, _ in res)     # traced calls run the executor
    assert all(y == P for _, _, y in res)
    return out


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """``minicomm sim --trace`` of the same call on a modelled 4-accelerator server."""
    d = tmp_path_factory.mktemp("sim")
    topo = d / "pcie-4gpu.json"
    topo.write_text(json.dumps(TOPOLOGY))
    path = d / "sim.json"
    rc = cli.main(["sim", "--topology", str(topo), "--collective", "allreduce",
                   "--algorithms", "ring", "--sizes", str(COUNT * ITEMSIZE),
                   "--trace", str(path)])
    assert rc == 0
    return path


def _load(path):
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _expected_steps(rank):
    """Per step of the builder's schedule: (sorted sends, sorted receives, copy and reduce
    bytes), peers as ranks (the world's: group == ranks)."""
    sched = build_schedule("allreduce", "ring", rank, P, COUNT, 0)
    out = []
    for st in sched.steps:
        out.append((sorted((o.peer, o.count * ITEMSIZE) for o in st if isinstance(o, Send)),
                    sorted((o.peer, o.count * ITEMSIZE, o.reduce) for o in st
                           if isinstance(o, Recv)),
                    sum(o.count for o in st if isinstance(o, Copy)) * ITEMSIZE,
                    sum(o.count for o in st if isinstance(o, Reduce)) * ITEMSIZE))
    return out


def _call_steps(events, rank, name="allreduce (ring)"):
    """The one call named ``name`` of ``rank`` and its step events, in step order, as the
    builder's form (``_expected_steps``)."""
    calls = [e for e in events if e.get("cat") == "call" and e["pid"] == rank
             and e["name"] == name]
    assert len(calls) == 1, calls
    call = calls[0]
    seq = call["args"]["seq"]
    steps = sorted((e for e in events if e.get("cat") == "step" and e["pid"] == rank
                    and e["tid"] == call["tid"] and e["args"]["seq"] == seq),
                   key=lambda e: e["args"]["step"])
    assert [e["args"]["step"] for e in steps] == list(range(len(steps)))
    for e in steps:             # inside their call (to the rounding of the microseconds)
        assert call["ts"] - 1e-3 <= e["ts"] and \
            e["ts"] + e["dur"] <= call["ts"] + call["dur"] + 2e-3
        assert 0 <= e["args"]["wait_us"] <= e["dur"] + 1e-3
    got = [(sorted((s["peer"], s["bytes"]) for s in e["args"]["sends"]),
            sorted((r["peer"], r["bytes"], r["reduce"]) for r in e["args"]["recvs"]),
            e["args"]["copy_bytes"], e["args"]["reduce_bytes"]) for e in steps]
    return call, got


def test_measured_and_simulated_ring_allreduce_have_the_schedules_steps(measured, simulated):
    sim_events = _load(simulated)
    for rank in range(P):
        want = _expected_steps(rank)
        call, got = _call_steps(_load(measured / f"rank-{rank}.json"), rank)
        assert call["args"]["op"] == "allreduce" and call["args"]["algorithm"] == "ring"
        assert call["args"]["count"] == COUNT and call["args"]["bytes"] == COUNT * ITEMSIZE
        assert call["tid"] == 1                          # the world communicator
        assert got == want, f"rank {rank}: measured steps differ from the schedule"
        sim_call, sim_got = _call_steps(sim_events, rank)
        assert sim_got == want, f"rank {rank}: simulated steps differ from the schedule"
        assert sim_got == got                            # the acceptance: measured == predicted
        assert (sim_call["args"]["count"], sim_call["args"]["bytes"], sim_call["tid"]) == \
            (COUNT, COUNT * ITEMSIZE, 1)


def _check_chrome_trace(path):
    with open(path) as f:
        data = json.load(f)
    events = data if isinstance(data, list) else data["traceEvents"]
    assert isinstance(events, list) and events
    if isinstance(data, dict):
        assert data["otherData"]["format"] == trace.FORMAT
        assert data.get("displayTimeUnit", "ms") in ("ms", "ns")
    for e in events:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) \
            and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["ts"] >= 0 and e["dur"] >= 0
            assert e["cat"] in ("call", "step")
    return data, events


def test_trace_files_are_chrome_trace_event_json(measured, simulated):
    for rank in range(P):
        data, events = _check_chrome_trace(measured / f"rank-{rank}.json")
        assert {e["pid"] for e in events} == {rank}
        assert data["otherData"]["source"] == "measured" and data["otherData"]["rank"] == rank
        names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
        assert names == [f"rank {rank}"]
    data, events = _check_chrome_trace(simulated)
    assert data["otherData"]["source"] == "simulated"
    assert {e["pid"] for e in events} == set(range(P))


def test_trace_merge_joins_the_ranks_and_the_prediction(measured, simulated, tmp_path, capsys):
    out = tmp_path / "merged.json"
    assert cli.main(["trace", "merge", str(measured), "--sim", str(simulated),
                     "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    data, events = _check_chrome_trace(out)
    offset = data["otherData"]["simulated_pid_offset"]
    assert offset == 100
    assert {e["pid"] for e in events} == set(range(P)) | {offset + r for r in range(P)}
    per_rank = [_load(measured / f"rank-{r}.json") for r in range(P)]
    timed = sum(1 for evs in per_rank for e in evs if e["ph"] == "X") + \
        sum(1 for e in _load(simulated) if e["ph"] == "X")
    assert sum(1 for e in events if e["ph"] == "X") == timed
    # each rank's events keep their spacing; the ranks are aligned by their processes' origins
    origins = []
    for r in range(P):
        with open(measured / f"rank-{r}.json") as f:
            origins.append(json.load(f)["otherData"]["origin_unix_us"])
    for r in range(P):
        mine = [e["ts"] for e in per_rank[r] if e["ph"] == "X"]
        merged = [e["ts"] for e in events if e["ph"] == "X" and e["pid"] == r]
        shift = origins[r] - min(origins)
        assert merged == pytest.approx([t + shift for t in mine], abs=2e-3)
    # the prediction starts with the first measured call of its name
    sim_first = min(e["ts"] for e in events if e.get("cat") == "call" and e["pid"] >= offset)
    measured_first = min(e["ts"] for e in events if e.get("cat") == "call" and e["pid"] < offset
                         and e["name"] == "allreduce (ring)")
    assert sim_first == pytest.approx(measured_first, abs=2e-3)
    # the default output goes beside the rank files, and is not taken for one of them
    assert cli.main(["trace", "merge", str(measured)]) == 0
    assert trace.rank_files(str(measured)) == [(r, str(measured / f"rank-{r}.json"))
                                               for r in range(P)]
    assert cli.main(["trace", "merge", str(tmp_path / "nothing")]) == 2


def _untraced(comm):
    from minicomm import trace as tr
    y = comm.allreduce(np.ones(4, np.float32), algorithm="ring")
    y = comm.allreduce(np.ones(4, np.float32), algorithm="ring")
    return tr.TRACER is None, comm.small_path, float(y[0]), os.listdir(".")


def test_tracing_off_writes_nothing_and_keeps_the_small_path(tmp_path, monkeypatch):
    monkeypatch.delenv("MINICOMM_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for off, small, y, listed in mc.spawn(_untraced, world_size=2, transport="shm", timeout=120):
        assert off and small and y == 2.0
        assert listed == before
    assert sorted(os.listdir(tmp_path)) == before


def test_a_failed_call_is_traced_up_to_its_step_and_threads_share_the_process(tmp_path,
                                                                              monkeypatch):
    # inproc: every rank is a thread of this process, each with its own file
    monkeypatch.setenv("MINICOMM_TRACE", str(tmp_path))

    def run(comm):
        op = "sum" if comm.rank == 0 else "max"
        try:
            comm.allreduce(np.ones(8, np.float32), op=op, algorithm="ring")
        except mc.CommError as e:
            return type(e).__name__
        return "none"
    try:
        kinds = mc.spawn(run, world_size=2, transport="inproc", timeout=60)
    finally:
        monkeypatch.delenv("MINICOMM_TRACE")
        trace.tracing_enabled()            # the next communicator of this process: untraced
    assert trace.TRACER is None
    assert "MismatchError" in kinds, kinds
    failed = []
    for rank in range(2):
        events = _load(tmp_path / f"rank-{rank}.json")
        failed += [e for e in events if e.get("cat") == "call" and "error" in e["args"]]
    assert failed and all("Mismatch" in e["args"]["error"] for e in failed)


def test_rank_file_is_valid_json_after_every_call_and_paused_traces_nothing(tmp_path,
                                                                           monkeypatch):
    tracer = trace.Tracer(str(tmp_path))
    log = tracer.log(3)
    log.add([trace.call_event(3, 1, "barrier (rhd)", 0.0, 1.0, "barrier", "rhd", 1, 0, 0)])
    assert [e["name"] for e in _load(tmp_path / "rank-3.json")] == \
        ["process_name", "thread_name", "barrier (rhd)"]
    log.add([trace.step_event(3, 2, 1, 0, 0.5, 0.25, [(1, 8)], [(2, 8, True)], 0, 0, 0.125)])
    events = _load(tmp_path / "rank-3.json")
    assert [e["name"] for e in events] == ["process_name", "thread_name", "barrier (rhd)",
                                           "thread_name", "step 0"]
    assert events[-1]["args"]["recvs"] == [{"peer": 2, "bytes": 8, "reduce": True}]
    tracer.close()
    monkeypatch.setenv("MINICOMM_TRACE", str(tmp_path / "t"))
    try:
        assert trace.tracing_enabled() and trace.TRACER is not None
        with trace.paused():
            assert trace.TRACER is None
            with trace.paused():
                assert trace.TRACER is None
            assert trace.TRACER is None
        assert trace.TRACER is not None
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("MINICOMM_TRACE", str(tmp_path / "file"))
        with pytest.raises(ValueError, match="MINICOMM_TRACE"):
            trace.tracing_enabled()
    finally:
        monkeypatch.delenv("MINICOMM_TRACE")
        trace.tracing_enabled()
    assert trace.TRACER is None


def test_a_timeline_leaves_the_simulated_times_alone():
    from minicomm import sim
    topo = sim.get_topology("dgx-h100", nodes=2)
    tl = trace.SimulatedTrace()
    for algo in ("ring", "hier"):
        plain = sim.simulate("allreduce", algo, topo, 1 << 20)
        traced = sim.simulate("allreduce", algo, topo, 1 << 20, timeline=tl)
        assert traced.time_s == plain.time_s and traced.busbw == plain.busbw
    # the second call starts where the first ended, on every rank
    calls = [e for e in tl.events if e.get("cat") == "call"]
    assert tl.calls == 2 and tl.ranks == 16 and len(calls) == 32
    first_end = max(e["ts"] + e["dur"] for e in calls if e["args"]["seq"] == 1)
    assert [e["ts"] for e in calls if e["args"]["seq"] == 2] == \
        pytest.approx([first_end] * 16, abs=2e-3)
