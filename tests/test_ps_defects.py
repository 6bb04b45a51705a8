"""Parameter-server defects of issue 35: checkpoints belong to their job (defect 2), the
checkpoint directory's safety and the metadata's shape (defect 3), and the key limits fit the
frame limit (defect 5). Jobs run on the thread world of ``ps_fakecomm`` and on inproc."""
from __future__ import annotations

import hashlib
import os
import stat

import numpy as np
import pytest

from minicomm import ps
from minicomm.ps import checkpoint, wire
from minicomm.ps.sharding import MAX_NAME_BYTES, MAX_NDIM, KeySpec
from minicomm.ps.worker import Worker

RUNNERS = ["fake", "inproc"]
LR = 0.25
A = np.array([1.0, 2.0, 3.0])          # the earlier job's target
B = np.array([-4.0, 0.5, 7.0])         # the new job's target


def expected(target, steps):
    """w after ``steps`` SGD steps on |w - target|^2 / 2 from w = 0."""
    return target * (1 - (1 - LR) ** steps)


def job(comm, target, steps, ckpt, resume=False, **extra):
    """2 servers, 1 worker, synchronous; a checkpoint every 5 updates. The worker trains from
    wherever the servers stand until clock ``steps`` and returns (starting clock, w)."""
    kv = ps.start(comm, num_servers=2, staleness=0, optimizer=ps.SGD(LR), chunk_bytes=8,
                  checkpoint_dir=ckpt, checkpoint_every=5, resume=resume, **extra)
    if kv is None:
        return None
    kv.init({"w": np.zeros(3)})
    first = kv.clock
    p = kv.pull(["w"])
    for _ in range(first, steps):
        p = kv.pushpull({"w": p["w"] - target})
    kv.close()
    return first, p["w"]


def _run(fn, size, runner, timeout=60.0):
    if runner == "fake":
        from ps_fakecomm import run_threads
        results, errors = run_threads(fn, size, timeout=timeout)
        if errors:
            r, (_, _, tb) = min(errors.items(), key=lambda kv: kv[1][0])
            raise AssertionError(f"rank {r} failed:\n{tb}")
        return results
    import minicomm as mc
    return mc.spawn(fn, size, transport=runner, timeout=timeout)


def _failures(fn, size, runner, timeout=60.0):
    """{rank: traceback text} of a job in which ranks fail."""
    if runner == "fake":
        from ps_fakecomm import run_threads
        _, errors = run_threads(fn, size, timeout=timeout)
        return {r: tb for r, (_, _, tb) in errors.items()}
    import minicomm as mc
    with pytest.raises(mc.SpawnError) as info:
        mc.spawn(fn, size, transport=runner, timeout=timeout)
    return dict(info.value.failures)


def _files(directory):
    """{name: sha256} of every file in ``directory``."""
    return {n: hashlib.sha256(open(os.path.join(directory, n), "rb").read()).hexdigest()
            for n in os.listdir(directory)}


# ============================================================== 2. checkpoints belong to a job
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_new_job_keeps_its_checkpoints_and_resumes_its_own_model(runner, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run(lambda c: job(c, A, 20, ckpt), 3, runner)        # the earlier job: up to update 20
    old = _files(ckpt)
    first, w = _run(lambda c: job(c, B, 10, ckpt), 3, runner)[2]   # a new job, resume=False
    assert first == 0                                     # it did not restore the old job's model
    np.testing.assert_allclose(w, expected(B, 10))
    now = _files(ckpt)
    assert {n: now.get(n) for n in old} == old            # the old job's files are untouched
    # The new job's checkpoints survived rotation, so resume=True restores *its* model (update
    # 10), not the old job's update 20 whose count is higher.
    first, w = _run(lambda c: job(c, B, 12, ckpt, resume=True), 3, runner)[2]
    assert first == 10
    np.testing.assert_allclose(w, expected(B, 12))
    assert {n: _files(ckpt).get(n) for n in old} == old


@pytest.mark.parametrize("runner", RUNNERS)
def test_resume_picks_the_run_that_wrote_last_or_the_named_one(runner, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run(lambda c: job(c, A, 10, ckpt, run_id="alpha"), 3, runner)
    _run(lambda c: job(c, B, 10, ckpt, run_id="beta"), 3, runner)
    assert sorted(checkpoint.runs(ckpt, 0)) == ["alpha", "beta"]
    # named: the older run, although beta wrote last; it goes on as alpha (update 15 written)
    first, w = _run(lambda c: job(c, A, 15, ckpt, resume=True, run_id="alpha"), 3, runner)[2]
    assert first == 10
    np.testing.assert_allclose(w, expected(A, 15))
    # unnamed: the run that wrote the newest checkpoint, alpha now
    first, w = _run(lambda c: job(c, A, 17, ckpt, resume=True), 3, runner)[2]
    assert first == 15
    np.testing.assert_allclose(w, expected(A, 17))
    assert sorted(checkpoint.runs(ckpt, 1)) == ["alpha", "beta"]   # resuming made no new run
    # beta's files were never touched by alpha's rotation
    assert [u for u, _ in checkpoint.available(ckpt, 0, "beta")] == [5, 10]


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_fresh_job_never_reuses_the_name_of_a_run_with_checkpoints(runner, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run(lambda c: job(c, A, 10, ckpt, run_id="alpha"), 3, runner)
    old = _files(ckpt)
    failed = _failures(lambda c: job(c, B, 10, ckpt, run_id="alpha"), 3, runner)
    assert {0, 1} <= set(failed)
    for r in (0, 1):
        assert "CheckpointError" in failed[r] and "'alpha'" in failed[r] \
            and "resume=True" in failed[r]
    assert _files(ckpt) == old


def test_run_ids_are_validated():
    class Comm:
        size, rank = 3, 0
    for bad in ("", ".hidden", "a/b", "../up", "x" * 65, "sp ace", 5):
        with pytest.raises(ValueError, match="run_id"):
            ps.start(Comm(), num_servers=1, checkpoint_dir="/nonexistent", checkpoint_every=5,
                     run_id=bad)
    with pytest.raises(ValueError, match="run_id"):
        ps.start(Comm(), num_servers=1, run_id="alpha")          # no checkpoint_dir


def test_rotation_and_temporaries_stay_inside_their_run(tmp_path):
    d = str(tmp_path / "ck")
    arrays = {"p0": np.arange(3.0)}
    for u in (100, 200, 300):
        checkpoint.write(d, 0, u, {}, arrays, run="old")
    for u in (5, 10, 15):
        checkpoint.write(d, 0, u, {}, arrays, run="new")
    assert [u for u, _ in checkpoint.available(d, 0, "old")] == [200, 300]
    assert [u for u, _ in checkpoint.available(d, 0, "new")] == [10, 15]
    meta, _ = checkpoint.read(checkpoint.available(d, 0, "new")[-1][1])
    assert meta["run"] == "new" and meta["updates"] == 15 and meta["server"] == 0
    torn = os.path.join(d, ".shard-000-rold-u000000000400.npz.k3x_9qz1.tmp")   # mkstemp's
    open(torn, "wb").close()
    checkpoint.remove_temporaries(d, 0, "new")            # another run's temporary stays
    assert os.path.exists(torn)
    checkpoint.remove_temporaries(d, 0, "old")
    assert not os.path.exists(torn)


def test_a_file_whose_metadata_names_another_run_is_refused(tmp_path):
    d = str(tmp_path / "ck")
    path = checkpoint.write(d, 0, 5, {}, {"p0": np.zeros(2)}, run="one")
    forged = os.path.join(d, checkpoint.shard_file(0, 5, "two"))
    os.rename(path, forged)
    with pytest.raises(ps.CheckpointError, match="run"):
        checkpoint.read(forged, run="two", server=0, updates=5)


# ============================================================== 3. the directory's safety
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o707, 0o1777, 0o720])
def test_a_directory_others_can_write_is_refused_by_name(tmp_path, mode):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(ps.CheckpointError) as info:
        checkpoint.ensure_dir(str(d))
    msg = str(info.value)
    assert str(d) in msg and f"{mode:04o}" in msg and "chmod go-w" in msg
    assert stat.S_IMODE(os.stat(d).st_mode) == mode and os.listdir(d) == []


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_job_refuses_a_directory_others_can_write(runner, tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    failed = _failures(lambda c: job(c, A, 5, str(d)), 3, runner)
    assert 0 in failed and "CheckpointError" in failed[0] and "0777" in failed[0]
    assert os.listdir(d) == []


def test_a_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() == 0:
        d = tmp_path / "theirs"
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
        path = str(d)
    else:
        path = "/"                                           # root's
    with pytest.raises(ps.CheckpointError, match="owned by uid"):
        checkpoint.ensure_dir(path)


def test_a_path_that_is_not_a_directory_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(ps.CheckpointError, match="not a directory"):
        checkpoint.ensure_dir(str(f))


def test_an_owner_only_directory_we_own_is_used_and_a_new_one_is_0700(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)                  # others may read, not write: used as it is
    os.chmod(mine, 0o755)
    assert checkpoint.ensure_dir(str(mine)) == str(mine)
    old = os.umask(0)
    try:
        checkpoint.ensure_dir(str(tmp_path / "a" / "new"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "new").st_mode) == 0o700


def test_the_temporary_name_cannot_be_taken_first(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    checkpoint.ensure_dir(str(d))
    # the name the old scheme used: predictable from the final name and the pid
    final = checkpoint.shard_file(0, 5, "r1")
    squat = d / f".{final}.tmp{os.getpid()}"
    squat.write_bytes(b"planted")
    temps = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (temps.append(a), replace(a, b))[1])
    for _ in range(2):
        path = checkpoint.write(str(d), 0, 5, {}, {"p0": np.zeros(2)}, run="r1")
    assert squat.read_bytes() == b"planted"
    names = [os.path.basename(t) for t in temps]
    assert len(set(names)) == 2          # drawn afresh for each write, not derived
    assert checkpoint.read(path)[0]["updates"] == 5


@pytest.mark.parametrize("blob", [b"[1, 2]", b'"x"', b"3", b"null", b"true"])
def test_metadata_that_is_not_an_object_is_a_checkpoint_error(tmp_path, blob):
    path = tmp_path / "shard-000-rx-u000000000005.npz"
    np.savez(path, __meta__=np.frombuffer(blob, np.uint8), p0=np.zeros(2))
    with pytest.raises(ps.CheckpointError, match="not a JSON object"):
        checkpoint.read(str(path))


# ============================================================== 5. limits vs the frame limit
def _worst_table(n):
    """``n`` keys at the documented limits: names of MAX_NAME_BYTES, MAX_NDIM dimensions."""
    return tuple(KeySpec(f"{i:08d}".ljust(MAX_NAME_BYTES, "k"), np.dtype("<f8"), (1,) * MAX_NDIM)
                 for i in range(n))


def test_the_worst_frames_at_the_documented_limits_fit_the_frame_limit():
    table = _worst_table(wire.MAX_KEYS)
    worst_init = wire.HEADER.size + wire.MAX_KEYS * (wire.KEY.size + MAX_NDIM * wire.DIM.size
                                                     + MAX_NAME_BYTES)
    init = wire.encode(wire.INIT, 1, keys=table)
    assert init.size == worst_init <= wire.MAX_FRAME
    assert len(wire.decode(init).keys) == wire.MAX_KEYS
    # a pull of every key (one piece each) and the server's answer
    refs = [wire.PieceRef(s.name, 0, 1, s.dtype) for s in table]
    worst_pieces = wire.HEADER.size + wire.MAX_KEYS * (wire.PIECE.size + MAX_NAME_BYTES)
    for opcode, response in ((wire.PULL, False), (wire.OK, True)):
        frame = wire.encode(opcode, 1, pieces=refs)
        assert frame.size == worst_pieces <= wire.MAX_FRAME
        assert len(wire.decode(frame, expect_response=response).pieces) == wire.MAX_KEYS


def _at_limits_job(comm, n):
    kv = ps.start(comm, num_servers=1, staleness=0, optimizer=ps.SGD(1.0))
    if kv is None:
        return None
    table = _worst_table(n)
    kv.init({s.name: np.full(s.shape, float(i)) for i, s in enumerate(table)})
    kv.push({s.name: np.ones(s.shape) for s in table})
    got = kv.pull([s.name for s in table])
    kv.close()
    return all(got[s.name].shape == s.shape and got[s.name].item() == i - 1.0
               for i, s in enumerate(table))


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_request_at_the_documented_limits_works_end_to_end(runner):
    # 12288 data messages per request: a generous per-wait limit for a loaded machine
    assert _run(lambda c: _at_limits_job(c, wire.MAX_KEYS), 2, runner, timeout=300.0)[1] is True


class _NoSends:
    """A communicator that fails the test if the worker sends or posts anything."""
    rank, size, timeout = 1, 2, 5.0

    def _touched(self, *a, **k):
        raise AssertionError("the worker sent or posted before refusing")
    send = isend = recv = irecv = _touched


def test_one_over_the_documented_limits_is_a_named_error_before_anything_is_sent():
    too_many = _worst_table(wire.MAX_KEYS + 1)
    with pytest.raises(ValueError, match=f"at most {wire.MAX_KEYS} keys"):
        Worker(_NoSends(), 1, [1], 0, 1 << 20).init({s.name: np.zeros(s.shape) for s in too_many})
    with pytest.raises(ValueError, match=f"1..{MAX_NAME_BYTES} utf-8 bytes"):
        Worker(_NoSends(), 1, [1], 0, 1 << 20).init({"k" * (MAX_NAME_BYTES + 1): np.zeros(1)})
    with pytest.raises(ValueError, match=f"at most {MAX_NDIM} dimensions"):
        Worker(_NoSends(), 1, [1], 0, 1 << 20).init({"k": np.zeros((1,) * (MAX_NDIM + 1))})
    # within the key limits, but one server's pieces (chunk_bytes 8: one per element) with long
    # names make a pull frame above the limit
    long = "p" * MAX_NAME_BYTES
    n = (wire.MAX_FRAME - wire.HEADER.size) // (wire.PIECE.size + MAX_NAME_BYTES) + 1
    with pytest.raises(ValueError, match="frame limit"):
        Worker(_NoSends(), 1, [1], 0, 8).init({long: np.zeros(n)})
    # the same number of keys below the limits with short names is fine up to the point of sending
    with pytest.raises(AssertionError, match="sent or posted"):
        Worker(_NoSends(), 1, [1], 0, 8).init({"p": np.zeros(n)})
