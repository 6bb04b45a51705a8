"""bytecopy: memory copies that keep their pace whatever the two buffers' addresses.

The slow case. On AMD Zen 3 / Zen 4, ``rep movsb`` runs several times slower when the destination
lies 1-31 bytes past the source modulo 4096 (4 KiB aliasing; glibc bug 30994). glibc before 2.39
uses it in ``memmove`` on AMD from ~2 KiB up to the L2 size (its ``rep_movsb_stop_threshold``;
on Intel that bound is the non-temporal threshold, and the slowdown was not seen there), and the
kernel's copy inside process_vm_readv uses it at every size. Two equal numpy arrays allocated
one after the other lie 16 bytes apart modulo a page, so a root's copy of its own block and a
single-copy read between ranks that allocated alike meet it on every call.

What this module does. ``copy(dst, src)`` makes such a skewed copy of ``TRAP_MIN`` up to
``TRAP_MAX`` bytes with numpy's identity ufunc over the bytes (a vector loop, bit-exact, no
``rep movsb``) and leaves every other copy to memmove; ``kernel_copy_slow`` tells shm's
single-copy read when to go through a scratch at the source's page offset instead. Both apply only where
``skew_rule`` says the host has the slow case: an AMD CPU (``/proc/cpuinfo``'s vendor), with
``TRAP_MAX`` its L2 size (sysfs); elsewhere the ufunc, slower than an aligned memmove, would
only cost. ``MINICOMM_SKEW_COPY=on|off`` forces the rule either way (``auto``, the default,
asks the host). Ring records are left to memmove: a payload's page offset moves from record to
record, so a per-record check would cost more than the rare slow record. Restrictions: both
arrays C-contiguous and of one byte length. Figures and the choice:
docs/decisions/glibc-copy-workaround.md.
"""
from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import numpy as np

from minicomm.settings import env_choice

SKEW_ENV = "MINICOMM_SKEW_COPY"      # auto (the host decides) | on | off
SKEW_SETTINGS = ("auto", "on", "off")
AMD = "AuthenticAMD"                 # the vendor whose rep movsb has the slow case
CPUINFO = "/proc/cpuinfo"
CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"
L2_UNKNOWN = 1 << 20                 # the L2 size assumed where sysfs does not say
# smaller copies take memmove as they come: the check's two address reads would cost more than
# it saves (docs/decisions/glibc-copy-workaround.md)
TRAP_MIN = 128 << 10
_U8 = np.dtype(np.uint8)
_CHAR = ctypes.c_char


class HostCpu(NamedTuple):
    """What the workaround's rule reads of a host: the CPU vendor and cpu0's L2 size."""
    vendor: str                      # /proc/cpuinfo's vendor_id; "" where it names none
    l2_bytes: int


class SkewRule(NamedTuple):
    """Which copies avoid ``rep movsb`` at a page skew: memmove's of ``TRAP_MIN`` up to
    ``trap_max`` bytes (0: none), and the kernel's (``kernel``)."""
    trap_max: int
    kernel: bool


def _cache_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def describe_cpu(cpuinfo: str = CPUINFO, cache_dir: str = CACHE_DIR) -> HostCpu:
    """This host's ``HostCpu``, read from ``cpuinfo`` and the cache levels under ``cache_dir``
    (the paths are arguments so a test can describe another host)."""
    vendor = ""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                    break
    except OSError:
        pass
    l2 = L2_UNKNOWN
    try:
        for index in sorted(os.listdir(cache_dir)):
            path = os.path.join(cache_dir, index)
            if index.startswith("index") and _read(path, "level") == "2" \
                    and _read(path, "type") in ("Unified", "Data"):
                l2 = _cache_size(_read(path, "size"))
                break
    except (OSError, ValueError):
        pass
    return HostCpu(vendor, l2)


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read().strip()


def skew_rule(cpu: HostCpu, setting: str = "auto") -> SkewRule:
    """The rule for a host described by ``cpu``: on an AMD CPU (or with ``setting`` "on"),
    memmove's skewed copies below the L2 size and the kernel's at every size avoid ``rep
    movsb``; elsewhere (or "off") every copy is left as it comes."""
    if setting not in SKEW_SETTINGS:
        raise ValueError(f"{SKEW_ENV}={setting!r}: choose one of {', '.join(SKEW_SETTINGS)}")
    if setting == "on" or (setting == "auto" and cpu.vendor == AMD):
        return SkewRule(trap_max=cpu.l2_bytes, kernel=True)
    return SkewRule(trap_max=0, kernel=False)


RULE = skew_rule(describe_cpu(), env_choice(SKEW_ENV, "auto", SKEW_SETTINGS))
TRAP_MAX = RULE.trap_max


def use_rule(rule: SkewRule) -> SkewRule:
    """Make ``rule`` this process's rule (the one ``copy`` and ``kernel_copy_slow`` follow);
    returns the rule it replaces."""
    global RULE, TRAP_MAX
    old, RULE, TRAP_MAX = RULE, rule, rule.trap_max
    return old


def page_skewed(dst_addr: int, src_addr: int) -> bool:
    """Whether the destination lies 1-31 bytes past the source modulo a page: where ``rep
    movsb`` is slow on the CPUs ``skew_rule`` names."""
    return 0 < (dst_addr - src_addr) & 4095 < 32


def kernel_copy_slow(dst_addr: int, src_addr: int) -> bool:
    """Whether the kernel's copy (process_vm_readv) from ``src_addr`` into ``dst_addr`` meets
    the slow case on this host: the rule's ``kernel`` and a page-skewed pair."""
    return RULE.kernel and page_skewed(dst_addr, src_addr)


def page_aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh (zeroed) memory starting on a page boundary: no pair of such buffers
    is ever page-skewed."""
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    k = -address(raw) & 4095
    return raw[k:k + nbytes]


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first byte (through ctypes for a writable array: cheaper than
    building ``__array_interface__``'s dict)."""
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
