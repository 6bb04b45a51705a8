"""Sharding plan: which server holds which piece of which key.

Keys are ordered by name (their utf-8 bytes) and laid end to end in one virtual byte range, as
ps-lite lays out its key space. An array larger than ``chunk_bytes`` is cut into
``ceil(nbytes / chunk_bytes)`` pieces (in whole elements) of near-equal counts (BytePS partitioning), so one
big tensor is spread over several servers instead of making one of them hot. Each piece goes to
the server whose share of the byte range holds the piece's midpoint: servers own contiguous key
ranges of about ``total / num_servers`` bytes each.

Everything here is a pure function of (key table, num_servers, chunk_bytes): every worker and
every server computes the same plan independently, and a checkpoint records the plan it was
written under.

Restrictions: floating-point dtypes only (float16/32/64: the optimizers update them in place);
names are non-empty str of at most ``MAX_NAME_BYTES`` utf-8 bytes; zero-size arrays have no
pieces (they never travel). Cost: O(pieces) to build, nothing per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import numpy as np

DTYPES: Tuple[np.dtype, ...] = (np.dtype("<f2"), np.dtype("<f4"), np.dtype("<f8"))
MAX_NAME_BYTES = 1024
MAX_NDIM = 32
# The most keys whose init frame, at MAX_NAME_BYTES names and MAX_NDIM dimensions, fits
# wire.MAX_FRAME (wire.py's docstring works it out; tests/test_ps_defects.py checks it).
MAX_KEYS = 12288


@dataclass(frozen=True)
class KeySpec:
    """One key of the model: its name, dtype and shape."""
    name: str
    dtype: np.dtype
    shape: Tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class Piece:
    """Elements ``[offset, offset + count)`` of the flattened key ``name`` live on ``server``;
    ``index`` numbers the key's pieces from 0."""
    name: str
    index: int
    server: int
    offset: int
    count: int
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def check_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"parameter server keys are str, got {type(name).__name__}")
    raw = name.encode("utf-8")
    if not raw or len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"key {name!r}: names are 1..{MAX_NAME_BYTES} utf-8 bytes")
    return name


def check_dtype(dtype, what: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind != "f":
        raise TypeError(f"{what}: the parameter server holds floating-point arrays "
                        f"(float16/32/64), got {dt}")
    return np.dtype("<" + dt.str[1:])     # the wire and the checkpoints are little-endian


def spec_of(name: str, array) -> KeySpec:
    """The KeySpec of a user's array (validates name and dtype)."""
    check_name(name)
    arr = np.asarray(array)
    dt = check_dtype(arr.dtype, f"key {name!r}")
    if arr.ndim > MAX_NDIM:
        raise ValueError(f"key {name!r}: at most {MAX_NDIM} dimensions")
    return KeySpec(name, dt, tuple(int(s) for s in arr.shape))


def key_table(arrays: Mapping[str, object]) -> Tuple[KeySpec, ...]:
    """The specs of a {name: array} dict, in the plan's canonical order (by utf-8 name)."""
    if not isinstance(arrays, Mapping):
        raise TypeError("expected a dict of {name: array}")
    if not arrays:
        raise ValueError("expected at least one key")
    if len(arrays) > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys")
    specs = [spec_of(n, a) for n, a in arrays.items()]
    return tuple(sorted(specs, key=lambda s: s.name.encode("utf-8")))


class Plan:
    """The pieces of every key and the server of every piece.

    A pure function of (key table, num_servers, chunk_bytes): every worker and server computes
    the same plan independently.

    Args:
        table (Sequence[KeySpec]): The keys (``key_table`` of a ``{name: array}`` dict).
        num_servers (int): How many servers share the keys.
        chunk_bytes (int): Arrays above this size are cut into pieces.

    Raises:
        ValueError: A bad num_servers or chunk_bytes, or duplicate key names.

    Examples:
        >>> plan = Plan(key_table({"a": np.zeros(4), "b": np.zeros(4)}), 2, chunk_bytes=1 << 20)
        >>> [p.name for p in plan.on_server(0)], [p.name for p in plan.on_server(1)]
        (['a'], ['b'])
    """

    def __init__(self, table: Sequence[KeySpec], num_servers: int, chunk_bytes: int):
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ValueError(f"num_servers must be a positive int, got {num_servers!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 8:
            raise ValueError(f"chunk_bytes must be an int >= 8, got {chunk_bytes!r}")
        names = [s.name for s in table]
        if len(set(names)) != len(names):
            raise ValueError("duplicate key names")
        self.table = tuple(sorted(table, key=lambda s: s.name.encode("utf-8")))
        self.num_servers, self.chunk_bytes = num_servers, chunk_bytes
        self.specs: Dict[str, KeySpec] = {s.name: s for s in self.table}
        self.pieces: Dict[str, Tuple[Piece, ...]] = {}
        total = sum(s.nbytes for s in self.table)
        start = 0                                   # byte offset of the key in the layout
        for spec in self.table:
            n = spec.size
            per = max(1, chunk_bytes // spec.dtype.itemsize)       # elements per chunk
            parts = -(-n // per)
            pieces = []
            for i in range(parts):
                lo, hi = n * i // parts, n * (i + 1) // parts
                mid = start + (lo + hi) * spec.dtype.itemsize // 2
                server = min(num_servers - 1, mid * num_servers // total)
                pieces.append(Piece(spec.name, i, server, lo, hi - lo, spec.dtype))
            self.pieces[spec.name] = tuple(pieces)
            start += spec.nbytes

    def __eq__(self, other) -> bool:
        return (isinstance(other, Plan) and self.table == other.table
                and self.num_servers == other.num_servers and self.chunk_bytes == other.chunk_bytes)

    def on_server(self, server: int) -> List[Piece]:
        """The pieces ``server`` holds, in canonical order.

        Args:
            server (int): A server, 0..num_servers-1.

        Returns:
            (list): The ``Piece`` objects on that server.

        Examples:
            >>> plan = Plan(key_table({"w": np.zeros(8)}), 2, chunk_bytes=32)
            >>> [(p.offset, p.count) for p in plan.on_server(1)]
            [(4, 4)]
        """
        return [p for s in self.table for p in self.pieces[s.name] if p.server == server]

    def bytes_per_server(self) -> List[int]:
        """How many bytes of the model each server holds.

        Returns:
            (list): One int per server.

        Examples:
            >>> Plan(key_table({"w": np.zeros(8)}), 2, chunk_bytes=32).bytes_per_server()
            [32, 32]
        """
        out = [0] * self.num_servers
        for ps in self.pieces.values():
            for p in ps:
                out[p.server] += p.nbytes
        return out

    def pieces_of(self, names: Iterable[str], server: int) -> List[Piece]:
        """The pieces of the keys ``names`` that ``server`` holds.

        Args:
            names (Iterable[str]): Key names.
            server (int): A server, 0..num_servers-1.

        Returns:
            (list): The ``Piece`` objects, key by key.

        Examples:
            >>> plan = Plan(key_table({"w": np.zeros(8)}), 2, chunk_bytes=32)
            >>> [p.index for p in plan.pieces_of(["w"], 0)]
            [0]
        """
        return [p for n in names for p in self.pieces[n] if p.server == server]
