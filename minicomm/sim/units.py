"""Sizes, times and link names as the simulator reads and prints them.

One size convention for every size option (``--sizes``, ``--model-bytes``): a plain byte count
(``4096``, ``3.5e9``), or a number with a unit —

  K, M, G, T and KiB, MiB, GiB, TiB   powers of 1024 (nccl-tests' and ``minicomm bench``'s K/M/G)
  kB, MB, GB, TB                      powers of 1000 (an article's "350 GB" is ``350GB``)
  B                                   bytes

Sizes are printed with their unit: the one that makes the number whole (1 GiB, 350 GB), else
KiB/MiB/GiB/TiB for multiples of 1 KiB and kB/MB/GB/TB for the rest, to four significant digits.
"""
from __future__ import annotations

import re
from typing import List, Optional

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMGT]?)(i?)([bB]?)\s*$")
_POWER = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str) -> int:
    """'4096' -> 4096, '4K' = '4KiB' -> 4096, '4kB' = '4KB' -> 4000, '1G' -> 2**30,
    '350GB' -> 350e9. Raises ValueError for anything else, or a fraction of a byte."""
    m = _SIZE.match(str(text))
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"size {text!r}: expected a number with an optional unit: K, M, G, T "
                         f"or KiB, MiB, GiB, TiB (powers of 1024), kB, MB, GB, TB (powers of "
                         f"1000), or B")
    num, prefix, iec, b = float(m.group(1)), m.group(2).upper(), m.group(3), m.group(4)
    decimal = bool(prefix) and bool(b) and not iec      # "GB" is SI; "G" and "GiB" are binary
    value = num * ((1000 if decimal else 1024) ** _POWER[prefix])
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def parse_sizes(text: str) -> List[int]:
    """'1K:1G' (x2 steps, both ends included) or '1K,64M,1G'."""
    text = str(text).strip()
    if ":" in text:
        lo_s, _, hi_s = text.partition(":")
        lo, hi = parse_size(lo_s), parse_size(hi_s)
        if lo <= 0 or hi < lo:
            raise ValueError(f"size range {text!r}: need 0 < start <= end")
        out = []
        s = lo
        while s <= hi:
            out.append(s)
            s *= 2
        return out
    out = [parse_size(x) for x in text.split(",") if x.strip()]
    if not out:
        raise ValueError("no sizes given")
    return out


_BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_DECIMAL = (("TB", 10 ** 12), ("GB", 10 ** 9), ("MB", 10 ** 6), ("kB", 10 ** 3))


def _in(units, n: float):
    for unit, div in units:
        if n >= div:
            return n / div, unit
    return n, "B"


def size_units(n: float) -> str:
    """'binary' or 'decimal': the units ``format_size`` prints ``n`` in by itself — the ones
    that make it whole (1 GiB, 350 GB), else binary for multiples of 1 KiB."""
    vb, vd = _in(_BINARY, n)[0], _in(_DECIMAL, n)[0]
    if vd == int(vd) and (vb != int(vb) or vd <= vb):
        return "decimal"
    if vb == int(vb) or (n == int(n) and int(n) % 1024 == 0):
        return "binary"
    return "decimal"


def format_size(n: float, units: Optional[str] = None) -> str:
    """2**30 -> '1 GiB', 350e9 -> '350 GB', 1.75 * 2**30 -> '1.75 GiB', 1.5e9 + 7 -> '1.5 GB',
    512 -> '512 B'. ``units`` ('binary' or 'decimal', default ``size_units(n)``): sizes derived
    from one input are best printed in that input's units (``size_units(model)``)."""
    value, unit = _in(_BINARY if (units or size_units(n)) == "binary" else _DECIMAL, n)
    return f"{int(value)} {unit}" if value == int(value) else f"{value:.4g} {unit}"


def format_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


_LINK_WORDS = (
    (re.compile(r"^NIC (\d+)\.(\d+) out$"), r"server \1's NIC \2, outbound"),
    (re.compile(r"^NIC (\d+)\.(\d+) in$"), r"server \1's NIC \2, inbound"),
    (re.compile(r"^nvswitch out of acc (\d+)$"), r"NVLink out of accelerator \1"),
    (re.compile(r"^nvswitch into acc (\d+)$"), r"NVLink into accelerator \1"),
    (re.compile(r"^pcie out of acc (\d+)$"), r"PCIe out of accelerator \1"),
    (re.compile(r"^pcie into acc (\d+)$"), r"PCIe into accelerator \1"),
    (re.compile(r"^mesh link (\d+):(\d+)->(\d+)$"),
     r"server \1's mesh link from accelerator \2 to \3"),
    (re.compile(r"^leaf (\d+) (up|down)link$"), r"leaf switch \1's \2link"),
    (re.compile(r"^pod (\d+) (up|down)link$"), r"pod \1's \2link"),
    (re.compile(r"^local copy on acc (\d+)$"), r"local copy on accelerator \1"),
    (re.compile(r"^NVLS port of acc (\d+), (up|down)$"),
     r"accelerator \1's NVLink SHARP port, \2"),
    (re.compile(r"^SHARP port of NIC (\d+)\.(\d+), (up|down)$"),
     r"the SHARP switch port of server \1's NIC \2, \3"),
)


def describe_link(name: str) -> str:
    """A fabric link id (``Fabric.name``: 'NIC 0.7 out') in words ('server 0's NIC 7,
    outbound'); an id it does not know is returned as it is."""
    for pattern, words in _LINK_WORDS:
        if pattern.match(name):
            return pattern.sub(words, name)
    return name
