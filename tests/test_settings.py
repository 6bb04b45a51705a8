"""Bad settings name the variable (or argument) and say what is allowed (issue 14).

Every MINICOMM_* variable and every timeout argument parses through minicomm.settings; a bad
value is a ValueError/TypeError naming it, raised where the value is read, never a
ZeroDivisionError, an OverflowError from a socket, a silently ignored entry or a hang.
"""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import minicomm as mc
from leaks import nothing_left_behind  # noqa: F401
from minicomm import cost, settings, tuning
from minicomm.launch import env as launch_env
from minicomm.launch import world

BAD_SECONDS = ["0", "-1", "nan", "inf", "-inf", "abc", "", " 5x"]


def _noop(comm):
    return comm.rank


# ---------------------------------------------------------------- one parser
@pytest.mark.parametrize("raw", [r for r in BAD_SECONDS if r])
def test_seconds_parser_names_the_variable(raw):
    with pytest.raises(ValueError, match=r"MINICOMM_TIMEOUT=.*seconds > 0"):
        settings.seconds("MINICOMM_TIMEOUT", raw)


@pytest.mark.parametrize("raw,expect", [("5", 5.0), (" 0.25 ", 0.25), ("1e3", 1000.0)])
def test_seconds_parser_accepts_positive_finite(raw, expect):
    assert settings.seconds("MINICOMM_TIMEOUT", raw) == expect


# ---------------------------------------------------------------- MINICOMM_TIMEOUT
@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "abc"])
def test_bad_minicomm_timeout_in_the_communicator(raw, monkeypatch):
    monkeypatch.setenv("MINICOMM_TIMEOUT", raw)
    with pytest.raises(ValueError, match="MINICOMM_TIMEOUT"):
        mc.spawn(_noop, 2, transport="inproc")


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "abc"])
def test_bad_minicomm_timeout_in_spawn_processes(raw, monkeypatch):
    """Found in the parent, before any rank starts (not as a SpawnError of every rank)."""
    monkeypatch.setenv("MINICOMM_TIMEOUT", raw)
    with pytest.raises(ValueError, match="MINICOMM_TIMEOUT"):
        mc.spawn(_noop, 2, transport="shm")


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "abc"])
def test_bad_minicomm_timeout_in_init(raw):
    env = {"MINICOMM_RANK": "0", "MINICOMM_SIZE": "1", "MINICOMM_MASTER_PORT": "1",
           "MINICOMM_TIMEOUT": raw}
    launch = launch_env.detect(env)
    with pytest.raises(ValueError, match="MINICOMM_TIMEOUT"):
        launch_env.setup_timeout_for(launch, None, None, env)


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "abc"])
def test_bad_minicomm_setup_timeout_in_init(raw):
    env = {"MINICOMM_RANK": "0", "MINICOMM_SIZE": "1", "MINICOMM_MASTER_PORT": "1",
           "MINICOMM_SETUP_TIMEOUT": raw}
    launch = launch_env.detect(env)
    with pytest.raises(ValueError, match="MINICOMM_SETUP_TIMEOUT"):
        launch_env.setup_timeout_for(launch, None, None, env)


@pytest.mark.parametrize("raw", ["0", "nan", "abc"])
def test_bad_minicomm_timeout_in_connect_world(raw, monkeypatch):
    monkeypatch.setenv("MINICOMM_TIMEOUT", raw)
    cfg = dict(rank=0, size=1, token="00" * 16, transport="shm", job_id="x",
               master_addr="127.0.0.1", master_port=1)
    with pytest.raises(ValueError, match="MINICOMM_TIMEOUT"):
        world.connect_world(cfg)


# ---------------------------------------------------------------- timeout= arguments
@pytest.mark.parametrize("value,error", [
    (float("nan"), ValueError), (float("inf"), ValueError), (0, ValueError), (-1, ValueError),
    (-0.5, ValueError), ("5", TypeError), (True, TypeError), ([5], TypeError)])
@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_spawn_timeout_argument(value, error, transport):
    with pytest.raises(error, match="timeout"):
        mc.spawn(_noop, 2, transport=transport, timeout=value)


def test_spawn_timeout_argument_accepts_numbers():
    assert mc.spawn(_noop, 2, transport="inproc", timeout=30) == [0, 1]


@pytest.mark.parametrize("value", [float("nan"), 0, "5"])
def test_collective_timeout_argument(value):
    """A per-call timeout (recv(timeout=)) is checked the same way, naming ``timeout``."""
    def fn(comm, v):
        comm.send(np.ones(1), comm.rank)      # without the check the receive would succeed
        try:
            comm.recv(comm.rank, timeout=v)
        except (TypeError, ValueError) as e:
            return type(e).__name__, "timeout" in str(e)
        return None
    out = mc.spawn(fn, 1, args=(value,), transport="inproc")
    assert out[0] is not None and out[0][1], out


# ---------------------------------------------------------------- link cache
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINICOMM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINICOMM_ALGO", raising=False)
    monkeypatch.delenv("MINICOMM_TUNE", raising=False)
    return tmp_path


GOOD_LINK = {"alpha": 2e-6, "beta": 1e-10, "overhead": 1e-6, "exec_overhead": 3e-6}


@pytest.mark.parametrize("field,value", [
    ("beta", 0), ("beta", -1e-9), ("beta", "nan"), ("beta", "inf"), ("alpha", -1e-6),
    ("alpha", "nan"), ("alpha", "inf"), ("overhead", -1), ("beta", "fast"), ("beta", None),
    ("exec_overhead", -1), ("exec_overhead", "nan")])
def test_bad_link_cache_value_is_rejected_naming_file_and_field(cache, field, value):
    link = dict(GOOD_LINK)
    link[field] = float(value) if value in ("nan", "inf") else value
    path = tuning.links_path()
    with open(path, "w") as f:
        f.write(json.dumps({"format": tuning.LINKS_FORMAT, "links": {"shm": link}},
                           allow_nan=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tuning.load_links() == {"links": {}}     # ignored: measured again
    text = " ".join(str(w.message) for w in caught)
    assert path in text and f"shm.{field}" in text, text


@pytest.mark.parametrize("field,value", [("gamma", 0), ("delta", 0), ("gamma", -1),
                                         ("wake", float("nan")), ("contention", -1)])
def test_bad_machine_field_is_rejected(cache, field, value):
    path = tuning.links_path()
    with open(path, "w") as f:
        json.dump({"format": tuning.LINKS_FORMAT, "links": {"shm": GOOD_LINK}, field: value}, f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tuning.load_links() == {"links": {}}
    text = " ".join(str(w.message) for w in caught)
    assert path in text and field in text, text


def test_good_link_cache_loads(cache):
    with open(tuning.links_path(), "w") as f:
        json.dump({"format": tuning.LINKS_FORMAT, "links": {"shm": GOOD_LINK}, "gamma": 1e-10}, f)
    assert tuning.load_links() == {"links": {"shm": GOOD_LINK}, "gamma": 1e-10}


def test_a_link_cached_before_a_field_existed_is_measured_again_quietly(cache):
    old = {k: v for k, v in GOOD_LINK.items() if k != "exec_overhead"}
    with open(tuning.links_path(), "w") as f:
        json.dump({"format": tuning.LINKS_FORMAT, "links": {"shm": old}, "gamma": 1e-10}, f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.load_links() == {"links": {}, "gamma": 1e-10}


def test_zero_beta_cache_does_not_fail_a_job(cache):
    """The job that meets a bad cache measures the link again (and rewrites the file)."""
    with open(tuning.links_path(), "w") as f:
        json.dump({"format": tuning.LINKS_FORMAT, "links": {"shm": dict(GOOD_LINK, beta=0)}}, f)

    def fn(comm):
        return float(comm.allreduce(np.ones(4))[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mc.spawn(fn, 2, transport="shm") == [2.0, 2.0]
    saved = tuning.load_links()
    assert all(v["beta"] > 0 for v in saved["links"].values())


# ---------------------------------------------------------------- MINICOMM_ALGO
def test_algo_auto_is_accepted():
    assert cost.parse_algo_env("allreduce:auto") == {}
    assert cost.parse_algo_env("allreduce:auto, broadcast:tree") == {"broadcast": "tree"}
    assert cost.parse_algo_env(" allreduce : ring ") == {"allreduce": "ring"}


@pytest.mark.parametrize("value,bad", [
    ("allreduse:ring", "allreduse"), ("allreduce:rnig", "rnig"), ("allreduce", "allreduce"),
    ("allreduce:ring,broadcast:", "broadcast:"), (":ring", ":ring"), ("p2p:ring", "p2p"),
    ("allreduce:ring:tree", "ring:tree")])
def test_algo_typos_name_the_variable_entry_and_choices(value, bad):
    with pytest.raises(ValueError) as info:
        cost.parse_algo_env(value)
    text = str(info.value)
    assert "MINICOMM_ALGO" in text and bad in text, text
    assert "allreduce" in text and "ring" in text and "auto" in text, text


def test_algo_typo_fails_the_communicator(monkeypatch):
    monkeypatch.setenv("MINICOMM_ALGO", "allreduse:ring")
    with pytest.raises(ValueError, match="MINICOMM_ALGO"):
        mc.spawn(_noop, 2, transport="inproc")


# ---------------------------------------------------------------- every other MINICOMM_* variable
@pytest.mark.parametrize("name,raw", [
    ("MINICOMM_DEBUG", "verbose"), ("MINICOMM_TUNE", "maybe"), ("MINICOMM_EMULATE_LINK", "yes please"),
    ("MINICOMM_TRANSPORT", "carrier-pigeon")])
def test_bad_choice_variables_are_named(name, raw, monkeypatch):
    from minicomm.transports import nic
    from minicomm.tuning import links
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        if name == "MINICOMM_DEBUG":
            mc.spawn(_noop, 1, transport="inproc")
        elif name == "MINICOMM_TUNE":
            links._tune_enabled()
        elif name == "MINICOMM_EMULATE_LINK":
            nic._emulate_enabled()
        else:
            monkeypatch.setenv("MINICOMM_RANK", "0")
            monkeypatch.setenv("MINICOMM_SIZE", "1")
            monkeypatch.setenv("MINICOMM_MASTER_PORT", "1")
            launch_env.init(setup_timeout=5)


@pytest.mark.parametrize("name,raw", [
    ("MINICOMM_SHM_RING_BYTES", "abc"), ("MINICOMM_SHM_RING_BYTES", "100"),
    ("MINICOMM_SHM_CHUNK", "100"),
    ("MINICOMM_P2P_BUFFER_BYTES", "-5"), ("MINICOMM_UNEXPECTED_BYTES", "lots"),
    ("MINICOMM_LANDING_BYTES", "abc"), ("MINICOMM_LANDING_BYTES", "0"),
    ("MINICOMM_NIC_ARENA_BYTES", "1GB"), ("MINICOMM_NIC_ARENA_BYTES", "-1"),
    ("MINICOMM_NUM_SERVERS", "two")])
def test_bad_size_variables_are_named(name, raw):
    """Read in a fresh interpreter: some of them are read when the transports are imported."""
    code = ("import sys, minicomm as mc, numpy as np\n"
            "def fn(comm, use_ps):\n"
            "    from minicomm import ps\n"
            "    comm.send(np.ones(4), comm.rank); comm.recv(comm.rank)\n"
            "    comm.allreduce(np.ones(4))\n"
            "    if use_ps: ps.start(comm)\n"
            "errors = []\n"
            "for t, nodes, use_ps in (('shm', 1, 0), ('rdma', 2, 0), ('shm', 1, 1)):\n"
            "    try:\n"
            "        mc.spawn(fn, 2, args=(use_ps,), transport=t, nodes=nodes, timeout=30)\n"
            "    except Exception as e:\n"
            "        errors.append(f'{t}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(errors), file=sys.stderr)\n"
            "sys.exit(1 if errors else 0)\n")
    env = dict(os.environ, **{name: raw})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert name in out.stderr, out.stderr[-3000:]
    assert "ZeroDivisionError" not in out.stderr and "invalid literal" not in out.stderr


def test_env_int_accepts_good_values(monkeypatch):
    monkeypatch.setenv("MINICOMM_SHM_RING_BYTES", "65536")
    assert settings.env_int("MINICOMM_SHM_RING_BYTES", 0, minimum=65536, multiple=4096) == 65536
