"""Parameter server: sharding plan, optimizers, wire codec, checkpoints, the shard's consistency
state machine (driven with fake requests, no communicator), then whole jobs over real transports.
Every value is checked against an independent numpy reference."""
from __future__ import annotations

import os
import stat
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minicomm import ps
from minicomm.ps import checkpoint, wire
from minicomm.ps.shard import DEAD, Shard
from minicomm.ps.sharding import KeySpec, Plan, key_table

F8 = np.dtype("<f8")


# ============================================================================ sharding
def _table(sizes, dtype=F8):
    return tuple(KeySpec(f"k{i:02d}", np.dtype(dtype), (n,)) for i, n in enumerate(sizes))


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
       servers=st.integers(1, 5), chunk=st.integers(8, 20000))
def test_plan_covers_every_element_once_in_contiguous_server_ranges(sizes, servers, chunk):
    plan = Plan(_table(sizes), servers, chunk)
    order = []
    for spec in plan.table:
        pieces = plan.pieces[spec.name]
        covered = np.zeros(spec.size, np.int64)
        for p in pieces:
            assert 0 < p.nbytes <= max(chunk, spec.dtype.itemsize)
            covered[p.offset:p.offset + p.count] += 1
            order.append(p.server)
        assert (covered == 1).all()
    assert order == sorted(order)                  # servers own contiguous ranges of the layout
    assert sum(plan.bytes_per_server()) == sum(s.nbytes for s in plan.table)


def test_plan_splits_a_big_array_evenly_across_servers():
    plan = Plan(_table([2 << 20]), 2, 4 << 20)    # one 16 MiB array, 4 MiB chunks
    assert [p.server for p in plan.pieces["k00"]] == [0, 0, 1, 1]
    assert plan.bytes_per_server() == [8 << 20, 8 << 20]
    many = Plan(_table([1000] * 7 + [3 << 20]), 3, 1 << 20)
    b = many.bytes_per_server()
    assert max(b) - min(b) <= 2 * (1 << 20)


def test_plan_is_independent_of_dict_order_and_validates():
    a = key_table({"w": np.zeros(3), "b": np.zeros(2, np.float32)})
    b = key_table({"b": np.zeros(2, np.float32), "w": np.zeros(3)})
    assert a == b and [s.name for s in a] == ["b", "w"]
    assert Plan(a, 2, 8) == Plan(b, 2, 8)
    with pytest.raises(TypeError):
        key_table({"w": np.zeros(3, np.int32)})
    with pytest.raises(TypeError):
        key_table({1: np.zeros(3)})
    with pytest.raises(ValueError):
        key_table({"": np.zeros(3)})
    with pytest.raises(ValueError):
        Plan(a, 0, 8)
    assert Plan(_table([0, 5]), 2, 8).pieces["k00"] == ()   # zero-size keys never travel


# ============================================================================ optimizers
def test_sgd_matches_numpy_reference_with_and_without_momentum():
    rng = np.random.default_rng(0)
    for momentum in (0.0, 0.9):
        opt = ps.SGD(0.05, momentum=momentum)
        p = rng.standard_normal(50)
        ref_p, ref_v = p.copy(), np.zeros(50)
        state = opt.new_state(50, p.dtype)
        for _ in range(6):
            g = rng.standard_normal(50)
            ref_v = momentum * ref_v + 0.5 * g
            ref_p = ref_p - 0.05 * ref_v
            opt.step(p, g.copy(), state, scale=0.5)
        np.testing.assert_allclose(p, ref_p, rtol=1e-12, atol=1e-14)


def test_adam_matches_numpy_reference():
    rng = np.random.default_rng(1)
    lr, (b1, b2), eps = 0.01, (0.8, 0.99), 1e-6
    opt = ps.Adam(lr, betas=(b1, b2), eps=eps)
    p = rng.standard_normal(40)
    ref, m, v = p.copy(), np.zeros(40), np.zeros(40)
    state = opt.new_state(40, p.dtype)
    for t in range(1, 8):
        g = rng.standard_normal(40)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        ref = ref - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        opt.step(p, g.copy(), state)
    np.testing.assert_allclose(p, ref, rtol=1e-10, atol=1e-12)
    assert int(state["t"][0]) == 7


def test_optimizer_arguments_are_validated():
    for bad in (lambda: ps.SGD(0), lambda: ps.SGD(-1), lambda: ps.SGD(0.1, momentum=1.0),
                lambda: ps.Adam(0.1, betas=(0.9,)), lambda: ps.Adam(0.1, eps=0)):
        with pytest.raises(ValueError):
            bad()


# ============================================================================ wire codec
names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)


@settings(max_examples=150, deadline=None)
@given(opcode=st.sampled_from([wire.PUSH, wire.PULL, wire.PUSHPULL]), seq=st.integers(0, 2**32 - 1),
       clock=st.integers(0, 2**62),
       pieces=st.lists(st.tuples(names, st.integers(0, 2**32 - 1), st.integers(0, 2**40),
                                 st.sampled_from([0, 1, 2])), max_size=6,
                       unique_by=lambda t: (t[0], t[1])))
def test_wire_round_trip_of_piece_frames(opcode, seq, clock, pieces):
    refs = [wire.PieceRef(n, i, c, ps.sharding.DTYPES[d]) for n, i, c, d in pieces]
    f = wire.decode(wire.encode(opcode, seq, clock=clock, pieces=refs))
    assert (f.opcode, f.seq, f.clock, f.pieces) == (opcode, seq, clock, refs)


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.tuples(names, st.lists(st.integers(0, 1000), max_size=4)), min_size=1,
                     max_size=5, unique_by=lambda t: t[0]))
def test_wire_round_trip_of_init_frames(keys):
    specs = [KeySpec(n, F8, tuple(s)) for n, s in keys]
    f = wire.decode(wire.encode(wire.INIT, 7, flags=wire.HAS_VALUES, keys=specs))
    assert f.keys == specs and f.flags == wire.HAS_VALUES


def _valid_frames():
    refs = [wire.PieceRef("w1", 0, 10, F8), wire.PieceRef("b1", 1, 3, F8)]
    return [wire.encode(wire.PUSH, 3, clock=2, pieces=refs),
            wire.encode(wire.INIT, 1, keys=[KeySpec("w1", F8, (2, 5))]),
            wire.encode(wire.CLOSE, 9)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 2), data=st.data())
def test_wire_mutated_frames_decode_or_raise_protocol_error(which, data):
    frame = bytearray(_valid_frames()[which].tobytes())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "grow"]))
        if kind == "flip" and frame:
            i = data.draw(st.integers(0, len(frame) - 1))
            frame[i] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del frame[data.draw(st.integers(0, len(frame))):]
        else:
            frame += bytes(data.draw(st.binary(max_size=20)))
    try:
        wire.decode(np.frombuffer(bytes(frame), np.uint8))
    except wire.ProtocolError:
        pass                       # the only exception decode may raise


def test_wire_names_what_is_wrong():
    good = _valid_frames()[0].tobytes()
    head = wire.HEADER.size
    cases = {
        "bad magic": b"XXXX" + good[4:],
        "protocol version": good[:4] + b"\x09" + good[5:],
        "unknown request opcode": good[:5] + b"\x63" + good[6:],
        "shorter than": good[:10],
        "table bytes": good[:-1],
        "left over": good[:head - 8] + struct.pack("<II", 1, len(good) - head) + good[head:],
        "reserved byte": good[:head + 3] + b"\x01" + good[head + 4:],
        "unknown dtype": good[:head + 2] + b"\x07" + good[head + 3:],
        "utf-8": good[:head + 16] + b"\xff\xfe" + good[head + 18:],
    }
    for what, raw in cases.items():
        with pytest.raises(wire.ProtocolError, match=what):
            wire.decode(np.frombuffer(raw, np.uint8))
    dup = wire.encode(wire.PULL, 1, pieces=[wire.PieceRef("a", 0, 1, F8)] * 2)
    with pytest.raises(wire.ProtocolError, match="twice"):
        wire.decode(dup)
    with pytest.raises(wire.ProtocolError, match="uint8"):
        wire.decode(np.zeros(40, np.float64))
    assert issubclass(ps.ProtocolError, ps.wire.CommError)


# ============================================================================ checkpoints
def test_checkpoint_round_trip_modes_and_rotation(tmp_path):
    d = tmp_path / "ckpt"
    arrays = {"p0": np.arange(5.0), "s0.m": np.ones(5, np.float32)}
    for u in (5, 10, 15):
        path = checkpoint.write(str(d), 1, u, {"clocks": [[2, u]]}, arrays, run="r1")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [u for u, _ in checkpoint.available(str(d), 1, "r1")] == [10, 15]   # newest KEEP kept
    assert checkpoint.available(str(d), 0, "r1") == []
    meta, back = checkpoint.read(path)
    assert meta["updates"] == 15 and meta["server"] == 1 and meta["clocks"] == [[2, 15]]
    np.testing.assert_array_equal(back["p0"], arrays["p0"])
    assert back["s0.m"].dtype == np.float32
    # a torn temporary (a crash mid-write) is never taken for a checkpoint, and is swept
    (d / ".shard-001-rr1-u000000000020.npz.x7k2m9qa.tmp").write_bytes(b"half")
    assert [u for u, _ in checkpoint.available(str(d), 1, "r1")] == [10, 15]
    checkpoint.remove_temporaries(str(d), 1, "r1")
    assert not any(n.startswith(".") for n in os.listdir(d))
    bad = d / checkpoint.shard_file(1, 99, "r1")
    bad.write_bytes(b"not a zip")
    with pytest.raises(ps.CheckpointError):
        checkpoint.read(str(bad))


# ============================================================================ the shard
class FakeIO:
    """The shard's I/O with payloads supplied by the test and responses recorded."""

    def __init__(self):
        self.payloads = {}
        self.responses = []
        self.reads = []

    def give(self, w, seq, arrays):
        self.payloads[(w, seq)] = [np.asarray(a, F8) for a in arrays]

    def post_payload(self, w, seq, bufs):
        ok = True
        for index, buf in enumerate(bufs):
            a = self.payloads[(w, seq)][index]
            if a.size != buf.size:
                ok = False
                break
            self.reads.append((w, seq, index))
            buf[...] = a
        return ok

    def payload_done(self, ok):
        return True

    def finish_payload(self, ok):
        if not ok:
            raise ps.shard.Refuse(wire.PROTOCOL, "size")

    def respond(self, w, seq, frame, arrays=()):
        self.responses.append((w, wire.decode(frame, expect_response=True),
                               [np.array(a) for a in arrays]))

    def settle(self):
        return []

    def take(self):
        out, self.responses = self.responses, []
        return out


KEYS = [KeySpec("w", F8, (4,)), KeySpec("b", F8, (2,))]


def _shard(staleness, workers=(1, 2), opt=None):
    io = FakeIO()
    sh = Shard(0, 1, list(workers), staleness, opt or ps.SGD(0.5), 1 << 20, io)
    seq = 100
    for w in workers:
        seq += 1
        lowest = w == min(workers)
        if lowest:
            io.give(w, seq, [np.full(2, 1.0), np.arange(4.0)])       # plan order: b, w
        sh.submit(w, wire.encode(wire.INIT, seq, keys=KEYS,
                                 flags=wire.HAS_VALUES if lowest else 0))
        sh.progress()
    oks = io.take()
    assert [f.opcode for _, f, _ in oks] == [wire.OK] * len(workers) and sh.init_done
    return sh, io


def _refs(sh):
    return [wire.PieceRef(p.name, p.index, p.count, p.dtype) for p in sh.plan.on_server(0)]


def _push(sh, io, w, seq, clock, gb, gw, opcode=wire.PUSH):
    io.give(w, seq, [gb, gw])
    sh.submit(w, wire.encode(opcode, seq, clock=clock, pieces=_refs(sh)))
    sh.progress()


def _pull(sh, w, seq, clock):
    sh.submit(w, wire.encode(wire.PULL, seq, clock=clock, pieces=_refs(sh)))
    sh.progress()


def test_shard_bsp_averages_a_clock_once_and_defers_what_is_ahead():
    sh, io = _shard(0)
    _push(sh, io, 1, 1, 0, [1, 1], [1, 2, 3, 4])
    assert io.take() == [] and sh.updates == 0              # worker 2 has not pushed clock 0
    _pull(sh, 1, 2, 1)                                       # pull at clock 1: must wait
    _push(sh, io, 1, 3, 1, [9, 9], [9, 9, 9, 9])             # clock 1 ahead of the aggregate
    assert io.take() == [] and (1, 3, 0) not in io.reads     # ... its data not even read yet
    _push(sh, io, 2, 1, 0, [3, 3], [3, 2, 1, 0])
    out = io.take()
    assert sh.updates == 1 and sh.applied == 1
    ref_b, ref_w = 1.0 - 0.5 * np.array([2.0, 2.0]), np.arange(4.0) - 0.5 * np.array([2.0] * 4)
    assert [(w, f.seq, f.opcode) for w, f, _ in out] == [(1, 1, wire.OK), (2, 1, wire.OK),
                                                         (1, 2, wire.OK)]
    np.testing.assert_allclose(out[2][2][0], ref_b)
    np.testing.assert_allclose(out[2][2][1], ref_w)
    assert (1, 3, 0) in io.reads                             # clock 1 of worker 1 now taken in
    assert sh.clocks == {1: 2, 2: 1}


def test_shard_async_applies_each_push_without_averaging():
    sh, io = _shard(None)
    _push(sh, io, 1, 1, 0, [1, 1], [1, 1, 1, 1])
    _push(sh, io, 1, 2, 1, [1, 1], [1, 1, 1, 1])
    _push(sh, io, 2, 1, 0, [2, 2], [2, 2, 2, 2], opcode=wire.PUSHPULL)
    out = io.take()
    assert sh.updates == 3
    np.testing.assert_allclose(out[-1][2][0], 1.0 - 0.5 * (1 + 1 + 2))   # W=2 steps, no 1/W
    np.testing.assert_allclose(out[-1][2][1], np.arange(4.0) - 0.5 * 4)


def test_shard_ssp_pull_waits_for_the_slowest_within_k():
    sh, io = _shard(1)
    for c in range(3):
        _push(sh, io, 1, 10 + c, c, [0, 0], [0, 0, 0, 0])
    io.take()
    _pull(sh, 1, 20, 3)                        # clock 3, slowest at 0: needs slowest >= 2
    assert io.take() == []
    _push(sh, io, 2, 1, 0, [0, 0], [0, 0, 0, 0])
    assert [f.seq for _, f, _ in io.take()] == [1]           # only worker 2's ack
    _push(sh, io, 2, 2, 1, [0, 0], [0, 0, 0, 0])
    assert sorted(f.seq for _, f, _ in io.take()) == [2, 20]  # ... and now the pull
    assert sh.max_lead == 3


def test_shard_async_dead_worker_releases_the_others_bsp_reports_it():
    sh, io = _shard(1)
    for c in range(3):
        _push(sh, io, 1, 10 + c, c, [0, 0], [0, 0, 0, 0])
    io.take()
    _pull(sh, 1, 20, 3)
    assert io.take() == []
    sh.worker_failed(2)
    assert [f.seq for _, f, _ in io.take()] == [20] and sh.status[2] == DEAD
    sh, io = _shard(0)
    _push(sh, io, 1, 1, 0, [1, 1], [1, 1, 1, 1])
    sh.worker_failed(2)
    (w, f, _), = io.take()
    assert (w, f.opcode, f.flags, f.clock) == (1, wire.ERROR, wire.PEER_FAILED, 2)
    _pull(sh, 1, 2, 1)
    assert io.take()[0][1].flags == wire.PEER_FAILED          # and every later request too
    sh.submit(1, wire.encode(wire.CLOSE, 3))
    sh.progress()
    assert io.take()[0][1].opcode == wire.OK and sh.done


def test_shard_refuses_malformed_and_meaningless_requests_and_keeps_serving():
    sh, io = _shard(None)
    bad = [np.frombuffer(b"garbage!" * 5, np.uint8),
           wire.encode(wire.PULL, 5, pieces=[wire.PieceRef("nope", 0, 2, F8)]),
           wire.encode(wire.PULL, 6, pieces=[wire.PieceRef("w", 3, 4, F8)]),
           wire.encode(wire.PULL, 7, pieces=[wire.PieceRef("w", 0, 5, F8)]),
           wire.encode(wire.PUSH, 8, clock=4, pieces=[]),
           wire.encode(wire.INIT, 9, keys=KEYS)]
    for frame in bad:
        sh.submit(1, frame)
        sh.progress()
    out = io.take()
    assert [f.opcode for _, f, _ in out] == [wire.ERROR] * len(bad)
    assert [f.flags for _, f, _ in out] == [wire.PROTOCOL] * 5 + [wire.STATE]
    assert "unknown key 'nope'" in out[1][1].message and "clock 4" in out[4][1].message
    sh.submit(0, wire.encode(wire.CLOSE, 1))                 # rank 0 is not a worker
    sh.progress()
    assert "not a worker" in io.take()[0][1].message
    _pull(sh, 1, 10, 0)
    (_, f, arrays), = io.take()
    assert f.opcode == wire.OK
    np.testing.assert_array_equal(arrays[1], np.arange(4.0))


def test_shard_init_mismatch_is_reported_to_everyone():
    io = FakeIO()
    sh = Shard(0, 1, [1, 2], 0, ps.SGD(0.1), 1 << 20, io)
    io.give(1, 1, [np.zeros(2), np.zeros(4)])
    sh.submit(1, wire.encode(wire.INIT, 1, keys=KEYS, flags=wire.HAS_VALUES))
    sh.submit(2, wire.encode(wire.INIT, 1, keys=KEYS[:1]))
    sh.progress()
    out = io.take()
    assert sorted(w for w, _, _ in out) == [1, 2]
    assert all(f.flags == wire.MISMATCH for _, f, _ in out)


def test_shard_snapshot_restores_params_state_and_clocks():
    sh, io = _shard(0, opt=ps.Adam(0.1))
    for c in range(3):
        _push(sh, io, 1, 10 + c, c, [1, 2], [1, 2, 3, 4])
        _push(sh, io, 2, 10 + c, c, [0, 1], [4, 3, 2, 1])
    meta, arrays = sh.snapshot()
    meta["updates"] = sh.updates
    again = Shard(0, 1, [1, 2], 0, ps.Adam(0.1), 1 << 20, FakeIO())
    again.restore(meta, {k: v.copy() for k, v in arrays.items()})
    assert again.clocks == sh.clocks and again.applied == 3 and again.resumed
    for key in sh.params:
        np.testing.assert_array_equal(again.params[key], sh.params[key])
        np.testing.assert_array_equal(again.opt_state[key]["v"], sh.opt_state[key]["v"])
    other = Shard(0, 1, [1, 2], 0, ps.SGD(0.1), 1 << 20, FakeIO())
    with pytest.raises(ps.CheckpointError, match="optimizer"):
        other.restore(meta, arrays)


# ============================================================================ whole jobs
# A linear model with a hand-written gradient; each worker has its own batch per step, all
# batches the same size, so the mean of the workers' gradients is the large-batch gradient.
D_IN, D_OUT, BATCH = 12, 5, 16


def _batch(worker, step):
    rng = np.random.default_rng(1000 * step + worker)
    x = rng.standard_normal((BATCH, D_IN))
    y = x @ np.linspace(-1, 1, D_IN * D_OUT).reshape(D_IN, D_OUT) + 0.3
    return x, y


def _grads(p, x, y):
    r = x @ p["w"] + p["b"] - y
    return {"w": x.T @ r / len(x), "b": r.mean(axis=0)}


def _initial():
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((D_IN, D_OUT)) * 0.1, "b": np.zeros(D_OUT)}


def reference_sync(workers, steps, lr=0.1, momentum=0.0, adam=None):
    """Single-process large-batch SGD, or Adam with ``adam=(b1, b2, eps)`` (the batches of all
    workers at once)."""
    p, v, m = _initial(), {"w": 0.0, "b": 0.0}, {"w": 0.0, "b": 0.0}
    for step in range(steps):
        xs, ys = zip(*(_batch(w, step) for w in range(workers)))
        g = _grads(p, np.concatenate(xs), np.concatenate(ys))
        for k in p:
            if adam:
                b1, b2, eps = adam
                t = step + 1
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
                p[k] = p[k] - lr * (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
            else:
                v[k] = momentum * v[k] + g[k]
                p[k] = p[k] - lr * v[k]
    return p


RECORDS = {}        # server rank -> [(updates, lead, {worker: clock}, {piece: params})]


def _record(shard):
    RECORDS.setdefault(shard.server, []).append(
        (shard.updates, shard.lead(), dict(shard.clocks),
         {k: v.copy() for k, v in shard.params.items()}))


def _install_hooks(comm, record, die_at):
    """Set the server hook (in thread worlds all ranks share it, hence the server check)."""
    if not record and die_at is None:
        return

    def after_update(shard):
        if record:
            _record(shard)
        if die_at is not None and shard.server == die_at[0] and shard.updates == die_at[1]:
            if die_at[2] == "exit":
                os._exit(3)                     # the server process dies mid-run
            raise RuntimeError(f"server {shard.server} killed at update {die_at[1]}")
    ps.server.TEST_HOOKS["after_update"] = after_update


def train_job(comm, num_servers, steps, staleness=0, chunk=256, optimizer=None, slow=None,
              ckpt=None, every=0, resume=False, pull_then_push=False, record=False,
              die_at=None):
    """Every rank runs this. Workers train until clock ``steps`` from wherever the servers stand
    (after a resume: the checkpoint's clock) and return (params, clocks seen, starting clock);
    servers return their update records (if ``record``)."""
    _install_hooks(comm, record, die_at)
    kv = ps.start(comm, num_servers=num_servers, staleness=staleness,
                  optimizer=optimizer or ps.SGD(0.1), chunk_bytes=chunk, checkpoint_dir=ckpt,
                  checkpoint_every=every, resume=resume)
    if kv is None:
        return RECORDS.get(comm.rank, [])
    me = comm.rank - num_servers
    init = _initial()
    if me:                                   # only the lowest-ranked worker's values count
        init = {k: v + 100.0 for k, v in init.items()}
    kv.init(init)
    first = kv.clock
    p = kv.pull(["w", "b"])
    clocks = []
    for step in range(first, steps):
        if slow is not None:
            import time
            time.sleep(slow[1] if me == slow[0] else slow[1] / 10)
        g = _grads(p, *_batch(me, step))
        if pull_then_push:
            ts = kv.push(g, wait=False)
            kv.wait(ts)
            p = kv.pull(["w", "b"])
        else:
            p = kv.pushpull(g)
        clocks.append(kv.clock)
    kv.close()
    return p, clocks, first


def _run(fn, size, runner, timeout=60.0):
    """Results by rank on the fake p2p world (threads) or through mc.spawn."""
    RECORDS.clear()
    ps.server.TEST_HOOKS.clear()
    if runner == "fake":
        from ps_fakecomm import run_threads
        results, errors = run_threads(fn, size, timeout=timeout)
        if errors:
            r, (_, e, tb) = min(errors.items(), key=lambda kv: kv[1][0])
            raise AssertionError(f"rank {r} failed:\n{tb}")
        return results
    import minicomm as mc
    return mc.spawn(fn, size, transport=runner, timeout=timeout)


RUNNERS = ["fake", "inproc"]


def _run_failing(fn, size, runner, timeout=60.0):
    """Like _run for a job in which ranks fail: the failed ranks, root cause first."""
    RECORDS.clear()
    ps.server.TEST_HOOKS.clear()
    if runner == "fake":
        from ps_fakecomm import run_threads
        _, errors = run_threads(fn, size, timeout=timeout)
        return sorted(errors, key=lambda r: errors[r][0])
    import minicomm as mc
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(fn, size, transport=runner, timeout=timeout)
    return [r for r, _ in info.value.failures]


def _close_to(a, b, rtol=1e-6):
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("servers,workers,pull_then_push", [(2, 2, False), (1, 3, True),
                                                              (3, 2, False)])
def test_sync_ps_equals_large_batch_sgd(runner, servers, workers, pull_then_push):
    out = _run(lambda c: train_job(c, servers, 20, pull_then_push=pull_then_push),
               servers + workers, runner)
    ref = reference_sync(workers, 20)
    for p, clocks, first in out[servers:]:
        assert first == 0 and clocks == list(range(1, 21))
        _close_to(p, ref)


@pytest.mark.parametrize("runner", RUNNERS)
def test_sync_ps_momentum_is_large_batch_momentum(runner):
    out = _run(lambda c: train_job(c, 2, 12, optimizer=ps.SGD(0.1, momentum=0.9)), 4, runner)
    ref = reference_sync(2, 12, momentum=0.9)
    for p, _, _ in out[2:]:
        _close_to(p, ref)


@pytest.mark.parametrize("runner", RUNNERS)
def test_sync_ps_adam_is_large_batch_adam(runner):
    out = _run(lambda c: train_job(c, 2, 10, optimizer=ps.Adam(0.05, betas=(0.8, 0.99))), 5,
               runner)
    ref = reference_sync(3, 10, lr=0.05, adam=(0.8, 0.99, 1e-8))
    for p, _, _ in out[2:]:
        _close_to(p, ref)


def const_job(comm, staleness, pushes, pipelined):
    """Workers push a constant gradient (worker i: i+1 everywhere) ``pushes`` times; pipelined:
    all pushes in flight at once (wait=False), waited for at the end."""
    _install_hooks(comm, True, None)
    kv = ps.start(comm, num_servers=1, staleness=staleness, optimizer=ps.SGD(0.5),
                  chunk_bytes=64)
    if kv is None:
        return RECORDS.get(comm.rank, [])
    kv.init({"w": np.zeros(20), "b": np.zeros(3)})
    me = comm.rank - 1
    g = {"w": np.full(20, me + 1.0), "b": np.full(3, me + 1.0)}
    stamps = [kv.push(g, wait=not pipelined) for _ in range(pushes)]
    if pipelined:
        for ts in stamps:
            kv.wait(ts)
    kv.close()
    return None


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("pipelined", [False, True])
def test_async_applies_one_step_per_push_and_sync_one_per_clock(runner, pipelined):
    workers, pushes, lr = 3, 4, 0.5
    total = sum(range(1, workers + 1))                       # gradients 1 + 2 + 3 per clock
    for staleness, updates, final in ((None, workers * pushes, -lr * total * pushes),
                                      (0, pushes, -lr * total / workers * pushes)):
        rec = _run(lambda c: const_job(c, staleness, pushes, pipelined), workers + 1, runner)[0]
        assert [u for u, _, _, _ in rec] == list(range(1, updates + 1))
        assert rec[-1][2] == {w: pushes for w in range(1, workers + 1)}
        for value in rec[-1][3].values():
            np.testing.assert_allclose(value, final, rtol=1e-12)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("k", [1, 2])
def test_ssp_no_worker_runs_more_than_k_plus_1_ahead_of_the_slowest(runner, k):
    # worker 0 sleeps 10x longer per step than the other two; every update is recorded
    out = _run(lambda c: train_job(c, 2, 24, staleness=k, slow=(0, 0.02), record=True), 5,
               runner)
    for server in (0, 1):
        rec = out[server]
        assert len(rec) == 3 * 24
        leads = [max(cl.values()) - min(cl.values()) for _, _, cl, _ in rec]
        assert max(leads) <= k + 1
        assert max(leads) >= 1                 # the fast workers did run ahead
    for p, clocks, _ in out[2:]:
        assert clocks == list(range(1, 25))
    # without the bound the fast workers race far ahead of the slow one
    out = _run(lambda c: train_job(c, 1, 24, staleness=None, slow=(0, 0.02), record=True), 4,
               runner)
    assert max(lead for _, lead, _, _ in out[0]) > 3


def malformed_job(comm):
    kv = ps.start(comm, num_servers=1, staleness=0, optimizer=ps.SGD(0.1))
    if kv is None:
        return None
    kv.init({"w": np.zeros(4)})
    c = kv._comm

    def ask(frame, seq, data=()):
        c.send(frame, 0, tag=wire.REQUEST_TAG)
        for d in data:
            c.send(d, 0, tag=wire.tag(wire.PUSH_DATA, seq))
        r = wire.decode(c.recv(0, tag=wire.tag(wire.RESPONSE, seq)), expect_response=True)
        return r.opcode, r.flags, r.message

    w4 = [wire.PieceRef("w", 0, 4, F8)]
    answers = [
        ask(np.frombuffer(b"\0" * 40, np.uint8), 0),                   # bad magic
        ask(np.zeros(8, np.float64), 0),                               # not a byte frame
        ask(wire.encode(wire.PULL, 900, pieces=[wire.PieceRef("w", 5, 4, F8)]), 900),
        ask(wire.encode(wire.PUSH, 901, pieces=w4), 901, [np.ones(7)]),          # 7 != 4
        ask(wire.encode(wire.PUSH, 902, pieces=w4), 902, [np.ones(4, np.float32)]),
        ask(wire.encode(wire.INIT, 903, keys=[KeySpec("w", F8, (4,))]), 903),    # again
    ]
    kv._clocks[0] += 3                 # a clock the server does not have: refused by name
    try:
        kv.pull(["w"])
        refused = None
    except ps.ProtocolError as e:
        refused = str(e)
    kv._clocks[0] -= 3
    mine = {"w": np.empty(4)}
    p = kv.pushpull({"w": np.ones(4)}, out=mine)["w"]   # none of the refused pushes applied
    assert p is mine["w"]
    try:
        kv.pull(["w"], out={"w": np.empty(5)})
        bad_out = None
    except ValueError as e:
        bad_out = str(e)
    kv.close()
    return answers, refused, p, bad_out


@pytest.mark.parametrize("runner", RUNNERS)
def test_malformed_requests_are_refused_by_name_and_the_server_keeps_serving(runner):
    answers, refused, p, bad_out = _run(malformed_job, 2, runner)[1]
    assert "shape (4,)" in bad_out
    assert [a[0] for a in answers] == [wire.ERROR] * 6
    assert [a[1] for a in answers] == [wire.PROTOCOL] * 5 + [wire.STATE]
    for (_, _, msg), what in zip(answers, ["bad magic", "uint8", "no piece 5", "does not fit",
                                           "does not fit", "already"]):
        assert what in msg
    assert refused is not None and "clock 3" in refused
    np.testing.assert_allclose(p, -0.1 * np.ones(4))


def death_job(comm, staleness, out_dir, how):
    import json

    import minicomm as mc
    kv = ps.start(comm, num_servers=1, staleness=staleness, optimizer=ps.SGD(0.1))
    if kv is None:
        return None
    kv.init({"w": np.zeros(8)})
    try:
        for step in range(10):
            if comm.rank == 2 and step == 3:
                if how == "exit":
                    os._exit(9)                  # a crash: no goodbye on any link
                raise RuntimeError("worker rank 2 dies")
            kv.push({"w": np.ones(8)})
        result = {"clock": kv.clock, "w": kv.pull(["w"])["w"].tolist()}
    except mc.PeerFailure as e:
        result = {"peer_failure": getattr(e, "peer", None), "message": str(e)}
    with open(os.path.join(out_dir, f"rank{comm.rank}.json"), "w") as f:
        json.dump(result, f)
    kv.close()
    return None


def _outcomes(d, ranks):
    import json
    return {r: json.load(open(os.path.join(d, f"rank{r}.json"))) for r in ranks}


# A rank that raises under "inproc" aborts the whole thread world (every peer's receive fails,
# naming no rank), so deaths are exercised with processes: a crash (os._exit, no goodbye on any
# link) and a raise (the spawned process closes its links in order, as if it had finished, and
# never calls kv.close(): the servers notice it by its links, not by a failure report).
DEATHS = [("fake", "raise"), ("shm", "exit"), ("shm", "raise")]


@pytest.mark.parametrize("runner,how", DEATHS)
def test_async_job_survives_a_dead_worker(runner, how, tmp_path):
    failed = _run_failing(lambda c: death_job(c, None, str(tmp_path), how), 4, runner)
    assert failed == [2]                     # only the dying worker; server and others finished
    out = _outcomes(tmp_path, [1, 3])
    assert [o["clock"] for o in out.values()] == [10, 10]


@pytest.mark.parametrize("runner,how", DEATHS)
def test_sync_job_reports_a_dead_worker_as_peer_failure(runner, how, tmp_path):
    failed = _run_failing(lambda c: death_job(c, 0, str(tmp_path), how), 4, runner)
    assert failed[0] == 2 and set(failed) <= {0, 2}    # root cause first; the server may follow
    out = _outcomes(tmp_path, [1, 3])
    for o in out.values():
        assert o["peer_failure"] == 2 and "worker rank 2 failed" in o["message"]


def _kill_and_resume(runner, tmp_path, how):
    ckpt = str(tmp_path / "ckpt")
    failed = _run_failing(lambda c: train_job(c, 2, 12, ckpt=ckpt, every=5,
                                              die_at=(0, 7, how)), 4, runner)
    assert failed and failed[0] == 0                        # the killed server is the cause
    assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o700
    files = sorted(os.listdir(ckpt))
    assert files and all(stat.S_IMODE(os.stat(os.path.join(ckpt, f)).st_mode) == 0o600
                         for f in files)
    assert any(f.startswith("shard-000-r") and f.endswith("-u000000000005.npz") for f in files)
    out = _run(lambda c: train_job(c, 2, 12, ckpt=ckpt, every=5, resume=True), 4, runner)
    ref = reference_sync(2, 12)
    for p, clocks, first in out[2:]:
        assert first == 5 and clocks == list(range(6, 13))
        _close_to(p, ref)
    uninterrupted = _run(lambda c: train_job(c, 2, 12), 4, runner)
    for (p, _, _), (q, _, _) in zip(out[2:], uninterrupted[2:]):
        _close_to(p, q)


@pytest.mark.parametrize("runner", RUNNERS)
def test_killed_server_resumes_from_checkpoint_threads(runner, tmp_path):
    _kill_and_resume(runner, tmp_path, "raise")


def test_start_validates_its_arguments_and_reads_the_launcher_env(monkeypatch):
    class Comm:
        size, rank = 4, 0
    monkeypatch.delenv(ps.ENV_NUM_SERVERS, raising=False)
    with pytest.raises(ValueError, match="MINICOMM_NUM_SERVERS"):
        ps.start(Comm())
    for kwargs in ({"num_servers": 4}, {"num_servers": 0}, {"num_servers": 1, "staleness": -1},
                   {"num_servers": 1, "checkpoint_every": 5},
                   {"num_servers": 1, "chunk_bytes": 2}):
        with pytest.raises(ValueError):
            ps.start(Comm(), **kwargs)
    with pytest.raises(TypeError):
        ps.start(Comm(), num_servers=1, optimizer="sgd")
    monkeypatch.setenv(ps.ENV_NUM_SERVERS, "4")
    with pytest.raises(ValueError, match="num_servers=4"):
        ps.start(Comm())                       # the env var was read (and 4 of 4 is too many)


@pytest.mark.parametrize("runner", RUNNERS)
def test_resume_with_another_configuration_is_refused(runner, tmp_path):
    ckpt = str(tmp_path)
    _run(lambda c: train_job(c, 1, 5, ckpt=ckpt, every=5), 3, runner)
    failed = _run_failing(lambda c: train_job(c, 1, 5, ckpt=ckpt, resume=True,
                                              optimizer=ps.Adam(0.1)), 3, runner)
    assert failed[0] == 0                      # the server raises CheckpointError


PS_SCRIPT = """
import numpy as np, minicomm as mc
from minicomm import ps
comm = mc.init()
kv = ps.start(comm, staleness=0, optimizer=ps.SGD(0.5))      # roles from --servers
if kv is not None:
    kv.init({"w": np.zeros(6)})
    for _ in range(3):
        p = kv.pushpull({"w": np.full(6, float(comm.rank))})
    print("worker", comm.rank, "clock", kv.clock, "w", p["w"][0])
    kv.close()
else:
    print("server", comm.rank, "done")
comm.close()
"""


def test_minicomm_run_servers_sets_the_roles(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "ps_job.py"
    script.write_text(PS_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "4", "--servers", "2",
                        str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    # workers 2 and 3 push 2 and 3: each clock moves w by -0.5 * 2.5, three clocks
    assert lines == ["[0] server 0 done", "[1] server 1 done",
                     "[2] worker 2 clock 3 w -3.75", "[3] worker 3 clock 3 w -3.75"]


def test_killed_server_process_resumes_from_checkpoint(tmp_path):
    # real processes over shm: server 0 calls os._exit at its 7th update (checkpoints every 5)
    _kill_and_resume("shm", tmp_path, "exit")


def test_bench_pushpull_cli_reports_every_figure(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "pp.json"
    r = subprocess.run([sys.executable, "-m", "minicomm.cli", "bench", "pushpull", "--sizes",
                        "256K", "--iters", "2", "--batches", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["bytes"] == 256 << 10 and (s["servers"], s["workers"]) == (2, 2)
    for k in ("p2p_s", "p2p_pairs_s", "allreduce_s", "pushpull_s"):
        assert s[k] > 0
    assert s["ratio"] == pytest.approx(2 * s["bytes"] / s["pushpull_s"] / (2 * s["bytes"] /
                                                                             s["p2p_s"]))
    assert "ps goodput / p2p bandwidth" in r.stdout


def test_shard_request_refused_while_its_data_arrives_leaves_nothing_in_flight():
    class SlowIO(FakeIO):
        def post_payload(self, w, seq, bufs):
            return "pending"

        def payload_done(self, h):
            return h != "pending"
    io = SlowIO()
    sh = Shard(0, 1, [1, 2], 0, ps.SGD(0.1), 1 << 20, io)
    sh.submit(1, wire.encode(wire.INIT, 1, keys=KEYS, flags=wire.HAS_VALUES))
    sh.progress()
    assert len(sh.receiving) == 1                 # worker 1's values are on their way
    sh.submit(2, wire.encode(wire.INIT, 1, keys=KEYS[:1]))
    sh.progress()                                 # mismatch: the job is broken for everyone
    assert sh.receiving == [] and sh.broken[0] == wire.MISMATCH
    assert sorted(w for w, f, _ in io.take() if f.flags == wire.MISMATCH) == [1, 2]
