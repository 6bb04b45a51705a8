"""Issue 11: the simulated rdma and ub transports and MPI-3 windows, in real processes.

- the collective matrix over rdma and over ub, 1 and 2 emulated nodes (shared mappings inside a
  node, NIC agents over authenticated sockets between), world sizes 1..5;
- windows over shm, rdma and ub: fence epochs, exclusive-lock counter, concurrent shared locks,
  exact accumulates from every rank, compare-and-swap, passive-target progress while the target
  computes, epoch and bound errors that change nothing;
- the verbs and URMA surfaces: WRITE_WITH_IMM consuming a posted receive, bad rkey / token /
  bound / permission each giving its named error with the target memory untouched, the QP and
  Jetty error states, JFS ordering, SEND into a JFR;
- nothing leaks: no /dev/shm segment, rank process or minicomm thread after any test, failure
  cases included.
Expected values are computed with plain numpy (collective_check) or closed forms.
"""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import minicomm as mc
from collective_check import matrix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_SIDED = [("shm", 1), ("rdma", 1), ("rdma", 2), ("ub", 1), ("ub", 2)]


from leaks import job_segments, my_worker_processes, nothing_left_behind  # noqa: F401


def _closed_cleanly(comm):
    """Close the communicator inside the rank and report minicomm threads still running."""
    comm.close()
    return [t.name for t in threading.enumerate() if t.name.startswith("minicomm-")
            and "handshake" not in t.name]


# ------------------------------------------------------------------------ the collective matrix
def _all_algorithms(comm):
    n = 0
    for algo in ("ring", "tree", "rhd", "hier", "auto"):
        n += matrix(comm, algo, counts=(0, 1, 2 * comm.size + 1), dtypes=("int32", "float32"),
                    all_roots=comm.size <= 3, every_op=False)
    return n, _closed_cleanly(comm)


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("kind", ["rdma", "ub"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_collective_matrix(kind, nodes, p):
    if nodes > p:
        pytest.skip("more nodes than ranks")
    res = mc.spawn(_all_algorithms, p, transport=kind, nodes=nodes, timeout=300)
    assert len({n for n, _ in res}) == 1 and res[0][0] > 0
    assert all(left == [] for _, left in res), res


def _large(comm):
    n = (3 << 20) // 8 + 5                          # several landing slots, an odd tail
    x = np.arange(n, dtype=np.float64) + comm.rank
    y = comm.allreduce(x, algorithm="ring")
    want = np.arange(n, dtype=np.float64) * comm.size + sum(range(comm.size))
    g = comm.allgather(np.full(200_001, comm.rank, dtype=np.int16))
    return bool(np.array_equal(y, want)) and all(bool((g[r] == r).all()) for r in range(comm.size))


@pytest.mark.parametrize("kind,nodes", [("rdma", 1), ("rdma", 2), ("ub", 1), ("ub", 2)])
def test_large_messages_stream_through_landing_slots(kind, nodes):
    assert mc.spawn(_large, 3, transport=kind, nodes=nodes, timeout=300) == [True] * 3


def test_minicomm_run_with_a_forced_one_sided_transport(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import numpy as np, minicomm as mc\n"
                      "comm = mc.init()\n"
                      "y = comm.allreduce(np.ones(3) * comm.rank)\n"
                      "print(comm.transport.name, comm.node, y.tolist())\n")
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "3", "--nodes", "2",
                          "--transport", "ub", str(script)], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = sorted(line.split("] ", 1)[1] for line in out.stdout.splitlines() if "] " in line)
    assert lines == ["ub 0 [3.0, 3.0, 3.0]", "ub 0 [3.0, 3.0, 3.0]", "ub 1 [3.0, 3.0, 3.0]"]


# ---------------------------------------------------------------------------------- windows
def _fence_epochs(comm):
    p, r = comm.size, comm.rank
    win = comm.window(np.full(p, -1, dtype=np.int64))
    seen = []
    for epoch in range(3):
        win.fence()
        for t in range(p):
            win.put(np.array([100 * epoch + r]), t, offset=r)
        win.fence()
        seen.append(win.local.tolist())
    got = win.get((r + 1) % p)
    win.free()
    return seen, got.tolist(), _closed_cleanly(comm)


@pytest.mark.parametrize("kind,nodes", ONE_SIDED)
def test_fence_epochs_see_every_put(kind, nodes):
    p = 3
    for seen, got, left in mc.spawn(_fence_epochs, p, transport=kind, nodes=nodes, timeout=120):
        assert seen == [[100 * e + q for q in range(p)] for e in range(3)]
        assert got == [200 + q for q in range(p)]
        assert left == []


def _locked_counter(comm, n):
    win = comm.window(np.zeros(1, dtype=np.int32))
    for _ in range(n):
        win.lock(0, exclusive=True)
        v = win.get(0, 0, 1)
        win.put(v + 1, 0, 0)
        win.unlock(0)
    win.fence()
    total = int(win.get(0, 0, 1)[0])
    win.free()
    return total


@pytest.mark.parametrize("kind,nodes", [("shm", 1), ("rdma", 2), ("ub", 2)])
def test_exclusive_lock_serialises_read_modify_write(kind, nodes):
    """1,000 lock / get / +1 / put / unlock by each of 4 ranks: exactly 4,000."""
    assert mc.spawn(_locked_counter, 4, args=(1000,), transport=kind, nodes=nodes,
                    timeout=600) == [4000] * 4


def _shared_locks(comm):
    win = comm.window(np.arange(16, dtype=np.float64) * (comm.rank + 1))
    readers = [r for r in range(comm.size) if r != 0]
    got = None
    if comm.rank in readers:
        win.lock(0, exclusive=False)
    comm.barrier()                    # every reader holds its shared lock on rank 0 right now
    if comm.rank in readers:
        got = win.get(0, 2, 5).tolist()
    comm.barrier()                    # ... and still does: the locks coexisted
    if comm.rank in readers:
        win.unlock(0)
    win.fence()
    win.free()
    return got


@pytest.mark.parametrize("kind,nodes", ONE_SIDED)
def test_shared_locks_allow_concurrent_gets(kind, nodes):
    res = mc.spawn(_shared_locks, 3, transport=kind, nodes=nodes, timeout=120)
    assert res == [None, [2.0, 3.0, 4.0, 5.0, 6.0], [2.0, 3.0, 4.0, 5.0, 6.0]]


def _accumulate_all(comm, dtype, reps):
    win = comm.window(np.zeros(4, dtype=dtype))
    win.fence()
    for _ in range(reps):
        win.accumulate(np.array([comm.rank + 1, 1], dtype=dtype), 0, offset=1)
    win.fence()
    fetched = [win.fetch_and_op(2, 0, 3) for _ in range(reps)]
    win.fence()
    after = win.get(0).tolist()
    win.free()
    return after, [float(v) for v in fetched]


@pytest.mark.parametrize("dtype", ["int64", "float64", "int32"])
@pytest.mark.parametrize("kind,nodes", ONE_SIDED)
def test_accumulate_from_every_rank_into_one_element_is_exact(kind, nodes, dtype):
    p, reps = 4, 50
    res = mc.spawn(_accumulate_all, p, args=(dtype, reps), transport=kind, nodes=nodes,
                   timeout=300)
    want = [0, reps * p * (p + 1) // 2, reps * p, 2 * reps * p]
    for after, _ in res:
        assert after == want
    fetched = sorted(v for _, f in res for v in f)   # fetch_and_op saw each old value once
    assert fetched == [2.0 * k for k in range(reps * p)]


def _cas_and_ops(comm):
    win = comm.window(np.zeros(3, dtype=np.int64))
    win.lock(0, exclusive=False)
    for _ in range(30):               # a CAS loop increment: atomic with respect to other CASes
        while True:
            cur = win.get(0, 0, 1)[0]
            if win.compare_and_swap(cur + 1, cur, 0, 0) == cur:
                break
    old = win.get_accumulate(np.array([5]), 0, 1, op="max")
    win.unlock(0)
    win.fence()
    out = win.get(0).tolist()
    win.free()
    return out, int(old[0])


@pytest.mark.parametrize("kind,nodes", ONE_SIDED)
def test_compare_and_swap_and_get_accumulate(kind, nodes):
    res = mc.spawn(_cas_and_ops, 3, transport=kind, nodes=nodes, timeout=120)
    assert all(out == [90, 5, 0] for out, _ in res)
    assert sorted(o for _, o in res) == [0, 5, 5]


def _passive_target(comm):
    """Rank 0 computes in a numpy loop, making no minicomm call, until the others' flag lands
    in its window (bounded by a deadline); it publishes its loop count in its own window. The
    others wait until it has looped a few times, then lock, put, accumulate, read back and set
    the flag -- all served while rank 0 computes."""
    import time
    n = 1000
    win = comm.window(np.zeros(n + 2, dtype=np.float64))
    deadline = time.monotonic() + 60
    if comm.rank == 0:
        a = np.random.default_rng(0).random((64, 64))
        loops = 0
        while win.local[n] < comm.size - 1 and time.monotonic() < deadline:
            a = np.tanh(a @ a)            # busy compute, no minicomm call
            loops += 1
            win.local[n + 1] = loops      # a plain local store
        result = win.local[:n].copy(), float(win.local[n]), loops
    else:
        win.lock(0, exclusive=False)
        seen = 0.0
        while seen < 3 and time.monotonic() < deadline:   # rank 0 is inside its loop now
            seen = win.get(0, n + 1, 1)[0]
        win.unlock(0)
        win.lock(0, exclusive=True)
        win.put(np.arange(n, dtype=np.float64), 0)
        win.accumulate(np.ones(n), 0, op="sum")
        back = win.get(0, 0, n)
        win.unlock(0)
        win.lock(0, exclusive=False)
        win.accumulate(np.array([1.0]), 0, offset=n)      # the flag: one more rank done
        win.unlock(0)
        result = bool(np.array_equal(back, np.arange(n) + 1.0)), float(seen)
    win.fence()
    win.free()
    return result


@pytest.mark.parametrize("kind,nodes", ONE_SIDED)
def test_passive_target_progress_while_the_target_computes(kind, nodes):
    res = mc.spawn(_passive_target, 2, transport=kind, nodes=nodes, timeout=120)
    data, flag, loops = res[0]
    read_back, seen = res[1]
    assert seen >= 3 and loops > seen and flag == 1.0 and read_back
    assert np.array_equal(data, np.arange(1000) + 1.0)


def _epoch_and_bound_errors(comm):
    win = comm.window(np.arange(10, dtype=np.int32))
    errors = []
    for call in (lambda: win.put(np.ones(2, np.int32), 1 - comm.rank),      # no epoch yet
                 lambda: win.get(1 - comm.rank),
                 lambda: win.unlock(0)):
        try:
            call()
        except mc.RMAError as e:
            errors.append(str(e)[:40])
    win.fence()
    other = 1 - comm.rank
    for call in (lambda: win.put(np.ones(2, np.int32), other, offset=9),    # one past the end
                 lambda: win.get(other, 8, 3),
                 lambda: win.accumulate(np.ones(11, np.int32), other),
                 lambda: win.fetch_and_op(1, other, 10),
                 lambda: win.compare_and_swap(1, 0, other, -1)):
        try:
            call()
        except mc.RMAError as e:
            errors.append("bounds" if "outside" in str(e) else str(e))
    for call, exc in ((lambda: win.put(np.ones(1), other), TypeError),      # float into int32
                      (lambda: win.get(5), ValueError),
                      (lambda: win.accumulate(np.ones(1, np.int32), other, op="avg"), ValueError)):
        try:
            call()
        except exc:
            errors.append(exc.__name__)
    win.fence()
    untouched = win.local.tolist()
    win.lock(other)
    try:
        win.lock(other)
    except mc.RMAError:
        errors.append("nested")
    try:
        win.fence()
    except mc.RMAError:
        errors.append("fence-while-locked")
    win.unlock(other)
    win.fence()
    win.free()
    try:
        win.put(np.ones(1, np.int32), other)
    except mc.RMAError:
        errors.append("freed")
    return errors, untouched


@pytest.mark.parametrize("kind,nodes", ONE_SIDED)
def test_errors_outside_epochs_and_bounds_change_nothing(kind, nodes):
    for errors, untouched in mc.spawn(_epoch_and_bound_errors, 2, transport=kind, nodes=nodes,
                                      timeout=120):
        assert len(errors) == 3 + 5 + 3 + 3, errors
        assert errors[3:8] == ["bounds"] * 5
        assert errors[8:] == ["TypeError", "ValueError", "ValueError", "nested",
                              "fence-while-locked", "freed"]
        assert untouched == list(range(10))


def test_window_copies_back_into_the_array_at_free():
    def fn(comm):
        a = np.zeros(4)
        win = comm.window(a)
        win.fence()
        win.put(np.array([comm.rank + 1.0]), (comm.rank + 1) % comm.size, offset=1)
        win.fence()
        before = a.tolist()
        win.free()
        return before, a.tolist()
    res = mc.spawn(fn, 2, transport="shm", timeout=60)
    assert res == [([0.0] * 4, [0, 2.0, 0, 0]), ([0.0] * 4, [0, 1.0, 0, 0])]


def test_window_over_tcp_is_refused_clearly():
    def fn(comm):
        try:
            comm.window(np.zeros(2))
        except mc.RMAError as e:
            return "tcp" in str(e)
    assert mc.spawn(fn, 2, transport="tcp", timeout=60) == [True, True]


def _crash_holding_a_window(comm):
    win = comm.window(np.zeros(8))
    win.fence()
    if comm.rank == 1:
        os._exit(3)
    win.fence()                       # rank 1 never comes: PeerFailure


@pytest.mark.parametrize("kind,nodes", [("shm", 1), ("rdma", 2), ("ub", 1)])
def test_a_rank_dying_with_open_windows_leaves_nothing_behind(kind, nodes):
    with pytest.raises(mc.SpawnError) as e:
        mc.spawn(_crash_holding_a_window, 3, transport=kind, nodes=nodes, timeout=60)
    assert "rank 1" in str(e.value)


# ------------------------------------------------------------------------------ rdma verbs
def _verbs(comm):
    from minicomm.transports import rdma
    nic = comm.transport.nic
    me, peer = comm.rank, 1 - comm.rank
    out = {}
    try:
        nic.reg_mr(64, rdma.ACCESS_REMOTE_WRITE)              # no local write: as verbs, EINVAL
    except ValueError:
        out["reg_mr_rule"] = True
    rw = nic.reg_mr(64, rdma.ACCESS_LOCAL_WRITE | rdma.ACCESS_REMOTE_WRITE |
                    rdma.ACCESS_REMOTE_READ | rdma.ACCESS_REMOTE_ATOMIC)
    ro = nic.reg_mr(64, rdma.ACCESS_LOCAL_WRITE | rdma.ACCESS_REMOTE_READ)
    rw.buf[:] = 7
    ro.buf[:] = 9
    theirs = comm.allgather_object((rw.addr, rw.rkey, ro.addr, ro.rkey))[peer]
    cq = nic.create_cq()
    qp = nic.create_qp(peer, 77, cq)
    qp.post_recv(wr_id=555)
    comm.barrier()
    if me == 0:
        addr, rkey, ro_addr, ro_rkey = theirs
        statuses = []

        def post(**kw):
            qp.post_send(**kw)
            wc = cq.wait(30)[0]
            statuses.append(wc.status)
            if not wc.ok:
                qp.reset()
            return wc
        post(opcode=rdma.WR_RDMA_WRITE, local=np.ones(8, np.uint8), remote_addr=addr,
             rkey=rkey ^ 0x5A5A00)                                        # bad rkey
        post(opcode=rdma.WR_RDMA_WRITE, local=np.ones(8, np.uint8), remote_addr=addr + 60,
             rkey=rkey)                                                   # crosses the end
        post(opcode=rdma.WR_RDMA_WRITE, local=np.ones(8, np.uint8), remote_addr=ro_addr,
             rkey=ro_rkey)                                                # read-only region
        post(opcode=rdma.WR_ATOMIC_FETCH_AND_ADD, remote_addr=ro_addr, rkey=ro_rkey,
             compare_add=1)                                               # no atomic right
        post(opcode=rdma.WR_ATOMIC_FETCH_AND_ADD, remote_addr=addr + 4, rkey=rkey,
             compare_add=1)                                               # misaligned
        out["errors"] = list(statuses)
        # after reset: the real thing works
        post(opcode=rdma.WR_RDMA_WRITE, local=np.arange(8, dtype=np.uint8), remote_addr=addr,
             rkey=rkey)
        old = np.zeros(1, np.int64)
        wc = post(opcode=rdma.WR_ATOMIC_CMP_AND_SWP, local=old, remote_addr=addr + 8, rkey=rkey,
                  compare_add=int(np.full(8, 7, np.uint8).view(np.int64)[0]), swap=42)
        out["cas_old"] = (int(old[0]), wc.value)
        got = np.zeros(16, np.uint8)
        post(opcode=rdma.WR_RDMA_READ, local=got, remote_addr=addr, rkey=rkey)
        out["read"] = got.tolist()
        post(opcode=rdma.WR_RDMA_WRITE_WITH_IMM, local=np.full(4, 3, np.uint8),
             remote_addr=addr + 32, rkey=rkey, imm=0xBEEF)
    else:
        wc = cq.wait(60, peer=peer)[0]                    # the WRITE_WITH_IMM's receive
        out["recv"] = (wc.wr_id, wc.opcode, wc.imm_data, wc.byte_len)
    comm.barrier()
    out["rw"] = rw.buf.tolist()
    out["ro"] = ro.buf.tolist()
    nic.dereg_mr(rw)
    nic.dereg_mr(ro)
    return out


@pytest.mark.parametrize("nodes", [1, 2])
def test_rdma_verbs_errors_never_write(nodes):
    from minicomm.transports import rdma
    r0, r1 = mc.spawn(_verbs, 2, transport="rdma", nodes=nodes, timeout=120)
    assert r0["reg_mr_rule"] and r1["reg_mr_rule"]
    assert r0["errors"][0] == rdma.WC_REM_ACCESS_ERR                      # bad rkey
    assert r0["errors"][1:5] == [rdma.WC_REM_ACCESS_ERR, rdma.WC_REM_ACCESS_ERR,
                                 rdma.WC_REM_ACCESS_ERR, rdma.WC_REM_INV_REQ_ERR]
    assert r0["cas_old"] == (int(np.full(8, 7, np.uint8).view(np.int64)[0]),) * 2
    want = list(range(8)) + list(np.array([42], np.int64).view(np.uint8))
    assert r0["read"] == want
    # the target's memory: exactly the successful writes, nothing of the refused ones
    assert r1["rw"] == want + [7] * 16 + [3] * 4 + [7] * 28
    assert r1["ro"] == [9] * 64
    assert r1["recv"] == (555, rdma.WC_RECV_RDMA_WITH_IMM, 0xBEEF, 4)


def test_rdma_qp_error_state_flushes_until_reset():
    def fn(comm):
        from minicomm.transports import rdma
        nic = comm.transport.nic
        mr = nic.reg_mr(16, rdma.ACCESS_LOCAL_WRITE | rdma.ACCESS_REMOTE_WRITE)
        cq = nic.create_cq()
        qp = nic.create_qp(comm.rank, 9, cq)                        # loopback
        qp.post_send(rdma.WR_RDMA_WRITE, local=np.ones(4, np.uint8), remote_addr=mr.addr,
                     rkey=mr.rkey + 1)
        qp.post_send(rdma.WR_RDMA_WRITE, local=np.ones(4, np.uint8), remote_addr=mr.addr,
                     rkey=mr.rkey)
        first = [wc.status for wc in cq.poll(8)]
        state = qp.state
        qp.reset()
        qp.post_send(rdma.WR_RDMA_WRITE, local=np.ones(4, np.uint8), remote_addr=mr.addr,
                     rkey=mr.rkey)
        return first, state, [wc.status for wc in cq.poll(8)], mr.buf.tolist()
    first, state, after, mem = mc.spawn(fn, 1, transport="rdma", timeout=60)[0]
    assert first == ["REM_ACCESS_ERR", "WR_FLUSH_ERR"] and state == "ERR"
    assert after == ["SUCCESS"] and mem == [1] * 4 + [0] * 12


def _window_channel_error(comm):
    win = comm.window(np.arange(4, dtype=np.float64))
    win.fence()
    ch = win._channels[1 - comm.rank]
    good = ch.rkey
    ch.rkey = good ^ 0x1234                        # a corrupted rkey: the target refuses it
    try:
        win.put(np.array([99.0]), 1 - comm.rank)
        win.flush(1 - comm.rank)
        status = None
    except mc.RMAError as e:
        status = e.status
    ch.rkey = good
    win.fence()
    mem = win.local.tolist()
    win.free()
    return status, mem


@pytest.mark.parametrize("nodes", [1, 2])
def test_window_over_rdma_reports_a_refused_put(nodes):
    for status, mem in mc.spawn(_window_channel_error, 2, transport="rdma", nodes=nodes,
                                timeout=60):
        assert status == "REM_ACCESS_ERR" and mem == [0.0, 1.0, 2.0, 3.0]


# ------------------------------------------------------------------------------------ ub
def _ub(comm):
    from minicomm.transports import ub
    ep = comm.transport.ub
    me, peer = comm.rank, 1 - comm.rank
    out = {}
    seg = ep.register_segment(64, ub.ACCESS_READ | ub.ACCESS_WRITE | ub.ACCESS_ATOMIC,
                              token=0xC0FFEE)
    ro = ep.register_segment(64, ub.ACCESS_READ, token=0xC0FFEE)
    seg.buf[:] = 5
    ro.buf[:] = 6
    jfc = ep.create_jfc()
    jfr = ep.create_jfr(jfc, depth=2, buf_bytes=32, token=0xAB)
    if me == 1:
        jfr.post_recv(user_ctx=77)    # before rank 0 can SEND
    infos = comm.allgather_object((seg.info.pack(), ro.info.pack(), jfr.info.pack()))[peer]
    info, ro_info, jfr_info = (ub.SegmentInfo.unpack(b) for b in infos)
    comm.barrier()
    if me == 0:
        errs = []
        try:
            ep.import_segment(info, token=0xBAD)                  # the wrong token
        except mc.RMAError as e:
            errs.append(("token", e.status, "token" in str(e)))
        t = ep.import_segment(info, token=0xC0FFEE)
        tro = ep.import_segment(ro_info, token=0xC0FFEE)
        for what, call in (("bounds", lambda: t.store(t.va + 60, np.ones(8, np.uint8))),
                           ("permission", lambda: tro.store(tro.va, np.ones(1, np.uint8))),
                           ("atomic-permission", lambda: tro.fadd(tro.va, 1))):
            try:
                call()
            except mc.RMAError as e:
                errs.append((what, e.status, True))
        out["errors"] = errs
        # memory semantics that work
        t.store(t.va, np.arange(8, dtype=np.uint8))
        out["load"] = t.load(t.va, 8).tolist()
        base = int(np.full(8, 5, np.uint8).view(np.int64)[0])
        out["atomics"] = [t.cas(t.va + 8, base, 10), t.fadd(t.va + 8, 5), t.swap(t.va + 8, 3),
                          t.for_(t.va + 8, 8), t.fand(t.va + 8, 12), t.fxor(t.va + 8, 1),
                          int(t.load(t.va + 8, 8).view(np.int64)[0])]
        # DMA on a JFS: one JFS, two targets (the peer and this rank itself)
        mine = ep.import_segment(seg.info, token=0xC0FFEE)
        jfs = ep.create_jfs(jfc)
        a, b = np.full(4, 1, np.uint8), np.full(4, 2, np.uint8)
        jfs.post([ub.JfsWr(ub.OPC_WRITE, t, a, t.va + 16, user_ctx=1),
                  ub.JfsWr(ub.OPC_WRITE, t, b, t.va + 16, user_ctx=2),         # unordered
                  ub.JfsWr(ub.OPC_WRITE, mine, a, mine.va, user_ctx=3),
                  ub.JfsWr(ub.OPC_WRITE, mine, b, mine.va, order=ub.ORDER_STRONG, user_ctx=4)])
        crs = [cr for _ in range(4) for cr in jfc.wait(30, 1, peer=peer)]
        out["dma"] = sorted(cr.user_ctx for cr in crs if cr.ok)
        got = np.zeros(8, np.uint8)
        jfs.post(ub.JfsWr(ub.OPC_READ, t, got, t.va + 16, fence=True, user_ctx=5))
        jfc.wait(30, peer=peer)
        out["unordered_then_strong"] = (got[:4].tolist(), seg.buf[:4].tolist())
        # an error completion puts the JFS in the ERROR state until it is flushed
        jfs.post([ub.JfsWr(ub.OPC_READ, t, got, t.va + 62, user_ctx=6),          # past the end
                  ub.JfsWr(ub.OPC_WRITE, t, a, t.va + 40, fence=True, user_ctx=7)])
        first = jfc.wait(30, peer=peer)
        try:
            jfs.post(ub.JfsWr(ub.OPC_WRITE, t, a, t.va + 40))
            refused = False
        except mc.RMAError as e:
            refused = "flush" in str(e)
        flushed = jfs.flush()
        jfc.poll(16)                  # flush() also queued the flushed records on the JFC
        out["jetty"] = (first[0].status, jfs.state, refused, [(c.user_ctx, c.status)
                                                               for c in flushed])
        # SEND into the peer's JFR (it posted one buffer): then RNR
        tjfr = ep.import_jfr(jfr_info, token=0xAB)
        jfs.post(ub.JfsWr(ub.OPC_SEND, tjfr, np.full(5, 4, np.uint8), imm=9, user_ctx=8))
        jfs.post(ub.JfsWr(ub.OPC_SEND, tjfr, np.full(5, 4, np.uint8), user_ctx=9))
        out["send"] = [c.status for _ in range(2) for c in jfc.wait(30, 1, peer=peer)]
        jfs.flush()
    else:
        comm.barrier()
        cr = jfc.wait(60, peer=peer)[0]
        out["recv"] = (cr.user_ctx, cr.opcode, cr.imm_data, cr.completion_len,
                       jfr.buffer(cr.slot)[:5].tolist())
    if me == 0:
        comm.barrier()
    comm.barrier()
    out["seg"] = seg.buf.tolist()
    out["ro"] = ro.buf.tolist()
    return out


@pytest.mark.parametrize("nodes", [1, 2])
def test_ub_segments_jettys_and_errors(nodes):
    from minicomm.transports import ub
    r0, r1 = mc.spawn(_ub, 2, transport="ub", nodes=nodes, timeout=120)
    assert r0["errors"] == [("token", ub.CR_REM_ACCESS_ABORT_ERR, True),
                            ("bounds", ub.CR_REM_ACCESS_ABORT_ERR, True),
                            ("permission", ub.CR_REM_ACCESS_ABORT_ERR, True),
                            ("atomic-permission", ub.CR_REM_ACCESS_ABORT_ERR, True)]
    assert r0["load"] == list(range(8))
    base = int(np.full(8, 5, np.uint8).view(np.int64)[0])
    assert r0["atomics"] == [base, 10, 15, 3, 11, 8, 9]
    assert r0["dma"] == [1, 2, 3, 4]
    # the unordered pair landed in reverse (the simulator's adversarial placement); the
    # strongly ordered write landed after the one before it
    assert r0["unordered_then_strong"] == ([1] * 4, [2] * 4)
    assert r0["jetty"] == (ub.CR_REM_ACCESS_ABORT_ERR, "READY", True,
                           [(7, ub.CR_WR_FLUSH_ERR)])
    assert r0["send"] == [ub.CR_SUCCESS, ub.CR_RNR_RETRY_CNT_EXC_ERR]
    assert r1["recv"] == (77, ub.CR_OPC_RECV_SEND, 9, 5, [4] * 5)
    # target memory: the refused accesses left no trace
    assert r1["seg"][:16] == list(range(8)) + [9, 0, 0, 0, 0, 0, 0, 0]
    assert r1["seg"][16:20] == [1] * 4 and r1["seg"][20:] == [5] * 44
    assert r1["ro"] == [6] * 64


def test_emulated_link_delay_keeps_results(monkeypatch):
    monkeypatch.setenv("MINICOMM_EMULATE_LINK", "1")

    def fn(comm):
        win = comm.window(np.zeros(2, dtype=np.int64))
        win.fence()
        v = win.fetch_and_op(1, 0, 0)
        win.fence()
        y = comm.allreduce(np.ones(10))
        out = (int(win.get(0)[0]), float(y[0]), comm.transport.device.emulate, int(v) >= 0)
        win.free()
        return out
    for kind in ("rdma", "ub"):
        assert mc.spawn(fn, 2, transport=kind, nodes=2, timeout=60) == [(2, 2.0, True, True)] * 2


# ------------------------------------------------------------------------------ the benchmark
def _bench(tmp_path, *args):
    import json
    path = tmp_path / "rows.json"
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "bench", *args, "--batches", "1",
                          "--batch-time", "0.002", "--warmup", "2", "--json", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(path.read_text())["rows"]


def test_one_sided_benchmark_checks_every_library(tmp_path):
    rows = _bench(tmp_path, "put,get,accumulate,fetch_and_op,cas", "--sizes", "8,4K")
    assert {r["library"] for r in rows} == {"mc shm", "mc rdma", "mc ub"}
    assert {r["op"] for r in rows} == {"put", "get", "accumulate", "fetch_and_op", "cas"}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)


def test_one_sided_benchmark_with_mpich_side_by_side(tmp_path):
    from extras import require
    from minicomm.tools.benchspec import mpi_available
    require(mpi_available())
    rows = _bench(tmp_path, "put,fetch_and_op", "--sizes", "1K", "--peers", "mpi")
    libs = {r["library"] for r in rows}
    assert {"mpi Win.Allocate", "mpi Win.Create", "mc shm"} <= libs
    assert all(r["wrong"] == 0 for r in rows)
    assert all(r["vs_mpi"] is not None for r in rows if r["library"].startswith("mc"))


def test_collectives_across_transports_in_one_run(tmp_path):
    rows = _bench(tmp_path, "allreduce,alltoall", "--sizes", "64K", "--transports", "shm,rdma,ub")
    assert [(r["op"], r["library"]) for r in rows] == [
        (c, f"mc {k}") for c in ("allreduce", "alltoall") for k in ("shm", "rdma", "ub")]
    assert all(r["vs_first"] > 0 for r in rows)


# --------------------------------------------------------------- the transport contract, p2p
def _p2p_contract(comm):
    out = {}
    comm.send(np.arange(4) + comm.rank, comm.rank, tag=8)                 # to self
    out["self"] = comm.recv(mc.ANY_SOURCE, tag=8).tolist()
    if comm.rank == 0:
        comm.send(np.arange(3 << 20, dtype=np.float32), 1, tag=2)         # 12 MiB, streamed
        comm.send(np.array([1, 2, 3]), 1, tag=1)
    elif comm.rank == 1:
        small = comm.recv(0, tag=1)                                       # behind the big one
        big = comm.recv(mc.ANY_SOURCE, tag=2)
        out["p2p"] = (small.tolist(), bool(np.array_equal(big, np.arange(3 << 20,
                                                                          dtype=np.float32))))
    sub = comm.split(comm.rank % 2)
    try:
        sub.allreduce(np.ones(100, dtype=np.float32 if comm.rank < 2 else np.int32))
        out["mismatch"] = "no error"
    except mc.MismatchError:
        out["mismatch"] = "mismatch"
    out["world"] = comm.allreduce(np.full(2, comm.rank + 1.0)).tolist()
    w = comm.allreduce(np.ones(1 << 16), async_op=True)                   # from the worker thread
    out["async"] = float(w.wait(60)[0])
    # a peer that leaves: ANY_SOURCE skips it (or reports it once, with .peer), and goes on
    # with the living
    if comm.rank == 3:
        comm.close()
        return out
    if comm.rank == 1:
        for i in range(3):
            comm.send(np.array([i]), 0, tag=5)
    if comm.rank == 0:
        got, failed = [], []
        while len(got) < 3:
            try:
                got.append(int(comm.recv(mc.ANY_SOURCE, tag=5, timeout=60)[0]))
            except mc.PeerFailure as e:
                failed.append(e.peer)
        out["survive"] = (got, failed)
    return out


@pytest.mark.parametrize("kind,nodes", [("rdma", 1), ("rdma", 2), ("ub", 1), ("ub", 2)])
def test_transport_contract_over_one_sided_transports(kind, nodes):
    res = mc.spawn(_p2p_contract, 4, transport=kind, nodes=nodes, timeout=120)
    assert [r["self"] for r in res] == [[r, r + 1, r + 2, r + 3] for r in range(4)]
    assert res[1]["p2p"] == ([1, 2, 3], True)
    assert [r["mismatch"] for r in res] == ["mismatch"] * 4
    assert all(r["world"] == [10.0, 10.0] and r["async"] == 4.0 for r in res)
    got, failed = res[0]["survive"]
    assert got == [0, 1, 2] and failed in ([], [3])
