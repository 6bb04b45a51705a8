"""Issue 35, defects 6-8: RMA windows after their end, one value rule for atomics, dead lock holders.

- 6: every operation on a freed window, or on a window whose communicator is closed (a split one
  or the world), is an ``RMAError`` that says why (freed / closed), on shm, rdma and ub -- never
  an ``IndexError`` and never a silent success;
- 7: the values of ``fetch_and_op`` / ``compare_and_swap`` (and the data of put / accumulate
  given as Python numbers) follow one rule on every transport: a Python int or numpy scalar that
  fits the window's dtype is accepted, anything else is a ``TypeError`` (wrong kind) or
  ``ValueError`` (out of the dtype's range) naming the value, the dtype and the range, raised
  before anything moves; the outcome table is identical on shm, rdma and ub;
- 8: a rank that dies holding an exclusive lock (or a window's accumulate lock) is named in a
  ``PeerFailure`` by the ranks waiting for that lock as soon as its death is known, not a
  ``CommTimeout`` after the full timeout.
"""
import json
import os

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401

TRANSPORTS = ["shm", "rdma", "ub"]
ONE_SIDED = [("shm", 1), ("rdma", 1), ("rdma", 2), ("ub", 1), ("ub", 2)]
DTYPES = ["int32", "int64", "uint32", "uint64", "float32", "float64"]


# ------------------------------------------------------------------ defect 6: after the end
def _every_op(win, other):
    """(name, call) of every window operation, each on ``other``'s window."""
    def one():                        # data of the window's own dtype: nothing else to refuse
        return np.ones(1, dtype=win.dtype)
    return [
        ("put", lambda: win.put(one(), other)),
        ("get", lambda: win.get(other, 0, 1)),
        ("accumulate", lambda: win.accumulate(one(), other)),
        ("get_accumulate", lambda: win.get_accumulate(one(), other)),
        ("fetch_and_op", lambda: win.fetch_and_op(one(), other)),
        ("fetch_and_op_int", lambda: win.fetch_and_op(1, other, 1)),
        ("compare_and_swap", lambda: win.compare_and_swap(1, 0, other)),
        ("lock", lambda: win.lock(other)),
        ("unlock", lambda: win.unlock(other)),
        ("flush", lambda: win.flush(other)),
        ("flush_all", lambda: win.flush_all()),
        ("fence", lambda: win.fence()),
    ]


def _outcomes(calls):
    out = {}
    for name, call in calls:
        try:
            call()
            out[name] = "no error"
        except Exception as e:        # the type and message are what the test checks
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _after_free(comm, dtype):
    win = comm.window(np.zeros(4, dtype=dtype))
    win.fence()                       # an open epoch: only the window's end can refuse the calls
    win.free()
    other = 1 - comm.rank
    out = _outcomes(_every_op(win, other))
    win.free()                        # a second free does nothing
    return out


def _after_close(comm, dtype, world):
    target = comm if world else comm.split(0)
    win = target.window(np.zeros(4, dtype=dtype))
    win.fence()                       # an open epoch, so only the closed communicator refuses
    if comm.rank == 1:
        win.lock(0)                   # ... and a held lock: unlock must be refused too
    target.barrier()
    target.close()
    other = 1 - comm.rank
    out = _outcomes(_every_op(win, other))
    try:
        win.free()
        out["free"] = "no error"
    except Exception as e:
        out["free"] = f"{type(e).__name__}: {e}"
    win.free()                        # released by the first: nothing more to do
    return out


def _expect_refused(res, why):
    for rank, out in enumerate(res):
        for name, outcome in out.items():
            assert outcome.startswith("RMAError: "), (rank, name, outcome)
            assert why in outcome, (rank, name, outcome)


@pytest.mark.parametrize("dtype", ["float64", "int64"])
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_operation_on_a_freed_window_is_an_rmaerror(kind, dtype):
    res = mc.spawn(_after_free, 2, args=(dtype,), transport=kind, timeout=60)
    _expect_refused(res, "freed")


@pytest.mark.parametrize("world", [False, True], ids=["split", "world"])
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_operation_on_a_window_of_a_closed_communicator_is_an_rmaerror(kind, world):
    res = mc.spawn(_after_close, 2, args=("int64", world), transport=kind, timeout=60)
    _expect_refused(res, "closed")
    for out in res:
        assert set(out) == {n for n, _ in _every_op(None, 0)} | {"free"}


# ------------------------------------------------------------------ defect 7: one value rule
def _signed(dt):
    return "ok" if dt.kind in "if" else "ValueError"


def _floats_only(dt):
    return "ok" if dt.kind == "f" else "ValueError"


def _ints_only(dt):
    return "ok" if dt.kind in "iu" else "TypeError"    # compare_and_swap: integer windows


# name: (the call rank 1 makes on rank 0's window, the expected outcome by dtype); ``hi`` is
# the dtype's largest value
CASES = {
    "fop_int": ("win.fetch_and_op(1, 0, 0)", lambda dt: "ok"),
    "fop_numpy_scalar": ("win.fetch_and_op(np.int64(2), 0, 0)", lambda dt: "ok"),
    "fop_negative": ("win.fetch_and_op(-1, 0, 0)", _signed),
    "fop_huge": ("win.fetch_and_op(2 ** 70, 0, 0)", _floats_only),
    "fop_max_plus_one": ("win.fetch_and_op(hi + 1, 0, 0)", _floats_only),
    "fop_max_replace": ("win.fetch_and_op(hi, 0, 1, op='replace')", lambda dt: "ok"),
    "fop_float": ("win.fetch_and_op(1.5, 0, 0)",
                  lambda dt: "ok" if dt.kind == "f" else "TypeError"),
    "fop_float_overflow": ("win.fetch_and_op(1e300, 0, 0)",
                           lambda dt: {"f4": "ValueError", "f8": "ok"}.get(dt.str[1:],
                                                                          "TypeError")),
    "fop_not_a_number": ("win.fetch_and_op('1', 0, 0)", lambda dt: "TypeError"),
    "cas_int": ("win.compare_and_swap(5, 0, 0, 2)", _ints_only),
    "cas_negative_value": ("win.compare_and_swap(-1, 0, 0, 2)",
                           lambda dt: "TypeError" if dt.kind == "f" else _signed(dt)),
    "cas_negative_compare": ("win.compare_and_swap(0, -1, 0, 2)",
                             lambda dt: "TypeError" if dt.kind == "f" else _signed(dt)),
    "cas_huge": ("win.compare_and_swap(2 ** 70, 0, 0, 2)",
                 lambda dt: "TypeError" if dt.kind == "f" else "ValueError"),
    "cas_numpy_scalars": ("win.compare_and_swap(np.uint8(7), np.int64(0), 0, 3)", _ints_only),
    "acc_python_list": ("win.accumulate([1, 2], 0, 0)", lambda dt: "ok"),
    "acc_python_negative": ("win.accumulate([1, -1], 0, 0)", _signed),
    "put_python_huge": ("win.put([2 ** 70], 0, 0)", _floats_only),
}
# what an accepted call leaves in rank 0's window (zeros before each call)
EFFECT = {"fop_int": {0: 1}, "fop_numpy_scalar": {0: 2}, "cas_int": {2: 5},
          "cas_numpy_scalars": {3: 7}, "acc_python_list": {0: 1, 1: 2}}


def _value_rules(comm):
    """Every case on every dtype, run by rank 1 against rank 0's window under an exclusive lock:
    the outcome (what the call returned, or its error) and rank 0's window before and after."""
    table = {}
    for dtype in DTYPES:
        dt = np.dtype(dtype)
        hi = int(np.iinfo(dt).max) if dt.kind in "iu" else float(np.finfo(dt).max)
        win = comm.window(np.zeros(4, dtype=dtype))
        win.fence()
        if comm.rank == 1:
            for name, (code, _) in CASES.items():
                win.lock(0)
                before = win.get(0).tolist()
                try:
                    got = eval(code, {"win": win, "np": np, "hi": hi})
                    outcome = "ok" if got is None else f"ok {type(got).__name__} {got!r}"
                except Exception as e:    # the type and message are the outcome
                    outcome = f"{type(e).__name__}: {e}"
                after = win.get(0).tolist()
                win.put(np.zeros(4, dtype=dtype), 0)
                win.unlock(0)
                table[f"{dtype}/{name}"] = (outcome, before, after)
        win.fence()
        win.free()
    return table


_tables = {}


def _table(kind):
    """The outcome table of one transport (one spawn per transport for the whole matrix)."""
    if kind not in _tables:
        _tables[kind] = mc.spawn(_value_rules, 2, transport=kind, timeout=120)[1]
    return _tables[kind]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_atomic_values_follow_one_rule(kind, dtype, name):
    dt = np.dtype(dtype)
    want = CASES[name][1](dt)
    outcome, before, after = _table(kind)[f"{dtype}/{name}"]
    assert before == [0, 0, 0, 0]
    if want == "ok":
        assert outcome.startswith("ok"), outcome
        if name.startswith(("fop_", "cas_")):      # the old value: a scalar of the dtype
            assert outcome.split()[1] == dt.name, outcome
            assert float(outcome.rsplit("(", 1)[1].rstrip(")")) == 0, outcome
        for i, v in EFFECT.get(name, {}).items():
            assert after[i] == v, (outcome, after)
        return
    assert after == before, (outcome, after)          # refused before anything moved
    assert outcome.startswith(f"{want}: win."), outcome
    assert str(dt) in outcome, outcome
    if want == "ValueError":
        assert "range" in outcome, outcome


@pytest.mark.parametrize("kind", ["rdma", "ub"])
def test_the_outcome_table_is_the_same_on_every_transport(kind):
    assert _table(kind) == _table("shm")


# ------------------------------------------------------------------ defect 8: dead holders
def _dies_holding(comm, out_dir, which):
    """Rank 1 takes a lock on rank 0's window (the exclusive lock, or the accumulate lock a
    non-native accumulate holds while it runs) and exits; rank 2 then waits for that lock."""
    win = comm.window(np.zeros(4))
    held = None
    if comm.rank == 1:
        if which == "exclusive":
            win.lock(0, exclusive=True)
        else:
            held = win._accumulate_lock(0, win._channels[0])     # as if mid-accumulate
            held.__enter__()          # (kept referenced: collecting it would release the lock)
    comm.barrier()                    # rank 1 holds the lock now
    if comm.rank == 1:
        os._exit(7)
    if comm.rank == 2:
        try:
            if which == "exclusive":
                win.lock(0, exclusive=True)
            else:
                win.lock(0, exclusive=False)
                win.accumulate(np.ones(1), 0, op="max")   # float max: takes the accumulate lock
            outcome = ["no error", None, ""]
        except mc.CommError as e:
            outcome = [type(e).__name__, getattr(e, "peer", None), str(e)]
        with open(os.path.join(out_dir, "rank2.json"), "w") as f:
            json.dump(outcome, f)
        comm.send(np.ones(1), 0)      # rank 0 may leave now
        return outcome
    comm.recv(2)                      # rank 0 keeps its window (and NIC agent) up until then
    return None


# shm accumulates under the target's robust mutex, never the accumulate lock (a holder that
# dies releases the mutex: EOWNERDEAD), so the accumulate lock is rdma's and ub's alone
DEAD_HOLDERS = [(k, n, "exclusive") for k, n in ONE_SIDED] + \
    [(k, n, "accumulate") for k, n in ONE_SIDED if k != "shm"]


@pytest.mark.parametrize("kind,nodes,which", DEAD_HOLDERS)
def test_a_rank_dying_holding_a_lock_is_named_to_its_waiters(kind, nodes, which, tmp_path):
    # timeout=60: without the fix rank 2 waits for the lock until spawn ends the failed job
    with pytest.raises(mc.SpawnError) as e:
        mc.spawn(_dies_holding, 3, args=(str(tmp_path), which), transport=kind, nodes=nodes,
                 timeout=60)
    assert [r for r, _ in e.value.failures] == [1], str(e.value)[:2000]   # only the dead rank
    result = tmp_path / "rank2.json"
    assert result.exists(), "rank 2 never came back from its lock wait"
    error, peer, text = json.loads(result.read_text())
    assert error == "PeerFailure", text
    assert peer == 1, text
    assert "rank 1" in text, text
