"""Fault injection: ``MINICOMM_FAULT`` drops, delays or crashes a rank's outgoing messages.

In the spirit of ps-lite's ``PS_DROP_MSG``: a knob for tests and chaos runs that makes the failure
paths run on demand, reproducibly. Off by default, and then it costs nothing: ``wrap`` returns the
transport itself, so no per-message check exists anywhere. Only when the variable is set at
connect time is the rank's transport wrapped in a ``FaultTransport``, whose ``isend`` decides each
message's fate (every other method is the inner transport's own bound method).

Grammar: comma-separated ``key:value`` items, each key at most once::

    MINICOMM_FAULT="drop:0.01,delay:5ms,seed:7"
    MINICOMM_FAULT="crash:40:term,ranks:2"

    drop:P          each outgoing message is lost with probability P (0 <= P <= 1). The link to
                    that peer then stays silent (later messages to it are lost too: a byte stream
                    cannot deliver past a hole), so the receiver's wait ends in ``CommTimeout``
                    naming this rank, never in a wrong result.
    delay:D         every outgoing message waits D before it is handed to the transport; D1-D2:
    delay:D1-D2     a uniform draw in [D1, D2] per message. Units us, ms, s (bare number: seconds),
                    at most 60 s. Order is kept, so results stay correct.
    crash:N[:how]   this rank dies as it posts its N-th outgoing message (N >= 1): how is ``kill``
                    (SIGKILL, the default), ``term`` (SIGTERM: the orderly exit of the launchers)
                    or ``exit`` (``os._exit(70)``). Process ranks only (not ``transport="inproc"``).
    after:N         the first N outgoing messages pass untouched (setup, link agreement).
    ranks:R         only these world ranks inject: ``1``, ``0+2`` (a list), ``1-3`` (a range),
                    combined as ``0+2-3``. Default: every rank.
    seed:N          seed of each rank's generator (default 0); the same seed and the same program
                    give the same faults.

Messages to this rank itself are never faulted. One-sided RMA accesses (windows) and the
transports' own control traffic (doorbells, handshakes, goodbyes) are not either: the hook sits
at the two-sided ``isend`` of the transport contract (base.py). A bad value raises
``ValueError`` naming ``MINICOMM_FAULT`` at connect time.
"""
from __future__ import annotations

import math
import os
import random
import re
import signal
import time
from dataclasses import dataclass, replace
from typing import FrozenSet, Mapping, Optional, Tuple

import numpy as np

from .base import Capabilities, Request, Tag, Transport, capabilities_of

ENV = "MINICOMM_FAULT"
KEYS = ("drop", "delay", "crash", "after", "ranks", "seed")
CRASH_HOW = ("kill", "term", "exit")
MAX_DELAY_S = 60.0
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}
_DURATION = re.compile(r"^([0-9]*\.?[0-9]+)(us|ms|s|)$")


@dataclass(frozen=True)
class FaultSpec:
    drop: float = 0.0
    delay: Tuple[float, float] = (0.0, 0.0)        # seconds: low, high
    crash: Optional[int] = None                   # the outgoing message that kills the rank
    crash_how: str = "kill"
    after: int = 0
    ranks: Optional[FrozenSet[int]] = None        # None: every rank
    seed: int = 0

    def applies_to(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def _bad(text: str, why: str) -> ValueError:
    return ValueError(f"{ENV}={text!r}: {why}. Grammar: comma-separated items of "
                      f"drop:P, delay:D or delay:D1-D2 (us/ms/s), crash:N[:kill|term|exit], "
                      f"after:N, ranks:A+B-C, seed:N (see minicomm/transports/fault.py)")


def _duration(text: str, value: str) -> float:
    m = _DURATION.match(value.strip())
    if not m:
        raise _bad(text, f"delay {value!r} is not a duration like 5ms, 200us or 0.1s")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(seconds) or seconds > MAX_DELAY_S:
        raise _bad(text, f"delay {value!r} must be at most {MAX_DELAY_S:g}s")
    return seconds


def _count(text: str, key: str, value: str, least: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise _bad(text, f"{key} {value!r} is not an integer") from None
    if n < least:
        raise _bad(text, f"{key} must be >= {least}, got {n}")
    return n


def _ranks(text: str, value: str) -> FrozenSet[int]:
    out = set()
    for part in value.split("+"):
        lo, sep, hi = part.partition("-")
        a = _count(text, "ranks", lo, 0)
        b = _count(text, "ranks", hi, 0) if sep else a
        if b < a:
            raise _bad(text, f"ranks range {part!r} runs backwards")
        out.update(range(a, b + 1))
    return frozenset(out)


def parse(text: str) -> Optional[FaultSpec]:
    """The spec of a ``MINICOMM_FAULT`` value; None for an empty one (faults off)."""
    if not text.strip():
        return None
    fields = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition(":")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise _bad(text, f"item {item.strip()!r} is not key:value")
        if key not in KEYS:
            raise _bad(text, f"unknown key {key!r} (keys: {', '.join(KEYS)})")
        if key in fields:
            raise _bad(text, f"{key} given twice")
        fields[key] = value.strip()
    spec = {}
    if "drop" in fields:
        try:
            p = float(fields["drop"])
        except ValueError:
            raise _bad(text, f"drop {fields['drop']!r} is not a probability") from None
        if not 0.0 <= p <= 1.0:          # also rejects nan
            raise _bad(text, f"drop must be a probability in [0, 1], got {fields['drop']}")
        spec["drop"] = p
    if "delay" in fields:
        v = fields["delay"]
        first, sep, second = v.partition("-")
        lo = _duration(text, first)
        hi = _duration(text, second) if sep else lo
        if hi < lo:
            raise _bad(text, f"delay range {v!r} runs backwards")
        spec["delay"] = (lo, hi)
    if "crash" in fields:
        n, _, how = fields["crash"].partition(":")
        spec["crash"] = _count(text, "crash", n, 1)
        how = how.strip().lower() or "kill"
        if how not in CRASH_HOW:
            raise _bad(text, f"crash how {how!r}: choose {', '.join(CRASH_HOW)}")
        spec["crash_how"] = how
    if "after" in fields:
        spec["after"] = _count(text, "after", fields["after"], 0)
    if "ranks" in fields:
        spec["ranks"] = _ranks(text, fields["ranks"])
    if "seed" in fields:
        spec["seed"] = _count(text, "seed", fields["seed"], 0)
    return FaultSpec(**spec)


def from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[FaultSpec]:
    return parse((os.environ if environ is None else environ).get(ENV, ""))


def wrap(transport: Transport, rank: int, processes: bool = True,
         environ: Optional[Mapping[str, str]] = None) -> Transport:
    """``transport`` itself when ``MINICOMM_FAULT`` is unset (or spares ``rank``), else a
    ``FaultTransport`` around it. ``processes``: False for ranks that are threads (no crash)."""
    spec = from_env(environ)
    if spec is None:
        return transport
    if spec.crash is not None and not processes:
        raise _bad(os.environ.get(ENV, "") if environ is None else environ.get(ENV, ""),
                   "crash needs ranks that are processes (not transport='inproc')")
    if not spec.applies_to(rank):
        return transport
    return FaultTransport(transport, spec, rank)


def unwrap(transport: Transport) -> Transport:
    """The transport a ``FaultTransport`` wraps, else ``transport`` (tests reach its links)."""
    return transport.inner_transport if isinstance(transport, FaultTransport) else transport


class _Lost(Request):
    """A send the fault hook swallowed: complete at once, as a send into a lossy link is."""
    __slots__ = ("engine", "u8", "nbytes", "off", "hdr")

    def __init__(self, peer: int, buf: np.ndarray, tag: Tag):
        super().__init__(peer, buf, tag, None, True)
        self.done = True
        self.engine, self.u8, self.nbytes, self.off, self.hdr = None, None, buf.nbytes, 0, None


class FaultTransport(Transport):
    """A transport whose outgoing messages suffer ``spec`` (see the module doc)."""

    def __init__(self, inner: Transport, spec: FaultSpec, rank: int):
        self.inner_transport, self.spec = inner, spec
        self.rank, self.size = rank, inner.size
        self.name = inner.name
        # the rest of the contract is the inner transport's own bound methods: no extra call
        # (dead_peers, exclude_peer: Transport's defaults would shadow __getattr__)
        for m in ("irecv", "wait_all", "wait_any", "cancel_context", "detach", "abort", "close",
                  "dead_peers", "exclude_peer"):
            setattr(self, m, getattr(inner, m))
        self._rng = random.Random(f"minicomm-fault:{spec.seed}:{rank}")
        self._sent = 0
        self._silent = set()             # peers whose link lost a message: it stays silent
        self.lost = 0                    # messages dropped so far (for tests and reports)
        self._crashed = False

    def __getattr__(self, name):         # describe(), recv_now, small_bytes, ... of the inner one
        return getattr(self.__dict__["inner_transport"], name)

    def capabilities(self) -> Capabilities:
        """The inner transport's, but its eager channel is this wrapper (whose sends never go
        eager: they all meet the fault in ``isend``), and no registered memory (plain arrays,
        as ``comm.empty`` has always handed out under ``MINICOMM_FAULT``). One-sided access is
        the inner transport's own: RMA is not faulted."""
        inner = capabilities_of(self.inner_transport)
        return replace(inner, eager=self if inner.eager is not None else None, registered=None)

    def send_now(self, peer: int, buf, tag: Tag) -> bool:
        """The small-message path's direct send (shm): never taken here, so that every message
        goes through ``isend`` and meets the fault (its caller then posts it with ``isend``).
        Every send entry point of a transport must be defined on this class, not forwarded by
        ``__getattr__`` (tests/chaos/test_fault.py checks it)."""
        return False

    def sendrecv_now(self, peer: int, sbuf, rbuf, tag: Tag, reduce, spin: float) -> int:
        """shm's fused ``send_now`` + ``recv_now``: never taken here either (0: nothing sent),
        for the same reason."""
        return 0

    def isend(self, peer: int, buf, tag: Tag) -> Request:
        if peer == self.rank:
            return self.inner_transport.isend(peer, buf, tag)
        self._sent += 1
        spec = self.spec
        if spec.crash is not None and self._sent >= spec.crash and not self._crashed:
            self._crashed = True
            self._crash()
        if self._sent > spec.after:
            if peer in self._silent or (spec.drop and self._rng.random() < spec.drop):
                self._silent.add(peer)
                self.lost += 1
                return _Lost(peer, buf, tag)
            lo, hi = spec.delay
            if hi > 0:
                time.sleep(lo if lo == hi else self._rng.uniform(lo, hi))   # the injected delay
        return self.inner_transport.isend(peer, buf, tag)

    def _crash(self) -> None:
        how = self.spec.crash_how
        if how == "exit":
            os._exit(70)
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGTERM)
        if how == "kill":                 # SIGKILL is not deferred; this line is never reached
            os._exit(137)
        # SIGTERM: the handler runs in the main thread at its next instruction boundary
