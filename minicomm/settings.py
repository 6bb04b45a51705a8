"""Settings: the one parser for every MINICOMM_* environment variable and for the timeout
arguments of the public API.

A bad value is an error that names the variable (or argument) and says what is allowed; it is
never silently replaced by a default and never surfaces later as a ZeroDivisionError, an
OverflowError from ``socket.settimeout`` or a job that hangs. This module is at the floor: it
imports only the standard library, so the transports, the rendezvous store, the communicator and
the launcher all parse through it.

``SETTINGS`` lists every variable with its default and meaning: docs/reference/settings.md is
generated from it, and a test fails when the code reads a variable it does not list.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Iterable, Mapping, NamedTuple, Optional, Tuple

DEFAULT_TIMEOUT = 300.0     # seconds a blocking wait may last when nothing says otherwise
# How long a waiting rank spins before it sleeps in the kernel (about one blocking wake-up's
# cost) ... and, with a core to itself, for a large message:
# about as long as the message's bytes take to copy at SPIN_BYTES_PER_S, at most SPIN_MAX_S
# (transports/progress.py waits so; the cost model and the simulator price it)
SPIN_S = 50e-6
SPIN_BYTES_PER_S = 4e9
SPIN_MAX_S = 1e-3
# ... and when a node's ranks outnumber its cores (the spin then yields the core between polls):
# about what a wake-up costs there, the competitive-spinning rule (spin as long as blocking
# would cost: never worse than twice the better choice): docs/decisions/shm-spin-then-sleep.md
SPIN_SHARED_S = 300e-6


def seconds(name: str, value, *, allow_none: bool = False) -> Optional[float]:
    """A duration in seconds: a finite number > 0. ``value`` is a number (a Python argument) or
    a string (an environment variable; then ``name`` is the variable). TypeError for a value
    that is not a number (a str passed as an argument, a bool), ValueError for 0, negative, nan
    or inf — each naming ``name``."""
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a number of seconds > 0, got None")
    if isinstance(value, str):
        text = value.strip()
        try:
            x = float(text)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a number: expected seconds > 0 "
                             f"(a finite number, e.g. 30 or 0.5)") from None
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds > 0 (int or float), got "
                        f"{type(value).__name__} {value!r}")
    else:
        x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name}={value!r}: expected seconds > 0 and finite (e.g. 30 or 0.5); "
                         f"0, negative, nan and inf are not allowed")
    return x


def timeout_arg(name: str, value) -> Optional[float]:
    """A ``timeout=`` argument of the public API: None (use the default) or a number of
    seconds > 0 (a str is a TypeError here: ``timeout='5'`` is a caller's bug)."""
    if isinstance(value, str):
        raise TypeError(f"{name} must be a number of seconds > 0 (int or float), got str "
                        f"{value!r}")
    return seconds(name, value, allow_none=True)


def env_seconds(name: str, default: Optional[float],
                env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """The environment variable ``name`` as seconds > 0; ``default`` when it is unset or empty."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return default
    return seconds(name, raw)


def env_timeout(env: Optional[Mapping[str, str]] = None) -> float:
    """MINICOMM_TIMEOUT (seconds > 0), else DEFAULT_TIMEOUT."""
    return env_seconds("MINICOMM_TIMEOUT", DEFAULT_TIMEOUT, env)


def env_int(name: str, default: Optional[int], *, minimum: Optional[int] = None,
            maximum: Optional[int] = None, multiple: int = 1, what: str = "an integer",
            env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The environment variable ``name`` as an int in [minimum, maximum] and a multiple of
    ``multiple``; ``default`` when unset or empty; a ValueError naming it otherwise."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return default
    rule = what
    if minimum is not None:
        rule += f" >= {minimum}"
    if maximum is not None:
        rule += f" <= {maximum}"
    if multiple > 1:
        rule += f", a multiple of {multiple}"
    try:
        v = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer: expected {rule}") from None
    if ((minimum is not None and v < minimum) or (maximum is not None and v > maximum)
            or v % multiple):
        raise ValueError(f"{name}={raw!r}: expected {rule}")
    return v


def byte_setting(name: str, default: int, minimum: int = 0, multiple: int = 1) -> int:
    """A byte-count setting from the environment; a bad value is a ValueError naming it."""
    return env_int(name, default, minimum=minimum, multiple=multiple, what="a byte count")


def env_choice(name: str, default: str, choices: Iterable[str],
               env: Optional[Mapping[str, str]] = None) -> str:
    """The environment variable ``name`` as one of ``choices`` (case-insensitive, stripped);
    ``default`` when unset or empty; a ValueError naming it and the choices otherwise."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}={raw!r}: choose one of {', '.join(choices)}")
    return value


DEBUG_LEVELS = ("0", "off", "warn", "info", "detail")


def env_debug(env: Optional[Mapping[str, str]] = None) -> str:
    """MINICOMM_DEBUG: off (default), info (log transports and choices) or detail (also a
    fingerprint exchange before every call)."""
    return env_choice("MINICOMM_DEBUG", "", DEBUG_LEVELS, env)


_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def env_path(name: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The environment variable ``name`` as a path (stripped, ``~`` expanded); None when unset
    or empty."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return None
    return os.path.expanduser(raw.strip())


def env_flag(name: str, default: bool, env: Optional[Mapping[str, str]] = None) -> bool:
    """A boolean environment variable: 1/on/true/yes or 0/off/false/no; else a ValueError."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")


# ------------------------------------------------------------------------------------ registry
class Setting(NamedTuple):
    """One ``MINICOMM_*`` environment variable: the settings reference (docs/reference/settings.md)
    is generated from ``SETTINGS``, and tests/test_settings_reference.py checks that it names
    every variable the library and the transports read, and nothing they do not."""
    name: str
    default: str        # what applies when it is unset or empty, as the reader would say it
    kind: str           # the values it takes
    description: str    # one line
    group: str          # the section of the reference it appears in
    set_by: str = ""    # what sets it for every rank ("": only a user does)


_LAUNCH = "Launching and rendezvous"
_TIMING = "Timeouts"
_CHOICE = "Algorithms and tuning"
_DEBUG = "Debugging and fault injection"
_MEMORY = "Buffers and local work"
_SHM = "The shm transport"
_RMA = "The rdma and ub transports"
_PS = "The parameter server"
_RUN = "`minicomm run` (and its ssh agent)"

# Every MINICOMM_* variable the library (minicomm/) and the transports (transports/) read or set;
# the defaults are those of the code that reads each one.
SETTINGS: Tuple[Setting, ...] = (
    # -- launching
    Setting("MINICOMM_TRANSPORT", "auto", "auto, shm, tcp, rdma, ub, inproc",
            "Transport of the world `mc.init()` and the torch backend build (`auto`: shm inside a "
            "node, tcp between nodes).", _LAUNCH, "`minicomm run` (its `--transport`)"),
    Setting("MINICOMM_RANK", "unset", "integer >= 0",
            "This process's world rank; with `MINICOMM_SIZE` it tells `mc.init()` that "
            "`minicomm run` (or a hand-started job) launched it.", _LAUNCH, _RUN),
    Setting("MINICOMM_SIZE", "unset", "integer >= 1",
            "The world size, read by `mc.init()` with `MINICOMM_RANK`.", _LAUNCH, _RUN),
    Setting("MINICOMM_LOCAL_RANK", "unset", "integer >= 0",
            "This rank's index among the ranks of its node, for the user's script (minicomm "
            "itself does not read it).", _LAUNCH, _RUN),
    Setting("MINICOMM_LOCAL_SIZE", "unset", "integer >= 1",
            "The number of ranks on this rank's node, for the user's script (minicomm itself does "
            "not read it).", _LAUNCH, _RUN),
    Setting("MINICOMM_NUM_NODES", "unset", "integer >= 1",
            "The number of nodes of the job, for the user's script (minicomm itself does not read "
            "it).", _LAUNCH, _RUN),
    Setting("MINICOMM_NODE", "the hostname", "text",
            "This rank's logical node: ranks with the same node form one node of the topology "
            "(`minicomm run --nodes` emulates several on one machine).", _LAUNCH, _RUN),
    Setting("MINICOMM_HOST", "`MINICOMM_NODE`", "text",
            "This rank's machine: ranks with the same host can reach each other over shared "
            "memory.", _LAUNCH, _RUN),
    Setting("MINICOMM_MASTER_ADDR", "127.0.0.1 (minicomm run); else the launcher's MASTER_ADDR",
            "address",
            "Address of rank 0's rendezvous store: overrides `MASTER_ADDR` under mpirun, srun and "
            "generic launches, and the address rank 0 publishes under mpiexec.", _LAUNCH, _RUN),
    Setting("MINICOMM_MASTER_PORT", "the launcher's (MASTER_PORT, or a free or derived port)",
            "port",
            "Port of rank 0's rendezvous store; under torchrun, mpirun and srun a fixed port "
            "instead of the one minicomm picks or derives.", _LAUNCH, _RUN),
    Setting("MINICOMM_BIND", "loopback when every rank is on this host, else the interface of "
                             "the ranks' address", "address",
            "Local address the rendezvous store and the transports listen on (`0.0.0.0`: every "
            "interface).", _LAUNCH),
    Setting("MINICOMM_SOCKET_IFNAME_ADDR", "unset", "address",
            "Older name for the transports' listening address, used only when `MINICOMM_BIND` is "
            "unset.", _LAUNCH),
    Setting("MINICOMM_JOB_ID", "the launcher's job identity (none by hand)", "text",
            "Identity of the job: the rendezvous store refuses ranks of another job, so give "
            "hand-started jobs a unique one.", _LAUNCH, _RUN),
    Setting("MINICOMM_JOB_TOKEN", "a random token (minicomm run, PMI, torchrun), else one "
                                  "derived from the job identity", "hex",
            "Secret of the job's HMAC handshake, the same on every rank (e.g. `openssl rand -hex "
            "32`).", _LAUNCH, _RUN),
    Setting("MINICOMM_LAUNCHER_PID", "unset", "process id",
            "The launcher's pid: a rank started by `minicomm run` or its ssh agent treats its "
            "SIGTERM as an orderly exit that removes the rank's shared memory.", _LAUNCH, _RUN),
    Setting("MINICOMM_SSH", "empty", "ssh options",
            "Extra ssh options of `minicomm run --hosts` (`--ssh-opts` wins).", _LAUNCH),
    # -- timeouts
    Setting("MINICOMM_TIMEOUT", "300", "seconds > 0",
            "How long one blocking wait may last before it raises `CommTimeout`, unless the call "
            "or the communicator says otherwise.", _TIMING, "`minicomm run --timeout`"),
    Setting("MINICOMM_SETUP_TIMEOUT", "30 under foreign launchers, else the timeout",
            "seconds > 0",
            "Bound on `mc.init()`'s rendezvous: reaching rank 0's store, every rank arriving, "
            "connecting the transports.", _TIMING),
    # -- algorithm choice
    Setting("MINICOMM_ALGO", "empty (the tuned table, else the cost model chooses)",
            "collective:algorithm,...",
            "Fixes the algorithm per collective, e.g. `allreduce:ring,broadcast:tree` (a per-call "
            "`algorithm=` still wins).", _CHOICE),
    Setting("MINICOMM_CHANNELS", "1", "integer >= 1",
            "Rings of a ring allreduce, allgather or reduce_scatter: the data split over that "
            "many rings at once, each with its own order (NCCL's channels); and trees of a tree "
            "allreduce, which on 2 or more is NCCL's double binary tree. On one machine they "
            "are concurrent streams; one stays the default here (docs/decisions/ring-channels.md).",
            _CHOICE),
    Setting("MINICOMM_SWITCH", "off", "flag",
            "Give the job an emulated in-network switch, which `algorithm=\"innet\"` runs "
            "through: rank 0 starts it (what `minicomm run --switch` and `mc.spawn(..., "
            "switch=True)` set).", _CHOICE, "`minicomm run --switch`"),
    Setting("MINICOMM_SWITCH_MAX_BYTES", "268435456 (256 MiB)", "bytes",
            "The switch's limit per operation (its largest buffer); a larger innet call is "
            "refused: `auto` falls back to a host family, `innet` by name raises.", _CHOICE),
    Setting("MINICOMM_SWITCH_GROUPS", "8", "integer >= 0",
            "Aggregation groups the switch holds at once (one per communicator that used innet, "
            "until it closes); past them a call is refused as above.", _CHOICE),
    Setting("MINICOMM_TUNE", "on", "flag",
            "Measure the links at world start (once per machine, then cached); off: the cost "
            "model's built-in constants.", _CHOICE),
    Setting("MINICOMM_CACHE_DIR", "`$XDG_CACHE_HOME/minicomm`, else `~/.cache/minicomm`", "path",
            "Directory of the link measurements and the tuned table.", _CHOICE),
    Setting("MINICOMM_FUSION_BYTES", "67108864 (64 MiB)", "byte count >= 0",
            "The largest buffer `comm.group()` packs allreduces of one op, dtype and algorithm "
            "into (Horovod's tensor fusion); more start another; 0: no fusion.", _CHOICE),
    Setting("MINICOMM_SMALL_PATH", "on", "flag",
            "The small-message path for hot small calls; off: every call runs through the "
            "executor.", _CHOICE),
    # -- debugging
    Setting("MINICOMM_DEBUG", "off", "0, off, warn, info, detail",
            "info: log the transports, copy paths and algorithm choices; detail: also compare "
            "every call's arguments across ranks.", _DEBUG),
    Setting("MINICOMM_TRACE", "unset (no trace)", "directory",
            "Write a Chrome trace-event timeline of every collective call and schedule step, "
            "one file per rank (`DIR/rank-<R>.json`; open it in Perfetto).", _DEBUG),
    Setting("MINICOMM_FLIGHT_RECORDS", "2048", "integer >= 0",
            "The calls each communicator's flight recorder keeps (0: no recorder); dumped on a "
            "timeout, a failed peer, a mismatch, SIGUSR1 or `comm.dump_flight_record()`.", _DEBUG),
    Setting("MINICOMM_FLIGHT_DIR", "a directory per job (`mc.spawn`, `minicomm run`), else "
            "`<tmp>/minicomm-flight-<job id>`", "directory",
            "Where flight records are dumped, one `rank-<R>.json` per rank (`minicomm doctor "
            "DIR` diagnoses them); one you set is kept.", _DEBUG, "`mc.spawn` and `minicomm run`"),
    Setting("MINICOMM_FAULT", "unset (no faults)", "drop:P,delay:D,crash:N[:how],after:N,"
                                                   "ranks:R,seed:N",
            "Drops, delays or crashes a rank's outgoing two-sided messages, for tests and chaos "
            "runs.", _DEBUG),
    # -- buffers and local work
    Setting("MINICOMM_P2P_BUFFER_BYTES", "67108864 (64 MiB)", "bytes",
            "Bytes of point-to-point messages a communicator buffers before a receive is posted; "
            "beyond it they wait in the transport.",
            _MEMORY),
    Setting("MINICOMM_UNEXPECTED_BYTES", "268435456 (256 MiB)", "bytes",
            "Bytes of messages no receive has taken yet that one link holds; beyond it they wait "
            "in the stream.",
            _MEMORY),
    Setting("MINICOMM_LOCAL_THREADS", "on", "flag",
            "Run a step's large local copies and reductions on a helper thread where the node "
            "has the cores.", _MEMORY),
    Setting("MINICOMM_LOCAL_THREAD_BYTES", "4194304 (4 MiB)", "bytes",
            "Size from which a step's local op runs on a helper thread.", _MEMORY),
    Setting("MINICOMM_SKEW_COPY", "auto", "auto, on, off",
            "The copy workaround for buffers at a skewed page offset (auto: on AMD CPUs).",
            _MEMORY),
    # -- shm
    Setting("MINICOMM_SHM_RING_BYTES", "4 MiB per ring, halved until a rank's rings fit 64 MiB "
                                       "(at least 256 KiB)",
            "bytes >= 65536, a multiple of 4096",
            "Size of each inbound ring of the shm transport.", _SHM),
    Setting("MINICOMM_SHM_CHUNK", "1048576 (1 MiB), at most a quarter of the ring",
            "bytes >= 4096, a multiple of 4096",
            "Unit in which shm streams messages larger than one record.", _SHM),
    Setting("MINICOMM_CMA", "on", "on, or 0/off/no/false",
            "Single-copy transfers between processes (`process_vm_readv`) where the setup probe "
            "allows them.", _SHM),
    Setting("MINICOMM_CMA_MIN", "262144 for collectives, 2097152 for point-to-point; 16777216 "
                                "where the kernel's read is slow", "bytes >= 0",
            "Size from which every message goes single-copy, for every pair.", _SHM),
    Setting("MINICOMM_FUTEX", "on", "on, or 0/off/no/false",
            "A waiting rank sleeps on a futex word; off: on its doorbell sockets only.", _SHM),
    Setting("MINICOMM_SPIN", "yield when the node's ranks outnumber its cores, else hot",
            "yield, hot",
            "Forces how a waiting rank polls before it sleeps: yield hands its core over between "
            "polls at once, hot polls without yielding first.",
            _SHM),
    # -- rdma / ub
    Setting("MINICOMM_LANDING_BYTES", "4194304 (4 MiB)", "bytes >= 4096, a multiple of 4096",
            "Landing ring per sender of the rdma and ub transports' two-sided messages.", _RMA),
    Setting("MINICOMM_NIC_ARENA_BYTES", "1073741824 (1 GiB)", "bytes >= 1048576",
            "Registrable memory of each rank's simulated NIC (rdma) or UB controller.", _RMA),
    Setting("MINICOMM_EMULATE_LINK", "off", "flag",
            "Make every rdma / ub operation wait the modelled link's latency and bandwidth.",
            _RMA),
    # -- parameter server
    Setting("MINICOMM_NUM_SERVERS", "unset (`ps.start` then needs num_servers=)", "integer >= 1",
            "How many of the first ranks serve in `ps.start(comm)`; the rest are workers.", _PS,
            "`minicomm run --servers`"),
)


def env_channels() -> int:
    """MINICOMM_CHANNELS: the rings a ring collective that takes channels runs on."""
    return env_int("MINICOMM_CHANNELS", 1, minimum=1)
