"""The communicator's core under the patterns the parameter server, DDP-style overlap and the
torch backend rely on (issue 9): async submission that never blocks, errors that are final,
close() that is safe from any thread, MPI-grade point-to-point, agreed sub-communicator ids,
and one thread at a time, checked.

Nothing here is timed: a blocking submit or a close() that does not wake a waiter shows up as a
different outcome (a flag never set, a CommTimeout instead of the close error), not as a slow run.
"""
import threading

import numpy as np
import pytest

import minicomm as mc


def spawn(fn, p=2, **kw):
    return mc.spawn(fn, p, transport="inproc", timeout=60, **kw)


# ----------------------------------------------------------------------- 1. async overlaps
def test_async_submit_never_waits_for_earlier_work():
    submitted = threading.Event()       # ranks are threads of this process with inproc

    def fn(comm):
        x = np.arange(1000, dtype=np.float64) + comm.rank
        if comm.rank == 1:
            # rank 1 joins only once rank 0 has submitted all its work: a submit that waits for
            # earlier work to finish can never get there
            if not submitted.wait(20):
                return "rank 0's submits blocked"
        works = []
        for _ in range(4):
            works.append(comm.allreduce(x, async_op=True))
            threading.Event().wait(0.05)     # a slice of "compute": the worker starts meanwhile
        if comm.rank == 0:
            submitted.set()
        return [w.wait(timeout=30)[:3].tolist() for w in works]
    res = spawn(fn)
    assert res[0] == res[1] == [[1.0, 3.0, 5.0]] * 4


def test_sync_call_after_async_ones_keeps_program_order():
    def fn(comm):
        works = [comm.allreduce(np.full(8, float(i + comm.rank)), async_op=True) for i in range(6)]
        b = comm.allreduce(np.full(8, 100.0))
        return [w.wait(30)[0] for w in works], b[0]
    res = spawn(fn, 3)
    assert res[0] == ([3.0 * i + 3 for i in range(6)], 300.0)


# ----------------------------------------------------------------------- 2. an error is final
def test_timeout_breaks_the_communicator_and_fails_queued_work():
    done = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            done.wait(30)                # never joins: rank 0 times out
            return None
        comm.timeout = 0.5
        first = comm.allreduce(np.ones(4), async_op=True)
        queued = [comm.allreduce(np.ones(4), async_op=True) for _ in range(3)]
        with pytest.raises(mc.CommTimeout):
            first.wait(30)
        errors = []
        for w in queued:
            with pytest.raises(mc.CommError) as e:
                w.wait(30)
            errors.append(type(e.value).__name__)
        with pytest.raises(mc.CommError, match="communicator is broken: .*timed out"):
            comm.allreduce(np.ones(4))
        with pytest.raises(mc.CommError, match="communicator is broken"):
            comm.send(np.ones(1), dst=1)
        done.set()
        return errors
    assert spawn(fn)[0] == ["CommTimeout"] * 3


def test_mismatch_on_one_communicator_leaves_the_others_working():
    def fn(comm):
        sub = comm.split(0)
        with pytest.raises(mc.MismatchError):
            sub.allreduce(np.ones(4, dtype=np.float32 if comm.rank == 0 else np.float64))
        with pytest.raises(mc.CommError, match="communicator is broken"):
            sub.allreduce(np.ones(4))
        return comm.allreduce(np.full(3, comm.rank + 1.0)).tolist()
    assert spawn(fn, 3) == [[6.0] * 3] * 3


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_mismatch_on_a_subcommunicator_over_processes(transport):
    def fn(comm):
        sub = comm.split(comm.rank % 2)
        try:
            # header-only checking: the disagreeing ranks' messages carry different signatures
            sub.allreduce(np.ones(1000, dtype=np.float32 if comm.rank < 2 else np.int32))
            status = "no error"
        except mc.MismatchError:
            status = "mismatch"
        world = comm.allreduce(np.full(5, comm.rank + 1.0))
        return status, world.tolist()
    res = mc.spawn(fn, 4, transport=transport, timeout=60)
    assert all(s == "mismatch" for s, _ in res), res
    assert all(w == [10.0] * 5 for _, w in res)


# ----------------------------------------------------------------------- 3. close() is safe
def test_close_from_another_thread_wakes_a_blocked_call():
    done = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            done.wait(30)
            return None
        comm.timeout = 60
        closer = threading.Timer(0.3, comm.close)
        closer.start()
        try:
            comm.allreduce(np.ones(4))
        except mc.CommTimeout:
            return "timed out: close() did not wake the call"
        except mc.CommError as e:
            return "closed" if "closed" in str(e) else str(e)
        finally:
            closer.join()
            done.set()
        return "returned"
    assert spawn(fn)[0] == "closed"


def test_close_from_another_thread_wakes_a_blocked_recv_over_shm():
    def fn(comm):
        sub = comm.split(0)
        if comm.rank == 1:
            comm.recv(0, tag=99)         # stays alive (and silent on sub) until rank 0 is done
            return None
        sub.timeout = 60
        closer = threading.Timer(0.3, sub.close)
        closer.start()
        try:
            sub.recv(1)
            result = "returned"
        except mc.CommTimeout:
            result = "timed out"
        except mc.CommError as e:
            result = "closed" if "closed" in str(e) else str(e)
        finally:
            closer.join()
        comm.send(np.zeros(1), 1, tag=99)
        return result
    assert mc.spawn(fn, 2, transport="shm", timeout=60)[0] == "closed"


def test_close_with_queued_work_completes_or_fails_it_with_a_named_error():
    def fn(comm):
        works = [comm.allreduce(np.full(10000, 1.0), async_op=True) for _ in range(5)]
        comm.close()
        out = []
        for w in works:
            try:
                out.append(float(w.wait(30)[0]))
            except mc.CommError as e:
                out.append(type(e).__name__)
        with pytest.raises(mc.CommError, match="closed"):
            comm.allreduce(np.ones(2))
        return out
    for res in spawn(fn, 3):
        assert all(v == 3.0 or v in ("CommError", "PeerFailure") for v in res), res


# ----------------------------------------------------------------------- 4. point to point
def test_tags_are_matched_not_compared():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.array([1.0]), dst=1, tag=1)
            comm.send(np.array([2.0]), dst=1, tag=2)
            return None
        two = comm.recv(0, tag=2)
        one = comm.recv(0, tag=1)
        return one[0], two[0]
    assert spawn(fn)[1] == (1.0, 2.0)


def test_any_source_any_tag_and_status():
    def fn(comm):
        if comm.rank != 0:
            comm.send(np.full(comm.rank, comm.rank, dtype=np.int32), dst=0, tag=10 + comm.rank)
            return None
        got = {}
        for _ in range(comm.size - 1):
            st = mc.Status()
            y = comm.recv(mc.ANY_SOURCE, tag=mc.ANY_TAG, status=st)
            assert st.tag == 10 + st.source and st.nbytes == y.nbytes and st.shape == y.shape
            got[st.source] = y.tolist()
        return got
    assert spawn(fn, 4)[0] == {1: [1], 2: [2, 2], 3: [3, 3, 3]}


def test_isend_irecv_return_work_and_report_the_match():
    def fn(comm):
        peer = 1 - comm.rank
        r = comm.irecv(peer, tag=mc.ANY_TAG)
        s = comm.isend(np.arange(5) * (comm.rank + 1), peer, tag=3 + comm.rank)
        assert s.wait(30) is None
        y = r.wait(30)
        return y.tolist(), r.status.source, r.status.tag
    res = spawn(fn)
    assert res[0] == ([0, 2, 4, 6, 8], 1, 4) and res[1] == ([0, 1, 2, 3, 4], 0, 3)


def test_recv_out_is_validated_before_the_message_is_consumed():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.arange(6, dtype=np.float32), dst=1, tag=5)
            comm.send(np.array([9.0]), dst=1, tag=6)
            return None
        with pytest.raises(ValueError, match="6 elements"):
            comm.recv(0, tag=5, out=np.empty(4, dtype=np.float32))
        with pytest.raises(TypeError, match="float32"):
            comm.recv(0, tag=5, out=np.empty(6, dtype=np.float64))
        out = np.empty(6, dtype=np.float32)
        y = comm.recv(0, tag=5, out=out)
        assert y is out
        return out.tolist(), comm.recv(0, tag=6).tolist()
    assert spawn(fn)[1] == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [9.0])


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_send_to_self_works_on_every_transport(transport):
    def fn(comm):
        comm.send(np.arange(4) + comm.rank, comm.rank, tag=8)
        w = comm.isend(np.array([comm.rank * 10]), comm.rank, tag=9)
        b = comm.recv(comm.rank, tag=9)
        a = comm.recv(mc.ANY_SOURCE, tag=8)
        w.wait(10)
        obj = None
        comm.send_object({"r": comm.rank}, comm.rank)
        obj = comm.recv_object(comm.rank)
        return a.tolist(), int(b[0]), obj
    res = mc.spawn(fn, 2, transport=transport, timeout=60)
    assert res == [([0, 1, 2, 3], 0, {"r": 0}), ([1, 2, 3, 4], 10, {"r": 1})]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_point_to_point_over_processes(transport):
    def fn(comm):
        if comm.rank == 0:
            big = np.arange(3 << 20, dtype=np.float32)          # 12 MiB: streams through
            comm.send(big, 1, tag=2)
            comm.send(np.array([1, 2, 3]), 1, tag=1)
            return float(comm.recv(1, tag=0)[0])
        small = comm.recv(0, tag=1)          # behind the 12 MiB message of tag 2
        big = comm.recv(mc.ANY_SOURCE, tag=2)
        ok = np.array_equal(big, np.arange(3 << 20, dtype=np.float32))
        comm.send(np.array([float(ok)]), 0)
        return small.tolist()
    assert mc.spawn(fn, 2, transport=transport, timeout=60) == [1.0, [1, 2, 3]]


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_a_flood_of_unexpected_messages_is_bounded(monkeypatch, transport):
    monkeypatch.setenv("MINICOMM_P2P_BUFFER_BYTES", str(64 << 10))

    def fn(comm):
        if comm.rank == 0:
            sends = [comm.isend(np.zeros(4096), 1, tag=1) for _ in range(40)]   # 40 x 32 KiB
            comm.barrier()
            for w in sends:
                w.wait(30)
            return None
        try:
            comm.recv(0, tag=2, timeout=1.0)            # never sent
            return "received"
        except mc.CommTimeout as e:
            held = comm._p2p.buffered_bytes
            msg = str(e)
        comm.barrier()
        got = [comm.recv(0, tag=1).size for _ in range(40)]
        return held, "limit" in msg, sum(got)
    held, named, total = mc.spawn(fn, 2, transport=transport, timeout=60)[1]
    assert held <= 64 << 10 and named and total == 40 * 4096


def test_peer_failure_on_any_source_is_reported_once():
    def fn(comm):
        if comm.rank == 2:
            comm.close()                 # this rank is gone
            return None
        if comm.rank == 1:
            for i in range(3):
                comm.send(np.array([i]), 0, tag=0)
            return None
        got, failed = [], []
        while len(got) < 3:
            try:
                got.append(int(comm.recv(mc.ANY_SOURCE, tag=0)[0]))
            except mc.PeerFailure as e:
                failed.append(e.peer)
        return got, failed
    got, failed = spawn(fn, 3)[0]
    assert got == [0, 1, 2] and failed in ([], [2])


# ----------------------------------------------------------------------- 5. agreed split ids
def test_split_with_numpy_and_python_ints_forms_one_group():
    def fn(comm):
        color = np.int64(0) if comm.rank % 2 else 0
        sub = comm.split(color)
        return sub.size, sub.comm_id, float(sub.allreduce(np.ones(1))[0])
    res = spawn(fn, 4)
    assert [r[0] for r in res] == [4] * 4 and len({r[1] for r in res}) == 1
    assert [r[2] for r in res] == [4.0] * 4


def test_split_ids_are_agreed_and_distinct():
    def fn(comm):
        a = comm.split(comm.rank % 2)
        b = comm.split(comm.rank % 2)
        c = comm.split(0)
        assert len({comm.comm_id, a.comm_id, b.comm_id, c.comm_id}) == 4
        return (a.comm_id, b.comm_id, c.comm_id, a.allreduce(np.array([comm.rank]))[0],
                c.allreduce(np.array([1]))[0])
    res = spawn(fn, 4)
    assert res[0][:3] == res[2][:3] and res[1][:3] == res[3][:3]
    assert res[0][0] != res[1][0]
    assert [r[3] for r in res] == [2, 4, 2, 4] and all(r[4] == 4 for r in res)


def test_split_rejects_a_non_integer_color():
    def fn(comm):
        with pytest.raises(TypeError, match="color"):
            comm.split("red")
        return True
    assert all(spawn(fn))


# ----------------------------------------------------------------------- 6. one thread at a time
def test_two_threads_in_one_communicator_get_a_named_error():
    def fn(comm):
        if comm.rank == 1:
            gate.wait(20)
            return comm.allreduce(np.ones(3)).tolist(), None
        seen = []

        def second():
            # enter only once the main thread is inside its call (bounded poll of its state)
            for _ in range(4000):
                if comm.busy_with is not None:
                    break
                inside.wait(0.005)
            try:
                comm.allreduce(np.ones(3))
                seen.append("no error")
            except mc.CommError as e:
                seen.append(str(e))
            gate.set()
        t = threading.Thread(target=second)
        t.start()
        r = comm.allreduce(np.ones(3))      # blocked until rank 1 joins (after the 2nd thread)
        t.join(20)
        return r.tolist(), seen[0]
    gate, inside = threading.Event(), threading.Event()
    res = spawn(fn)
    assert res[0][0] == res[1][0] == [2.0, 2.0, 2.0]
    msg = res[0][1]
    assert "allreduce" in msg and "thread" in msg, msg
