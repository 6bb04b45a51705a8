"""Single-copy large messages over shm (transports/cma.py): the ctypes calls themselves, the
per-peer probe and its failure reasons, the forced fallback (MINICOMM_CMA=0) to the ring path,
and the collective matrix over real processes with single copy on and off, against numpy."""
import errno
import os
import subprocess
import sys

import numpy as np
import pytest

import minicomm as mc
from collective_check import matrix
from leaks import job_segments, my_worker_processes, nothing_left_behind  # noqa: F401
from minicomm.transports import cma

needs_cma = pytest.mark.skipif(cma.disabled() is not None,
                               reason=f"single copy unavailable: {cma.disabled()}")


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# ------------------------------------------------------------------------- the calls
@needs_cma
def test_read_and_write_move_exact_bytes_of_another_process():
    # a child that holds a known buffer and waits; we read it and write into it
    code = ("import numpy as np, sys\n"
            "a = (np.arange(1 << 20, dtype=np.int64) * 7).astype(np.int64)\n"
            "b = np.zeros(1000, dtype=np.uint8)\n"
            "print(a.__array_interface__['data'][0], b.__array_interface__['data'][0], flush=True)\n"
            "sys.stdin.readline()\n"
            "print(int(b.sum()), int(b[0]), int(b[999]), flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        a_addr, b_addr = map(int, child.stdout.readline().split())
        got = np.empty(1 << 20, dtype=np.int64)
        cma.read(child.pid, a_addr, got.view(np.uint8))
        np.testing.assert_array_equal(got, np.arange(1 << 20, dtype=np.int64) * 7)
        part = np.empty(3, dtype=np.int64)                 # at an offset
        cma.read(child.pid, a_addr + 8 * 5, part.view(np.uint8))
        assert part.tolist() == [35, 42, 49]
        cma.write(child.pid, b_addr, np.full(1000, 3, dtype=np.uint8))
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["3000", "3", "3"]
    finally:
        child.kill()
        child.wait()


def test_a_dead_process_gives_esrch_and_a_probe_names_the_reason():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()                                       # reaped: the pid is free
    with pytest.raises(cma.CmaError) as ei:
        cma.read(child.pid, 4096, np.empty(8, dtype=np.uint8))
    assert ei.value.errno == errno.ESRCH
    why = cma.probe(child.pid, 4096, b"x" * 16)
    assert why is not None and ("ESRCH" in why or cma.ENV in why)


@needs_cma
def test_probe_checks_the_bytes_not_only_the_call():
    token = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
    assert cma.probe(os.getpid(), _addr(token), token.tobytes()) is None
    why = cma.probe(os.getpid(), _addr(token), bytes(16))
    assert why is not None and "other bytes" in why


def test_env_forces_single_copy_off_and_bad_threshold_is_named(monkeypatch):
    monkeypatch.setenv(cma.ENV, "0")
    token = np.zeros(16, dtype=np.uint8)
    assert cma.disabled() == "MINICOMM_CMA=0"
    assert cma.probe(os.getpid(), _addr(token), token.tobytes()) == "MINICOMM_CMA=0"
    monkeypatch.setenv(cma.MIN_ENV, "lots")
    with pytest.raises(ValueError, match="MINICOMM_CMA_MIN"):
        cma.min_bytes()


# ------------------------------------------------------------------- over the transport
def _matrix_and_paths(comm):
    t = comm.transport
    n = 0
    for algo in ("ring", "tree", "rhd", "auto"):
        # 20001 elements: every message is above the eager size (16 KiB) and MINICOMM_CMA_MIN
        n += matrix(comm, algo, counts=(20001,), dtypes=("int32", "float64"),
                    all_roots=comm.size <= 2, every_op=False)
    return n, t.single_copy_peers(), t.describe_copies(), t.received_single_copy["cma"]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("mode", ["single-copy", "forced-off"])
def test_matrix_over_shm_with_and_without_single_copy(p, mode, monkeypatch):
    monkeypatch.setenv(cma.MIN_ENV, "4096")
    if mode == "forced-off":
        monkeypatch.setenv(cma.ENV, "0")
    elif cma.disabled() is not None:
        pytest.skip(f"single copy unavailable: {cma.disabled()}")
    res = mc.spawn(_matrix_and_paths, p, transport="shm", timeout=180)
    for r, (n, peers, text, reads) in enumerate(res):
        assert n == res[0][0] > 0
        others = [q for q in range(p) if q != r]
        if mode == "forced-off":
            assert peers == [] and "MINICOMM_CMA=0" in text, text
            assert reads == 0
        else:
            assert peers == others, text
            assert "single-copy" in text
            # the small path leaves single-copy sends to isend: messages really went that way
            assert reads > 0


def _p2p_out_of_the_way(comm):
    """A large p2p message meets a receiver busy with a collective: the receiver reads it out of
    the way (an unexpected message) so the collective goes on; then the receive takes it."""
    big = np.arange(1 << 20, dtype=np.float64) + comm.rank    # 8 MiB
    if comm.rank == 0:
        comm.send(big, 1, tag=5)          # returns once rank 1 has read it
        comm.barrier()
        return True
    comm.barrier()
    got = comm.recv(0, tag=5)
    return bool(np.array_equal(got, np.arange(1 << 20, dtype=np.float64)))


def test_large_p2p_send_is_read_out_of_the_way_of_a_collective():
    assert mc.spawn(_p2p_out_of_the_way, 2, transport="shm", timeout=60) == [True, True]


def _small_receive_behind_a_descriptor(comm):
    # Transport level, so the ring's order is certain: rank 0 posts a 4 MiB single-copy send on
    # context 100 (a descriptor record) and then an 8-byte send on context 104. Rank 1, once
    # both records are in its ring, takes the small one with recv_now (the small-message path):
    # the descriptor must read as a record of another context, not as a wrap marker.
    import time

    from minicomm.transports.base import Tag
    from minicomm.transports.shm.layout import _HEAD
    t = comm.transport
    big = np.arange(1 << 19, dtype=np.float64)
    a, b = Tag(100, 1, 0, 0, big.size), Tag(104, 1, 0, 0, 1)
    if comm.rank == 0:
        reqs = [t.isend(1, big, a), t.isend(1, np.full(1, 7.0), b)]
        t.wait_all(reqs, time.monotonic() + 20, "sends")
        return True
    p = t._peer(0)
    deadline = time.monotonic() + 20
    while p.rx_q[_HEAD] - p.rx_tail < 2 * 128 and time.monotonic() < deadline:
        time.sleep(0.001)             # polling for the two records, bounded by the deadline
    small, got = np.zeros(1), np.zeros_like(big)
    reqs = [] if t.recv_now(0, small, b, None, 0.0) else [t.irecv(0, small, b)]
    reqs.append(t.irecv(0, got, a))
    t.wait_all(reqs, time.monotonic() + 20, "receives")
    return (float(small[0]) == 7.0 and bool(np.array_equal(got, big))
            and t.received_single_copy["cma"] == 1)


@needs_cma
def test_a_small_receive_behind_a_single_copy_descriptor_in_the_ring(monkeypatch):
    monkeypatch.setenv(cma.MIN_ENV, str(cma.DEFAULT_MIN))   # the 4 MiB send goes single-copy
    assert mc.spawn(_small_receive_behind_a_descriptor, 2, transport="shm",
                    timeout=30) == [True, True]


def _inplace_and_reuse(comm):
    p, r = comm.size, comm.rank
    n = 600_000                                              # 2.4 MB blocks of float32
    buf = np.empty((p, n), dtype=np.float32)
    for it in range(3):                                      # the same buffers, changed between
        buf[r] = r + 10 * it
        comm.allgather(buf[r], out=buf)                      # in place: our block is inside
        want = np.repeat((np.arange(p) + 10 * it)[:, None], n, axis=1).astype(np.float32)
        assert np.array_equal(buf, want), it
        x = np.full((p, n), r + it, dtype=np.float32)
        y = comm.alltoall(x)
        assert np.array_equal(y, np.repeat((np.arange(p) + it)[:, None], n, axis=1)), it
    return comm.transport.single_copy_peers()


def test_in_place_allgather_and_buffer_reuse_at_default_threshold():
    if cma.disabled() is not None:
        pytest.skip(f"single copy unavailable: {cma.disabled()}")
    res = mc.spawn(_inplace_and_reuse, 3, transport="shm", timeout=60)
    assert res == [[1, 2], [0, 2], [0, 1]]


def _killed_while_read(comm):
    import signal
    x = np.ones(4 << 20, dtype=np.float32)                  # 16 MiB broadcasts, single copy
    for i in range(1000):
        if comm.rank == 1 and i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.broadcast(x, root=1)


def test_a_sender_killed_mid_job_is_a_peer_failure_not_a_hang():
    with pytest.raises(mc.SpawnError) as ei:
        mc.spawn(_killed_while_read, 2, transport="shm", timeout=60)
    assert "rank 1" in str(ei.value)


def _model_single_copy(comm):
    return comm.link_model.single_copy, comm.transport.single_copy_from()


@pytest.mark.parametrize("mode", ["on", "off"])
def test_the_cost_model_prices_single_copy_only_where_it_is_on(mode, monkeypatch):
    """auto's model (minicomm.cost) knows the world's shm pairs read each other single-copy,
    so it prices a large non-reducing call's messages as one read; with MINICOMM_CMA=0 (or a
    kernel that forbids it) it prices the two copies through the ring."""
    if mode == "off":
        monkeypatch.setenv(cma.ENV, "0")
    elif cma.disabled() is not None:
        pytest.skip(f"single copy is off here: {cma.disabled()}")
    got = mc.spawn(_model_single_copy, 3, transport="shm", timeout=60)
    chosen = got[0][1]                 # rank 0's pairs: the size their probes chose
    assert chosen in ((cma.DEFAULT_MIN, cma.SLOW_MIN) if mode == "on" else (0,))
    assert [m for m, _ in got] == [chosen] * 3


def _thresholds(comm, marker):
    # a 1 MiB point-to-point send returns while its receiver is outside the library (eager,
    # through the ring): rank 1 enters it only once rank 0 says its send returned, which a
    # rendezvous send would never do (rank 1 then gives up after 20 s); a collective's message
    # of the size the pair's probe chose goes single-copy, one a byte smaller through the ring
    import time
    t = comm.transport
    big = np.arange(1 << 17, dtype=np.float64)                # 1 MiB
    if comm.rank == 0:
        comm.send(big, 1, tag=3)
        open(marker, "w").close()
    else:
        deadline = time.monotonic() + 20
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "the 1 MiB send did not return by itself"
            time.sleep(0.01)          # a file to appear, outside the library: bounded above
        got = comm.recv(0, tag=3)
        assert np.array_equal(got, big)
    p2p_reads = t.received_single_copy["cma"]
    chosen = t._peer(1 - comm.rank).cma_min        # what rank 1's probe chose for rank 0's sends
    chosen = int(comm.broadcast(np.array([chosen]), root=0)[0])
    # tree: one message of the whole size (auto may pick ring, whose segments are smaller)
    below = comm.broadcast(np.full(chosen - 8, comm.rank + 1, dtype=np.uint8), root=0,
                           algorithm="tree")
    ring_reads = t.received_single_copy["cma"]
    y = comm.broadcast(np.full(chosen, comm.rank + 1, dtype=np.uint8), root=0, algorithm="tree")
    assert np.array_equal(y, np.ones(chosen, dtype=np.uint8)) and (below == 1).all()
    return chosen, p2p_reads, ring_reads, t.received_single_copy["cma"]


@needs_cma
def test_collectives_go_single_copy_from_the_probed_size_and_p2p_stays_eager_to_2m(tmp_path):
    assert cma.DEFAULT_MIN == 256 << 10 and cma.P2P_MIN == 2 << 20
    res = mc.spawn(_thresholds, 2, args=(str(tmp_path / "sent"),), transport="shm", timeout=60)
    assert res[1][0] in (cma.DEFAULT_MIN, cma.SLOW_MIN)
    # rank 1: the p2p payload and the broadcast just below the size came through the ring, the
    # broadcast of the size single-copy
    assert res[1][1:] == (0, 0, 1)


def test_the_probe_chooses_single_copy_from_256k_where_the_read_keeps_up_with_two_copies():
    assert cma.choose_min(20e-6, 10e-6) == cma.DEFAULT_MIN       # read = the ring's two copies
    assert cma.choose_min(8e-6, 12e-6) == cma.DEFAULT_MIN
    assert cma.choose_min(46e-6, 10e-6) == cma.SLOW_MIN           # this EPYC VM: ~4.5x a copy
    assert cma.SLOW_MIN > cma.P2P_MIN > cma.DEFAULT_MIN


def _paces(comm):
    t = comm.transport
    return {p.rank: (p.cma_pace, p.cma_min) for p in t._peers.values()}, t.describe_copies()


@needs_cma
def test_each_senders_threshold_is_what_its_receivers_probe_chose():
    res = mc.spawn(_paces, 3, transport="shm", timeout=60)
    for r, (pairs, text) in enumerate(res):
        for q, (pace, threshold) in pairs.items():
            reader_pace = res[q][0][r][0]          # q's probe of r's memory decides r's sends
            assert reader_pace is not None and reader_pace[0] > 0 and reader_pace[1] > 0
            assert threshold == cma.choose_min(*reader_pace), (r, q)
            assert f"{threshold} B to {q}" in text


def _fixed(comm):
    return sorted({p.cma_min for p in comm.transport._peers.values()})


@needs_cma
def test_minicomm_cma_min_overrides_the_probe(monkeypatch):
    monkeypatch.setenv(cma.MIN_ENV, "123456")
    assert mc.spawn(_fixed, 2, transport="shm", timeout=60) == [[123456], [123456]]
