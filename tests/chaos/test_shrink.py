"""Chaos for communicators that survive a failure: a rank dies at a random message of a random
collective; the survivors ``agree`` and ``shrink``, and the next 20 collectives on the shrunk
communicator are correct.

Each case is drawn from one seed: transport (shm or tcp), world size (3-5), the collective,
algorithm and root, the victim, the outgoing message of the program it dies at (through
``MINICOMM_FAULT=crash:N:how``, counted from the program's start, not the world's setup) and how
(SIGKILL, SIGTERM, os._exit). Every survivor catches its error (``PeerFailure``,
``CommTimeout``, ``Revoked``), votes in ``agree`` with a flag of its own, shrinks, and runs 20
collectives drawn from the seed, each checked against numpy. The job runs with
``on_failure="continue"``, so the launcher ends no survivor.

What is checked, every case: ``agree`` returns the same value on every survivor, the AND of
their flags; the agreed failed set is exactly the victim; the survivors are renumbered in old
order; the 20 collectives are correct; nothing is left behind (no /dev/shm segment, process or
abstract socket of the job).

CI runs ``CI_RUNS`` seeds. The long run: ``MINICOMM_SHRINK_RUNS=100 pytest tests/chaos/test_shrink.py``
(seeds ``MINICOMM_SHRINK_SEED`` .. + RUNS - 1). A failure prints its seed and the rerun line.
"""
import dataclasses
import os
import random
import time

import pytest
from test_chaos import ALGORITHMS, COLLECTIVES, SETUP_TIMEOUT, TIMEOUT, _collective, _sockets_of

import minicomm as mc
from leaks import job_segments, nothing_left_behind  # noqa: F401  (autouse fixture)

CI_RUNS = 6
RUNS = int(os.environ.get("MINICOMM_SHRINK_RUNS") or CI_RUNS)
FIRST = int(os.environ.get("MINICOMM_SHRINK_SEED") or 0)
SEEDS = range(FIRST, FIRST + RUNS)
AFTER_SHRINK = 20             # collectives on the shrunk communicator, each checked
UNARMED = 10 ** 9             # MINICOMM_FAULT's crash count until the victim's program sets it


def case(seed):
    rng = random.Random(seed)
    c = dict(seed=seed, transport=rng.choice(("shm", "tcp")), size=rng.randint(3, 5),
             how=rng.choice(("kill", "term", "exit")),
             collective=rng.choice(COLLECTIVES), algorithm=rng.choice(ALGORITHMS),
             crash_at=rng.randint(1, 120))
    c["victim"] = rng.randrange(c["size"])
    if c["collective"] in ("broadcast", "scatter"):   # their leaves send nothing: the root dies
        c["root"] = c["victim"]
    else:
        c["root"] = rng.choice([q for q in range(c["size"]) if q != c["victim"]])
    c["flags"] = [rng.random() < 0.75 for _ in range(c["size"])]
    return c


def rank_survive(comm, c):
    """Collectives until the victim's death breaks one; then agree, shrink, 20 more."""
    comm.timeout = TIMEOUT            # per wait, from here on (setup had SETUP_TIMEOUT)
    if comm.rank == c["victim"]:
        # its death counts from here: setup's messages (more of them when the link cache is
        # cold) must not end the world before it exists, which no shrink can survive
        t = comm.transport
        t.spec = dataclasses.replace(t.spec, crash=t._sent + c["crash_at"])
    error = None
    try:
        for i in range(400):
            _collective(comm, c["collective"], c["algorithm"], c["root"], i)
    except mc.CommError as e:         # PeerFailure, CommTimeout or Revoked
        error = type(e).__name__
    agreed = comm.agree(c["flags"][comm.rank])
    agreed_failed = comm.failed_ranks(agreed=True)
    new = comm.shrink()
    rng = random.Random(c["seed"] * 7919 + 1)        # the same draws on every survivor
    done = 0
    for i in range(AFTER_SHRINK):
        _collective(new, rng.choice(COLLECTIVES), rng.choice(ALGORITHMS), rng.randrange(new.size),
                    i)
        done += 1
    return dict(error=error, agreed=agreed, agreed_failed=agreed_failed,
                shrink_failed=comm.failed_ranks(agreed=True), rank=new.rank, size=new.size,
                done=done)


def _run_case(c, monkeypatch):
    # armed far away here; the victim moves its death to crash_at messages into the program
    monkeypatch.setenv("MINICOMM_FAULT", f"crash:{UNARMED}:{c['how']},ranks:{c['victim']}")
    from minicomm.launch import local
    started = time.monotonic()
    try:
        mc.spawn(rank_survive, c["size"], args=(c,), transport=c["transport"],
                 timeout=SETUP_TIMEOUT, on_failure="continue")
        raise AssertionError(f"the victim never died: {c}")
    except mc.SpawnError as e:
        failures, results = e.failures, e.results
    finally:
        monkeypatch.delenv("MINICOMM_FAULT", raising=False)
        c["wall_s"] = round(time.monotonic() - started, 2)
        c["job"] = local.last_job_id
    assert [rank for rank, _ in failures] == [c["victim"]], f"{c}\n{failures}"
    survivors = [r for r in range(c["size"]) if r != c["victim"]]
    want_value = all(c["flags"][r] for r in survivors)
    for new_rank, r in enumerate(survivors):
        got = results[r]
        assert got is not None, f"survivor {r} returned nothing: {c}"
        assert got["error"] is not None, f"survivor {r} never saw the failure: {c} {got}"
        assert got["agreed"] == want_value, f"rank {r}: agree {got} != AND {want_value}: {c}"
        assert got["agreed_failed"] == [c["victim"]], f"rank {r}: {got}: {c}"
        assert got["shrink_failed"] == [c["victim"]], f"rank {r}: {got}: {c}"
        assert (got["rank"], got["size"]) == (new_rank, c["size"] - 1), f"rank {r}: {got}: {c}"
        assert got["done"] == AFTER_SHRINK, f"rank {r}: {got}: {c}"
    assert job_segments(c["job"]) == [], f"segments left: {c}"
    assert _sockets_of(c["job"]) == [], f"sockets of the job left: {c}"


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_shrink_after_a_random_death(seed, monkeypatch):
    c = case(seed)
    try:
        _run_case(c, monkeypatch)
    except BaseException:
        print(f"\nshrink chaos case failed: {c}\nrerun: MINICOMM_SHRINK_SEED={seed} "
              f"MINICOMM_SHRINK_RUNS=1 python -m pytest tests/chaos/test_shrink.py", flush=True)
        raise
    print(f"shrink chaos {c}")


def test_the_sample_has_votes_that_agree_and_votes_that_differ():
    """The agree check above means something only if the sample holds both outcomes."""
    cases = [case(s) for s in SEEDS]
    outcomes = {all(c["flags"][r] for r in range(c["size"]) if r != c["victim"]) for c in cases}
    assert outcomes == {True, False}, [c["flags"] for c in cases]
