"""The declared transport contract (transports/base.py): every transport says what it offers
beyond the two-sided core in ``capabilities()``, ``capabilities_of`` checks each declaration
against its Protocol, and a transport that declares what it does not implement is a TypeError
naming it and the missing members. What each transport declares is today's behaviour: the
routed shm+tcp transport has registered memory but no eager channel, the fault wrapper keeps
every send on ``isend``, and so on."""
import glob
import os
import threading
import uuid

import numpy as np
import pytest

from minicomm.rendezvous import StoreClient, StoreServer, new_token
from minicomm.transports import RoutedTransport, connect, fault, registered_memory, rma_backend
from minicomm.transports.base import (
    Capabilities,
    EagerChannel,
    OneSided,
    RegisteredMemory,
    SingleCopy,
    Transport,
    TwoSided,
    capabilities_of,
)
from minicomm.transports.inproc import Fabric, InprocTransport
from minicomm.transports.rdma import RdmaTransport
from minicomm.transports.shm import ShmTransport
from minicomm.transports.shmrma import ShmRma
from minicomm.transports.tcp import TcpTransport
from minicomm.transports.ub import UbTransport

CLASSES = (ShmTransport, TcpTransport, RdmaTransport, UbTransport, InprocTransport,
           RoutedTransport, fault.FaultTransport)


def _world(kind, nodes):
    """One transport per rank of a world on ``nodes`` (a node id per rank), ranks as threads."""
    token, job = new_token(), f"caps{os.getpid()}{uuid.uuid4().hex[:6]}"
    built, errs = {}, []
    with StoreServer("127.0.0.1", 0, token) as server:
        def rank(r):
            with StoreClient("127.0.0.1", server.port, token, timeout=30) as c:
                try:
                    built[r] = connect(kind, r, len(nodes), c, job, token, nodes, 30.0)
                except BaseException as e:
                    errs.append(e)
        threads = [threading.Thread(target=rank, args=(r,), daemon=True)
                   for r in range(len(nodes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errs and len(built) == len(nodes), errs
    return job, [built[r] for r in range(len(nodes))]


def _close(job, transports):
    for t in transports:
        t.close()
    assert glob.glob(f"/dev/shm/minicomm-{job}-*") == []


def _summary(t, caps):
    """What ``caps`` declares, by kind of object: 'self', a class name, or None."""
    def what(obj):
        return None if obj is None else "self" if obj is t else type(obj).__name__
    return {"eager": what(caps.eager), "registered": what(caps.registered),
            "single_copy": what(caps.single_copy), "one_sided": what(caps.one_sided),
            "describe": caps.describe is not None}


TODAY = {
    "shm": {"eager": "self", "registered": "self", "single_copy": "self", "one_sided": "ShmRma",
            "describe": True},
    "tcp": {"eager": None, "registered": None, "single_copy": None, "one_sided": None,
            "describe": True},
    "rdma": {"eager": None, "registered": None, "single_copy": None, "one_sided": "self",
             "describe": True},
    "ub": {"eager": None, "registered": None, "single_copy": None, "one_sided": "self",
           "describe": True},
    "shm+tcp": {"eager": None, "registered": "ShmTransport", "single_copy": "self",
                "one_sided": None, "describe": True},
}


@pytest.mark.parametrize("kind,nodes", [("shm", [0, 0]), ("tcp", [0, 1]), ("rdma", [0, 0]),
                                        ("ub", [0, 1]), ("auto", [0, 0, 1])])
def test_every_transport_declares_what_it_offers_today(kind, nodes):
    job, ts = _world(kind, nodes)
    try:
        for t in ts:
            caps = capabilities_of(t)
            assert _summary(t, caps) == TODAY[t.name], t.name
            assert isinstance(t, TwoSided)
            # the transports package's helpers are thin reads of the declaration
            assert registered_memory(t) is caps.registered
            assert type(rma_backend(t)) is type(caps.one_sided)
            if t.name == "shm":
                assert caps.oversubscribed == t.oversubscribed and caps.job_id == job
                assert caps.eager.small_bytes == t.small_bytes
            else:
                assert caps.oversubscribed is True and caps.job_id is None
            assert caps.device_job_id == (job if t.name in ("rdma", "ub") else None)
            if t.name == "shm+tcp":       # single-copy aggregates the parts: shm's peers only
                assert caps.registered is t._transports["shm"]
                shm_part = t._transports["shm"]
                assert t.single_copy_peers() == shm_part.single_copy_peers()
                assert t.single_copy_from() == shm_part.single_copy_from()
        assert "shm+tcp" in {t.name for t in ts} or kind != "auto"
    finally:
        _close(job, ts)


def test_inproc_declares_the_two_sided_core_only():
    t = InprocTransport(Fabric(2), 0)
    assert capabilities_of(t) == Capabilities()


def test_the_fault_wrapper_keeps_every_send_on_isend():
    """Wrapped shm: the eager channel is the wrapper (its send_now never sends), no registered
    memory; single-copy and one-sided access are the inner transport's own."""
    spec = fault.parse("drop:0")
    job, ts = _world("shm", [0, 0])
    try:
        inner = ts[0]
        w = fault.FaultTransport(inner, spec, 0)
        caps = capabilities_of(w)
        assert caps.eager is w and caps.registered is None
        assert caps.single_copy is inner and caps.describe == inner.describe
        assert isinstance(caps.one_sided, ShmRma) and caps.one_sided.t is inner
        assert caps.eager.small_bytes == inner.small_bytes
        assert w.send_now(1, np.zeros(1), None) is False
        assert fault.unwrap(w) is inner and fault.unwrap(inner) is inner
    finally:
        _close(job, ts)
    w = fault.FaultTransport(InprocTransport(Fabric(2), 0), spec, 0)
    assert capabilities_of(w) == Capabilities()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_transport_class_declares_its_capabilities_itself(cls):
    assert issubclass(cls, Transport)
    assert "capabilities" in vars(cls), f"{cls.__name__} inherits capabilities()"


# ---------------------------------------------------------------------------- broken declarations
class _Declaring(InprocTransport):
    """An inproc transport that declares ``declared`` (a callable of the transport)."""

    def __init__(self, declared):
        super().__init__(Fabric(2), 0)
        self._declared = declared

    def capabilities(self):
        return self._declared(self)


class HalfEager(_Declaring):
    small_bytes = 64

    def send_now(self, peer, buf, tag):
        return False


class _OnlyRegister:
    def register_memory(self, nbytes):
        return np.empty(nbytes, np.uint8)


class _OnlyPeers:
    def single_copy_peers(self):
        return []


class _OnlyExpose:
    def rma_expose(self, nbytes, name):
        return None


@pytest.mark.parametrize("make,cls,declared,proto,missing", [
    (lambda t: Capabilities(eager=t), HalfEager, "eager", EagerChannel,
     "recv_now, sendrecv_now, recv_now_many"),
    (lambda t: Capabilities(registered=_OnlyRegister()), _Declaring, "registered",
     RegisteredMemory, "free_memory, is_registered"),
    (lambda t: Capabilities(single_copy=_OnlyPeers()), _Declaring, "single_copy", SingleCopy,
     "single_copy_from"),
    (lambda t: Capabilities(one_sided=_OnlyExpose()), _Declaring, "one_sided", OneSided,
     "rma_attach"),
], ids=["eager", "registered", "single_copy", "one_sided"])
def test_a_declared_capability_that_is_not_implemented_is_a_named_typeerror(
        make, cls, declared, proto, missing):
    t = cls(make)
    with pytest.raises(TypeError) as info:
        capabilities_of(t)
    assert str(info.value).startswith(
        f"transport {cls.__name__} declares {declared} ({proto.__name__}) but ")
    assert str(info.value).endswith(f"lacks {missing}")


def test_a_transport_without_the_two_sided_core_is_a_named_typeerror():
    class NoDetach:
        name, rank, size = "nodetach", 0, 1

        def capabilities(self):
            return Capabilities()

        isend = irecv = wait_all = wait_any = cancel_context = abort = close = (
            lambda self, *a: None)
    with pytest.raises(TypeError, match=r"transport NoDetach declares the two-sided core "
                                        r"\(TwoSided\) but NoDetach lacks detach$"):
        capabilities_of(NoDetach())


def test_capabilities_must_be_a_capabilities_object():
    t = _Declaring(lambda t: {"eager": t})
    with pytest.raises(TypeError, match=r"_Declaring.capabilities\(\) returned dict, "
                                        r"not Capabilities"):
        capabilities_of(t)
