"""Training that goes on: elastic data-parallel training that shrinks, rolls back and
trains on when a worker dies, the parameter server's ``on_worker_failure="drop"`` (at the shard,
with fake I/O, and in real processes), and ``minicomm demo --kill-worker``.

Every distributed result is checked against an independent single-process numpy reference: the
elastic trainer keeps the global batch, so a run that loses a worker must follow the trajectory
of one that does not; a PS-sync run that drops a worker follows large-batch SGD on the whole
global batch until the death and on the survivors' shards after it.
"""
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401
from minicomm import ps
from minicomm.ps import wire
from minicomm.ps.shard import DEAD, Shard
from minicomm.ps.sharding import KeySpec
from minicomm.tools import demo
from minicomm.training import (
    ShardedLoader,
    TrainConfig,
    evaluate,
    load_dataset,
    sgd_step,
    shard_bounds,
    train_elastic,
    train_ps,
    train_single,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F8 = np.dtype("<f8")
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def dataset():
    return load_dataset("synthetic")


def assert_params_close(got, want, rtol=1e-6):
    assert list(got) == list(want)
    for name in want:
        err = np.max(np.abs(got[name] - want[name])) / np.max(np.abs(want[name]))
        assert err <= rtol, f"{name}: relative error {err:.3g}"


def _die_at(step):
    def hook(s):
        if s == step:
            os._exit(86)                       # a crash: no goodbye on any link
    return hook


def _killed_run(fn, world, victim, transport):
    """Run ``fn`` on ``world`` processes in which ``victim`` dies; the survivors' results."""
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(fn, world, transport=transport, timeout=TIMEOUT, on_failure="continue")
    assert [rank for rank, _ in info.value.failures] == [victim]
    return info.value.results


# ============================================================================ shard_bounds
@settings(max_examples=200, deadline=None)
@given(world=st.integers(1, 16), extra=st.integers(0, 200))
def test_shard_bounds_cover_the_batch_once_in_order_and_evenly(world, extra):
    batch = world + extra
    bounds = [shard_bounds(batch, r, world) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == batch
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))       # contiguous, in order
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_shard_bounds_match_the_sharded_loader_when_the_batch_divides(dataset):
    whole = ShardedLoader(dataset.x_train, dataset.y_train, 60, 0, 1, seed=3).batch(7)[0]
    for r in range(4):
        lo, hi = shard_bounds(60, r, 4)
        part = ShardedLoader(dataset.x_train, dataset.y_train, 60, r, 4, seed=3).batch(7)[0]
        np.testing.assert_array_equal(whole[lo:hi], part)


def test_bad_arguments_are_named(dataset):
    with pytest.raises(ValueError, match="global_batch"):
        shard_bounds(2, 0, 3)
    with pytest.raises(ValueError, match="rank 3"):
        shard_bounds(8, 3, 3)
    with pytest.raises(mc.SpawnError, match="commit_every"):
        mc.spawn(lambda c: train_elastic(c, dataset, TrainConfig(steps=2), commit_every=0), 2,
                 transport="inproc", timeout=TIMEOUT)
    with pytest.raises(ValueError, match="on_worker_failure"):
        Shard(0, 1, [1], 0, ps.SGD(0.1), 1 << 20, None, on_worker_failure="ignore")
    with pytest.raises(ValueError, match="on_worker_failure"):
        ps.start(types.SimpleNamespace(size=2), 1, on_worker_failure="ignore")
    with pytest.raises(mc.SpawnError, match="on_worker_failure"):
        mc.spawn(lambda c: train_ps(c, dataset, TrainConfig(steps=2), 1,
                                    on_worker_failure="later"), 2, transport="inproc",
                 timeout=TIMEOUT)


# ============================================================================ elastic training
def test_elastic_without_failure_is_large_batch_sgd_even_on_uneven_shards(dataset):
    config = TrainConfig(steps=12, global_batch=64, seed=1)      # 64 over 3 ranks: 22, 21, 21
    logs = mc.spawn(lambda c: train_elastic(c, dataset, config, "ring", commit_every=4,
                                            return_params=True), 3, transport="inproc",
                    timeout=TIMEOUT)
    want = train_single(dataset, config).params
    for log in logs:
        assert log.info["recoveries"] == [] and len(log.losses) == 12
        assert_params_close(log.params, want)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_elastic_survivors_roll_back_and_follow_the_unbroken_trajectory(dataset, transport):
    config = TrainConfig(steps=24, global_batch=60, seed=2)
    kill_step, commit_every = 13, 5

    def work(comm):
        hook = _die_at(kill_step) if comm.rank == 1 else None     # a middle rank dies
        return train_elastic(comm, dataset, config, "ring", commit_every=commit_every,
                             return_params=True, before_step=hook)

    results = _killed_run(work, 4, 1, transport)
    survivors = [results[r] for r in (0, 2, 3)]
    assert results[1] is None and all(log is not None for log in survivors)
    want = train_single(dataset, config).params       # the global batch was kept: same SGD
    for new_rank, log in enumerate(survivors):
        assert log.rank == new_rank and log.info["world_size"] == 3
        (rec,) = log.info["recoveries"]
        assert rec["resumed_at"] == 10 and rec["failed_at"] == kill_step
        assert rec["steps_lost"] == kill_step - 10 and rec["world"] == [4, 3]
        assert rec["recover_s"] >= 0 and len(log.losses) == len(log.step_times) == 24
        assert log.step_times == sorted(log.step_times)
        assert_params_close(log.params, want)


def test_elastic_with_a_kill_ends_as_accurate_as_without(dataset):
    config = TrainConfig(steps=60, global_batch=64)

    def work(comm):
        return train_elastic(comm, dataset, config, "auto",
                             before_step=_die_at(31) if comm.rank == 2 else None)

    results = _killed_run(work, 3, 2, "shm")
    model = config.model(dataset)
    with_failure = evaluate(model, results[0].params, dataset)[1]
    without = evaluate(model, train_single(dataset, config).params, dataset)[1]
    assert abs(with_failure - without) <= 0.02 and with_failure > 0.5


# ============================================================================ PS: drop at the shard
class FakeIO:
    """The shard's I/O: payloads given by the test, responses recorded (no communicator)."""

    def __init__(self):
        self.payloads, self.responses = {}, []

    def give(self, w, seq, arrays):
        self.payloads[(w, seq)] = [np.asarray(a, F8) for a in arrays]

    def post_payload(self, w, seq, bufs):
        for buf, a in zip(bufs, self.payloads[(w, seq)]):
            buf[...] = a
        return True

    def payload_done(self, handle):
        return True

    def finish_payload(self, handle):
        pass

    def respond(self, w, seq, frame, arrays=()):
        self.responses.append((w, wire.decode(frame, expect_response=True),
                               [np.array(a) for a in arrays]))

    def settle(self):
        return []

    def take(self):
        out, self.responses = self.responses, []
        return out


KEYS = [KeySpec("w", F8, (3,))]
LR = 0.5


def _drop_shard(workers=(1, 2, 3), init=(1.0, 2.0, 3.0)):
    io = FakeIO()
    sh = Shard(0, 1, list(workers), 0, ps.SGD(LR), 1 << 20, io, on_worker_failure="drop")
    for seq, w in enumerate(workers, start=100):
        lowest = w == min(workers)
        if lowest:
            io.give(w, seq, [np.asarray(init)])
        sh.submit(w, wire.encode(wire.INIT, seq, keys=KEYS,
                                 flags=wire.HAS_VALUES if lowest else 0))
        sh.progress()
    assert all(f.opcode == wire.OK for _, f, _ in io.take()) and sh.init_done
    return sh, io


def _refs(sh):
    return [wire.PieceRef(p.name, p.index, p.count, p.dtype) for p in sh.plan.on_server(0)]


def _pushpull(sh, io, w, seq, clock, grad):
    io.give(w, seq, [np.asarray(grad, F8)])
    sh.submit(w, wire.encode(wire.PUSHPULL, seq, clock=clock, pieces=_refs(sh)))
    sh.progress()


@settings(max_examples=60, deadline=None)
@given(grads=st.lists(st.lists(st.floats(-10, 10), min_size=3, max_size=3), min_size=3,
                      max_size=3),
       pushed_before_death=st.integers(0, 3), dead=st.sampled_from([1, 2, 3]),
       dead_first=st.booleans())
def test_sync_drop_averages_the_clock_over_those_who_pushed_and_goes_on(
        grads, pushed_before_death, dead, dead_first):
    """Clock 0: some workers push, then ``dead`` dies (its push counts if it came before); the
    clock is applied with the mean of the pushes that arrived; clock 1 has the survivors only."""
    sh, io = _drop_shard()
    params = np.array([1.0, 2.0, 3.0])
    others = [w for w in (1, 2, 3) if w != dead]
    order = [dead] + others if dead_first else others + [dead]
    if pushed_before_death == 3:
        pushed_before_death = 2                 # everyone pushing completes the clock first
    pushers = order[:pushed_before_death]
    for w in pushers:
        _pushpull(sh, io, w, 10 + w, 0, grads[w - 1])
    assert io.take() == [] and sh.applied == 0               # clock 0 is not complete yet
    sh.worker_failed(dead)
    assert sh.status[dead] == DEAD and sh.broken is None
    for w in order[pushed_before_death:]:
        if w != dead:
            _pushpull(sh, io, w, 10 + w, 0, grads[w - 1])
    contributors = pushers + [w for w in order[pushed_before_death:] if w != dead]
    params -= LR * np.mean([grads[w - 1] for w in contributors], axis=0)
    out = io.take()
    assert sh.applied == 1 and sorted(w for w, _, _ in out) == sorted(set(contributors) - {dead})
    for _, f, arrays in out:
        assert f.opcode == wire.OK
        np.testing.assert_allclose(arrays[0], params, rtol=1e-12, atol=1e-12)
    survivors = [w for w in (1, 2, 3) if w != dead]
    for w in survivors:                                      # clock 1: two workers, mean of two
        _pushpull(sh, io, w, 20 + w, 1, np.ones(3) * w)
    params -= LR * np.mean([np.ones(3) * w for w in survivors], axis=0)
    out = io.take()
    assert sh.applied == 2 and len(out) == 2
    np.testing.assert_allclose(out[-1][2][0], params, rtol=1e-12, atol=1e-12)


def test_sync_drop_still_breaks_when_the_initial_values_never_arrive():
    io = FakeIO()
    sh = Shard(0, 1, [1, 2], 0, ps.SGD(LR), 1 << 20, io, on_worker_failure="drop")
    sh.submit(2, wire.encode(wire.INIT, 1, keys=KEYS))
    sh.progress()
    sh.worker_failed(1)                       # the lowest worker, whose values init uses
    (w, f, _), = io.take()
    assert (w, f.opcode, f.flags) == (2, wire.ERROR, wire.PEER_FAILED) and sh.broken


# ============================================================================ PS: real processes
def _reference_drop(dataset, config, workers, survivors, kill_step):
    """Large-batch SGD on the whole global batch before ``kill_step``, on the survivors' shards
    (the first ``survivors`` of ``workers`` equal shards) from it on."""
    model = config.model(dataset)
    params = model.init_params()
    loader = config.loader(dataset)
    share = config.global_batch // workers * survivors
    for step in range(config.steps):
        x, y = loader.batch(step)
        if step >= kill_step:
            x, y = x[:share], y[:share]
        sgd_step(params, model.loss_and_grads(params, x, y)[1], config.lr)
    return params


def test_ps_sync_drop_survivors_finish_on_the_survivors_gradients(dataset):
    config = TrainConfig(steps=20, global_batch=60, seed=4)
    kill_step = 8

    def work(comm):
        hook = _die_at(kill_step) if comm.rank == comm.size - 1 else None
        return train_ps(comm, dataset, config, num_servers=2, staleness=0, chunk_bytes=1024,
                        on_worker_failure="drop", before_step=hook, return_params=True)

    results = _killed_run(work, 5, 4, "shm")                # 2 servers, 3 workers, one dies
    assert results[:2] == [None, None]
    want = _reference_drop(dataset, config, 3, 2, kill_step)
    for log in results[2:4]:
        assert len(log.losses) == 20
        assert_params_close(log.params, want)


def test_ps_async_with_drop_finishes_and_reports_from_the_first_survivor(dataset):
    config = TrainConfig(steps=30, global_batch=64)

    def work(comm):
        hook = _die_at(10) if comm.rank == 1 else None       # the first worker dies
        return train_ps(comm, dataset, config, num_servers=1, staleness=None,
                        on_worker_failure="drop", before_step=hook)

    results = _killed_run(work, 3, 1, "shm")
    log = results[2]
    assert len(log.losses) == 30 and log.params is not None   # worker 1 took over the report
    accuracy = evaluate(config.model(dataset), log.params, dataset)[1]
    assert accuracy > 0.5


# ============================================================================ demo and example
def test_demo_kill_worker_reports_a_failure_table_and_plot(tmp_path, capsys):
    rc = demo.main(["--steps", "30", "--kill-worker", "12", "--modes", "ring,ps-sync",
                    "--transport", "inproc", "--dataset", "synthetic", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0 and "failure drill runs on shm (not inproc)" in err
    table = out[out.index("killed before step"):].splitlines()
    rows = [line.split() for line in table[2:4]]
    assert [r[0] for r in rows] == ["allreduce", "ps-sync"]
    assert rows[0][2:5] == ["2", "->", "1"] and rows[0][5] == "12" and rows[0][6] == "2"
    assert (tmp_path / "failure.png").stat().st_size > 0


def test_demo_refuses_a_kill_step_outside_the_run(capsys):
    assert demo.main(["--steps", "10", "--kill-worker", "10", "--modes", "ring"]) == 2
    assert "--kill-worker 10 must be a step in 1..9" in capsys.readouterr().err
    assert demo.main(["--workers", "1", "--kill-worker", "3", "--modes", "ring"]) == 2
    assert "at least 2 workers" in capsys.readouterr().err


def test_example_elastic_under_minicomm_run_recovers(tmp_path):
    cmd = [sys.executable, "-m", "minicomm.cli", "run", "--on-failure", "continue", "-n", "3",
           os.path.join(REPO, "examples", "train_mlp.py"), "--elastic", "--kill-worker", "13",
           "--steps", "30", "--dataset", "synthetic", "--no-plots", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("[0] {")]
    doc = json.loads(line[len("[0] "):])
    (record,) = doc["runs"]
    (rec,) = record["recoveries"]
    assert rec["resumed_at"] == 10 and rec["steps_lost"] == 3 and rec["world"] == [3, 2]
    assert "rank 2 exited with status 86" in proc.stdout + proc.stderr
