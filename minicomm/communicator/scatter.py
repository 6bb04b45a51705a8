"""Scatter's header exchange: the only collective whose non-roots may not know their output.

A non-root may pass no ``out=`` (and no ``x``): it learns the block's shape and dtype from the
root. Every rank sends every other one header row -- its call fingerprint (packed signature,
count, crc32 of the shape), then the block's dtype and shape (``encode_meta``) -- and the rows
are compared as they arrive, so the exchange is also the call's argument check. A rank that does
not know the block sends a row of zeros, which claims nothing, and takes the root's row first.
The rows of the peers a rank receives data from come before the data (each is that peer's first
message of the call, so FIFO order puts it there); the others' are taken after the data
(``check="full"``: all of them before).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple

import numpy as np

from ..errors import CommError, pack_call
from ..smallpath import SMALL_SPIN_S
from ..transports.base import Tag
from .buffers import META_WORDS, MISS, decode_meta, encode_meta
from .cache import BoundedCache
from .calls import Call, new_tag

SCATTER_META = "scatter:meta"       # the header exchange's name (errors.COLLECTIVE_CODES)
HEADER_WORDS = 3 + META_WORDS       # a header row: fingerprint, then dtype and shape
NO_CLAIM = np.zeros(HEADER_WORDS, dtype=np.int64)   # ... of a rank that takes the root's word
NO_CLAIM.flags.writeable = False
HEADER_PLANS = 256                  # header plans (and decoded headers) a communicator keeps


@functools.lru_cache(maxsize=None)
def scatter_header_call(root: int) -> int:
    """The packed call in a scatter header's tag: scatter and its root, no dtype (module doc)."""
    return pack_call(SCATTER_META, "none", "none", None, root)


class HeaderPlan(NamedTuple):
    """What a scatter's header exchange derives from its signature (``_scatter_header_plan``):
    the call, its count and shape, this rank's row (read-only) and its fingerprint part's bytes
    (what arriving rows are compared with), the ranks whose rows come before the data (the
    root's first) and those taken at the end, and both without the root (for a rank that took
    the root's row first)."""
    call: Call
    count: int
    shape: Tuple[int, ...]
    mine: np.ndarray
    key: bytes
    first: Tuple[int, ...]
    rest: Tuple[int, ...]
    first_after_root: Tuple[int, ...]
    rest_after_root: Tuple[int, ...]


class ScatterHeader:
    """Scatter's binding, fast path and header exchange (module doc)."""

    def _init_scatter(self) -> None:
        self._scatter_headers = BoundedCache(HEADER_PLANS)   # (root, algo, dtype, block) -> plan
        self._scatter_metas = BoundedCache(HEADER_PLANS)     # a root's meta words -> decoded

    def _scatter_fast(self, x, root, algorithm, out):
        """Scatter's layout on the fast path: a synchronous call with nothing queued whose
        arguments need no conversion -- the root's x C-contiguous blocks, a header plan made
        before (so dtype and shape were validated then), out= absent or of the block's shape
        and dtype -- runs ``_scatter_run`` at once. ``MISS`` otherwise. The header exchange is
        the call's check either way."""
        if type(root) is not int or not 0 <= root < self.size or self._pending or self._started \
                or self._closed or self._broken is not None:
            return MISS
        inflat = None
        if self.rank == root:
            if type(x) is not np.ndarray or not x.flags.c_contiguous or x.ndim == 0 \
                    or x.shape[0] != self.size:
                return MISS
            dtype, block = x.dtype, x.shape[1:]
            inflat = x.reshape(-1)
        elif type(out) is np.ndarray:
            dtype, block = out.dtype, out.shape
        elif out is None:
            dtype = block = None          # the root's header row says
        else:
            return MISS
        if dtype is not None and (root, algorithm, dtype, block) not in self._scatter_headers:
            return MISS
        res = None
        if out is not None:
            if not (type(out) is np.ndarray and out.shape == block and out.dtype == dtype
                    and out.flags.c_contiguous):
                return MISS
            res = out
        elif dtype is not None:
            res = np.empty(block, dtype)
        self._enter("scatter")
        try:
            return self._scatter_run(root, algorithm, dtype, block, inflat, res, out)
        finally:
            self._exit()

    def _bind_scatter(self, x, root, algorithm, out):
        """The general path's validation of a scatter; returns its ``run()``."""
        root = self._check_root(root, "scatter")
        inflat = res = None
        if self.rank == root:
            arr, inflat = self._flat_in(x)
            block, dtype = self._blocked(arr, "scatter"), arr.dtype
        elif out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("scatter: out= must be a numpy array")
            block, dtype = out.shape, out.dtype
        else:
            block = dtype = None          # the root's header row says
        if block is not None:
            if len(block) > META_WORDS - 3:       # what encode_meta refuses, before any message
                encode_meta(dtype, block)
            res = self._make_out(out, block, dtype, "scatter")[0]
        return lambda: self._scatter_run(root, algorithm, dtype, block, inflat, res, out)

    def _scatter_run(self, root: int, algorithm, dtype, block, inflat, res, out):
        """A scatter whose arguments are checked: the header exchange, then the data. ``res``
        is the result (None: a non-root without out=, which learns the block from the root)."""
        try:
            c, dt, count, shape, finish = self._scatter_header(root, algorithm, dtype, block)
        except CommError as e:
            self._fail(e)
        if res is None:
            res = self._make_out(out, shape[1:], dt, "scatter")[0]
        outflat = res if res.ndim == 1 else res.reshape(-1)
        src = (self._separate(inflat, outflat, out) if self.rank == root
               else np.empty(0, dtype=outflat.dtype))
        # the header exchange is this call's argument check (its fingerprints)
        self._run_call(c, src, outflat, count, shape, fingerprint=False)
        try:
            finish()
        except CommError as e:
            self._fail(e)
        return res

    def _scatter_header(self, root: int, algorithm: Optional[str], dtype, block):
        """The header exchange (module doc). The tag names scatter and its root but no dtype,
        which the rank may not know yet; the rows compare the rest. Returns the call
        (``Call``), its dtype, count and shape, and ``finish()``, which takes and compares the
        rows due after the data and waits for this rank's sends."""
        size, me, group, t = self.size, self.rank, self.world_ranks, self.transport
        seq = self._next_seq()
        tag = new_tag(Tag, (self._ctx, seq, 0, scatter_header_call(root), HEADER_WORDS))
        deadline, what = self._deadline(), f"scatter #{seq} (its header)"
        eager = self.caps.eager if self.small_path else None

        def take(ranks, rows):
            reqs = [t.irecv(group[r], rows[r], tag) for r in ranks if not
                    (eager is not None and eager.recv_now(group[r], rows[r], tag, None,
                                                          SMALL_SPIN_S))]
            if reqs:
                t.wait_all(reqs, deadline, what)

        def send(row):
            return [t.isend(group[r], row, tag) for r in range(size) if r != me
                    and not (eager is not None and eager.send_now(group[r], row, tag))]
        rows = np.empty((size, HEADER_WORDS), dtype=np.int64)
        took_root = dtype is None
        if took_root:
            sends = send(NO_CLAIM)        # at once: the peers need not wait for the root's row
            take((root,), rows)
            dtype, block = self._decoded_meta(rows[root, 3:])
        h = self._scatter_header_plan(root, algorithm, dtype, block)
        c, count, shape, mine, key, first, rest = h[:7]
        if took_root:
            root_row = rows[root].copy()
            rows[:] = mine                # every row holds ours until theirs arrives
            rows[root] = root_row
            first, rest = h.first_after_root, h.rest_after_root
        else:
            rows[:] = mine
            sends = send(mine)

        def check(ranks):
            if any(rows[r, :3].tobytes() != key and rows[r, 0] != 0 for r in ranks):
                claims = np.ascontiguousarray(rows[:, :3])
                claims[claims[:, 0] == 0] = mine[:3]
                self._compare_fingerprints(claims, mine[:3].copy(), c.call, count, seq)
        take(first, rows)
        check(first + (root,) if took_root else first)

        def finish():
            take(rest, rows)
            if sends:
                t.wait_all(sends, deadline, what)
            check(rest)
        return c, dtype, count, shape, finish

    def _decoded_meta(self, words: np.ndarray):
        """The root's dtype and block shape from its header row's meta words (memoised)."""
        meta = words.tobytes()
        decoded = self._scatter_metas.get(meta)
        if decoded is None:
            decoded = self._scatter_metas.put(meta, decode_meta(words))
        return decoded

    def _scatter_header_plan(self, root: int, algorithm: Optional[str], dtype,
                             block) -> HeaderPlan:
        """The ``HeaderPlan`` of a signature, made on its first call."""
        h = self._scatter_headers.get((root, algorithm, dtype, block))
        if h is not None:
            return h
        shape = (self.size,) + tuple(block)
        count = math.prod(block)
        c = self._calls.get(("scatter", "none", algorithm, dtype, count, root)) \
            or self._prepare("scatter", "none", algorithm, dtype, count, root)
        mine = np.empty(HEADER_WORDS, dtype=np.int64)
        mine[:3] = self._fingerprint(c.call, count, shape)
        mine[3:] = encode_meta(dtype, block)
        mine.flags.writeable = False
        heard, me = c.plan.recv_peers, self.rank
        first = tuple(r for r in sorted(range(self.size), key=lambda r: r != root)
                      if r != me and (self.check == "full" or self.world_ranks[r] in heard))
        rest = tuple(r for r in range(self.size) if r != me and r not in first)
        h = HeaderPlan(c, count, shape, mine, mine[:3].tobytes(), first, rest,
                       tuple(r for r in first if r != root), tuple(r for r in rest if r != root))
        return self._scatter_headers.put((root, algorithm, dtype, block), h)
