"""bytecopy: memory copies that keep their pace whatever the two buffers' addresses.

What it does. Every copy this library makes between two buffers (a record into or out of an
shm ring, a rank's own block into its output, the pieces of a registered or single-copy read) is
a ``memmove`` when numpy makes it, or the kernel's copy inside process_vm_readv. Both use ``rep
movsb`` on CPUs that advertise ERMS/FSRM -- glibc before 2.39 for sizes from ~2 KiB up to its
"stop" threshold (the L2 size on AMD), the kernel for every size -- and on AMD Zen 3 / Zen 4 that
instruction runs at a tenth to a fifth of its pace when the destination lies 1-31 bytes past the
source modulo 4096 (4 KiB aliasing; glibc bug 30994). Measured on an EPYC (Zen 3, 512 KiB L2,
glibc 2.36) VM this project runs on: memmove 1.4-2.0 GB/s at 8-256 KiB against 6-25 GB/s at
any other offset; process_vm_readv of 512 KiB 1.4 against 6.1-6.9 GB/s. It is not rare: two
equal numpy arrays allocated one after the other from the heap lie ``nbytes + 16`` apart, 16
modulo 4096, so an out-of-place call's copy of its own block (a root's broadcast copy: 590 us
where 33 us is the aligned figure) and a single-copy read between two ranks that allocated
alike hit it every time. ``GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=...`` lifts the
user-space case, but only for a process started with it.

``copy(dst, src)`` makes the copies in that case -- ``TRAP_MIN`` bytes up to the L2 size (read
from sysfs; 1 MiB when it cannot be) -- with numpy's identity ufunc over the bytes
(``np.positive`` on uint8: a vector load/store loop, bit-exact, 12-20 GB/s at any offset) and
leaves every other copy to memmove. The executor's local copies, registered-memory reads and
the shm windows' put/get go through it, and shm.py routes a skewed single-copy read through a scratch placed at the source's
page offset. Ring records are left to memmove: a payload's page offset moves from record to
record (1 in 64 positions is skewed against a numpy buffer), so a per-record check would cost
more than the rare slow record. Restrictions: both arrays C-contiguous and of one byte length.
Cost: two address reads through ctypes per copy of at least ``TRAP_MIN`` bytes, 1.5-4 us on this
VM (measured in-process: 128 KiB and larger copies, where that is under a third of an aligned
memmove and a tenth of a skewed one); the ufunc is 20-45% slower than an aligned memmove, which
is why it is used only where the offset calls for it, on every CPU (a CPU-model table would go
stale). In-process A/B, heap-allocated buffers, n=2, 256 KiB: allgather 164-198 -> 100-123 us.
"""
from __future__ import annotations

import ctypes

import numpy as np

# glibc's rep_movsb_threshold is 2 KiB (2112 bytes with AVX2), but the check's two address reads
# (1.5-4 us here) cost more than an aligned copy below ~64 KiB: smaller copies take memmove as
# they come (in-process A/B at 64 KiB with a 16 KiB threshold: allgather 0.92x).
TRAP_MIN = 128 << 10
_U8 = np.dtype(np.uint8)
_CHAR = ctypes.c_char


def _l2_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        return 1 << 20


TRAP_MAX = _l2_bytes()               # glibc 2.36 on AMD: rep movsb below the L2 size only


def page_skewed(dst_addr: int, src_addr: int) -> bool:
    """Whether the destination lies 1-31 bytes past the source modulo a page: where ``rep
    movsb`` is slow, in the C library's memmove (sizes ``TRAP_MIN`` to ``TRAP_MAX``) and in the
    kernel's copies (every size: process_vm_readv's, shm.py)."""
    return 0 < (dst_addr - src_addr) & 4095 < 32


def page_aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh (zeroed) memory starting on a page boundary: no pair of such buffers
    is ever page-skewed."""
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    k = -address(raw) & 4095
    return raw[k:k + nbytes]


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first byte (through ctypes for a writable array: a third of the
    time ``__array_interface__`` takes to build its dict)."""
    if a.flags.writeable:
        return ctypes.addressof(_CHAR.from_buffer(a))
    return a.__array_interface__["data"][0]


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for two C-contiguous arrays of the same byte length (their dtypes may
    differ: the bytes are copied), avoiding the slow case of memmove (module doc)."""
    n = dst.nbytes
    if TRAP_MIN <= n < TRAP_MAX and page_skewed(ctypes.addressof(_CHAR.from_buffer(dst)),
                                                address(src)):
        skewed_copy(dst, src)
    elif dst.dtype == src.dtype and dst.shape == src.shape:
        dst[...] = src
    else:
        dst.reshape(-1).view(_U8)[...] = src.reshape(-1).view(_U8)


def skewed_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """The copy of a skewed pair: the identity ufunc over the bytes, no memmove (module doc)."""
    np.positive(src if src.dtype is _U8 else src.reshape(-1).view(_U8),
                out=dst if dst.dtype is _U8 else dst.reshape(-1).view(_U8))
