"""shm's futex doorbell (transports/futex.py) and its forced fallback to the socket doorbell."""
import mmap
import os
import threading
import time

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401
from minicomm.transports import futex

needs_futex = pytest.mark.skipif(not futex.AVAILABLE, reason="no futex on this platform")


@needs_futex
def test_wait_times_out_while_the_word_holds_the_value():
    mm = mmap.mmap(-1, 4096)
    words = memoryview(mm).cast("i")
    words[0] = 7
    addr = futex.address_of(mm, 0)
    assert futex.wait(addr, 7, 0.01) is False          # still 7: slept, then timed out
    assert futex.wait(addr, 8, 5.0) is True            # not 8: returns at once
    words.release()
    mm.close()


@needs_futex
def test_wake_wakes_a_waiter():
    mm = mmap.mmap(-1, 4096)
    words = memoryview(mm).cast("i")
    addr = futex.address_of(mm, 64)
    got = []
    t = threading.Thread(target=lambda: got.append(futex.wait(addr, 0, 60.0)))
    t.start()
    time.sleep(0.2)                                      # let it block (the value check is
    words[16] = 1                                        # atomic: a late start returns at once)
    futex.wake(addr)
    t.join(60)
    assert got == [True]                                 # woken, not timed out
    words.release()
    mm.close()


def _late_sender(comm):
    """Rank 0 must fall asleep (rank 1 sleeps first); results checked; how rank 0 slept."""
    out = []
    for i in range(3):
        if comm.rank == 1:
            time.sleep(0.2)
        x = np.full(5, comm.rank + i, np.float64)
        out.append(comm.allreduce(x, algorithm="rhd").tolist())
        big = np.arange(300000, dtype=np.float32) * (comm.rank + 1)
        if comm.rank == 0:
            time.sleep(0.2)
        y = comm.allreduce(big, algorithm="ring")
        out.append(bool(np.array_equal(y, np.arange(300000, dtype=np.float32) * 3)))
    comm.barrier()
    t = comm.transport
    return out, futex.AVAILABLE, t.futex_sleeps, t.futex_ok


@pytest.mark.parametrize("mode", ["futex", "forced-off"])
def test_shm_sleeps_on_the_futex_or_the_forced_fallback(monkeypatch, mode):
    if mode == "forced-off":
        monkeypatch.setenv("MINICOMM_FUTEX", "0")
    elif not futex.AVAILABLE:
        pytest.skip("no futex on this platform")
    res = mc.spawn(_late_sender, world_size=2, transport="shm", timeout=120)
    for r, (out, avail, sleeps, ok) in enumerate(res):
        want = []
        for i in range(3):
            want += [[float(0 + i + 1 + i)] * 5, True]
        assert out == want
        if mode == "futex":
            assert avail and ok
        else:
            assert not avail and not ok and sleeps == 0
    if mode == "futex":
        assert res[0][2] > 0                   # rank 0 waited for rank 1 on its futex word
        assert res[1][2] > 0                   # and rank 1 for rank 0 (the large calls)


def _dies_while_peer_sleeps(comm):
    if comm.rank == 1:
        time.sleep(0.3)
        os._exit(3)
    try:
        comm.allreduce(np.ones(4), algorithm="rhd")
    except mc.PeerFailure as e:
        return ("PeerFailure", e.peer, comm.transport.futex_sleeps)
    return ("none", None, 0)


@needs_futex
def test_a_peer_dying_while_we_sleep_on_the_futex_is_noticed():
    with pytest.raises(mc.SpawnError) as ei:
        mc.spawn(_dies_while_peer_sleeps, world_size=2, transport="shm", timeout=120)
    assert "rank 1" in str(ei.value)


class _IdleEngine:
    """A progress engine with nothing ever arriving: it records when the waiter gave up
    spinning (its first ``sleep(True)``)."""
    name, rank, futex_ok = "idle", 0, False

    def __init__(self, oversubscribed: bool):
        self.oversubscribed = oversubscribed
        self.slept_at = None

    def progress(self):
        return False

    def check(self, req, what):
        pass

    def check_foreign(self, tag):
        pass

    def kick(self):
        pass

    def sleep(self, flag):
        if flag and self.slept_at is None:
            self.slept_at = time.monotonic()


@pytest.mark.parametrize("oversubscribed", [False, True])
def test_a_waiter_spins_about_a_wake_up_before_it_sleeps_when_ranks_share_cores(oversubscribed):
    # ranks that outnumber the cores yield between polls for SPIN_SHARED_S (a wake-up's cost
    # there) before sleeping; ranks with a core each spin SPIN_S (or a large message's copy time)
    from minicomm.errors import CommTimeout
    from minicomm.settings import SPIN_S, SPIN_SHARED_S
    from minicomm.transports.base import Tag
    from minicomm.transports.progress import Progress, Req
    assert SPIN_SHARED_S > SPIN_S
    prog, engine = Progress(), _IdleEngine(oversubscribed)
    prog.attach(engine, spin=True)
    try:
        assert (prog.spin_s, prog.hot_spin == 0.0, prog.spin_long) == (
            (SPIN_SHARED_S, True, False) if oversubscribed else (SPIN_S, False, True))
        req = Req(engine, 1, np.zeros(8, dtype=np.uint8), Tag(4, 1, 0, 1, 8), None, False)
        start = time.monotonic()
        with pytest.raises(CommTimeout):
            prog.wait([req], start + 0.2, "idle wait")
        assert engine.slept_at is not None, "it never went to sleep"
        assert engine.slept_at - start >= prog.spin_s
    finally:
        prog.detach(engine)
