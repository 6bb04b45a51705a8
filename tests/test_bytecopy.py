"""Copies at page-skewed offsets (transports/bytecopy.py): the rule, exact bytes at every offset
and size, and that the executor's own-block copies and single-copy reads never hand a skewed
pair to memmove or to the kernel (where rep movsb runs at a fifth to a tenth
of its pace on AMD Zen 3/4). What is checked is the path taken, not a time: this machine is
shared and noisy."""
import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minicomm as mc
from leaks import job_segments, my_worker_processes, nothing_left_behind  # noqa: F401
from minicomm.transports import bytecopy, cma

PAGE = 4096


def _arena(nbytes: int) -> np.ndarray:
    """Page-aligned bytes (an anonymous mapping), so a test picks the page offset it wants."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def test_the_skew_is_a_destination_1_to_31_bytes_past_the_source_modulo_a_page():
    skewed = [d for d in range(-64, 2 * PAGE + 64) if bytecopy.page_skewed(10 * PAGE + d,
                                                                           10 * PAGE)]
    assert skewed == [k * PAGE + d for k in range(3) for d in range(1, 32)]
    assert not bytecopy.page_skewed(5 * PAGE + 16, 5 * PAGE + 16)     # alike: fine
    assert bytecopy.page_skewed(7 * PAGE + 16, 3 * PAGE)              # 16 past, other pages


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 700 << 10), src_off=st.integers(0, PAGE - 1),
       skew=st.one_of(st.integers(0, 40), st.integers(0, PAGE - 1)),
       dtype=st.sampled_from([np.uint8, np.float32, np.int64, np.float64]))
def test_copy_gives_the_exact_bytes_at_every_offset_and_size(nbytes, src_off, skew, dtype):
    dt = np.dtype(dtype)
    nbytes -= nbytes % dt.itemsize
    src_off -= src_off % dt.itemsize
    skew -= skew % dt.itemsize
    arena = _arena(2 * nbytes + 6 * PAGE)
    src = arena[src_off:src_off + nbytes]
    src[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    want = src.tobytes()                       # the reference: the bytes as Python sees them
    base = -(-(src_off + nbytes) // PAGE) * PAGE + PAGE
    dst = arena[base + src_off + skew:base + src_off + skew + nbytes]
    dst[:] = 0xA5
    before = arena.tobytes()
    bytecopy.copy(dst.view(dt), src.view(dt))
    assert dst.tobytes() == want
    lo, hi = base + src_off + skew, base + src_off + skew + nbytes
    after = arena.tobytes()
    assert after[:lo] == before[:lo] and after[hi:] == before[hi:]   # nothing outside dst


def test_skewed_copies_take_the_ufunc_and_the_rest_memmove(monkeypatch):
    calls = []
    real = bytecopy.skewed_copy
    monkeypatch.setattr(bytecopy, "skewed_copy", lambda d, s: (calls.append(d.nbytes), real(d, s)))
    arena = _arena(4 << 20)
    n = 256 << 10
    for skew, size, expect in [(16, n, True), (31, n, True), (0, n, False), (32, n, False),
                               (48, n, False), (16, bytecopy.TRAP_MIN - 16, False),
                               (16, bytecopy.TRAP_MAX, False)]:
        calls.clear()
        s = arena[PAGE:PAGE + size]
        d = arena[(2 << 20) + PAGE + skew:(2 << 20) + PAGE + skew + size]
        s[:] = 3
        bytecopy.copy(d, s)
        assert bool(calls) == expect, (skew, size)
        assert (d == 3).all()


def _skewed_buffers(comm, nbytes):
    """A root buffer at page offset 0 and a receiving one 16 bytes past it: what two ranks get
    from equal heap allocations made one after the other (module doc of bytecopy)."""
    arena = _arena(nbytes + 3 * PAGE)
    return arena[:nbytes] if comm.rank == 0 else arena[16:16 + nbytes]


def _own_block_copy(comm):
    calls = []
    real = bytecopy.skewed_copy
    bytecopy.skewed_copy = lambda d, s: (calls.append(d.nbytes), real(d, s))
    try:
        x = _arena(1 << 20)[:1 << 20].view(np.float32)
        out = _arena((1 << 20) + PAGE)[16:16 + (1 << 20)].view(np.float32)  # 16 bytes past x
        x[:] = np.arange(x.size, dtype=np.float32) + comm.rank
        got = comm.broadcast(x, root=0, algorithm="tree", out=out)
        ok = np.array_equal(got, np.arange(x.size, dtype=np.float32))
        return ok, (sum(calls) if comm.rank == 0 else None)
    finally:
        bytecopy.skewed_copy = real


def test_a_roots_own_copy_between_skewed_buffers_avoids_memmove():
    # The root copies its 1 MiB input into its output (in 256 KiB pieces, executor.py): with the
    # output 16 bytes past the input modulo a page, every piece goes through the ufunc.
    res = mc.spawn(_own_block_copy, 2, transport="shm", timeout=60)
    assert res[0] == (True, 1 << 20) and res[1][0] is True


def _single_copy_reads(comm):
    reads = []
    real = cma.read

    def spy(pid, addr, dst):
        reads.append((addr, bytecopy.address(dst), dst.nbytes))
        return real(pid, addr, dst)
    cma.read = spy
    try:
        n = 1 << 20
        buf = _skewed_buffers(comm, n)
        if comm.rank == 0:
            buf[:] = np.arange(n, dtype=np.uint32).astype(np.uint8)
        comm.broadcast(buf, root=0, algorithm="tree", out=buf)
        ok = np.array_equal(buf, np.arange(n, dtype=np.uint32).astype(np.uint8))
        return ok, reads, comm.transport.received_single_copy["cma"]
    finally:
        cma.read = real


@pytest.mark.skipif(cma.disabled() is not None,
                    reason=f"single copy unavailable: {cma.disabled()}")
def test_a_single_copy_read_into_a_skewed_destination_reads_through_an_aligned_scratch(
        monkeypatch):
    # The receiver's buffer lies 16 bytes past the sender's modulo a page: the kernel's copy
    # must never be asked for that pair, and the bytes must arrive whole.
    monkeypatch.setenv(cma.MIN_ENV, str(cma.DEFAULT_MIN))   # 1 MiB single-copy, whatever the pace
    res = mc.spawn(_single_copy_reads, 2, transport="shm", timeout=60)
    ok, reads, received = res[1]
    assert ok and res[0][0] and received == 1
    assert reads and sum(n for _, _, n in reads) == 1 << 20
    assert not [r for r in reads if bytecopy.page_skewed(r[1], r[0])], reads


# above a ring chunk (1 MiB), so it goes as a registered descriptor, and whole 256 KiB pieces
REGISTERED_BYTES = (1 << 20) + (256 << 10)


def _registered_into_plain(comm):
    calls = []
    real = bytecopy.skewed_copy
    bytecopy.skewed_copy = lambda d, s: (calls.append(d.nbytes), real(d, s))
    try:
        n = REGISTERED_BYTES
        if comm.rank == 0:
            buf = comm.empty(n, np.uint8)               # registered: page-aligned
            buf[:] = np.arange(n, dtype=np.uint32).astype(np.uint8)
        else:
            buf = _arena(n + 2 * PAGE)[16:16 + n]       # plain, 16 bytes past a page
        comm.broadcast(buf, root=0, algorithm="tree", out=buf)
        ok = np.array_equal(buf, np.arange(n, dtype=np.uint32).astype(np.uint8))
        return ok, sum(calls), comm.transport.received_single_copy["registered"]
    finally:
        bytecopy.skewed_copy = real


def test_a_registered_message_into_a_skewed_plain_buffer_avoids_memmove():
    # the receiver copies straight from the sender's registered segment (page-aligned) into a
    # plain buffer 16 bytes past a page: every 256 KiB piece through the ufunc
    res = mc.spawn(_registered_into_plain, 2, transport="shm", timeout=60)
    assert res[0][0] and res[1] == (True, REGISTERED_BYTES, 1)
