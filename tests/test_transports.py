"""Real-process tests of the rendezvous store and the shm / tcp / routed transports.

A tiny harness (``run_job``) starts a ``StoreServer`` in this process and N spawned ranks; each
builds its transport with ``connect`` and runs a scenario function of this module, then reports a
JSON record through the store. Every child is joined (killed first if it overstays), and every job
must leave nothing in /dev/shm. ``python tests/test_transports.py`` prints throughput and latency.
"""
from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback

import numpy as np
import pytest

from minicomm.errors import CommTimeout, MismatchError, PeerFailure, pack_call
from minicomm.rendezvous import AuthError, StoreClient, StoreServer, dial_peer, new_token
from minicomm.transports import connect, shm
from minicomm.transports.base import Tag
from minicomm.transports.shm import segment_path, sweep_job_segments

CTX = mp.get_context("spawn")
SETUP = 30.0                          # setup / wait deadline inside the ranks
SIZES = (0, 1, 1001, 5 << 20)         # bytes: empty, one, odd, several chunks
ALLREDUCE = pack_call("allreduce", "sum", "ring", np.float64, -1)
EAGER_PLUS = 128 << 10                # above shm's EAGER, below a chunk


def ADD(dst, src):
    np.add(dst, src, out=dst)


def _leftovers(job_id: str):
    return glob.glob(f"/dev/shm/minicomm-{job_id}-*")


# ----------------------------------------------------------------------------------- harness
def _rank_main(scenario, rank, size, port, token, job_id, kind, nodes, gate):
    store = StoreClient("127.0.0.1", port, token, timeout=SETUP)
    t = None
    try:
        if gate and rank:
            store.get("go")
        t = connect(kind, rank, size, store, job_id, token, nodes, SETUP)
        out = {"ok": True, "value": globals()[scenario](t, rank, size, store)}
    except BaseException as e:
        out = {"ok": False, "type": type(e).__name__, "error": str(e),
               "tb": traceback.format_exc()}
    finally:
        if t is not None:
            t.close()
    store.set(f"result/{rank}", json.dumps(out).encode())
    store.close()


class Job:
    def __init__(self, scenario, size, kind, nodes=None, gate=False):
        self.scenario, self.size, self.kind, self.gate = scenario, size, kind, gate
        self.nodes = list(nodes) if nodes is not None else [0] * size
        self.token = new_token()
        self.job_id = f"t{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.results = {}
        self.exitcodes = {}

    def run(self, timeout=60.0, during=None):
        with StoreServer("127.0.0.1", 0, self.token) as server:
            self.port = server.port
            procs = [CTX.Process(target=_rank_main, name=f"rank{r}",
                                 args=(self.scenario, r, self.size, server.port, self.token,
                                       self.job_id, self.kind, self.nodes, self.gate))
                     for r in range(self.size)]
            try:
                for p in procs:
                    p.start()
                if during is not None:
                    during(self)
                end = time.monotonic() + timeout
                for p in procs:
                    p.join(max(0.0, end - time.monotonic()))
                hung = [r for r, p in enumerate(procs) if p.is_alive()]
                assert not hung, f"ranks {hung} still running after {timeout}s"
            finally:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                for p in procs:
                    p.join()           # every child reaped, whatever happened
            self.exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
            with StoreClient("127.0.0.1", server.port, self.token, timeout=5) as c:
                for r in range(self.size):
                    try:
                        self.results[r] = json.loads(c.get(f"result/{r}", timeout=0.01))
                    except CommTimeout:
                        self.results[r] = None
        return self

    def values(self):
        for r, out in self.results.items():
            assert out is not None and out["ok"], f"rank {r} failed: {out and out['tb']}"
        return [self.results[r]["value"] for r in range(self.size)]


@pytest.fixture
def no_leftovers():
    jobs = []
    yield jobs.append
    for job in jobs:
        assert _leftovers(job.job_id) == [], "segments left in /dev/shm"


# --------------------------------------------------------------------------------- scenarios
def _pattern(n, src, dst, i):
    return ((np.arange(n, dtype=np.int64) * (src * 7 + dst * 3 + i + 1) + i) % 251).astype(np.uint8)


def sc_p2p(t, rank, size, store):
    dl = time.monotonic() + SETUP
    peers = [p for p in range(size) if p != rank]
    # FIFO: several messages of every size to and from every peer, all in flight at once.
    recvs = {(p, i): np.full(n, 7, np.uint8) for p in peers for i, n in enumerate(SIZES)}
    reqs = [t.irecv(p, recvs[p, i], Tag(1, i, 0, 0, n)) for p in peers
            for i, n in enumerate(SIZES)]
    sends = {(p, i): _pattern(n, rank, p, i) for p in peers for i, n in enumerate(SIZES)}
    reqs += [t.isend(p, sends[p, i], Tag(1, i, 0, 0, n)) for p in peers
             for i, n in enumerate(SIZES)]
    t.wait_all(reqs, dl, "fifo")
    for (p, i), buf in recvs.items():
        assert np.array_equal(buf, _pattern(SIZES[i], p, rank, i)), (p, i)

    # Reduce on arrival: chunk-crossing float64 and an odd int32 vector with max.
    a = [np.full(700_001, float(rank)), np.arange(1001, dtype=np.int32)]
    got = {p: [np.ones(700_001), np.full(1001, 500, np.int32)] for p in peers}
    reqs = [t.irecv(p, got[p][0], Tag(2, 0, 0, 0, 1), ADD) for p in peers]
    reqs += [t.irecv(p, got[p][1], Tag(2, 1, 0, 0, 1), lambda d, s: np.maximum(d, s, out=d))
             for p in peers]
    reqs += [t.isend(p, a[0], Tag(2, 0, 0, 0, 1)) for p in peers]
    reqs += [t.isend(p, a[1], Tag(2, 1, 0, 0, 1)) for p in peers]
    t.wait_all(reqs, dl, "reduce")
    for p in peers:
        assert np.array_equal(got[p][0], np.full(700_001, 1.0 + p))
        assert np.array_equal(got[p][1], np.maximum(np.arange(1001), 500))

    # Communicators do not steal each other's messages: comm 7 is sent first, comm 8 is
    # received first; the comm-7 message is queued, not mismatched.
    right, left = (rank + 1) % size, (rank - 1) % size
    s7, s8 = np.full(3000, rank, np.int16), np.full(5, rank + 100, np.int16)
    sends = [t.isend(right, s7, Tag(7, 0, 0, 0, 3000)), t.isend(right, s8, Tag(8, 0, 0, 0, 5))]
    r8 = np.empty(5, np.int16)
    t.wait_all([t.irecv(left, r8, Tag(8, 0, 0, 0, 5))], dl, "comm 8")
    r7 = np.empty(3000, np.int16)
    t.wait_all([t.irecv(left, r7, Tag(7, 0, 0, 0, 3000))] + sends, dl, "comm 7")
    assert (r8 == left + 100).all() and (r7 == left).all()

    # Threads: two communicators driven concurrently through the one transport.
    errors = []

    def worker(comm):
        try:
            out, inp = np.empty(4), np.empty(4)
            for i in range(150):
                out[:] = rank * 1000 + i
                t.wait_all([t.irecv(left, inp, Tag(comm, i, 0, 0, 4)),
                            t.isend(right, out, Tag(comm, i, 0, 0, 4))], dl, f"thread {comm}")
                assert (inp == left * 1000 + i).all()
        except BaseException as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(c,)) for c in (20, 21)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(SETUP)
    assert not errors and not any(th.is_alive() for th in threads), errors
    return t.describe()


def _barrier(store, size, name):
    if store.add(name, 1) == size:
        store.set(name + "/go", b"1")
    store.get(name + "/go")


def sc_ring(t, rank, size, store):
    """Full-duplex ring, 64 MiB each way per rank, reduced on arrival."""
    n = (64 << 20) // 4
    mine = np.full(n, rank + 1, np.float32)
    acc = np.full(n, 0.5, np.float32)
    right, left = (rank + 1) % size, (rank - 1) % size
    dl = time.monotonic() + SETUP
    _barrier(store, size, "ring")     # time the transfer, not the skew of the ranks' setup
    t0 = time.perf_counter()
    t.wait_all([t.irecv(left, acc, Tag(1, 0, 0, 0, n), ADD),
                t.isend(right, mine, Tag(1, 0, 0, 0, n))], dl, "ring")
    elapsed = time.perf_counter() - t0
    assert (acc == left + 1.5).all()
    return mine.nbytes / elapsed / 1e9


def sc_mismatch(t, rank, size, store):
    dl = time.monotonic() + SETUP
    out = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            t.wait_all([t.irecv(1, np.empty(3), Tag(99, 4, 6, 0, 3))], t0 + 0.3, "allreduce #4")
        except CommTimeout as e:
            out["timeout"] = [str(e), time.monotonic() - t0]
        store.set("timed-out", b"1")
        t.wait_all([t.isend(1, np.zeros(10), Tag(1, 5, 2, ALLREDUCE, 10))], dl, "send")
        t0 = time.monotonic()
        try:                          # rank 1 aborts: we learn it now, not at our deadline
            t.wait_all([t.irecv(1, np.empty(10), Tag(1, 6, 0, ALLREDUCE, 10))], dl, "next")
        except PeerFailure as e:
            out["abort"] = [str(e), time.monotonic() - t0]
    else:
        store.get("timed-out")
        try:
            t.wait_all([t.irecv(0, np.empty(12), Tag(1, 5, 2, ALLREDUCE, 12))], dl, "allreduce #5")
        except MismatchError as e:
            out["mismatch"] = str(e)
            t.abort(f"MismatchError: {e}")    # what the communicator does
    return out


def sc_killed(t, rank, size, store):
    if rank == 1:
        store.set("ready", b"1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.get("ready")
    out = {}
    t0 = time.monotonic()
    try:
        t.wait_all([t.irecv(1, np.empty(10), Tag(1, 1, 0, 0, 10))], t0 + SETUP, "recv")
    except PeerFailure as e:
        out["recv"] = [str(e), time.monotonic() - t0]
    t0 = time.monotonic()
    try:                              # more than ring and socket buffers hold
        t.wait_all([t.isend(1, np.zeros(16 << 20), Tag(1, 2, 0, 0, 1))], t0 + SETUP, "send")
    except PeerFailure as e:
        out["send"] = [str(e), time.monotonic() - t0]
    return out


def sc_exchange(t, rank, size, store):
    right, left = (rank + 1) % size, (rank - 1) % size
    got = np.empty(100, np.int64)
    t.wait_all([t.irecv(left, got, Tag(1, 0, 0, 0, 100)),
                t.isend(right, np.arange(100) * rank, Tag(1, 0, 0, 0, 100))],
               time.monotonic() + SETUP, "exchange")
    return bool((got == np.arange(100) * left).all())


def sc_small_steps(t, rank, size, store):
    right, left = (rank + 1) % size, (rank - 1) % size
    a, b = np.full(1, float(rank)), np.zeros(1)
    dl = time.monotonic() + SETUP
    t0 = time.perf_counter()
    for i in range(1000):
        tag = Tag(1, i, 0, 0, 1)
        t.wait_all([t.irecv(left, b, tag), t.isend(right, a, tag)], dl, "small step")
    assert b[0] == left
    return (time.perf_counter() - t0) / 1000, t.oversubscribed     # what shm decided


def sc_one_record_sends(t, rank, size, store):
    """shm's send_now up to a chunk (the small path's upper sizes): whole records while the ring
    has room, then False -- and False for every later message while one is queued (FIFO) --
    and False for what isend sends otherwise (above a chunk: streamed, or from registered
    memory a descriptor). A registered message of up to a chunk is one record like any other.
    The receiver gets every message, in order, by recv_now or irecv."""
    chunk, dl, k = t.small_bytes, time.monotonic() + SETUP, 8
    call = pack_call("broadcast", "none", "tree", np.uint8, 0)
    msgs = [np.full(chunk, i + 1, dtype=np.uint8) for i in range(k)]
    if rank == 0:
        went = 0
        while went < k and t.send_now(1, msgs[went], Tag(1, went, 0, call, chunk)):
            went += 1
        reqs = [t.isend(1, msgs[i], Tag(1, i, 0, call, chunk)) for i in range(went, k)]
        refused = [t.send_now(1, msgs[0], Tag(1, k, 0, call, chunk))]        # one is queued
        store.set("filled", b"1")
        t.wait_all(reqs, dl, "fill")
        t.wait_all([t.isend(1, msgs[0], Tag(1, k, 0, call, chunk))], dl, "last")
        big = np.zeros(chunk + 8, dtype=np.uint8)
        reg = t.register_memory(chunk + 8)
        reg[:] = 9
        refused += [t.send_now(1, big, Tag(1, k + 1, 0, call, big.size)),
                    t.send_now(1, reg, Tag(1, k + 2, 0, call, reg.size))]
        t.wait_all([t.isend(1, big, Tag(1, k + 1, 0, call, big.size)),
                    t.isend(1, reg, Tag(1, k + 2, 0, call, reg.size))], dl, "others")
        small_reg = t.register_memory(EAGER_PLUS)
        small_reg[:] = 5
        took = t.send_now(1, small_reg, Tag(1, k + 3, 0, call, EAGER_PLUS))
        if not took:
            t.wait_all([t.isend(1, small_reg, Tag(1, k + 3, 0, call, EAGER_PLUS))], dl, "reg")
        return {"went": went, "refused": refused, "chunk": chunk, "small_registered": took}
    store.get("filled")
    got, taken = [], 0
    for i in range(k + 1):
        buf = np.empty(chunk, dtype=np.uint8)
        if t.recv_now(0, buf, Tag(1, i, 0, call, chunk), None, 0.01):
            taken += 1
        else:
            t.wait_all([t.irecv(0, buf, Tag(1, i, 0, call, chunk))], dl, "recv")
        got.append(int(buf[0]) if (buf == buf[0]).all() else -1)
    rest = [np.empty(chunk + 8, dtype=np.uint8), np.empty(chunk + 8, dtype=np.uint8),
            np.empty(EAGER_PLUS, dtype=np.uint8)]
    t.wait_all([t.irecv(0, rest[0], Tag(1, k + 1, 0, call, chunk + 8)),
                t.irecv(0, rest[1], Tag(1, k + 2, 0, call, chunk + 8)),
                t.irecv(0, rest[2], Tag(1, k + 3, 0, call, EAGER_PLUS))], dl, "others")
    return {"got": got, "taken": taken, "rest": [int(b.min()) + 100 * int(b.max()) for b in rest],
            "single_copy": dict(t.received_single_copy)}


def sc_hold(t, rank, size, store):
    store.get("release")


# ------------------------------------------------------------------------------ store tests
def test_store_set_get_add_and_timeout():
    token = new_token()
    with StoreServer("127.0.0.1", 0, token) as srv, \
            StoreClient("127.0.0.1", srv.port, token, timeout=5) as a, \
            StoreClient("127.0.0.1", srv.port, token, timeout=5) as b:
        a.set("k", b"v\x00\xff")
        assert b.get("k") == b"v\x00\xff"
        threading.Timer(0.05, lambda: a.set("late", b"x")).start()
        assert b.get("late", timeout=5) == b"x"            # blocks until set
        with pytest.raises(CommTimeout, match="'missing'"):
            b.get("missing", timeout=0.2)

        def bump():
            with StoreClient("127.0.0.1", srv.port, token, timeout=5) as c:
                for _ in range(50):
                    c.add("n", 1)
        threads = [threading.Thread(target=bump) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        assert a.add("n", 0) == 200                           # atomic


def test_store_refuses_strangers_and_keeps_serving():
    token = new_token()
    with StoreServer("127.0.0.1", 0, token) as srv:
        with pytest.raises(AuthError):
            StoreClient("127.0.0.1", srv.port, new_token(), timeout=5)
        silent = socket.create_connection(("127.0.0.1", srv.port))   # never speaks
        garbage = socket.create_connection(("127.0.0.1", srv.port))
        garbage.settimeout(5)
        garbage.recv(48)                                      # the server's challenge
        garbage.sendall(os.urandom(64))
        assert garbage.recv(1) == b""                         # refused: disconnected
        with StoreClient("127.0.0.1", srv.port, token, timeout=5) as c:
            c.set("still", b"serving")
            assert c.get("still") == b"serving"
        silent.close()
        garbage.close()


# -------------------------------------------------------------------------- transport tests
@pytest.mark.parametrize("kind,size,nodes", [("shm", 3, None), ("tcp", 3, None),
                                             ("auto", 4, [0, 0, 1, 1])])
def test_p2p_fifo_reduce_comms_threads(kind, size, nodes, no_leftovers):
    job = Job("sc_p2p", size, kind, nodes)
    no_leftovers(job)
    desc = job.run().values()
    if kind == "auto":
        assert desc[0] == "rank 0: shm to [1], tcp to [2, 3]"
        assert desc[3] == "rank 3: shm to [2], tcp to [0, 1]"
    else:
        assert desc[1] == f"rank 1: {kind} to [0, 2]"


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_full_duplex_ring_64mib(kind, no_leftovers):
    job = Job("sc_ring", 3, kind)
    no_leftovers(job)
    rates = job.run().values()
    print(f"\n{kind}: 64 MiB ring with reduce, per-rank GB/s: {[round(r, 2) for r in rates]}")


def test_send_now_moves_a_chunk_as_one_record_and_leaves_the_rest_to_isend(no_leftovers):
    job = Job("sc_one_record_sends", 2, "shm")
    no_leftovers(job)
    sender, receiver = job.run().values()
    assert sender["chunk"] == shm.CHUNK
    # the 4 MiB ring takes a few whole 1 MiB records, then no more until the receiver drains
    assert 1 <= sender["went"] < 8, sender
    assert sender["refused"] == [False, False, False], sender
    assert sender["small_registered"] is True, sender      # a chunk or less: one record
    assert receiver["got"] == [1, 2, 3, 4, 5, 6, 7, 8, 1], receiver       # all, in order
    assert receiver["rest"] == [0, 909, 505], receiver
    # only the registered message above a chunk went as a registered-memory descriptor
    assert receiver["single_copy"]["registered"] == 1, receiver
    assert receiver["taken"] >= sender["went"], (sender, receiver)


def test_more_ranks_than_cores_keep_full_speed(no_leftovers):
    """4 shm ranks on 2 cores: waiting ranks yield and then sleep, so a ring of small steps runs
    at scheduler speed. A pure busy-spin would burn each time slice (ms per step). The ranks
    are pinned to 2 of this host's CPUs, whatever it has, and shm must see them outnumbered."""
    job = Job("sc_small_steps", 4, "shm")
    no_leftovers(job)
    allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)[:2]
    os.sched_setaffinity(0, cpus)         # the ranks, fresh interpreters, inherit it
    try:
        results = job.run().values()
    finally:
        os.sched_setaffinity(0, allowed)
    per_step = max(step for step, _ in results)
    print(f"\n4 shm ranks on {len(cpus)} cores: {per_step * 1e6:.0f} us per ring step")
    assert [shared for _, shared in results] == [True] * 4
    assert per_step < 1e-3


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_timeout_and_mismatch(kind, no_leftovers):
    job = Job("sc_mismatch", 2, kind)
    no_leftovers(job)
    r0, r1 = job.run().values()
    msg, waited = r0["timeout"]
    assert 0.25 < waited < 5
    assert "allreduce #4" in msg and "step 6" in msg and "rank 1" in msg
    assert "rank 0 called allreduce" in r1["mismatch"] and "count=10" in r1["mismatch"]
    assert "count=12" in r1["mismatch"]
    msg, waited = r0["abort"]
    assert waited < 5 and "rank 1" in msg and "aborted: MismatchError" in msg, msg


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_killed_peer_is_reported_quickly(kind, no_leftovers):
    job = Job("sc_killed", 2, kind)
    no_leftovers(job)
    job.run()
    assert job.exitcodes[1] == -signal.SIGKILL
    out = job.results[0]
    assert out["ok"], out.get("tb")
    for op in ("recv", "send"):
        msg, waited = out["value"][op]
        assert waited < 5 and "rank 1" in msg, (op, msg, waited)


def test_stray_tcp_clients_are_refused_while_the_job_goes_on(no_leftovers):
    job = Job("sc_exchange", 3, "tcp", gate=True)
    no_leftovers(job)
    strays = []

    def during(job):
        with StoreClient("127.0.0.1", job.port, job.token, timeout=SETUP) as c:
            host, port = c.get("addr/0").decode().rsplit(":", 1)   # rank 0 is listening
            silent = socket.create_connection((host, int(port)))    # connects, never speaks
            strays.append(silent)
            rude = socket.create_connection((host, int(port)))
            rude.settimeout(10)
            assert len(rude.recv(48)) == 48                        # the challenge
            rude.sendall(os.urandom(64))                            # a wrong answer
            assert rude.recv(1) == b""                              # refused, nothing read
            rude.close()
            job.released = time.monotonic()
            c.set("go", b"1")         # now the other ranks connect, the silent stray still there

    t0 = time.monotonic()
    try:
        assert job.run(during=during).values() == [True, True, True]
    finally:
        for s in strays:
            s.close()
    # The silent stray's handshake times out only after 10 s: the job did not wait for it.
    assert time.monotonic() - job.released < 9, time.monotonic() - t0


def test_sweep_removes_segments_of_killed_ranks():
    job = Job("sc_hold", 2, "shm", gate=True)   # rank 1 never starts: rank 0 waits in setup

    def during(job):
        with StoreClient("127.0.0.1", job.port, job.token, timeout=SETUP) as c:
            c.get("shm/0")                      # rank 0's segment exists (not yet unlinked)
            assert os.path.exists(segment_path(job.job_id, 0))
            os.kill(job_pid(job), signal.SIGKILL)
            c.set("go", b"1")

    def job_pid(job):
        return [p.pid for p in mp.active_children() if p.name == "rank0"][0]

    job.run(during=during)
    assert job.exitcodes[0] == -signal.SIGKILL
    # rank 1 found rank 0's listener gone: a named failure at once, not the setup timeout
    assert job.results[1]["type"] == "PeerFailure" and "rank 0" in job.results[1]["error"], \
        job.results[1]
    assert sweep_job_segments(job.job_id) == [segment_path(job.job_id, 0)]
    assert _leftovers(job.job_id) == []


def test_dialing_a_local_peer_that_stopped_listening_is_a_peer_failure():
    """A local (AF_UNIX) peer's listener name is published only once it listens, so a refused
    connection means the peer is gone (killed, or it gave up its setup): PeerFailure naming it,
    where the dialer used to retry until the setup deadline and then raise CommTimeout. A full
    listen queue is EAGAIN, not a refusal, and is still retried
    (test_security.py::test_dialer_retries_a_full_listen_queue)."""
    name = f"\0minicomm-test-gone-{os.getpid()}"
    with pytest.raises(PeerFailure, match="rank 0 .*no longer listens"):
        dial_peer(socket.AF_UNIX, name, new_token(), 1, 0, time.monotonic() + 20,
                  refused_is_final=True)


# ------------------------------------------------------------------------------ measurements
def sc_bench(t, rank, size, store):
    right, left = (rank + 1) % size, (rank - 1) % size
    dl = time.monotonic() + 120
    a, b = np.zeros(1), np.zeros(1)
    _barrier(store, size, "bench")
    for i in range(-200, 3000):
        if i == 0:
            t0 = time.perf_counter()
        tag = Tag(1, i, 0, 0, 1)
        t.wait_all([t.irecv(left, b, tag, ADD), t.isend(right, a, tag)], dl, "latency")
    lat = (time.perf_counter() - t0) / 3000 * 1e6
    big = np.ones(64 << 20, np.uint8)
    dst = np.zeros_like(big)
    rates = []
    for i in range(3):
        _barrier(store, size, f"one-way{i}")
        t0 = time.perf_counter()
        if rank == 0:
            t.wait_all([t.isend(1, big, Tag(2, i, 0, 0, 0))], dl, "one-way")
        elif rank == 1:
            t.wait_all([t.irecv(0, dst, Tag(2, i, 0, 0, 0))], dl, "one-way")
        rates.append(big.nbytes / (time.perf_counter() - t0) / 1e9)
    return {"latency_us": round(lat, 1), "one_way_GBps": round(max(rates), 2)}


if __name__ == "__main__":
    for kind in ("shm", "tcp"):
        for size in (2, 4):
            vals = Job("sc_bench", size, kind).run(timeout=300).values()
            print(f"{kind} x{size}: 8-byte step (irecv+reduce, isend, wait_all) "
                  f"{max(v['latency_us'] for v in vals)} us; 64 MiB one-way "
                  f"{vals[1]['one_way_GBps']} GB/s")
        vals = Job("sc_ring", 3, kind).run(timeout=300).values()
        print(f"{kind} x3: 64 MiB full-duplex ring with reduce {min(vals):.2f} GB/s per rank")
    sys.exit(0)
