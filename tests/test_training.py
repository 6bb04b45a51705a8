"""minicomm.training and ``minicomm demo``: the MLP's gradients against finite differences, the
sharded loader against the single-process batch, data-parallel allreduce (every algorithm) and
PS-sync against single-process large-batch SGD, accuracy, and the demo's JSON.

Tests of the real parameter server are skipped only while ``minicomm.ps`` cannot be imported
(``pytest.importorskip``); the trainer's own call sequence is exercised meanwhile against
``tests/fake_ps.py``.
"""
import json
import os
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest

import minicomm as mc
from extras import module_missing, require
from minicomm.training import (
    MLP,
    GradBuckets,
    ShardedLoader,
    TrainConfig,
    evaluate,
    load_dataset,
    train_data_parallel,
    train_ps,
    train_single,
)
from minicomm.training.data import synthetic
from minicomm.training.data_parallel import DataParallel, schedule_traffic

sys.path.insert(0, os.path.dirname(__file__))
import fake_ps  # noqa: E402

ALGORITHMS = ("ring", "tree", "rhd", "hier", "auto")
STEPS = 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dataset():
    return load_dataset()


@pytest.fixture(scope="module")
def reference(dataset):
    """Single-process large-batch SGD after STEPS steps, for global batches 64 and 60."""
    return {b: train_single(dataset, TrainConfig(steps=STEPS, global_batch=b)).params
            for b in (64, 60)}


def assert_params_close(got, want, rtol=1e-6):
    assert list(got) == list(want)
    for name in want:
        err = np.max(np.abs(got[name] - want[name])) / np.max(np.abs(want[name]))
        assert err <= rtol, f"{name}: relative error {err:.3g}"


# ------------------------------------------------------------------------------ model
def test_gradients_match_finite_differences():
    model = MLP((7, 6, 5, 4), seed=3)
    params = model.init_params()
    rng = np.random.default_rng(1)
    for p in params.values():            # non-zero biases, so every term is exercised
        p += rng.normal(0, 0.1, p.shape)
    x = rng.normal(size=(9, 7))
    y = rng.integers(0, 4, size=9)
    loss, grads = model.loss_and_grads(params, x, y)
    assert loss == pytest.approx(model.loss(params, x, y), rel=1e-14)
    h = 1e-6
    for name, p in params.items():
        numeric = np.empty_like(p)
        for i in np.ndindex(p.shape):
            old = p[i]
            p[i] = old + h
            up = model.loss(params, x, y)
            p[i] = old - h
            down = model.loss(params, x, y)
            p[i] = old
            numeric[i] = (up - down) / (2 * h)
        assert grads[name].shape == p.shape
        rel = np.max(np.abs(grads[name] - numeric)) / max(np.max(np.abs(numeric)), 1e-12)
        assert rel < 1e-6, f"{name}: relative error {rel:.3g}"


def test_backward_reports_layers_last_first():
    model = MLP((5, 4, 3, 2))
    seen = []
    _, grads = model.loss_and_grads(model.init_params(), np.ones((2, 5)), np.array([0, 1]),
                                    on_layer=lambda g: seen.append(sorted(g)))
    assert seen == [["b3", "w3"], ["b2", "w2"], ["b1", "w1"]]
    assert list(grads) == ["w1", "b1", "w2", "b2", "w3", "b3"]


def test_init_is_deterministic_and_float64():
    a, b = MLP((64, 64, 10), seed=5).init_params(), MLP((64, 64, 10), seed=5).init_params()
    assert all(np.array_equal(a[k], b[k]) and a[k].dtype == np.float64 for k in a)
    c = MLP((64, 64, 10), seed=6).init_params()
    assert not np.array_equal(a["w1"], c["w1"])


def test_model_rejects_bad_input():
    model = MLP((4, 3))
    p = model.init_params()
    with pytest.raises(ValueError):
        model.loss(p, np.ones((2, 5)), np.array([0, 1]))
    with pytest.raises(ValueError):
        model.loss(p, np.ones((2, 4)), np.array([0, 3]))
    with pytest.raises(ValueError):
        MLP((4,))
    with pytest.raises(TypeError):
        MLP((4, 3), dtype=np.int32)


# ------------------------------------------------------------------------------ data
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_reproduce_the_single_process_batch(dataset, world):
    batch = 60
    single = ShardedLoader(dataset.x_train, dataset.y_train, batch, seed=7)
    shards = [ShardedLoader(dataset.x_train, dataset.y_train, batch, r, world, seed=7)
              for r in range(world)]
    # across an epoch boundary too: a new permutation per epoch
    for step in list(range(5)) + [single.steps_per_epoch - 1, single.steps_per_epoch,
                                  3 * single.steps_per_epoch + 2]:
        idx = np.concatenate([s.indices(step) for s in shards])
        assert np.array_equal(idx, single.indices(step))
        x, y = single.batch(step)
        assert np.array_equal(np.concatenate([s.batch(step)[0] for s in shards]), x)
        assert np.array_equal(np.concatenate([s.batch(step)[1] for s in shards]), y)
    epoch = np.concatenate([single.indices(s) for s in range(single.steps_per_epoch)])
    assert len(set(epoch.tolist())) == len(epoch)        # no sample twice within an epoch


def test_loader_rejects_unequal_shards(dataset):
    with pytest.raises(ValueError, match="multiple"):
        ShardedLoader(dataset.x_train, dataset.y_train, 64, 0, 3)
    with pytest.raises(ValueError):
        ShardedLoader(dataset.x_train, dataset.y_train, 64, 2, 2)


def test_dataset_is_deterministic_and_disjoint():
    a, b = load_dataset("synthetic", seed=0), load_dataset("synthetic", seed=0)
    assert a.name == "synthetic"
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert a.x_train.shape[1] == 64 and a.num_classes == 10
    assert len(a.y_train) + len(a.y_test) == len(synthetic(0)[1])
    with pytest.raises(ValueError):
        load_dataset("mnist")


def test_digits_when_scikit_learn_is_installed():
    require(module_missing("sklearn", "demo"))
    ds = load_dataset()
    assert ds.name == "digits"
    assert len(ds.y_train) + len(ds.y_test) == 1797
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0


# ------------------------------------------------------------------------------ allreduce
def test_buckets_follow_backward_order_and_cap():
    model = MLP((64, 64, 10))
    b = GradBuckets(model, cap_bytes=16 << 10)
    assert b.buckets == [["w2", "b2"], ["w1"], ["b1"]]
    assert b.counts == [650, 4096, 64]
    one = GradBuckets(model, cap_bytes=1 << 30)
    assert one.buckets == [["w2", "b2", "w1", "b1"]]
    grads = OrderedDict((n, np.random.default_rng(0).normal(size=s))
                        for n, s in model.param_shapes().items())
    back = {}
    for i in range(len(b.buckets)):
        b.unpack(i, b.pack(i, grads), back)
    assert all(np.array_equal(back[n], grads[n]) for n in grads)


def test_ring_traffic_is_the_closed_form():
    for p in (2, 3, 4, 5):
        n = 60 * p
        sent, received, rounds = schedule_traffic("ring", 0, p, n)
        assert sent == received == 2 * (p - 1) * n // p
        assert rounds == 2 * (p - 1)


class _RecordingComm:
    """Enough of a Communicator for DataParallel: records when each allreduce starts."""

    def __init__(self, events):
        self.rank, self.size, self.topology, self.timeout = 0, 2, (0, 0), 10.0
        self.events = events

    def _resolve_algorithm(self, coll, algorithm, nbytes):
        return "ring" if algorithm == "auto" else algorithm

    def allreduce(self, x, op, out, algorithm, async_op):
        assert op == "avg" and async_op and out is x
        self.events.append(("allreduce", x.size))
        work = mc.Work("recorded allreduce")
        work._finish(x)                 # as if every rank had the same gradients
        return work


def test_allreduce_of_a_bucket_starts_before_backward_ends():
    events = []
    model = MLP((64, 64, 10))
    real = model.loss_and_grads

    def traced(params, x, y, on_layer=None):
        def hook(g):
            events.append(("layer", sorted(g)))
            on_layer(g)
        return real(params, x, y, on_layer=hook)

    model.loss_and_grads = traced
    dp = DataParallel(_RecordingComm(events), model, "ring")
    dp.step(model.init_params(), np.ones((4, 64)), np.arange(4), lr=0.1)
    assert events == [("layer", ["b2", "w2"]), ("allreduce", 650), ("layer", ["b1", "w1"]),
                      ("allreduce", 4096), ("allreduce", 64)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_data_parallel_equals_single_process_sgd(dataset, reference, algorithm, world):
    batch = 60 if world == 3 else 64
    config = TrainConfig(steps=STEPS, global_batch=batch)
    logs = mc.spawn(lambda comm: train_data_parallel(comm, dataset, config, algorithm,
                                                     return_params=True),
                    world, transport="inproc", nodes=2, timeout=60)
    for log in logs:                       # every rank holds the same, right parameters
        assert_params_close(log.params, reference[batch])
        assert len(log.losses) == STEPS


def test_data_parallel_in_real_processes_over_shm(dataset, reference):
    config = TrainConfig(steps=STEPS)
    logs = mc.spawn(train_data_parallel, 2, args=(dataset, config, "ring"), transport="shm",
                    timeout=60)
    assert_params_close(logs[0].params, reference[64])
    assert logs[1].params is None
    assert logs[0].bytes_sent_per_step == 2 * 4810 * 8 // 2     # 2(p-1)/p * model, p = 2


def test_data_parallel_rejects_bad_arguments(dataset):
    with pytest.raises(mc.SpawnError, match="algorithm"):
        mc.spawn(lambda c: train_data_parallel(c, dataset, TrainConfig(steps=1), "bogus"), 2,
                 transport="inproc", timeout=30)
    with pytest.raises(mc.SpawnError, match="multiple"):
        mc.spawn(lambda c: train_data_parallel(c, dataset, TrainConfig(steps=1), "ring"), 3,
                 transport="inproc", timeout=30)


# ------------------------------------------------------------------------------ accuracy
def test_single_process_accuracy_with_demo_defaults():
    require(module_missing("sklearn", "demo"))
    ds = load_dataset()
    log = train_single(ds, TrainConfig())
    loss, accuracy = evaluate(TrainConfig().model(ds), log.params, ds)
    print(f"single, demo defaults: final loss {loss:.4f}, test accuracy {accuracy:.4f}")
    assert accuracy >= 0.90


# ------------------------------------------------------------------------------ PS trainer
def test_ps_trainer_call_sequence_against_a_stand_in(dataset, reference):
    """The trainer against tests/fake_ps.py (not the real server): sync = single."""
    config = TrainConfig(steps=STEPS)
    logs = mc.spawn(lambda c: train_ps(c, dataset, config, num_servers=2, staleness=0,
                                       ps_module=fake_ps), 4, transport="inproc", timeout=60)
    assert logs[0] is None and logs[1] is None
    assert_params_close(logs[2].params, reference[64])
    assert logs[3].params is None and logs[3].bytes_sent_per_step == 4810 * 8


def test_ps_trainer_rejects_bad_arguments(dataset):
    with pytest.raises(mc.SpawnError, match="num_servers"):
        mc.spawn(lambda c: train_ps(c, dataset, TrainConfig(steps=1), num_servers=2,
                                    ps_module=fake_ps), 2, transport="inproc", timeout=30)
    with pytest.raises(mc.SpawnError, match="staleness"):
        mc.spawn(lambda c: train_ps(c, dataset, TrainConfig(steps=1), num_servers=1,
                                    staleness=-1, ps_module=fake_ps), 2, transport="inproc",
                 timeout=30)


def _ps_run(dataset, config, staleness, transport="shm", world=4, servers=2):
    return mc.spawn(train_ps, world, args=(dataset, config, servers, staleness),
                    transport=transport, timeout=120)


def test_ps_sync_equals_single_process_sgd(dataset, reference):
    pytest.importorskip("minicomm.ps")
    logs = _ps_run(dataset, TrainConfig(steps=STEPS), 0)
    assert logs[0] is None and logs[1] is None
    assert_params_close(logs[2].params, reference[64])


def test_ps_async_and_ssp_reach_sync_accuracy(dataset):
    pytest.importorskip("minicomm.ps")
    config = TrainConfig()                     # the demo's defaults
    model = config.model(dataset)
    acc = {}
    for staleness in (0, None, 2):
        logs = _ps_run(dataset, config, staleness)
        acc[staleness] = evaluate(model, logs[2].params, dataset)[1]
    print(f"PS test accuracy: sync {acc[0]:.4f}, async {acc[None]:.4f}, ssp(2) {acc[2]:.4f}")
    assert abs(acc[None] - acc[0]) <= 0.02
    assert abs(acc[2] - acc[0]) <= 0.02


# ------------------------------------------------------------------------------ demo
RUN_KEYS = {"mode", "algorithm", "workers", "servers", "staleness", "final_loss",
            "test_accuracy", "wall_s", "samples_per_s", "bytes_per_step_per_worker"}


def _demo_json(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "demo", "--json", "--no-plots",
                          *args], capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)            # exactly one JSON object, nothing else


def test_demo_json_has_the_documented_keys():
    doc = _demo_json("--steps", "40")
    assert doc["dataset"] in ("digits", "synthetic") and doc["steps"] == 40
    modes = [r["mode"] for r in doc["runs"]]
    expected = ["single", "allreduce", "allreduce", "allreduce"]
    try:
        import minicomm.ps  # noqa: F401
        expected += ["ps-sync", "ps-async", "ps-ssp"]
    except ImportError:
        assert doc["skipped"] == ["ps-sync", "ps-async", "ps-ssp"]
    assert modes == expected
    for r in doc["runs"]:
        assert RUN_KEYS <= set(r)
        assert (r["algorithm"] is None) == (r["mode"] != "allreduce")
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["wall_s"] > 0 and r["samples_per_s"] > 0
    assert [r["algorithm"] for r in doc["runs"] if r["mode"] == "allreduce"] == \
        ["ring", "rhd", "auto"]
    single = doc["runs"][0]["final_loss"]
    for r in doc["runs"]:
        if r["mode"] in ("allreduce", "ps-sync"):      # the synchronous modes
            assert r["final_loss"] == pytest.approx(single, rel=1e-4)
            assert r["bytes_per_step_per_worker"] > 0


def test_demo_ps_modes_through_a_stand_in(monkeypatch, tmp_path, capsys):
    """The demo's PS path end to end (threads, tests/fake_ps.py standing in for minicomm.ps),
    with the table, the comparison and the plots."""
    import minicomm
    from minicomm.tools import demo
    monkeypatch.setitem(sys.modules, "minicomm.ps", fake_ps)
    monkeypatch.setattr(minicomm, "ps", fake_ps, raising=False)
    assert demo.main(["--transport", "inproc", "--steps", "30", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for mode in ("single", "allreduce", "ps-sync", "ps-async", "ps-ssp(k=2)"):
        assert mode in out
    assert "Bytes through the busiest endpoint" in out
    require(module_missing("matplotlib", "plot"))
    assert sorted(os.listdir(tmp_path)) == ["loss_vs_step.png", "loss_vs_time.png",
                                            "throughput.png"]


def test_demo_rejects_bad_options(capsys):
    from minicomm.tools import demo
    assert demo.main(["--workers", "3", "--modes", "single"]) == 2
    assert "multiple" in capsys.readouterr().err
    assert demo.main(["--modes", "single,warp"]) == 2
    assert demo.main(["--batch", "4096", "--dataset", "synthetic", "--modes", "single"]) == 2
    assert "exceeds the" in capsys.readouterr().err


def test_demo_an_error_inside_a_run_is_not_called_a_usage_error(monkeypatch):
    from minicomm.tools import demo

    def broken(*args, **kwargs):
        raise ValueError("max() arg is an empty sequence")
    monkeypatch.setattr(demo, "execute", broken)
    with pytest.raises(ValueError, match="empty sequence"):
        demo.main(["--modes", "single", "--dataset", "synthetic", "--steps", "2", "--no-plots"])


def test_progress_falls_back_to_a_plain_line(monkeypatch, capsys):
    from minicomm.tools import demo
    monkeypatch.setitem(sys.modules, "tqdm", None)       # import tqdm -> ImportError
    bar = demo.Progress("single", 3)
    for step in range(3):
        bar(step, 1.0 / (step + 1))
    bar.close()
    err = capsys.readouterr().err
    assert "3/3 steps" in err and "loss 0.3333" in err and err.endswith("\n")


def test_example_runs_under_minicomm_run():
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "minicomm.cli", "run", "-n", "2",
                          os.path.join(REPO, "examples", "train_mlp.py"), "--json", "--steps",
                          "20", "--mode", "ring", "--no-plots"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln[len("[0] "):] for ln in out.stdout.splitlines() if ln.startswith("[0] {")]
    assert len(lines) == 1, out.stdout
    doc = json.loads(lines[0])
    (run,) = doc["runs"]
    assert run["mode"] == "allreduce" and run["algorithm"] == "ring" and run["workers"] == 2
    single = train_single(load_dataset(), TrainConfig(steps=20))
    want, _ = evaluate(TrainConfig().model(load_dataset()), single.params, load_dataset())
    assert run["final_loss"] == pytest.approx(want, rel=1e-6)
