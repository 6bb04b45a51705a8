"""Fuzz the parameter server's wire format (minicomm/ps/wire.py): the parser alone, and a LIVE
server (inproc ranks: rank 0 serves, rank 1 is a worker) fed random, truncated, oversized,
wrong-version, semantically wrong (unknown key, piece, dtype, count 2**62) and replayed frames.

The parser raises ProtocolError or returns a Frame, nothing else. The server answers every bad
frame with an error frame (a named refusal for that request), allocates nothing a frame
announces, keeps serving: afterwards the worker's own pull returns the right values and close
ends the server cleanly.
"""
import os
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minicomm as mc
from minicomm.ps import wire
from minicomm.ps.sharding import DTYPES, KeySpec

EXAMPLES = int(os.environ.get("MINICOMM_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
names = st.text(min_size=1, max_size=12)
pieces = st.builds(wire.PieceRef, names, st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
                   st.sampled_from(DTYPES))
keys = st.builds(KeySpec, names, st.sampled_from(DTYPES), st.tuples(*[st.integers(0, 2**20)] * 2))


def valid_frames():
    return st.one_of(
        st.builds(lambda seq, c, p: wire.encode(wire.PULL, seq, c, pieces=p),
                  st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.lists(pieces, max_size=3,
                                                                              unique_by=lambda r: (r.name, r.piece))),
        st.builds(lambda seq, p: wire.encode(wire.PUSH, seq, pieces=p),
                  st.integers(0, 2**32 - 1), st.lists(pieces, max_size=3,
                                                      unique_by=lambda r: (r.name, r.piece))),
        st.builds(lambda seq, k: wire.encode(wire.INIT, seq, keys=k),
                  st.integers(0, 2**32 - 1), st.lists(keys, min_size=1, max_size=3,
                                                      unique_by=lambda k: k.name)),
        st.builds(lambda seq: wire.encode(wire.CLOSE, seq), st.integers(0, 2**32 - 1)))


@st.composite
def mutated(draw):
    raw = bytearray(draw(valid_frames()).tobytes())
    how = draw(st.sampled_from(["truncate", "flip", "extend", "version", "table", "entries",
                                "opcode", "raw"]))
    if how == "truncate":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] ^= draw(st.integers(1, 255))
    elif how == "extend":
        raw += draw(st.binary(min_size=1, max_size=64))
    elif how == "version":
        raw[4] = draw(st.integers(0, 255))
    elif how == "table":
        struct.pack_into("<I", raw, 24, draw(st.sampled_from([0, 1, 2**31, 2**32 - 1])))
    elif how == "entries":
        struct.pack_into("<I", raw, 20, draw(st.sampled_from([0, 2, 2**20, 2**32 - 1])))
    elif how == "opcode":
        raw[5] = draw(st.integers(0, 255))
    else:
        raw = bytearray(draw(st.binary(max_size=200)))
    return np.frombuffer(bytes(raw), dtype=np.uint8)


@FUZZ
@given(frame=st.one_of(mutated(), valid_frames()))
def test_decode_returns_a_frame_or_raises_protocol_error(frame):
    for expect_response in (False, True):
        try:
            got = wire.decode(frame, expect_response=expect_response)
        except wire.ProtocolError:
            continue
        assert isinstance(got, wire.Frame)


@FUZZ
@given(obj=st.one_of(st.none(), st.integers(), st.binary(),
                     st.builds(np.zeros, st.integers(0, 40), st.sampled_from(DTYPES))))
def test_decode_refuses_what_is_not_a_uint8_frame(obj):
    try:
        wire.decode(obj)
    except wire.ProtocolError:
        pass


N = 1000                 # the live server's key: "w", float64[N], one piece
MY_SEQ = 1 << 22         # far from the worker's own request numbers


@st.composite
def semantic(draw):
    """Well-formed frames the server must refuse by meaning."""
    seq = MY_SEQ + draw(st.integers(0, 1 << 20))
    bad = draw(st.sampled_from([
        wire.PieceRef("nope", 0, N, np.dtype(np.float64)),
        wire.PieceRef("w", draw(st.integers(1, 2**32 - 1)), N, np.dtype(np.float64)),
        wire.PieceRef("w", 0, draw(st.sampled_from([0, N - 1, N + 1, 2**62, 2**64 - 1])),
                      np.dtype(np.float64)),
        wire.PieceRef("w", 0, N, np.dtype(draw(st.sampled_from([d for d in DTYPES
                                                                 if d != np.float64])))),
    ]))
    op = draw(st.sampled_from([wire.PULL, wire.PUSH, wire.PUSHPULL]))
    return wire.encode(op, seq, draw(st.integers(0, 5)), pieces=[bad])


def _live(comm, examples, replay):
    from minicomm import ps
    kv = ps.start(comm, num_servers=1, staleness=None, optimizer=ps.SGD(lr=1.0))
    if kv is None:
        return None                   # the server ran until the worker closed
    w0 = np.arange(N, dtype=np.float64)
    kv.init({"w": w0})
    sent = refused = 0
    link = kv._comm                   # the parameter server's own communicator

    def one(frame):
        nonlocal sent, refused
        link.send(frame, 0, tag=wire.REQUEST_TAG)
        answer = link.recv(0, tag=mc.ANY_TAG, timeout=20)
        got = wire.decode(answer, expect_response=True)
        assert got.opcode == wire.ERROR and got.message, got
        sent += 1
        refused += 1

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frame=st.one_of(mutated(), semantic()))
    def fuzz(frame):
        try:
            wire.decode(frame)
        except wire.ProtocolError:
            return one(frame)            # malformed: refused at once
        f = wire.decode(frame)
        if f.opcode in (wire.PULL, wire.PUSH, wire.PUSHPULL) and f.pieces and all(
                (p.name, p.piece, p.count, p.dtype) == ("w", 0, N, np.float64) for p in f.pieces):
            return                       # a real request: not what this test sends
        if f.opcode in (wire.INIT, wire.CLOSE) or not f.pieces:
            return                       # would change this worker's session
        one(frame)
    fuzz()
    if replay:                           # the worker's own init again: refused by state
        one(wire.encode(wire.INIT, MY_SEQ - 1, keys=[KeySpec("w", np.dtype(np.float64), (N,))]))
    got = kv.pull(["w"])["w"]            # the server still serves, values untouched
    kv.close()
    return sent, refused, bool(np.array_equal(got, w0))


def test_live_server_refuses_every_bad_frame_and_keeps_serving():
    out = mc.spawn(_live, 2, args=(EXAMPLES, True), transport="inproc", timeout=60)
    sent, refused, intact = out[1]
    assert out[0] is None and intact and sent == refused and sent >= 1, out
