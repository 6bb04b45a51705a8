"""The parameter server's wire format: binary frames, validated field by field, never pickled.

A request is one frame (a uint8 message on tag ``REQUEST_TAG``) followed, for the pieces it
pushes, by one raw numpy message per piece (the gradient's own bytes, no framing, on
``tag(PUSH_DATA, seq)``). The server answers each request with a response frame on
``tag(RESPONSE, seq)``, followed for a pull by one raw message per piece on
``tag(RESPONSE_DATA, seq)``. ``seq`` numbers a worker's requests, so a reply can never be taken for
another request's, and a stray or forged data message cannot land in a later request's buffer.

Frame = 28-byte header, then a table of ``table_nbytes`` bytes:

    magic  b"MCPS" | version u8 | opcode u8 | flags u16 | seq u32 | clock i64
    | n_entries u32 | table_nbytes u32                                   (little-endian)

    piece entry (push / pull / pushpull, and the OK answer to a pull):
        name_len u16 | dtype u8 | 0 u8 | piece u32 | count u64 | name (utf-8)
    key entry (init): name_len u16 | dtype u8 | ndim u8 | ndim x dim u64 | name (utf-8)
    error frame: no entries; the table is a utf-8 message, ``flags`` the error code and, for
        ``PEER_FAILED``, ``clock`` the failed rank.

``decode`` checks every field before anything uses it (magic, version, opcode, sizes, each entry
inside the table, utf-8 names, no duplicates, the table consumed exactly) and raises
``ProtocolError`` naming what is wrong. What a frame *means* (does this server hold that piece,
is the count right, is the clock in order) is checked by the server against its plan.

Limits: a frame is at most ``MAX_FRAME`` bytes (the 28-byte header and a 16 MiB table), so the
key limits are chosen to fit it: ``MAX_KEYS`` keys of ``MAX_NAME_BYTES``-byte names and
``MAX_NDIM`` dimensions make an init frame of 28 + 12288 x (4 + 32 x 8 + 1024) = 15,777,820
bytes, and a request for one piece of each of them 28 + 12288 x (16 + 1024) bytes.
``check_fits`` refuses, before anything is sent, a key table or plan beyond that: more keys, or
one server holding more pieces (an array above ``chunk_bytes`` is several) than one frame names.

Cost: 28 + 16 + len(name) bytes per piece per request; decoding is O(entries).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import numpy as np

from ..errors import CommError
from .sharding import DTYPES, MAX_KEYS, MAX_NAME_BYTES, MAX_NDIM, KeySpec, Plan

MAGIC = b"MCPS"
VERSION = 1
HEADER = struct.Struct("<4sBBHIqII")
PIECE = struct.Struct("<HBBIQ")
KEY = struct.Struct("<HBB")
DIM = struct.Struct("<Q")
MAX_ENTRIES = 1 << 20
MAX_FRAME = HEADER.size + (16 << 20)
MAX_DIM = 1 << 48

# opcodes
INIT, PUSH, PULL, PUSHPULL, CLOSE = 1, 2, 3, 4, 5
OK, ERROR = 16, 17
REQUESTS = (INIT, PUSH, PULL, PUSHPULL, CLOSE)
OPCODE_NAMES = {INIT: "init", PUSH: "push", PULL: "pull", PUSHPULL: "pushpull", CLOSE: "close",
                OK: "ok", ERROR: "error"}
# flags
HAS_VALUES = 1        # init: this worker's frame is followed by the initial values
RESUMED = 1           # ok to init: the server restored a checkpoint (clock = the worker's clock)
# error codes (the flags of an ERROR frame)
PROTOCOL, PEER_FAILED, MISMATCH, STATE = 1, 2, 3, 4
ERROR_NAMES = {PROTOCOL: "protocol", PEER_FAILED: "peer failed", MISMATCH: "mismatch",
               STATE: "state"}

# tags: kind in bits 24..30, the request's seq in bits 0..23 (user tags are < 2**31)
REQUEST, PUSH_DATA, RESPONSE, RESPONSE_DATA, SERVER, LIVENESS = 1, 2, 3, 4, 5, 6
SEQ_MASK = (1 << 24) - 1
REQUEST_TAG = REQUEST << 24


def tag(kind: int, seq: int) -> int:
    return kind << 24 | (seq & SEQ_MASK)


class ProtocolError(CommError):
    """A parameter-server frame was malformed or meaningless (bad magic, version, opcode, size,
    entry, key, piece, count or clock), or the server refused a request for that reason."""


@dataclass(frozen=True)
class PieceRef:
    """A reference to piece ``piece`` (``count`` elements of ``dtype``) of key ``name``."""
    name: str
    piece: int
    count: int
    dtype: np.dtype


@dataclass
class Frame:
    opcode: int
    seq: int
    clock: int = 0
    flags: int = 0
    pieces: List[PieceRef] = field(default_factory=list)
    keys: List[KeySpec] = field(default_factory=list)
    message: str = ""

    @property
    def name(self) -> str:
        return OPCODE_NAMES.get(self.opcode, f"opcode {self.opcode}")


def _dtype_code(dt: np.dtype) -> int:
    try:
        return DTYPES.index(np.dtype(dt))
    except ValueError:
        raise TypeError(f"dtype {dt} cannot travel in a parameter-server frame") from None


def _name_bytes(name: str) -> bytes:
    raw = name.encode("utf-8")
    if not 1 <= len(raw) <= MAX_NAME_BYTES:
        raise ValueError(f"key {name!r}: names are 1..{MAX_NAME_BYTES} utf-8 bytes")
    return raw


def encode(opcode: int, seq: int, clock: int = 0, flags: int = 0,
           pieces: Sequence[PieceRef] = (), keys: Sequence[KeySpec] = (),
           message: str = "") -> np.ndarray:
    """One frame as a uint8 array, ready to send."""
    parts: List[bytes] = []
    for p in pieces:
        raw = _name_bytes(p.name)
        parts.append(PIECE.pack(len(raw), _dtype_code(p.dtype), 0, p.piece, p.count))
        parts.append(raw)
    for k in keys:
        raw = _name_bytes(k.name)
        parts.append(KEY.pack(len(raw), _dtype_code(k.dtype), len(k.shape)))
        parts.extend(DIM.pack(d) for d in k.shape)
        parts.append(raw)
    if message:
        parts.append(message.encode("utf-8")[:1 << 16])
    table = b"".join(parts)
    head = HEADER.pack(MAGIC, VERSION, opcode, flags, seq & 0xFFFFFFFF, clock,
                       len(pieces) + len(keys), len(table))
    return np.frombuffer(head + table, dtype=np.uint8)


def check_fits(table: Sequence[KeySpec], plan: Plan) -> None:
    """ValueError, naming the limit, if the init frame of ``table`` or a request for every piece
    one server of ``plan`` holds would not fit one frame (checked before anything is sent)."""
    if len(table) > MAX_KEYS:
        raise ValueError(f"{len(table)} keys: at most {MAX_KEYS} keys (the init frame must fit "
                         f"the {MAX_FRAME}-byte frame limit)")
    names = {s.name: len(_name_bytes(s.name)) for s in table}
    init = HEADER.size + sum(KEY.size + DIM.size * len(s.shape) + names[s.name] for s in table)
    if init > MAX_FRAME:
        raise ValueError(f"the init frame of these keys is {init} bytes, above the "
                         f"{MAX_FRAME}-byte frame limit")
    size = [HEADER.size] * plan.num_servers
    count = [0] * plan.num_servers
    for pieces in plan.pieces.values():
        for p in pieces:
            size[p.server] += PIECE.size + names[p.name]
            count[p.server] += 1
    for s in range(plan.num_servers):
        if size[s] > MAX_FRAME or count[s] > MAX_ENTRIES:
            raise ValueError(f"server {s} holds {count[s]} pieces: a request naming them all is "
                             f"a {size[s]}-byte frame of {count[s]} entries, above the frame "
                             f"limit ({MAX_FRAME} bytes, {MAX_ENTRIES} entries); use fewer or "
                             f"shorter-named keys, a larger chunk_bytes or more servers")


def decode(frame, expect_response: bool = False) -> Frame:
    """Parse and validate a frame; ``ProtocolError`` says what is wrong with it."""
    if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or frame.ndim != 1:
        what = (f"{frame.dtype} array of shape {frame.shape}" if isinstance(frame, np.ndarray)
                else type(frame).__name__)
        raise ProtocolError(f"a frame is a 1-D uint8 message, got a {what}")
    n = frame.size
    if n < HEADER.size:
        raise ProtocolError(f"frame of {n} bytes is shorter than the {HEADER.size}-byte header")
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    buf = frame.tobytes()
    magic, version, opcode, flags, seq, clock, n_entries, table_nbytes = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} (this side speaks {VERSION})")
    allowed = (OK, ERROR) if expect_response else REQUESTS
    if opcode not in allowed:
        raise ProtocolError(f"unknown {'response' if expect_response else 'request'} "
                            f"opcode {opcode}")
    if table_nbytes != n - HEADER.size:
        raise ProtocolError(f"header says {table_nbytes} table bytes, frame carries "
                            f"{n - HEADER.size}")
    if clock < 0 and opcode != ERROR:
        raise ProtocolError(f"negative clock {clock}")
    if n_entries > MAX_ENTRIES:
        raise ProtocolError(f"{n_entries} entries exceed the limit of {MAX_ENTRIES}")
    out = Frame(opcode, seq, clock, flags)
    if opcode == ERROR:
        if n_entries:
            raise ProtocolError("an error frame carries no entries")
        out.message = buf[HEADER.size:].decode("utf-8", errors="replace")
        return out
    if opcode in (CLOSE,) and n_entries:
        raise ProtocolError(f"a {out.name} frame carries no entries")
    pos = HEADER.size
    seen = set()
    for i in range(n_entries):
        if opcode == INIT:
            spec, pos = _decode_key(buf, pos, i)
            if spec.name in seen:
                raise ProtocolError(f"entry {i}: key {spec.name!r} appears twice")
            seen.add(spec.name)
            out.keys.append(spec)
        else:
            ref, pos = _decode_piece(buf, pos, i)
            if (ref.name, ref.piece) in seen:
                raise ProtocolError(f"entry {i}: piece {ref.piece} of {ref.name!r} appears twice")
            seen.add((ref.name, ref.piece))
            out.pieces.append(ref)
    if pos != n:
        raise ProtocolError(f"{n - pos} bytes left over after {n_entries} entries")
    if opcode == INIT and not 1 <= len(out.keys) <= MAX_KEYS:
        raise ProtocolError(f"init carries {len(out.keys)} keys (1..{MAX_KEYS})")
    return out


def _decode_name(buf: bytes, pos: int, name_len: int, i: int) -> Tuple[str, int]:
    if not 1 <= name_len <= MAX_NAME_BYTES:
        raise ProtocolError(f"entry {i}: name length {name_len} (1..{MAX_NAME_BYTES})")
    end = pos + name_len
    if end > len(buf):
        raise ProtocolError(f"entry {i}: name runs past the end of the frame")
    try:
        return buf[pos:end].decode("utf-8"), end
    except UnicodeDecodeError:
        raise ProtocolError(f"entry {i}: key name is not valid utf-8") from None


def _dtype_of(code: int, i: int) -> np.dtype:
    if code >= len(DTYPES):
        raise ProtocolError(f"entry {i}: unknown dtype code {code}")
    return DTYPES[code]


def _decode_piece(buf: bytes, pos: int, i: int) -> Tuple[PieceRef, int]:
    if pos + PIECE.size > len(buf):
        raise ProtocolError(f"entry {i}: piece entry runs past the end of the frame")
    name_len, code, reserved, piece, count = PIECE.unpack_from(buf, pos)
    if reserved:
        raise ProtocolError(f"entry {i}: reserved byte is {reserved}, not 0")
    dt = _dtype_of(code, i)
    if count > MAX_DIM:
        raise ProtocolError(f"entry {i}: count {count} is implausible")
    name, pos = _decode_name(buf, pos + PIECE.size, name_len, i)
    return PieceRef(name, piece, count, dt), pos


def _decode_key(buf: bytes, pos: int, i: int) -> Tuple[KeySpec, int]:
    if pos + KEY.size > len(buf):
        raise ProtocolError(f"entry {i}: key entry runs past the end of the frame")
    name_len, code, ndim = KEY.unpack_from(buf, pos)
    dt = _dtype_of(code, i)
    if ndim > MAX_NDIM:
        raise ProtocolError(f"entry {i}: {ndim} dimensions (at most {MAX_NDIM})")
    pos += KEY.size
    if pos + ndim * DIM.size > len(buf):
        raise ProtocolError(f"entry {i}: shape runs past the end of the frame")
    shape = struct.unpack_from(f"<{ndim}Q", buf, pos)
    pos += ndim * DIM.size
    if any(d > MAX_DIM for d in shape):
        raise ProtocolError(f"entry {i}: implausible shape {shape}")
    name, pos = _decode_name(buf, pos, name_len, i)
    return KeySpec(name, dt, tuple(int(d) for d in shape)), pos


def error_frame(seq: int, code: int, message: str, peer: int = -1) -> np.ndarray:
    return encode(ERROR, seq, clock=peer, flags=code, message=message)
