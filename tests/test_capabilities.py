"""A communicator learns its transport's capabilities once, when it is built (``comm.caps``), and
takes the small-message path only where the transport declares an eager channel: without one
(inproc, or shm with its eager channel masked) every call runs through the executor and the
results are the same; with one, small calls never reach the executor."""
import dataclasses

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401
from minicomm.communicator import Communicator
from minicomm.transports.base import Capabilities


def _calls_and_paths(comm, mask_eager):
    """Small allreduce, broadcast, reduce_scatter and barrier, three times each, against numpy;
    returns (all agree, caps.eager declared, calls bound to a small plan, the collectives the
    executor ran)."""
    import minicomm.communicator.calls as calls
    if mask_eager:
        comm.caps = dataclasses.replace(comm.caps, eager=None)
        comm._forget_calls()          # calls bound while the world started had the channel
    ran = []
    real = calls.run_plan

    def counting(*a, **k):
        ran.append(a[0].schedule.collective)
        return real(*a, **k)
    calls.run_plan = counting
    p, r = comm.size, comm.rank
    ok = []
    try:
        for _ in range(3):
            x = np.arange(4.0) + r
            ok.append(np.array_equal(comm.allreduce(x), sum(np.arange(4.0) + q for q in range(p))))
            ok.append(np.array_equal(comm.broadcast(x, root=p - 1), np.arange(4.0) + p - 1))
            blocks = np.arange(p * 2.0).reshape(p, 2)
            ok.append(np.array_equal(comm.reduce_scatter(blocks + r),
                                     sum(blocks + q for q in range(p))[r]))
            comm.barrier()
    finally:
        calls.run_plan = real
    smalls = sum(1 for c in comm._calls.values() if c.small is not None)
    return all(ok), comm.caps.eager is not None, smalls, ran


@pytest.mark.parametrize("transport,mask", [("inproc", False), ("shm", True)])
def test_a_transport_without_an_eager_channel_gets_the_general_path(transport, mask):
    for ok, eager, smalls, ran in mc.spawn(_calls_and_paths, 2, args=(mask,),
                                           transport=transport, timeout=120):
        assert ok and not eager and smalls == 0
        # each call ran the executor (inproc's ranks are threads: they share the count)
        assert ran.count("allreduce") >= 3 and ran.count("barrier") >= 3, ran


def test_a_transport_with_an_eager_channel_takes_the_small_path():
    for ok, eager, smalls, ran in mc.spawn(_calls_and_paths, 2, args=(False,), transport="shm",
                                           timeout=120):
        assert ok and eager and smalls > 0
        assert "allreduce" not in ran and "barrier" not in ran, ran


class _Channel:
    """An eager channel whose peer has always answered (a reduce adds zeros); it records calls."""
    small_bytes = 1 << 16

    def __init__(self):
        self.log = []

    def send_now(self, peer, buf, tag):
        self.log.append("send_now")
        return True

    def recv_now(self, peer, buf, tag, reduce, spin):
        self.log.append("recv_now")
        if reduce is not None:
            reduce(buf, np.zeros_like(buf))
        return True

    def sendrecv_now(self, peer, sbuf, rbuf, tag, reduce, spin):
        self.log.append("sendrecv_now")
        if reduce is not None:
            reduce(rbuf, np.zeros_like(rbuf))
        return 3

    def recv_now_many(self, waiting, tag, spin):
        self.log.append("recv_now_many")
        for _, buf, reduce in waiting:
            if reduce is not None:
                reduce(buf, np.zeros_like(buf))
        return []


class _TwoSided:
    """The two-sided core only, which this test never expects to be called for data; its eager
    channel is another object (what ``capabilities()`` declares)."""
    name = "two-sided"

    def __init__(self, channel):
        self.rank, self.size, self.channel, self.posted = 0, 2, channel, []

    def capabilities(self):
        return Capabilities(eager=self.channel)

    def isend(self, peer, buf, tag):
        self.posted.append("isend")

    def irecv(self, peer, buf, tag, reduce=None):
        self.posted.append("irecv")

    def wait_all(self, reqs, deadline, what):
        pass

    def wait_any(self, reqs, deadline, what):
        pass

    def cancel_context(self, ctx, error):
        pass

    def detach(self, req):
        pass

    def abort(self, reason):
        pass

    def close(self):
        pass


def test_the_small_path_calls_the_declared_eager_channel():
    """The compiled plan calls the object ``capabilities()`` declares as the eager channel, even
    when it is not the transport itself, and nothing is posted two-sided."""
    channel = _Channel()
    t = _TwoSided(channel)
    comm = Communicator(t, 0, 2)
    assert comm.caps.eager is channel
    x = np.arange(3.0)
    for _ in range(3):                # the first call binds, the next ones take the fast path
        assert np.array_equal(comm.allreduce(x, algorithm="rhd"), x)    # the peer adds zeros
    assert channel.log and t.posted == []
    comm.close()
