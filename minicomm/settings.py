"""Settings: the one parser for every MINICOMM_* environment variable and for the timeout
arguments of the public API.

A bad value is an error that names the variable (or argument) and says what is allowed; it is
never silently replaced by a default and never surfaces later as a ZeroDivisionError, an
OverflowError from ``socket.settimeout`` or a job that hangs. This module is at the floor: it
imports only the standard library, so the transports, the rendezvous store, the communicator and
the launcher all parse through it.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Iterable, Mapping, Optional

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
