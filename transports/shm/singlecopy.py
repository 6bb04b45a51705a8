"""Single-copy sends of the shm transport (cma.py's process_vm_readv).

A message of at least the pair's single-copy size (what the receiver's setup probe chose,
``cma.choose_min``; ``MINICOMM_CMA_MIN`` fixes it; a point-to-point send's also from
``cma.P2P_MIN``, so a send below that returns at once while its receiver computes) of a call that
does not reduce (broadcast, gather, scatter, allgather, alltoall, p2p), to a peer that can read
this process's memory, travels as one 128-byte *descriptor record* (the header with chunk length
``-2``, then the buffer's address) instead of chunks: the receiver, once its receive is posted,
reads the bytes straight from the sender's buffer into the destination, then advances ``tail``
past the record. The sender's request completes when it sees ``tail`` pass the record (the
receiver's usual doorbell wakes it if it sleeps): until then its buffer is in use, so such a send
is a rendezvous send, which every schedule is verified against. Reducing calls keep the ring:
the sender copies the next chunk while the receiver reduces this one. Thresholds and the choice:
docs/decisions/shm-single-copy-threshold.md.

Each rank probes every peer at setup (reads a random token from the peer's memory, then times
reads of it against a local copy) and writes the verdict and the chosen size into the control
page of the ring that peer sends into; a pair whose probe fails (EPERM under ptrace
restrictions or seccomp, ESRCH across pid namespaces) or a side with ``MINICOMM_CMA=0`` keeps
the ring path.
"""
from __future__ import annotations

from typing import List

import numpy as np

from minicomm.errors import call_reduces
from .. import bytecopy, cma
from ..progress import deliver
from .layout import _PIECE, _TAIL, PAGE
from .peer import _Peer


class SingleCopyMixin:
    """ShmTransport's single-copy decisions and reads (base.SingleCopy). Its state:
    ``_cma_min`` / ``_cma_min_p2p`` (this side's thresholds), ``_cma_off`` (why this side never
    sends single-copy, or None), ``_cma_reduce``, ``_scratch``, and each peer's ``cma*``."""

    def _single_copy(self, call: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` (at least ``_cma_min``) of packed call ``call`` goes as
        a single-copy descriptor: not a reducing call's (module doc), and a point-to-point
        send's only from ``_cma_min_p2p``."""
        if not call & 31:             # the collective bits of a p2p call are 0
            return nbytes >= self._cma_min_p2p
        return self._cma_reduce or not call_reduces(call)

    def _read_done(self, p: _Peer) -> bool:
        """Complete the single-copy sends whose descriptor the receiver has consumed."""
        tail = p.tx_q[_TAIL]
        w = p.cma_wait
        moved = False
        while w and w[0][0] <= tail:
            w.popleft()[1].done = True
            moved = True
        return moved

    def _read_from(self, p: _Peer, target, addr: int, total: int) -> None:
        """Read a single-copy message of ``total`` bytes at ``addr`` in ``p``'s memory: straight
        into ``target``'s bytes, or piecewise through a scratch that stays in cache -- for a
        reducing receive, which the collectives' reducing calls never meet (they keep the ring)
        but the transport contract allows on any message, reducing from it; and where the
        destination lies 1-31 bytes past the source modulo a page, where the kernel's copy (``rep
        movsb``) is slow (docs/decisions/glibc-copy-workaround.md), copying from a scratch
        placed at the source's page offset (the kernel's copy then aligned, ours through
        bytecopy)."""
        dst = target.u8[:total]
        if target.reduce is None and not bytecopy.kernel_copy_slow(bytecopy.address(dst), addr):
            cma.read(p.pid, addr, dst)
            return
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = np.empty(_PIECE + PAGE, dtype=np.uint8)
        k = (addr - bytecopy.address(scratch)) & (PAGE - 1)    # the source's page offset
        for lo in range(0, total, _PIECE):    # _PIECE is whole pages: every piece at offset k
            piece = scratch[k:k + min(_PIECE, total - lo)]
            cma.read(p.pid, addr + lo, piece)
            if target.reduce is None:         # the skewed pair again: bytecopy's ufunc
                bytecopy.copy(target.u8[lo:lo + piece.shape[0]], piece)
            else:
                deliver(target, lo, piece)

    def single_copy_peers(self) -> List[int]:
        """The peers our large sends reach single-copy (they read this process's memory)."""
        return [p.rank for p in self._peers.values() if p.cma]

    def single_copy_from(self) -> int:
        """The size from which our collective sends go single-copy to every peer that reads us
        (the largest of the pairs' thresholds; 0: none does)."""
        return max((p.cma_min for p in self._peers.values() if p.cma), default=0)

    def describe_copies(self) -> str:
        """How large messages move to and from each peer, and why (logged at setup under
        MINICOMM_DEBUG=info)."""
        if not self.peer_ranks:
            return f"rank {self.rank}: no peers"
        single = [p.rank for p in self._peers.values() if p.cma]
        ring = {p.rank: (self._cma_off or "the peer cannot read this process's memory")
                for p in self._peers.values() if not p.cma}
        reads = {p.rank: p.cma_read for p in self._peers.values() if p.cma_read is not None}
        text = f"rank {self.rank}: shm large messages"
        if single:
            froms = {p.rank: p.cma_min for p in self._peers.values() if p.cma}
            why = ("MINICOMM_CMA_MIN" if cma.min_override() else
                   "each peer's probe: its read of 256 KiB of ours against its own copy")
            text += (f"; collective sends single-copy (process_vm_readv) to {single} from "
                     + ", ".join(f"{b} B to {r}" for r, b in froms.items())
                     + f" ({why}; point-to-point: also >= {self._cma_min_p2p} B)")
        if ring:
            text += "; ring copies to " + ", ".join(f"{r} ({why})" for r, why in ring.items())
        if reads:
            text += "; cannot read " + ", ".join(f"{r} ({why})" for r, why in reads.items())
        return text
