"""Fuzzers for the byte parsers of connection setup: the auth handshake, the rendezvous store
protocol and the tcp frame header, each against a LIVE server / rank.

Every case must end in a named outcome for that connection (the store closes it, logging a named
error; a rank's receive raises a ``CommError`` subclass: ``PeerFailure`` from an authenticated
sender that broke the framing) and never in an uncaught exception in a background thread, a
hang (every wait here has a deadline) or unbounded memory (the store reads values as they
arrive; a tcp frame announcing more than ``MAX_PAYLOAD`` is refused).

CI size: ``MINICOMM_FUZZ_EXAMPLES`` examples per fuzzer (default 60; total well under a minute).
A longer seeded run: ``MINICOMM_FUZZ_EXAMPLES=5000 MINICOMM_FUZZ_SEED=1 pytest tests/fuzz``;
each fuzzer prints how many cases it tried (``-s`` to see them)."""
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import minicomm as mc  # noqa: E402
from leaks import thread_exceptions  # noqa: E402
from minicomm import rendezvous as rv  # noqa: E402
from minicomm.rendezvous import StoreClient, StoreServer, new_token  # noqa: E402
from minicomm.transports.base import Tag  # noqa: E402
from minicomm.transports.tcp import FRAME, TcpTransport  # noqa: E402

EXAMPLES = int(os.environ.get("MINICOMM_FUZZ_EXAMPLES", "60"))
SEED = int(os.environ.get("MINICOMM_FUZZ_SEED", "20261201"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
                suppress_health_check=list(HealthCheck))
CASES = {}


def _count(name):
    CASES[name] = CASES.get(name, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def report_cases():
    yield
    print("\nfuzz cases tried:", dict(sorted(CASES.items())))


@pytest.fixture(scope="module")
def thread_errors():
    """Any exception escaping a background thread while the fuzzers run fails the module."""
    with thread_exceptions() as caught:
        yield caught
    assert not caught, caught


@pytest.fixture(scope="module")
def store(thread_errors):
    token = new_token()
    with StoreServer("127.0.0.1", 0, token) as server:
        server.token = token
        yield server
    assert not thread_errors


def _read_until_closed(sock, timeout):
    """Read what the server says until it closes (True) or ``timeout`` passes (False)."""
    sock.settimeout(timeout)
    end = time.monotonic() + timeout
    got = b""
    try:
        while time.monotonic() < end:
            chunk = sock.recv(65536)
            if not chunk:
                return True, got
            got += chunk
            if len(got) > (1 << 20):
                return False, got
    except (ConnectionResetError, BrokenPipeError):
        return True, got
    except socket.timeout:
        pass
    return False, got


def _store_alive(server):
    with StoreClient("127.0.0.1", server.port, server.token, timeout=20) as c:
        key = f"alive/{time.monotonic_ns()}"
        c.set(key, b"1")
        assert c.get(key, timeout=5) == b"1"


HELLO = len(rv._MAGIC) + rv._NONCE


# ------------------------------------------------------------------------- auth handshake
def _captured_reply(server):
    """A legitimate client's handshake reply from an earlier session (for replays)."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        hello = rv._recv_exact(s, HELLO, time.monotonic() + 10, "capture")
        ns = hello[len(rv._MAGIC):]
        nc = os.urandom(rv._NONCE)
        return nc + rv._mac(server.token, b"client", ns, nc)
    finally:
        s.close()


@seed(SEED)
@FUZZ
@given(data=st.one_of(
    st.binary(max_size=200),
    st.binary(min_size=64, max_size=64),
    st.just("replay"),
    st.tuples(st.just("replay-prefix"), st.integers(0, 63)),
    st.tuples(st.just("oversized"), st.integers(65, 1 << 16))))
def test_fuzz_auth_handshake_at_the_live_store(store, data):
    """Anything but a correct MAC over this session's nonces ends the connection, and the
    server answers nothing beyond its hello: no request is served before authentication."""
    _count("auth")
    if data == "replay":
        data = _captured_reply(store)
    elif isinstance(data, tuple) and data[0] == "replay-prefix":
        data = _captured_reply(store)[:data[1]]
    elif isinstance(data, tuple):
        data = os.urandom(64) + rv._REQ.pack(rv._OP_SET, 1, 1) + b"k" * (data[1] - 64 - 13)
    s = socket.create_connection(("127.0.0.1", store.port), timeout=10)
    try:
        try:
            s.sendall(data)
            if len(data) < 64:
                s.shutdown(socket.SHUT_WR)     # a truncated handshake: the store sees EOF
        except OSError:          # the server already closed it
            pass
        closed, said = _read_until_closed(s, 15.0)
        assert closed, "the store kept an unauthenticated connection open"
        assert len(said) <= HELLO, "the store answered before authentication"
    finally:
        s.close()


def test_store_still_serves_after_the_auth_fuzz(store):
    _store_alive(store)


# -------------------------------------------------------------------- store protocol
def _authenticated(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    rv.authenticate_client(s, server.token, 10)
    return s


OPS = st.sampled_from([rv._OP_SET, rv._OP_GET, rv._OP_ADD, rv._OP_JOIN, rv._OP_WAIT_WORLD,
                       0, 6, 255])


def _wait_value():
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(
        lambda t: struct.pack("!d", t)), st.binary(max_size=12))


@st.composite
def store_request(draw):
    op = draw(OPS)
    key = draw(st.one_of(st.text(max_size=40).map(str.encode), st.binary(max_size=40)))
    if op in (rv._OP_GET, rv._OP_WAIT_WORLD):
        value = draw(_wait_value())
    elif op == rv._OP_JOIN:
        value = draw(st.one_of(
            st.binary(max_size=80),
            st.just(b"[" * 5000 + b"]" * 5000),
            st.fixed_dictionaries({"job": st.text(max_size=5), "size": st.integers(-2, 3),
                                   "rank": st.integers(-2, 3), "member": st.text(max_size=4)})
            .map(lambda d: __import__("json").dumps(d).encode())))
    else:
        value = draw(st.binary(max_size=64))
    klen, vlen = len(key), len(value)
    lie = draw(st.sampled_from(["exact", "truncate", "huge-key", "huge-value", "short-head"]))
    if lie == "huge-key":
        klen = draw(st.integers(rv._MAX_KEY + 1, 2**32 - 1))
    elif lie == "huge-value":
        vlen = draw(st.integers(rv._MAX_VALUE + 1, 2**64 - 1))
    frame = rv._REQ.pack(op, klen, vlen) + key + value
    if lie == "truncate":
        frame = frame[:draw(st.integers(0, max(0, len(frame) - 1)))]
    elif lie == "short-head":
        frame = frame[:draw(st.integers(0, rv._REQ.size - 1))]
    return op, lie, frame


@seed(SEED)
@FUZZ
@given(reqs=st.lists(store_request(), min_size=1, max_size=4))
def test_fuzz_store_protocol_from_an_authenticated_client(thread_errors, reqs):
    """Random, truncated, oversized and wrong-op requests from a member: the store answers or
    closes that connection (StoreProtocolError logged); waits are bounded by the request's own
    (validated) timeout; the store serves others afterwards (unless the fuzzer's joins or
    writes poisoned it: then every member gets a named RendezvousError, which is checked)."""
    _count("store")
    token = new_token()
    with StoreServer("127.0.0.1", 0, token) as server:
        server.token = token
        s = _authenticated(server)
        try:
            try:
                for _, _, frame in reqs:
                    s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
            except OSError:          # the server already closed it
                pass
            waits = any(op in (rv._OP_GET, rv._OP_WAIT_WORLD) for op, _, _ in reqs)
            closed, _ = _read_until_closed(s, 1.0 if waits else 15.0)
            assert closed or waits, "a non-waiting request left the connection open"
        finally:
            s.close()
        try:
            _store_alive(server)
        except rv.RendezvousError as e:        # poisoned by the fuzzer's own joins / writes
            assert "claim rank" in str(e) or "conflicting writes" in str(e), e
    assert not thread_errors


def test_store_value_memory_follows_bytes_sent(store):
    """A header announcing a 256 MiB value costs nothing until the bytes come (the old store
    allocated the announced size up front)."""
    s = _authenticated(store)
    try:
        s.sendall(rv._REQ.pack(rv._OP_SET, 1, rv._MAX_VALUE) + b"k" + b"x" * 100)
        _store_alive(store)
    finally:
        s.close()


def test_store_poison_is_named_not_a_hang(store):
    # kept last among the store tests: it poisons the module's store on purpose
    a = StoreClient("127.0.0.1", store.port, store.token, timeout=10)
    b = StoreClient("127.0.0.1", store.port, store.token, timeout=10)
    try:
        a.set("dup", b"1")
        with pytest.raises(rv.RendezvousError, match="conflicting writes"):
            b.set("dup", b"2")
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------ tcp frame header
def _rank0(server, token, out):
    with StoreClient("127.0.0.1", server.port, token, timeout=20) as c:
        try:
            t = TcpTransport(0, 2, c, token, [1], "127.0.0.1", 20.0)
        except BaseException as e:
            out["setup"] = e
            return
        out["t"] = t
        out["ready"].set()
        buf = np.zeros(16, np.float64)
        try:
            t.wait_all([t.irecv(1, buf, Tag(7, 0, 0, 0, 16))], time.monotonic() + 15, "fuzz")
            out["result"] = buf
        except BaseException as e:
            out["error"] = e
        finally:
            t.close()


@st.composite
def frames(draw):
    out = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["random", "right", "wrong-count", "huge", "negative",
                                     "abort", "garbage"]))
        tag = [7, 0, 0, 0, 16]
        total = 128
        if kind == "random":
            tag = [draw(st.integers(-2**63, 2**63 - 1)) for _ in range(5)]
            total = draw(st.integers(-2**63, 2**63 - 1))
        elif kind == "wrong-count":
            tag[4], total = draw(st.integers(0, 40)), draw(st.integers(0, 400))
        elif kind == "huge":
            total = draw(st.integers(1 << 40, 2**63 - 1))
        elif kind == "negative":
            total = draw(st.integers(-2**63, -1))
        elif kind == "abort":
            tag[0], total = -1, draw(st.integers(0, 1 << 20))
        if kind == "garbage":
            out.append(draw(st.binary(min_size=1, max_size=FRAME * 2)))
            continue
        payload = draw(st.binary(max_size=min(max(total, 0), 256)))
        out.append(struct.pack("<6q", *tag, total) + payload)
    cut = draw(st.one_of(st.none(), st.integers(0, sum(map(len, out)))))
    blob = b"".join(out)
    return blob if cut is None else blob[:cut]


@seed(SEED)
@FUZZ
@given(blob=frames())
def test_fuzz_tcp_frames_from_an_authenticated_peer(thread_errors, blob):
    """A job member (it holds the token) sends random, truncated, oversized, negative-length,
    wrong-count and abort frames, then closes: the live rank's receive either completes with
    the right bytes or raises a named CommError (PeerFailure / MismatchError) — bounded."""
    _count("tcp")
    token = new_token()
    with StoreServer("127.0.0.1", 0, token) as server:
        out = {"ready": threading.Event()}
        th = threading.Thread(target=_rank0, args=(server, token, out), daemon=True)
        th.start()
        with StoreClient("127.0.0.1", server.port, token, timeout=20) as c:
            h, p = c.get("addr/0", timeout=20).decode().rsplit(":", 1)
            s = rv.dial_peer(socket.AF_INET, (h, int(p)), token, 1, 0, time.monotonic() + 20)
        try:
            assert out["ready"].wait(20), out
            try:
                s.sendall(blob)
            except OSError:          # the server already closed it
                pass
        finally:
            s.close()
        th.join(30)
        assert not th.is_alive(), "the rank hung"
    assert "setup" not in out, out
    if "error" in out:
        assert isinstance(out["error"], mc.CommError), repr(out["error"])
    else:
        assert out["result"].shape == (16,)
    assert not thread_errors


@seed(SEED)
@FUZZ
@given(data=st.binary(max_size=200))
def test_fuzz_handshake_at_a_live_rank_listener(data):
    """Strays (random bytes, no token) at a rank's peer listener during setup are refused; the
    real peer still connects."""
    _count("peer-handshake")
    token = new_token()
    listener = socket.create_server(("127.0.0.1", 0))
    addr = listener.getsockname()
    box = {}

    def accept():
        try:
            box["got"] = rv.accept_peers(listener, token, 0, [1], time.monotonic() + 20)
        except BaseException as e:
            box["error"] = e
    th = threading.Thread(target=accept, daemon=True)
    th.start()
    stray = socket.create_connection(addr, timeout=10)
    try:
        try:
            stray.sendall(data)
            stray.shutdown(socket.SHUT_WR)
        except OSError:          # the server already closed it
            pass
        real = rv.dial_peer(socket.AF_INET, addr, token, 1, 0, time.monotonic() + 20)
        th.join(20)
        real.close()
        closed, said = _read_until_closed(stray, 15.0)
        assert closed and len(said) <= HELLO
        assert 1 in box.get("got", {}), box
        box["got"][1].close()
    finally:
        stray.close()
        listener.close()
