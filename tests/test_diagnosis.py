"""The hang diagnosis: the four cases, on records made by hand (each rule alone) and
on real hung jobs of 4 ranks over shm and tcp, under ``mc.spawn`` and under ``minicomm run``,
each named within the timeout plus 5 s; and ``minicomm doctor`` on a job's collected records."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401  (autouse fixture)
from minicomm.diagnosis import diagnose
from minicomm.launch.local import FAILURE_GRACE

TIMEOUT = 3.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ records made by hand
def _rec(number, op, state, kind="collective", peer=None, count=4, dtype="float64",
         algorithm="ring", root=None, error=None):
    return {"number": number, "kind": kind, "op": op, "algorithm": algorithm, "count": count,
            "dtype": dtype, "root": root, "peer": peer, "tag": 0 if kind == "p2p" else None,
            "state": state, "entered": 0.0, "ended": None, "error": error}


def _dump(rank, calls, reason="SIGUSR1", size=4):
    return {"format": "minicomm-flight-record/1", "rank": rank, "reason": reason,
            "communicators": [{"comm_id": 1, "rank": rank, "size": size,
                               "group": list(range(size)), "calls": calls}]}


def _timed_out(n, op="allreduce"):
    return _rec(n, op, "failed", error="CommTimeout: timed out")


def test_a_rank_that_never_entered_the_call_is_named():
    dumps = {r: _dump(r, [_rec(7, "allreduce", "done"), _timed_out(8)], "CommTimeout: x")
             for r in range(3)}
    dumps[3] = _dump(3, [_rec(7, "allreduce", "done")])
    lines = diagnose(dumps, {0: "exit status 1", 1: "exit status 1", 2: "exit status 1", 3: None})
    assert lines[0] == ("diagnosis: rank 3 never entered #8 allreduce, which ranks 0, 1, 2 are "
                        "in on the world: it is still computing, or it skipped the call; its "
                        "last collective: #7 allreduce, done")


def test_a_rank_that_returned_early_is_named_as_such():
    dumps = {r: _dump(r, [_timed_out(8)], "CommTimeout: x") for r in range(3)}
    lines = diagnose(dumps, {0: None, 1: None, 2: None, 3: "finished"})
    assert "rank 3 never entered #8 allreduce" in lines[0]
    assert "it returned without making the call" in lines[0]


def test_different_collectives_at_one_number_name_the_minority():
    dumps = {r: _dump(r, [_rec(8, "allreduce", "failed")], "MismatchError: x") for r in range(4)}
    dumps[2] = _dump(2, [_rec(8, "broadcast", "failed", algorithm="tree", root=0)],
                     "MismatchError: x")
    [line] = [ln for ln in diagnose(dumps) if "different" in ln]
    assert line == ("diagnosis: ranks entered different collectives at #8 on the world: ranks 0, "
                    "1, 3 in allreduce(count=4, dtype=float64, algorithm=ring); rank 2 in "
                    "broadcast(count=4, dtype=float64, algorithm=tree, root=0): rank 2 at fault "
                    "(the others agree)")


def test_a_count_or_dtype_difference_is_a_mismatch_too():
    dumps = {r: _dump(r, [_rec(5, "allreduce", "failed")], "MismatchError: x", size=2)
             for r in range(2)}
    dumps[1]["communicators"][0]["calls"][0]["count"] = 5
    assert any("different collectives at #5" in ln for ln in diagnose(dumps))


def test_a_dead_rank_is_named_with_the_call_the_others_were_in():
    dumps = {r: _dump(r, [_rec(9, "allreduce", "failed", error="PeerFailure: rank 1 died")],
                      "PeerFailure: rank 1 died") for r in (0, 2, 3)}
    lines = diagnose(dumps, {0: "exit status 1", 1: "killed by SIGKILL", 2: "exit status 1",
                             3: "exit status 1"})
    assert lines[0] == ("diagnosis: rank 1 died (killed by SIGKILL) in or before #9 allreduce, "
                        "the call ranks 0, 2, 3 were in on the world")


def test_a_dead_rank_while_the_others_only_queued_a_call_is_still_named():
    queued = dict(_rec(None, "allreduce", "queued"), algorithm=None, count=None, dtype=None)
    dumps = {r: _dump(r, [_rec(9, "allreduce", "done"), queued], "PeerFailure: rank 1 died")
             for r in (0, 2, 3)}
    lines = diagnose(dumps, {0: "exit status 1", 1: "killed by SIGKILL", 2: "exit status 1",
                             3: "exit status 1"})
    assert lines[0] == ("diagnosis: rank 1 died (killed by SIGKILL) while the others were not "
                        "in a collective with it on the world")


def test_without_a_launcher_a_missing_record_is_a_dead_rank():
    dumps = {r: _dump(r, [_timed_out(4)], "CommTimeout: x") for r in (0, 1, 2)}
    lines = diagnose(dumps)
    assert lines[0].startswith("diagnosis: rank 3 died (no flight record")
    assert "in or before #4 allreduce" in lines[0]


def test_a_cycle_of_point_to_point_waits_is_named():
    dumps = {r: _dump(r, [_rec(1, "recv", "failed", kind="p2p", peer=(r + 1) % 4,
                               error="CommTimeout: recv")], "CommTimeout: x")
             for r in range(4)}
    [line] = [ln for ln in diagnose(dumps) if "cycle" in ln]
    assert line.startswith("diagnosis: a cycle of point-to-point waits on the world: rank 0 in "
                           "recv from rank 1 (p2p #1, tag 0), rank 1 in recv from rank 2")
    assert "rank 3 in recv from rank 0 (p2p #1, tag 0), back to rank 0" in line


def test_waits_that_end_outside_a_cycle_are_no_cycle():
    dumps = {r: _dump(r, [_rec(1, "recv", "entered", kind="p2p", peer=r + 1)]) for r in range(3)}
    dumps[3] = _dump(3, [_rec(1, "recv", "done", kind="p2p", peer=0)])
    assert not any("cycle" in ln for ln in diagnose(dumps, {r: None for r in range(4)}))


def test_a_healthy_record_finds_nothing_at_fault():
    dumps = {r: _dump(r, [_rec(3, "allreduce", "done")], size=2) for r in range(2)}
    lines = diagnose(dumps, {0: None, 1: None})
    assert lines[0] == "diagnosis: nothing at fault found in the records of ranks 0, 1"


# ------------------------------------------------------------------ real hung jobs
def never_entered(comm):
    comm.allreduce(np.ones(4))
    if comm.rank == 3:
        time.sleep(60)               # still computing: the others wait in the next call
    comm.allreduce(np.ones(4))


def different_collectives(comm):
    comm.allreduce(np.ones(4))
    if comm.rank == 2:
        comm.broadcast(np.ones(4), root=0)
    else:
        comm.allreduce(np.ones(4))


def died(comm):
    for i in range(5):
        if comm.rank == 1 and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(np.ones(4))


def wait_cycle(comm):
    comm.barrier()
    comm.recv((comm.rank + 1) % comm.size)      # everyone receives first: a deadlock


CASES = {
    "never_entered": (never_entered, ["rank 3 never entered #", " allreduce, which ranks 0, 1, "
                                      "2 are in on the world"]),
    "different_collectives": (different_collectives, [
        "ranks entered different collectives at #", "rank 2 in broadcast(", "rank 2 at fault"]),
    "died": (died, ["rank 1 died (killed by SIGKILL) in or before #",
                    "allreduce, the call ranks 0, 2, 3 were in"]),
    "wait_cycle": (wait_cycle, ["a cycle of point-to-point waits on the world: rank 0 in recv "
                                "from rank 1 (p2p #1, tag 0)", "rank 3 in recv from rank 0"]),
}


def _check(text, case):
    lines = [ln for ln in text.splitlines() if ln.startswith("diagnosis:")]
    assert lines, text[-3000:]
    for part in CASES[case][1]:
        assert any(part in ln for ln in lines), (part, lines)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_spawn_names_the_culprit(case, transport, capfd):
    """After a timeout the diagnosis is printed to stderr at once (about a second later); the
    SpawnError holding it comes once the others had their grace period to fail by themselves."""
    t0 = time.monotonic()
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(CASES[case][0], 4, transport=transport, timeout=TIMEOUT)
    assert time.monotonic() - t0 < TIMEOUT + FAILURE_GRACE + 3
    _check(str(info.value), case)
    if case == "never_entered":      # a rank still ran at the timeout: asked, diagnosed, printed
        _check(capfd.readouterr().err, case)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_minicomm_run_names_the_culprit_on_stderr(case, transport, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(f"import sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                      f"import minicomm as mc\nfrom test_diagnosis import {case}\n"
                      f"{case}(mc.init())\n")
    env = dict(os.environ, MINICOMM_FLIGHT_DIR=str(tmp_path / "records"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "4", "--transport",
                           transport, "--timeout", str(TIMEOUT), str(script)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert time.monotonic() - t0 < TIMEOUT + 5 + 3      # + the interpreters' start
    assert proc.returncode != 0
    _check(proc.stderr, case)
    # the records stay where the user asked; minicomm doctor reads them again
    doctor = subprocess.run([sys.executable, "-m", "minicomm.cli", "doctor",
                             str(tmp_path / "records"), "--size", "4"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert doctor.returncode == 1
    if case != "died":               # without the launcher, a dead rank is a missing record
        _check(doctor.stdout, case)


def test_inproc_spawn_diagnoses_too():
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(different_collectives, 4, transport="inproc", timeout=TIMEOUT)
    _check(str(info.value), "different_collectives")


def test_doctor_without_records_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minicomm.cli", "doctor", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "no flight record" in proc.stderr
