"""The transport contract: the small interface every byte mover implements.

A transport belongs to one process (one rank of the world) and is shared by every communicator of
that process. It moves contiguous numpy buffers to and from peers (world ranks), two-sided:

    req = t.isend(peer, buf, tag)                 # buf: contiguous 1-D numpy view, read-only use
    req = t.irecv(peer, buf, tag, reduce=None)    # buf: contiguous 1-D numpy view to fill;
                                                  # reduce(dst, src) combines in place instead
    t.wait_all([req, ...], deadline, what)        # progress until all complete
    t.wait_any([req, ...], deadline, what)        # progress until at least one completes
    t.cancel_context(ctx, error)                  # a communicator broke or closed: see below
    t.detach(req)                                 # a receive stops writing into its buffer
    t.close()

Matching: messages from one peer with one ``tag.comm`` are matched in FIFO order (different
communicators never steal each other's messages). Every message carries its ``Tag``; the receiver
compares it with the tag it expects and raises ``MismatchError`` naming both calls when they
differ, so desynchronised or mismatched ranks are detected instead of silently mixed. A message
whose byte length differs from the posted buffer is a ``MismatchError`` too.

Failures: ``wait_all`` raises ``CommTimeout`` (naming ``what``, the step and the peer waited on)
when ``deadline`` (a ``time.monotonic()`` value) passes, and ``PeerFailure`` as soon as a peer it
waits on is known dead or closed. It must block (no busy-spin beyond a short spin), so that more
ranks than cores still progress.

Liveness (fault tolerance): ``dead_peers()`` is the links known ended, with their reasons, from
link state only; ``exclude_peer(peer, reason)`` ends one link on purpose. A peer's failure or
exclusion never closes another link, and no communicator's break tears a link down.

Cancellation: ``cancel_context(ctx, error)`` drops every request of that ``tag.comm`` that has not
started to move, makes every wait on one of its requests raise ``error`` at once (a blocked waiter
is woken), and from then on drains and drops whatever peers still send on it, so a broken or
closed communicator neither blocks the link for the others nor holds memory. An ``abort notice``
(a message whose ``call`` is ``ABORT_CALL``, its ``step`` the failure kind) tells a peer that this
rank broke a communicator: the peer's receive on it raises the matching error.

One-sided (optional; shm through shmrma.py, rdma, ub): ``rma_expose(nbytes, name)`` returns this
rank's exposed memory (``u8``, a ``descriptor`` for the peers, ``seal()`` once every peer has
attached, ``close()``); ``rma_attach(peer, descriptor, channel)`` a channel to a peer's memory
with ``put(off, src_u8)`` (may complete at ``flush()``), ``get(off, dst_u8)`` (complete on
return), ``fadd(off, v)`` / ``cas(off, compare, swap)`` on 8-byte words returning the old value,
``flush()``, ``close()`` (``OneSidedChannel``). A channel declares its optional features as
class attributes (``ChannelBase`` holds the defaults): ``mapped`` (shm: the target's memory is
mapped here -- ``typed(off, dtype, count)``, ``update(off, n, fn)``, a read-modify-write under the
target's ``mutex``), ``native_atomics`` (rdma, ub: the target's NIC does 8-byte fadd / cas) and
``native_swap`` (ub: ``swap(off, value)``). Failed accesses raise ``RMAError`` naming the
transport's status.

``reduce`` lets a transport reduce straight out of its landing memory (shared memory, a socket
buffer it owns) into the destination, saving a copy: ``reduce(dst_view, incoming_view)`` performs
``dst op= incoming`` in place. Zero-byte messages are real messages (they order; barrier uses them).

Capabilities. Beyond the two-sided core (``TwoSided``) a transport may offer an eager
small-message channel (``EagerChannel``), registered memory (``RegisteredMemory``), single-copy
reads (``SingleCopy``) and one-sided access (``OneSided``). It says which by overriding
``capabilities()``; ``capabilities_of(transport)`` is the one place the layers above learn them
(a communicator does, once, when it is built) and checks each declared capability against its
Protocol. A transport without a capability gets the general path: nothing above probes a
transport with ``getattr`` / ``hasattr`` / ``isinstance``. ``ProgressEngine`` and ``FutexSleep``
declare what ``progress.Progress`` calls on the engines it drives.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, runtime_checkable

import numpy as np

ReduceFn = Callable[[np.ndarray, np.ndarray], None]


ABORT_CALL = -7                 # Tag.call of an abort notice; Tag.step is one of ABORT_KINDS
# "Shrink": a Revoked sent by a rank between calls (shrink); ``count`` is the first call it
# has not done, so a peer's earlier call, which it did its part of, may still complete
ABORT_KINDS = ("MismatchError", "CommTimeout", "PeerFailure", "CommError", "Revoked", "Shrink")
CLEAN_CLOSE = "it closed its transport"   # a link's reason starts so when its peer finished
# the start of the reason of a link ended by ``exclude_peer`` (an agreement fenced that rank): a
# live rank that reads it on a link knows the others decided it failed
EXCLUDED = "it excluded this rank"
FENCED = "this rank excluded it"  # ... and the excluding side's own reason for that link


def fenced_reason(reason: str) -> str:
    """The excluding side's record of a link it ended with ``reason``: never reads EXCLUDED."""
    return FENCED + (reason[len(EXCLUDED):] if reason.startswith(EXCLUDED) else f": {reason}")


class Tag(NamedTuple):
    """What a message belongs to. ``call`` and ``count`` encode the call's signature (collective,
    op, algorithm, dtype, root; element count) so a receiver detects mismatched calls."""
    comm: int      # communicator id
    seq: int       # call sequence number on that communicator
    step: int      # the sender's schedule step (informational), or the user tag for p2p
    call: int      # packed call signature, see minicomm.errors.describe_call
    count: int     # per-rank element count of the call


class Request:
    """A posted send or receive; transports subclass or use it as is."""
    __slots__ = ("peer", "buf", "tag", "reduce", "done", "is_send")

    def __init__(self, peer: int, buf: np.ndarray, tag: Tag, reduce: Optional[ReduceFn],
                 is_send: bool):
        self.peer, self.buf, self.tag, self.reduce = peer, buf, tag, reduce
        self.is_send = is_send
        self.done = False


# ------------------------------------------------------------------------- the declared contract
@runtime_checkable
class TwoSided(Protocol):
    """The core every transport implements (the module doc, and ``Transport`` below)."""
    name: str
    rank: int
    size: int

    def isend(self, peer: int, buf: np.ndarray, tag: Tag) -> Request: ...

    def irecv(self, peer: int, buf: np.ndarray, tag: Tag,
              reduce: Optional[ReduceFn] = None) -> Request: ...

    def wait_all(self, requests: List[Request], deadline: float, what: str) -> None: ...

    def wait_any(self, requests: List[Request], deadline: float, what: str) -> None: ...

    def cancel_context(self, ctx: int, error: BaseException) -> None: ...

    def detach(self, req: Request) -> np.ndarray: ...

    def abort(self, reason: str) -> None: ...

    def close(self) -> None: ...

    # ``dead_peers`` and ``exclude_peer`` (fault tolerance) are ``Transport``'s, with defaults


@runtime_checkable
class EagerChannel(Protocol):
    """The small-message channel (minicomm.smallpath): messages of up to ``small_bytes`` move
    with no request object. Each call returns a falsy value when it moved nothing; the caller
    then posts the message with ``isend`` / ``irecv`` as usual."""
    small_bytes: int

    def send_now(self, peer: int, buf: np.ndarray, tag: Tag) -> bool:
        """Send now, or False (nothing written)."""

    def recv_now(self, peer: int, buf: np.ndarray, tag: Tag, reduce: Optional[ReduceFn],
                 spin: float) -> bool:
        """Receive (or reduce) within ``spin`` seconds, or False (nothing consumed)."""

    def sendrecv_now(self, peer: int, sbuf: np.ndarray, rbuf: np.ndarray, tag: Tag,
                     reduce: Optional[ReduceFn], spin: float) -> int:
        """``send_now`` then ``recv_now``: 0 nothing sent, 1 sent only, 3 both done."""

    def recv_now_many(self, waiting: list, tag: Tag, spin: float) -> list:
        """``recv_now`` for ``[(peer, buf, reduce), ...]``; returns those still waiting."""


@runtime_checkable
class RegisteredMemory(Protocol):
    """Memory the peers map: messages from it move with one copy (what ``comm.empty`` and
    ``comm.register`` hand out)."""

    def register_memory(self, nbytes: int) -> np.ndarray:
        """A page-aligned uint8 array of ``nbytes`` the peers can map."""

    def free_memory(self, arr: np.ndarray) -> bool:
        """Stop sharing ``arr``'s memory (it stays valid); False if it is not registered."""

    def is_registered(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` lies wholly in registered memory."""


@runtime_checkable
class SingleCopy(Protocol):
    """Large sends the receiver reads straight from the sender's memory (shm's cma.py)."""

    def single_copy_peers(self) -> List[int]:
        """The peers this rank's large sends reach single-copy."""

    def single_copy_from(self) -> int:
        """The size from which collective sends go single-copy (0: to no peer)."""


@runtime_checkable
class OneSided(Protocol):
    """What windows (minicomm.window) use: the module doc's "One-sided"."""

    def rma_expose(self, nbytes: int, name: str) -> Any:
        """This rank's exposed memory (``u8``, ``descriptor``, ``seal()``, ``close()``)."""

    def rma_attach(self, peer: int, descriptor: bytes, channel: int) -> "OneSidedChannel":
        """A channel to ``peer``'s exposed memory."""


@runtime_checkable
class OneSidedChannel(Protocol):
    """A window's access to one target (what ``rma_attach`` returns; the module doc's
    "One-sided"). The three flags say which optional features it has (``ChannelBase``)."""
    mapped: bool
    native_atomics: bool
    native_swap: bool

    def put(self, off: int, src: np.ndarray) -> None:
        """Write ``src`` at byte ``off`` of the target (may complete at ``flush``)."""

    def get(self, off: int, dst: np.ndarray) -> None:
        """Read into ``dst`` from byte ``off`` of the target (complete on return)."""

    def fadd(self, off: int, value: int) -> int:
        """Atomically add ``value`` to the 8-byte word at ``off``; the old value."""

    def cas(self, off: int, compare: int, swap: int) -> int:
        """Atomically store ``swap`` at ``off`` if the word there is ``compare``; the old value."""

    def flush(self) -> None:
        """Complete every ``put`` posted so far."""

    def peer_gone(self) -> Optional[str]:
        """Why this channel's peer is known gone (died, aborted), or None; never blocks.
        Lock waits ask it so a dead holder is a PeerFailure, not a timeout."""

    def close(self) -> None:
        """Release the channel's resources."""


class ChannelBase:
    """The defaults of ``OneSidedChannel``'s optional features: none. Each channel class
    declares every flag it sets; a method whose flag is False is never called."""
    mapped = False            # typed(), update() and mutex: the target's memory is mapped here
    native_atomics = False    # fadd / cas on 8-byte words run on the target's NIC
    native_swap = False       # swap(): an atomic 8-byte exchange

    def typed(self, off: int, dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` at byte ``off`` of the target's memory (``mapped``)."""
        raise NotImplementedError(f"{type(self).__name__} is not mapped")

    def update(self, off: int, nbytes: int, fn: Callable[[np.ndarray], Any]) -> Any:
        """``fn(view)`` on the target's bytes [off, off+nbytes) under its mutex (``mapped``)."""
        raise NotImplementedError(f"{type(self).__name__} is not mapped")

    def swap(self, off: int, value: int) -> int:
        """Atomically store ``value`` at ``off``; the old value (``native_swap``)."""
        raise NotImplementedError(f"{type(self).__name__} has no native swap")

    def peer_gone(self) -> Optional[str]:
        """Nothing known of the peer's death (a channel that can tell overrides this)."""
        return None


@runtime_checkable
class ProgressEngine(Protocol):
    """What ``progress.Progress`` calls on each engine it drives (see progress.py)."""
    name: str
    rank: int

    def progress(self) -> bool:
        """One non-blocking pass over the posted work; True if anything moved."""

    def check(self, req: Request, what: str) -> None:
        """Raise if ``req`` can never complete."""

    def check_foreign(self, tag: Tag) -> None:
        """Raise if a peer's unclaimed message proves the call waiting on ``tag`` cannot end."""

    def sleep(self, flag: int) -> None:
        """Raise (non-zero) or lower the flag peers read before ringing a doorbell."""


@runtime_checkable
class FutexSleep(Protocol):
    """An engine whose poller may sleep on a futex word instead of epoll (shm alone)."""
    futex_ok: bool

    def futex_value(self) -> int:
        """The word's value, read after the flag is raised and before the last pass."""

    def futex_block(self, value: int, timeout: float) -> None:
        """Sleep while the word holds ``value``, at most ``timeout`` seconds."""

    def kick(self) -> None:
        """Wake this engine's own futex sleeper."""


@dataclass(frozen=True)
class Capabilities:
    """What a transport offers beyond ``TwoSided``: each field the object to call, or None."""
    eager: Optional[EagerChannel] = None          # usually the transport itself
    registered: Optional[RegisteredMemory] = None
    single_copy: Optional[SingleCopy] = None
    one_sided: Optional[OneSided] = None
    oversubscribed: bool = True       # this node's ranks outnumber its cores (no helper threads)
    describe: Optional[Callable[[], str]] = None   # one line on routes and copies (debug=info)
    job_id: Optional[str] = None      # the job id in the transport's shared-memory names (shm)
    device_job_id: Optional[str] = None   # ... in its simulated NIC device's (rdma, ub)


# field of Capabilities -> the Protocol its object must implement
_DECLARED = (("eager", EagerChannel), ("registered", RegisteredMemory),
             ("single_copy", SingleCopy), ("one_sided", OneSided))


def _members(proto: type) -> List[str]:
    """The attributes and methods ``proto`` declares (its own, not Protocol's machinery)."""
    names = list(vars(proto).get("__annotations__", {}))
    return names + [k for k, v in vars(proto).items() if callable(v) and not k.startswith("_")]


def _require(transport, obj, proto: type, what: str) -> None:
    if isinstance(obj, proto):
        return
    missing = [m for m in _members(proto) if not hasattr(obj, m)]
    raise TypeError(f"transport {type(transport).__name__} declares {what} ({proto.__name__}) "
                    f"but {type(obj).__name__} lacks {', '.join(missing) or '?'}")


def capabilities_of(transport) -> Capabilities:
    """THE one place a transport's capabilities are learned: its own ``capabilities()``, each
    declared capability checked against its Protocol. Raises TypeError naming the transport and
    the missing members when a declared capability (or the two-sided core) is not implemented."""
    caps = transport.capabilities()
    if not isinstance(caps, Capabilities):
        raise TypeError(f"transport {type(transport).__name__}.capabilities() returned "
                        f"{type(caps).__name__}, not Capabilities")
    _require(transport, transport, TwoSided, "the two-sided core")
    for field, proto in _DECLARED:
        obj = getattr(caps, field)
        if obj is not None:
            _require(transport, obj, proto, field)
    return caps


class Transport:
    name = "abstract"
    rank: int
    size: int

    def isend(self, peer: int, buf: np.ndarray, tag: Tag) -> Request:
        raise NotImplementedError

    def irecv(self, peer: int, buf: np.ndarray, tag: Tag,
              reduce: Optional[ReduceFn] = None) -> Request:
        raise NotImplementedError

    def wait_all(self, requests: List[Request], deadline: float, what: str) -> None:
        raise NotImplementedError

    def wait_any(self, requests: List[Request], deadline: float, what: str) -> None:
        raise NotImplementedError

    def cancel_context(self, ctx: int, error: BaseException) -> None:
        raise NotImplementedError

    def detach(self, req: Request) -> np.ndarray:
        """Stop ``req`` (a receive) from writing into its buffer: give it a private one, holding
        what arrived so far, and return that. For a done request, its own buffer."""
        raise NotImplementedError

    def abort(self, reason: str) -> None:
        """Best effort: tell peers this rank is failing so they raise PeerFailure now."""

    def dead_peers(self) -> Dict[int, str]:
        """The peers whose link this rank knows ended (died, aborted, finished, or excluded
        either way), each with the link's reason; from link state alone, never from a notice
        (a peer that broke a communicator is alive). As far as noticed so far: no blocking."""
        return {}

    def exclude_peer(self, peer: int, reason: str) -> None:
        """End the link to ``peer`` alone (an agreement fenced it): tell it ``reason`` (start it
        with ``EXCLUDED``: the peer reads it as its link's reason), fail this rank's waits on it,
        drop what is queued for it. Idempotent (the first reason stays); other links go on."""

    def close(self) -> None:
        pass

    def capabilities(self) -> Capabilities:
        """What this transport offers beyond the two-sided core (default: nothing); read it
        through ``capabilities_of``."""
        return Capabilities()


def remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def check_tag(peer: int, expected: Tag, got: Tag, exp_nbytes: int, got_nbytes: int) -> None:
    """Raise MismatchError when an arriving message does not belong to the call we are in."""
    # ``step`` is the sender's own step index (for error messages): FIFO matching pairs messages,
    # and a sender's and receiver's step indices legitimately differ (trees, folds).
    if (got.comm == expected.comm and got.seq == expected.seq and got.call == expected.call
            and got.count == expected.count and exp_nbytes == got_nbytes):
        return
    from minicomm import errors
    from minicomm.errors import MismatchError, describe_call
    if got.call == ABORT_CALL:
        kind = ABORT_KINDS[got.step] if 0 <= got.step < len(ABORT_KINDS) else "CommError"
        cls = {"MismatchError": MismatchError, "Revoked": errors.Revoked,
               "Shrink": errors.Revoked}.get(kind, errors.PeerFailure)
        broke = (f"revoked this communicator to shrink it, before its call #{got.count}"
                 if kind == "Shrink" else
                 f"broke this communicator at its call #{got.count} with a {kind} (its own "
                 f"error names the cause)")
        err = cls(f"rank {peer} {broke}; this rank was in call #{expected.seq} "
                  f"({describe_call(expected)})")
        # the notifier is alive: it names no failed peer (the failed set is link state)
        err.peer, err.notice = None, True
        raise err
    if got.comm != expected.comm or got.seq != expected.seq:
        raise MismatchError(
            f"desynchronised with rank {peer}: expected a message of call #{expected.seq} "
            f"({describe_call(expected)}), got one of call #{got.seq} ({describe_call(got)})")
    if got.call != expected.call or got.count != expected.count:
        raise MismatchError(
            f"rank {peer} called {describe_call(got)} while this rank called "
            f"{describe_call(expected)} (call #{expected.seq})")
    raise MismatchError(
        f"message from rank {peer} (its step {got.step}) for call #{expected.seq} has {got_nbytes} "
        f"bytes, step {expected.step} here expects {exp_nbytes} bytes ({describe_call(expected)})")


def check_foreign(peer: int, expected: Tag, got: Tag) -> None:
    """Called while a collective waits, for the first unclaimed message of its context from each
    peer (not only the peers it waits on). Raise when that message proves the call cannot
    complete: an abort notice (the peer broke this communicator), or a message of this same call
    (same sequence number) with another signature (the peer made a different call). Anything
    else (a peer already in a later call, point-to-point traffic) is left alone. This is what
    makes detection independent of the algorithm: the ranks that disagree need not be the ones
    that exchange the first message, and a rank blocked on a third rank still learns of it.

    Point-to-point waits (any tag may be queued) raise only for an abort notice of their context:
    the peer broke the communicator, so no receive of it can be trusted to end. A ``Revoked``
    notice raises whatever call the revoker was in; a ``Shrink`` notice only calls from its
    ``count`` on (the shrinker did the earlier ones)."""
    if got.comm != expected.comm:
        return
    if got.call == ABORT_CALL:
        # a notice carries the call the peer broke in (``count``): one that broke in a later
        # call has done its part of this one, which may still complete
        if (not (expected.call & 31) or got.count <= expected.seq
                or got.step == ABORT_KINDS.index("Revoked")):
            check_tag(peer, expected, got, 0, 0)
    elif not (expected.call & 31):
        return
    elif got.seq == expected.seq and (got.call != expected.call or got.count != expected.count):
        check_tag(peer, expected, got, 0, 0)
