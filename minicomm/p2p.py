"""Point-to-point messaging of one communicator, with MPI matching rules.

Every ``send`` is one message: a 256-byte header (magic, user tag, dtype, shape) and then its
payload, two transport messages on the communicator's p2p context. Messages of one ordered pair
travel in FIFO order, so both sides count them and the transport tags (sequence numbers) always
agree; the *user* tag lives in the header, and receives match on (source, tag) with
``ANY_SOURCE`` / ``ANY_TAG``: a receive takes the earliest matching message, and messages of one
source with one tag never overtake each other (MPI's non-overtaking rule).

Flow. A header receive is posted on a peer only while some receive could match that peer. When a
header arrives, its message either goes straight into the matching receive's buffer (no copy),
or is unexpected: then its payload is read into a buffer of this engine, so later messages from
that peer can be reached. Buffered payloads are bounded (``MINICOMM_P2P_BUFFER_BYTES``, 64 MiB by
default): past the bound, the payload stays in the transport and nothing more is read from that
peer until a receive takes it; the sender's ``send`` then blocks (rendezvous), and a receive
that waits behind it times out saying so. Memory never grows without bound.

``out=`` is checked against the header (dtype and element count) before the payload is touched:
a wrong ``out`` raises and leaves the message in place for the next receive. Sends to oneself
are copied into the unexpected list (they count against the same bound).

Failures. A peer whose link fails fails the receives that name it; for ``ANY_SOURCE`` the first
such receive reports it (``PeerFailure.peer``) and later ones skip that peer and go on with the
living ones. A receive that times out is cancelled alone: a payload already arriving into its
buffer is moved to a private one first. None of these break the communicator.

Cost: one header message (256 B) per send, so α twice; the payload moves once. Matching costs
what it matches: posted receives and unexpected messages are filed by (source, tag) pattern, so
a message looks at four queue heads and a receive at one, never at the whole list
(docs/decisions/posted-receive-index.md).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import numpy as np

from .errors import CommError, CommTimeout, PeerFailure, pack_call
from .transports.progress import byte_setting

ANY_SOURCE = -1
ANY_TAG = -1
MAX_TAG = (1 << 31) - 1
HEADER_BYTES = 256
_HEADER_WORDS = HEADER_BYTES // 8
_MAX_DIMS = _HEADER_WORDS - 6
_MAGIC = 0x4D43503250       # "MCP2P"
_CALL = pack_call("p2p", "none", "none", None, -1)
DEFAULT_BUFFER_BYTES = 64 << 20


class Status:
    """What a receive matched (mpi4py's ``Status``).

    Pass one as ``status=`` to ``recv``; an ``irecv``'s ``Work.status`` is one.

    Attributes:
        source (int): The rank the message came from.
        tag (int): Its tag.
        nbytes (int): Its payload's size in bytes.
        dtype (np.dtype | None): Its dtype.
        shape (tuple): Its shape.

    Examples:
        >>> w = comm.isend(np.zeros((2, 3), np.float32), dst=1 - comm.rank, tag=4)
        >>> st = mc.Status()
        >>> y = comm.recv(mc.ANY_SOURCE, tag=mc.ANY_TAG, status=st)
        >>> w.wait()
        >>> st.tag, st.nbytes, st.dtype, st.shape
        (4, 24, dtype('float32'), (2, 3))
    """
    __slots__ = ("source", "tag", "nbytes", "dtype", "shape")

    def __init__(self):
        self.source: int = ANY_SOURCE
        self.tag: int = ANY_TAG
        self.nbytes: int = 0
        self.dtype: Optional[np.dtype] = None
        self.shape: Tuple[int, ...] = ()

    def __repr__(self):
        return (f"Status(source={self.source}, tag={self.tag}, nbytes={self.nbytes}, "
                f"dtype={self.dtype}, shape={self.shape})")


def _buffer_limit() -> int:
    return byte_setting("MINICOMM_P2P_BUFFER_BYTES", DEFAULT_BUFFER_BYTES)


def encode_header(tag: int, arr: np.ndarray) -> np.ndarray:
    if arr.ndim > _MAX_DIMS:
        raise ValueError(f"send: arrays of more than {_MAX_DIMS} dimensions are not supported")
    h = np.zeros(_HEADER_WORDS, dtype=np.int64)
    code = arr.dtype.str.encode()
    h[0], h[1], h[2], h[3] = _MAGIC, tag, arr.nbytes, arr.ndim
    h[4] = np.frombuffer(code.ljust(8, b"\0"), dtype=np.int64)[0]
    h[6:6 + arr.ndim] = arr.shape
    return h


def decode_header(h: np.ndarray, peer: int) -> Tuple[int, np.dtype, Tuple[int, ...], int]:
    """(tag, dtype, shape, nbytes) of a header, every field checked (a peer's bug or a corrupt
    stream is a clear error, not a wrong reshape)."""
    def bad(why: str) -> CommError:
        return CommError(f"malformed point-to-point header from rank {peer}: {why}")
    if int(h[0]) != _MAGIC:
        raise bad("bad magic")
    tag, nbytes, ndim = int(h[1]), int(h[2]), int(h[3])
    if not 0 <= tag <= MAX_TAG or not 0 <= ndim <= _MAX_DIMS or nbytes < 0:
        raise bad(f"tag {tag}, ndim {ndim}, nbytes {nbytes}")
    try:
        dtype = np.dtype(h[4:5].tobytes().rstrip(b"\0").decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError):
        raise bad("unknown dtype") from None
    if dtype.kind not in "biufc":
        raise bad(f"dtype {dtype}")
    shape = tuple(int(v) for v in h[6:6 + ndim])
    if any(d < 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != nbytes:
        raise bad(f"shape {shape} of {dtype} is not {nbytes} bytes")
    return tag, dtype, shape, nbytes


class _Msg:
    """A message whose header arrived (or a send to self) and that no receive has taken yet."""
    __slots__ = ("src", "tag", "dtype", "shape", "nbytes", "data", "req", "recv", "buffered",
                 "seq")

    def __init__(self, src, tag, dtype, shape, nbytes):
        self.src, self.tag, self.dtype, self.shape, self.nbytes = src, tag, dtype, shape, nbytes
        self.data: Optional[np.ndarray] = None   # landing buffer (ours, or the receive's)
        self.req = None                           # the payload's transport receive, in flight
        self.recv: Optional["_Recv"] = None       # the receive that took it
        self.buffered = False                     # its bytes count against the bound
        self.seq = 0                              # arrival order (set by the engine)

    def arrived(self) -> bool:
        return self.data is not None and (self.req is None or self.req.done)


class _Recv:
    __slots__ = ("src", "tag", "out", "work", "msg", "error", "result", "seq")

    def __init__(self, src, tag, out, work):
        self.src, self.tag, self.out, self.work = src, tag, out, work
        self.msg: Optional[_Msg] = None
        self.error: Optional[BaseException] = None
        self.result = None
        self.seq = 0                              # posting order (set by the index)

    def matches(self, m: _Msg) -> bool:
        return (self.src in (ANY_SOURCE, m.src)) and (self.tag in (ANY_TAG, m.tag))

    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def describe(self) -> str:
        src = "any source" if self.src == ANY_SOURCE else f"rank {self.src}"
        tag = "any tag" if self.tag == ANY_TAG else f"tag {self.tag}"
        return f"recv from {src} ({tag})"


def _file(queues: dict, key, item) -> None:
    q = queues.get(key)
    if q is None:
        q = queues[key] = OrderedDict()
    q[item] = None


def _unfile(queues: dict, key, item) -> None:
    q = queues[key]
    del q[item]
    if not q:
        del queues[key]           # no empty queues pile up (one per tag ever used)


class _PostedIndex:
    """Posted receives in posting order, filed under their (source, tag) pattern.

    The earliest receive that a message (s, t) matches heads one of four queues: (s, t),
    (s, ANY_TAG), (ANY_SOURCE, t), (ANY_SOURCE, ANY_TAG). Matching a message looks at those four
    heads, not at every posted receive. ``by_src`` files the same receives by source alone (the
    peers to read headers from; what a dead peer fails). ``examined`` counts the entries looked
    at (tests count work, not time)."""
    __slots__ = ("_queues", "by_src", "_next", "examined")

    def __init__(self):
        self._queues: Dict[Tuple[int, int], OrderedDict] = {}
        self.by_src: Dict[int, OrderedDict] = {}
        self._next = 0
        self.examined = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self.by_src.values())

    def __contains__(self, r: _Recv) -> bool:
        q = self.by_src.get(r.src)
        return q is not None and r in q

    def add(self, r: _Recv) -> None:
        r.seq = self._next
        self._next += 1
        _file(self._queues, (r.src, r.tag), r)
        _file(self.by_src, r.src, r)

    def remove(self, r: _Recv) -> None:
        _unfile(self._queues, (r.src, r.tag), r)
        _unfile(self.by_src, r.src, r)

    def first(self, src: int, tag: int) -> Optional[_Recv]:
        """The earliest posted receive that a message from ``src`` with ``tag`` matches."""
        best = None
        queues = self._queues
        for key in ((src, tag), (src, ANY_TAG), (ANY_SOURCE, tag), (ANY_SOURCE, ANY_TAG)):
            q = queues.get(key)
            if q:
                self.examined += 1
                r = next(iter(q))
                if best is None or r.seq < best.seq:
                    best = r
        return best


class _UnexpectedIndex:
    """Messages no receive has taken yet, in arrival order, each filed under the four patterns a
    receive may have that match it: (s, t), (s, ANY_TAG), (ANY_SOURCE, t), (ANY_SOURCE,
    ANY_TAG). A receive reads the head of its own pattern's queue: one entry, not the list.
    Iterating gives every message in arrival order."""
    __slots__ = ("_queues", "examined")

    def __init__(self):
        self._queues: Dict[Tuple[int, int], OrderedDict] = {}
        self.examined = 0

    def _all(self):
        return self._queues.get((ANY_SOURCE, ANY_TAG), ())

    def __iter__(self):
        return iter(list(self._all()))

    def __len__(self) -> int:
        return len(self._all())

    def __contains__(self, m: _Msg) -> bool:
        return m in self._all()

    def add(self, m: _Msg) -> None:
        """File ``m`` at its arrival place (``m.seq``): the end, unless it is put back."""
        queues = self._queues
        for key in ((m.src, m.tag), (m.src, ANY_TAG), (ANY_SOURCE, m.tag), (ANY_SOURCE, ANY_TAG)):
            q = queues.get(key)
            if q is None:
                q = queues[key] = OrderedDict()
            q[m] = None
            if len(q) > 1 and m.seq < _before_last(q).seq:
                _reorder(q, m)            # put back by a cancelled receive: rare

    def remove(self, m: _Msg) -> None:
        for key in ((m.src, m.tag), (m.src, ANY_TAG), (ANY_SOURCE, m.tag), (ANY_SOURCE, ANY_TAG)):
            _unfile(self._queues, key, m)

    def first(self, src: int, tag: int) -> Optional[_Msg]:
        """The earliest message a receive from ``src`` with ``tag`` (either may be ANY) matches."""
        q = self._queues.get((src, tag))
        if not q:
            return None
        self.examined += 1
        return next(iter(q))


def _before_last(q: OrderedDict):
    it = reversed(q)
    next(it)
    return next(it)


def _reorder(q: OrderedDict, m: _Msg) -> None:
    """Move ``m`` (just appended) to its arrival place in ``q``."""
    if next(iter(q)).seq > m.seq:
        q.move_to_end(m, last=False)
        return
    items = sorted(q, key=lambda x: x.seq)
    q.clear()
    q.update((x, None) for x in items)


class P2PEngine:
    """The point-to-point state of one communicator (see the module docstring)."""

    def __init__(self, transport, rank: int, group: Tuple[int, ...], ctx: int):
        self.transport, self.rank, self.group, self.ctx = transport, rank, group, ctx
        self.size = len(group)
        self.limit = _buffer_limit()
        self.buffered_bytes = 0
        self._sent: Dict[int, int] = {}
        self._received: Dict[int, int] = {}
        self._hdr: Dict[int, Tuple[object, np.ndarray]] = {}   # peer -> posted header receive
        self._stalled: Dict[int, _Msg] = {}                     # peer -> payload left unread
        self._inflight: Dict[_Msg, None] = {}                   # payloads arriving, in order
        self._unexpected = _UnexpectedIndex()
        self._posted = _PostedIndex()
        self._arrivals = 0
        self.dead: Dict[int, PeerFailure] = {}
        self._reported: set = set()

    @property
    def examined(self) -> int:
        """Matching entries looked at so far (posted receives and unexpected messages)."""
        return self._posted.examined + self._unexpected.examined

    # ------------------------------------------------------------------------ sending
    def _tag(self, seq: int, tag: int, payload: bool):
        from .transports.base import Tag
        return Tag(self.ctx, seq, tag, _CALL, int(payload))

    def isend(self, arr: np.ndarray, flat: np.ndarray, dst: int, tag: int):
        """Post one message; returns the transport requests to wait for ([] when done)."""
        if dst == self.rank:
            m = _Msg(dst, tag, arr.dtype, arr.shape, arr.nbytes)
            if self.buffered_bytes + arr.nbytes > self.limit:
                raise CommError(f"send to self (tag {tag}): {self.buffered_bytes} bytes of "
                                f"unreceived messages already buffered; {arr.nbytes} more would "
                                f"pass the limit of {self.limit} (MINICOMM_P2P_BUFFER_BYTES)")
            m.data = flat.view(np.uint8).copy()
            m.buffered = True
            self.buffered_bytes += arr.nbytes
            self._arrive(m)
            return []
        if dst in self.dead:
            raise _again(self.dead[dst])
        seq = self._sent.get(dst, 0) + 1
        self._sent[dst] = seq
        peer = self.group[dst]
        t = self.transport
        return [t.isend(peer, encode_header(tag, arr).view(np.uint8), self._tag(seq, tag, False)),
                t.isend(peer, flat.view(np.uint8), self._tag(seq, tag, True))]

    # ------------------------------------------------------------------------ receiving
    def post(self, src: int, tag: int, out, work) -> _Recv:
        r = _Recv(src, tag, out, work)
        if src != ANY_SOURCE and src in self.dead:
            r.error = _again(self.dead[src])
            return r
        m = self._unexpected.first(src, tag)
        if m is None:
            self._posted.add(r)
            return r
        err = _check_out(out, m)
        if err is not None:
            r.error = err                 # the message stays for the next receive
            return r
        self._unexpected.remove(m)
        self._take(r, m)
        return r

    def cancel(self, r: _Recv) -> None:
        """Withdraw a receive (it timed out): it must never write into its buffer later."""
        if r in self._posted:
            self._posted.remove(r)
            return
        m = r.msg
        if m is None or r.done():
            return
        m.recv, r.msg = None, None
        if not m.buffered and m.data is not None:     # it lands (or landed) in r's buffer
            if m.req is not None and not m.req.done:
                m.data = self.transport.detach(m.req).view(np.uint8)   # finish privately
            else:
                m.data = m.data.copy()
            m.buffered = True
            self.buffered_bytes += m.nbytes
        self._put_back(m)

    def _put_back(self, m: _Msg) -> None:
        """A message a cancelled receive had taken: the earliest posted receive that matches it
        takes it, or it is unexpected again, at its arrival place (non-overtaking)."""
        r = self._claim(m)
        if r is None:
            self._unexpected.add(m)
        else:
            self._take(r, m)

    def _claim(self, m: _Msg) -> Optional[_Recv]:
        """Unpost and return the earliest posted receive that can take ``m``; one whose out=
        does not fit fails and the message looks further."""
        posted = self._posted
        while True:
            r = posted.first(m.src, m.tag)
            if r is None:
                return None
            posted.remove(r)
            err = _check_out(r.out, m)
            if err is None:
                return r
            r.error = err

    def _take(self, r: _Recv, m: _Msg) -> None:
        """Receive ``r`` (checked against ``m``, in no index) takes message ``m``."""
        m.recv, r.msg = r, m
        if m.data is not None and m.req is None:          # arrived, in our buffer
            self._deliver(r, m)
        elif m.data is None and m.req is None:            # not read yet: read it into r's buffer
            if self._stalled.get(m.src) is m:
                del self._stalled[m.src]
            self._start_payload(m, self._target(r, m))
            if m.req.done:
                del self._inflight[m]
                m.req = None
                self._deliver(r, m)
        # else: arriving into our buffer: delivered when it completes

    def _target(self, r: _Recv, m: _Msg) -> np.ndarray:
        if r.out is not None and r.out.flags.c_contiguous:
            return r.out.reshape(-1).view(np.uint8)
        return np.empty(m.nbytes, dtype=np.uint8)

    def _start_payload(self, m: _Msg, buf: np.ndarray) -> None:
        peer = self.group[m.src]
        seq = self._received[m.src]
        m.data = buf
        m.req = self.transport.irecv(peer, buf, self._tag(seq, m.tag, True))
        self._inflight[m] = None

    def _deliver(self, r: _Recv, m: _Msg) -> None:
        """``m``'s payload is complete: hand it to ``r``."""
        if m.buffered:
            self.buffered_bytes -= m.nbytes
            m.buffered = False
        data = m.data
        if r.out is not None:
            flat_out = r.out.reshape(-1).view(np.uint8) if r.out.flags.c_contiguous else None
            if flat_out is None or data.ctypes.data != flat_out.ctypes.data:
                r.out[...] = data.view(m.dtype).reshape(m.shape)
            r.result = r.out
        else:
            r.result = data.view(m.dtype).reshape(m.shape)
        if r.work is not None:
            st = r.work.status
            st.source, st.tag, st.nbytes, st.dtype, st.shape = m.src, m.tag, m.nbytes, m.dtype, \
                m.shape

    def _arrive(self, m: _Msg) -> None:
        """A message's header is here: the earliest posted receive that matches takes it."""
        m.seq = self._arrivals
        self._arrivals += 1
        r = self._claim(m)
        if r is not None:
            self._take(r, m)
            return
        self._unexpected.add(m)
        if m.data is not None:
            return                                  # a send to self: already buffered
        if self.buffered_bytes + m.nbytes <= self.limit:
            m.buffered = True
            self.buffered_bytes += m.nbytes
            self._start_payload(m, np.empty(m.nbytes, dtype=np.uint8))
        else:
            self._stalled[m.src] = m                # flow control: the sender waits for us

    def _on_header(self, p: int, buf: np.ndarray) -> None:
        """Peer ``p``'s next header (``buf``) arrived."""
        self._received[p] = self._received.get(p, 0) + 1
        tag, dtype, shape, nbytes = decode_header(buf.view(np.int64), p)
        self._arrive(_Msg(p, tag, dtype, shape, nbytes))

    def _settle(self) -> None:
        """Hand the payloads that completed to the receives that took them."""
        done = [m for m in self._inflight if m.req.done]
        for m in done:
            del self._inflight[m]
            m.req = None
            if m.recv is not None:
                self._deliver(m.recv, m)

    def _wanted_peers(self) -> List[int]:
        """The peers some posted receive could match (read from the index, not by a scan)."""
        srcs = self._posted.by_src
        if ANY_SOURCE in srcs:
            return [p for p in range(self.size) if p != self.rank]
        return sorted(p for p in srcs if p != self.rank)

    def progress(self, until, deadline: float, what: str) -> None:
        """Move messages until ``until()`` holds; raises CommTimeout at ``deadline``."""
        t = self.transport
        while not until():
            for p in self._wanted_peers():
                if p in self.dead or p in self._stalled or p in self._hdr:
                    continue
                seq = self._received.get(p, 0) + 1
                buf = np.empty(HEADER_BYTES, dtype=np.uint8)
                self._hdr[p] = (t.irecv(self.group[p], buf, self._tag(seq, 0, False)), buf)
            self._fail_hopeless()
            if until():
                return
            reqs = [req for req, _ in self._hdr.values()] + \
                   [m.req for m in self._inflight]
            if not reqs:
                left = deadline - time.monotonic()
                raise CommTimeout(self._timeout_text(what, left))
            try:
                t.wait_any(reqs, deadline, what)
            except PeerFailure as e:
                self._peer_failed(e)
                continue
            except CommTimeout as e:
                raise CommTimeout(self._timeout_text(what, 0, str(e))) from None
            for p in list(self._hdr):
                req, buf = self._hdr[p]
                if req.done:
                    del self._hdr[p]
                    self._on_header(p, buf)
            self._settle()

    def _peer_failed(self, e: PeerFailure) -> None:
        world = getattr(e, "peer", None)
        if world not in self.group:
            raise e                                   # not a peer of ours: nothing to skip
        p = self.group.index(world)
        err = PeerFailure(str(e))
        err.peer, err.clean = p, bool(getattr(e, "clean", False))
        self.dead[p] = err
        if err.clean:
            self._reported.add(p)     # a peer that finished is no failure for ANY_SOURCE
        self._hdr.pop(p, None)
        for m in [m for m in self._inflight if m.src == p]:
            del self._inflight[m]
            if m.recv is not None:
                m.recv.error = _again(err)
        self._stalled.pop(p, None)

    def _fail_hopeless(self) -> None:
        """Receives that can never match: their source died, or (ANY_SOURCE) every peer did.
        Only the receives that fail are looked at (the index files them by source)."""
        if not self.dead:
            return
        posted = self._posted
        for p, err in self.dead.items():
            q = posted.by_src.get(p)
            while q:
                r = next(iter(q))
                posted.examined += 1
                posted.remove(r)
                r.error = _again(err)
        anyq = posted.by_src.get(ANY_SOURCE)
        if not anyq:
            return
        for p in [p for p in self.dead if p not in self._reported]:
            if not anyq:
                return
            r = next(iter(anyq))          # the earliest ANY_SOURCE receive reports it
            posted.examined += 1
            posted.remove(r)
            self._reported.add(p)
            r.error = _again(self.dead[p])
        if anyq and all(p in self.dead for p in range(self.size) if p != self.rank):
            for r in list(anyq):
                posted.examined += 1
                if self._unexpected.first(r.src, r.tag) is not None:
                    continue                  # a message it matches is here (put back)
                err = PeerFailure(f"{r.describe()}: every other rank of the communicator "
                                  f"failed ({sorted(self.dead)})")
                err.peer = sorted(self.dead)[0]
                posted.remove(r)
                r.error = err

    def _timeout_text(self, what: str, left: float, base: str = "") -> str:
        text = f"{what}: rank {self.rank} timed out" + (f" ({base})" if base else "")
        stalled = sorted(self._stalled)
        if stalled:
            text += (f"; {self.buffered_bytes} bytes of unexpected messages are buffered, the "
                     f"limit (MINICOMM_P2P_BUFFER_BYTES={self.limit}) is reached, and the next "
                     f"messages of ranks {stalled} wait in the transport until a receive takes "
                     f"them")
        return text


def _check_out(out, m: _Msg) -> Optional[BaseException]:
    if out is None:
        return None
    count = m.nbytes // m.dtype.itemsize if m.dtype.itemsize else 0
    if out.dtype != m.dtype:
        return TypeError(f"recv: the message from rank {m.src} (tag {m.tag}) holds {m.dtype}, "
                         f"out= is {out.dtype}")
    if out.size != count:
        return ValueError(f"recv: the message from rank {m.src} (tag {m.tag}) has {count} "
                          f"elements of shape {m.shape}, out= has {out.size} of shape {out.shape}")
    return None


def _again(e: BaseException) -> BaseException:
    c = type(e)(str(e))
    c.peer = getattr(e, "peer", None)
    c.clean = getattr(e, "clean", False)
    return c
