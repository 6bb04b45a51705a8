"""minicomm's exceptions, and the packed call signature carried in every message tag."""
from __future__ import annotations

import functools

import numpy as np


class CommError(RuntimeError):
    """Base class of every communication error minicomm raises.

    After a collective's ``CommError`` the communicator is broken: every later call raises.

    Examples:
        >>> issubclass(mc.MismatchError, mc.CommError)
        True
    """


class CommTimeout(CommError):
    """A blocking wait passed its deadline; the message names the op, the step and the peer.

    Attributes:
        peer (int | None): The world rank the wait was for, when the transport knows it.
    """
    peer = None


class PeerFailure(CommError):
    """A peer died, closed its connection, or aborted the job.

    Attributes:
        peer (int | None): That peer's rank (in the world of the transport that saw it;
            communicators translate it to theirs), when known.
        clean (bool): The peer closed in order (finished), rather than crashing.
    """
    peer = None
    clean = False     # the peer closed in order (finished), rather than crashing


class Revoked(CommError):
    """A member revoked the communicator (``comm.revoke()``): its pending and later calls fail.

    Raised on every member that learns of the revoke (from the revoker's notice, or from its own
    ``revoke``). Recover with ``comm.shrink()`` (every survivor calls it).

    Attributes:
        notice (bool): Raised from a peer's notice (that peer is alive: see
            ``comm.failed_ranks()`` for the ranks known dead), rather than by this rank itself.
        peer (None): Never a failed peer (as ``PeerFailure.peer`` of a notice: None).

    Examples:
        >>> issubclass(mc.errors.Revoked, mc.CommError)
        True
    """
    notice = False
    peer = None


class MismatchError(CommError):
    """Ranks disagree on a call: collective, op, shape, dtype, root or algorithm.

    The message names both calls and the rank that differs, and numbers the call the way the
    user counts: "the user's collective call #N on this communicator" is the N-th collective
    the program called on that communicator (the world's setup calls and internal exchanges
    not counted); "sequence #" numbers are minicomm's internal message sequence.
    """


class RMAError(CommError):
    """A one-sided operation outside an epoch, out of bounds, or refused."""


class SpawnError(CommError):
    """Raised by ``spawn`` in the parent: one or more ranks failed.

    The message gives the root cause first (the first rank to fail with its own error), then
    the ranks that only lost a peer.

    Args:
        message (str): The summary.
        failures (Sequence): ``(rank, traceback text)`` of every failed rank.
        results (Sequence): Every rank's return value by rank (None for a failed rank).

    Attributes:
        failures (list): ``(rank, traceback text)`` pairs, root cause first.
        results (list): What the ranks that finished returned, by rank; None where one failed
            (with ``on_failure="continue"``: the survivors' results).

    Examples:
        >>> try:
        ...     mc.spawn(lambda comm: 1 / comm.rank, world_size=2, transport="inproc")
        ... except mc.SpawnError as e:
        ...     print(e.failures[0][0], "ZeroDivisionError" in e.failures[0][1])
        0 True
    """

    def __init__(self, message: str, failures=(), results=()):
        super().__init__(message)
        self.failures = list(failures)
        self.results = list(results)


# ---- packed call signature: what a message tag says about the call it belongs to ----
COLLECTIVE_CODES = ("p2p", "broadcast", "reduce", "allreduce", "allgather", "reduce_scatter",
                    "gather", "scatter", "alltoall", "barrier", "fingerprint", "scatter:meta",
                    "monitored_barrier", "allgatherv", "gatherv", "scatterv", "alltoallv",
                    "reduce_scatterv", "scan", "exscan", "counts")
# "fingerprint": the argument check before a rooted call (or every call, MINICOMM_DEBUG=detail);
# its tag carries the checked call's collective in the algorithm bits (see fingerprint_call), so a
# rank in another call names it. "scatter:meta": scatter's header exchange (its argument check,
# which also tells the ranks the block's shape and dtype).
OP_CODES = ("none", "sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
ALGO_CODES = ("none", "ring", "tree", "rhd", "hier", "innet", "registered")


def pack_call(collective: str, op: str, algorithm: str, dtype, root: int) -> int:
    """One int identifying a call's signature (everything but the count)."""
    dnum = np.dtype(dtype).num if dtype is not None else 0
    return (COLLECTIVE_CODES.index(collective) | OP_CODES.index(op) << 5
            | (ALGO_CODES.index(algorithm) if algorithm in ALGO_CODES else _REGISTERED_CODE) << 9
            | dnum << 13 | (root + 1) << 21)


_REGISTERED_CODE = ALGO_CODES.index("registered")   # any user-registered algorithm


_FINGERPRINT = COLLECTIVE_CODES.index("fingerprint")


class _Sig:
    __slots__ = ("call", "count")

    def __init__(self, call: int, count: int):
        self.call, self.count = call, count


def fingerprint_call(call: int) -> int:
    """The packed call of the fingerprint exchange that checks ``call``: collective
    "fingerprint", the checked collective in the algorithm bits (the algorithm is compared in the
    payload), op, dtype and root as in ``call``. Ranks making different calls disagree already
    in the header of the first fingerprint message, which names both calls."""
    return (call & ~(31 | 15 << 9)) | _FINGERPRINT | (call & 31) << 9


def call_reduces(call: int) -> bool:
    """Whether the packed call ``call`` combines data with an op (its receives may reduce)."""
    return (call >> 5) & 15 != 0


@functools.lru_cache(maxsize=256)
def decode_call(call: int):
    """(collective, op, dtype) of a packed call (``pack_call``)."""
    dnum = (call >> 13) & 255
    dtype = next((np.dtype(t) for t in np.sctypeDict.values() if np.dtype(t).num == dnum), None)
    return COLLECTIVE_CODES[call & 31], OP_CODES[(call >> 5) & 15], dtype


def signature(call: int, count: int) -> _Sig:
    """A packed call and its count, in the form ``describe_call`` reads."""
    return _Sig(call, count)


def describe_call(tag) -> str:
    c = tag.call
    if (c & 31) == _FINGERPRINT and (c >> 9) & 15:
        inner = describe_call(_Sig(c & ~(31 | 15 << 9) | (c >> 9) & 15, -1))
        return f"{inner.replace(' count=-1', '')} (its argument check)"
    coll = COLLECTIVE_CODES[c & 31] if (c & 31) < len(COLLECTIVE_CODES) else "?"
    op = OP_CODES[(c >> 5) & 15] if ((c >> 5) & 15) < len(OP_CODES) else "?"
    algo = ALGO_CODES[(c >> 9) & 15] if ((c >> 9) & 15) < len(ALGO_CODES) else "?"
    dnum = (c >> 13) & 255
    dname = next((np.dtype(t).name for t in np.sctypeDict.values()
                  if np.dtype(t).num == dnum), f"dtype#{dnum}")
    root = (c >> 21) - 1
    if coll == "p2p":
        return f"send/recv with tag {root} of {tag.count} bytes"
    if coll == "scatter:meta":
        return f"scatter root={root} (its header: argument check, shape and dtype)"
    parts = [coll]
    if op != "none":
        parts.append(f"op={op}")
    if algo != "none":
        parts.append(f"algorithm={algo}")
    if coll != "barrier":
        parts.append(f"dtype={dname} count={tag.count}")
    if root >= 0 and coll in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root={root}")
    return " ".join(parts)
