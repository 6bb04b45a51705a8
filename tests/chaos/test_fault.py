"""MINICOMM_FAULT (transports/fault.py): the grammar, zero cost when off, and what each fault
does to a real job: delays keep results exact, a drop ends in CommTimeout naming the sender, a
crash kills the chosen rank at the chosen message."""

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401  (autouse fixture)
from minicomm.transports import fault


# ------------------------------------------------------------------ grammar
def test_grammar():
    s = fault.parse("drop:0.01,delay:5ms,seed:7")
    assert s.drop == 0.01 and s.delay == (0.005, 0.005) and s.seed == 7 and s.ranks is None
    s = fault.parse(" crash:40:term , ranks:0+2-3 , after:10 , delay:200us-1ms ")
    assert s.crash == 40 and s.crash_how == "term" and s.after == 10
    assert s.ranks == frozenset({0, 2, 3}) and s.delay == pytest.approx((200e-6, 1e-3))
    assert fault.parse("crash:3").crash_how == "kill"
    assert fault.parse("delay:0.25").delay == (0.25, 0.25)
    assert fault.parse("") is None and fault.parse("  ") is None


@pytest.mark.parametrize("bad", [
    "drop:2", "drop:-0.1", "drop:nan", "drop:x", "delay:5xs", "delay:61s", "delay:9ms-1ms",
    "delay:-1ms", "crash:0", "crash:2:bang", "after:-1", "ranks:3-1", "ranks:a", "seed:-1",
    "seed:1.5", "foo:1", "drop", "drop:", "drop:0.1,drop:0.2", "drop:0.1,,seed:1"])
def test_bad_values_are_a_valueerror_naming_the_variable(bad):
    with pytest.raises(ValueError, match="MINICOMM_FAULT"):
        fault.parse(bad)


def test_bad_value_fails_spawn_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("MINICOMM_FAULT", "drop:often")
    with pytest.raises(ValueError, match="MINICOMM_FAULT"):
        mc.spawn(lambda comm: None, 2, transport="inproc")
    with pytest.raises(mc.SpawnError, match="MINICOMM_FAULT"):
        mc.spawn(lambda comm: None, 2, transport="shm", timeout=20)


def test_crash_is_refused_for_thread_ranks(monkeypatch):
    monkeypatch.setenv("MINICOMM_FAULT", "crash:1")
    with pytest.raises(ValueError, match="MINICOMM_FAULT.*processes"):
        mc.spawn(lambda comm: None, 2, transport="inproc")


# ------------------------------------------------------------------ zero cost when off
def _transport_class(comm):
    return type(comm.transport).__name__


def test_off_by_default_the_transport_is_not_wrapped(monkeypatch):
    monkeypatch.delenv("MINICOMM_FAULT", raising=False)
    for t in ("inproc", "shm"):
        assert "FaultTransport" not in mc.spawn(_transport_class, 2, transport=t, timeout=20)
    monkeypatch.setenv("MINICOMM_FAULT", "delay:1us,ranks:1")
    assert mc.spawn(_transport_class, 2, transport="shm", timeout=20)[1] == "FaultTransport"
    assert mc.spawn(_transport_class, 2, transport="shm", timeout=20)[0] != "FaultTransport"


# ------------------------------------------------------------------ behaviour
def _mixed(comm, iters):
    """Collectives and p2p of several sizes; every result checked against numpy here."""
    n, r = comm.size, comm.rank
    for i in range(iters):
        base = np.arange(7 + 1000 * (i % 3), dtype=np.float64)
        y = comm.allreduce(base * (r + 1))
        np.testing.assert_array_equal(y, base * (n * (n + 1) / 2))
        g = comm.allgather(np.full(3, r + i, dtype=np.int32))
        np.testing.assert_array_equal(g, np.repeat(np.arange(n)[:, None] + i, 3, axis=1))
        b = comm.broadcast(base + i if r == i % n else np.empty_like(base), root=i % n)
        np.testing.assert_array_equal(b, base + i)
        comm.send(np.array([r, i]), (r + 1) % n, tag=i)
        np.testing.assert_array_equal(comm.recv((r - 1) % n, tag=i), [(r - 1) % n, i])
    comm.barrier()
    return True


def test_every_send_entry_point_of_a_transport_is_faulted_not_forwarded():
    # a send method the wrapper forwards through __getattr__ would bypass the fault (the
    # small-message path's shm.send_now once did): each must be defined on FaultTransport
    from minicomm.transports import inproc, rdma, shm, tcp, ub
    classes = (shm.ShmTransport, tcp.TcpTransport, inproc.InprocTransport, rdma.RdmaTransport,
               ub.UbTransport)
    sends = {name for cls in classes for name in dir(cls)
             if "send" in name and not name.startswith("_") and callable(getattr(cls, name))}
    assert {"isend", "send_now"} <= sends
    assert [n for n in sorted(sends) if n not in fault.FaultTransport.__dict__] == []


@pytest.mark.parametrize("transport,size", [("shm", 3), ("tcp", 2), ("inproc", 4)])
def test_delays_keep_results_exact(monkeypatch, transport, size):
    monkeypatch.setenv("MINICOMM_FAULT", "delay:0-3ms,seed:5")
    assert mc.spawn(_mixed, size, args=(4,), transport=transport, timeout=30) == [True] * size


def _lossy(comm):
    for i in range(50):
        comm.allreduce(np.ones(100) * i)
    return "finished"


@pytest.mark.parametrize("transport", ["shm", "tcp", "inproc"])
def test_a_dropped_message_ends_in_a_commtimeout_naming_the_sender(monkeypatch, transport):
    # rank 1 loses its 20th message on: the link to it goes silent, its peer's error is a
    # CommTimeout naming rank 1, never a wrong result
    monkeypatch.setenv("MINICOMM_FAULT", "drop:1,after:20,ranks:1")
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(_lossy, 2, transport=transport, timeout=2.0)
    text = str(info.value)
    assert ": CommTimeout:" in text.splitlines()[0], text
    rank0 = text.split("--- rank 0: ", 1)[1].split("\n", 1)[0]     # the receiver of the loss
    # its own timeout, or the silent rank's abort when that one timed out first (aborts do not
    # ride on isend: the transports' own abort notice, or inproc's fabric, carries them)
    assert ((rank0.startswith("CommTimeout") and "from rank 1" in rank0)
            or (rank0.startswith("PeerFailure") and "rank 1" in rank0
                and "CommTimeout" in rank0)), text
    assert "finished" not in text


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_dropped_message_in_a_bigger_world_ends_in_named_errors_only(monkeypatch, transport):
    # with more ranks the first to time out may wait on a rank that waits on the silent one:
    # the root cause is a CommTimeout, every other rank fails with CommTimeout or PeerFailure
    monkeypatch.setenv("MINICOMM_FAULT", "drop:0.05,seed:3,after:10")
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(_lossy, 4, transport=transport, timeout=2.0)
    text = str(info.value)
    assert "root cause: rank" in text and ": CommTimeout:" in text.splitlines()[0], text
    for line in text.splitlines()[1:]:
        if line.startswith("--- rank "):
            assert "PeerFailure" in line or "CommTimeout" in line, text


def test_p2p_drop_is_a_commtimeout_and_the_comm_keeps_working(monkeypatch):
    def fn(comm):
        if comm.rank == 1:
            before = getattr(comm.transport, "_sent", None)   # messages sent during setup
            comm.send(np.ones(4), 0, tag=3)       # lost when the fault is on
            comm.recv(0, tag=4)                   # stay until rank 0 is done (0 -> 1 is clean)
            return before
        try:
            got = comm.recv(1, tag=3, timeout=1.0)
            outcome = "received" if got.tolist() == [1.0] * 4 else "wrong"
        except mc.CommTimeout as e:
            assert "rank 1" in str(e)
            outcome = "timed out"
        comm.send(np.zeros(1), 1, tag=4)          # a p2p timeout did not break the comm
        return outcome
    # link agreement runs before the first user message: after:N keeps it out of the lossy window
    for transport in ("inproc", "shm"):
        monkeypatch.setenv("MINICOMM_FAULT", "drop:1,ranks:1,after:1000000")
        outcome, setup_messages = mc.spawn(fn, 2, transport=transport, timeout=5)
        assert outcome == "received"
        monkeypatch.setenv("MINICOMM_FAULT", f"drop:1,ranks:1,after:{setup_messages}")
        assert mc.spawn(fn, 2, transport=transport, timeout=5) == ["timed out", setup_messages]


@pytest.mark.parametrize("how,death", [("kill", "signal SIGKILL"), ("exit", "exit code 70"),
                                       ("term", "rank terminated by SIGTERM")])
def test_crash_kills_the_chosen_rank(monkeypatch, how, death):
    monkeypatch.setenv("MINICOMM_FAULT", f"crash:30:{how},ranks:2")
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(_lossy, 3, transport="shm", timeout=5.0)
    text = str(info.value)
    root = text.splitlines()[0]
    assert "root cause: rank 2" in root and death in root, text
    for line in text.splitlines()[1:]:
        if line.startswith("--- rank ") and not line.startswith("--- rank 2:"):
            assert "PeerFailure" in line or "CommTimeout" in line, text


def test_windows_still_work_under_the_fault_wrapper(monkeypatch):
    monkeypatch.setenv("MINICOMM_FAULT", "delay:0-1ms")

    def fn(comm):
        win = comm.window(np.zeros(comm.size))
        win.fence()
        win.put(np.array([comm.rank + 1.0]), (comm.rank + 1) % comm.size, comm.rank)
        win.fence()
        out = win.local.copy()
        win.free()
        return type(comm.transport).__name__, out.tolist()
    res = mc.spawn(fn, 3, transport="shm", timeout=20)
    for r, (kind, local) in enumerate(res):
        want = [0.0] * 3
        want[(r - 1) % 3] = (r - 1) % 3 + 1.0
        assert kind == "FaultTransport" and local == want
