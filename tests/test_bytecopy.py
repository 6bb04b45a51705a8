"""Copies at page-skewed offsets (transports/bytecopy.py): the skew, the rule a host description
yields (AMD: avoid rep movsb below the L2 size; elsewhere: leave every copy as it comes), exact
bytes at every offset and size, and that where the rule holds the executor's own-block copies
and single-copy reads never hand a skewed pair to memmove or to the kernel. Every test steers
the rule (a described host, or ``MINICOMM_SKEW_COPY`` for spawned ranks) and reads the sizes
the code computed from it, so none depends on this host's CPU vendor or cache sizes. What is
checked is the path taken, not a time: this machine is shared and noisy."""
import mmap
import os
import subprocess
import sys

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


# a host with the slow case (its L2 inside the sizes drawn below) and one without
HOSTS = [bytecopy.HostCpu("AuthenticAMD", 512 << 10), bytecopy.HostCpu("GenuineIntel", 2 << 20)]


@pytest.mark.parametrize("cpu", HOSTS, ids=lambda c: c.vendor)
@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 700 << 10), src_off=st.integers(0, PAGE - 1),
       skew=st.one_of(st.integers(0, 40), st.integers(0, PAGE - 1)),
       dtype=st.sampled_from([np.uint8, np.float32, np.int64, np.float64]))
def test_copy_gives_the_exact_bytes_at_every_offset_and_size(cpu, nbytes, src_off, skew, dtype):
    saved = bytecopy.use_rule(bytecopy.skew_rule(cpu))
    try:
        _check_copy(nbytes, src_off, skew, dtype)
    finally:
        bytecopy.use_rule(saved)


def _check_copy(nbytes, src_off, skew, dtype):
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


def _describe_host(tmp_path, vendor: str, l2: str) -> bytecopy.HostCpu:
    """A host's description as the code reads it: a cpuinfo file naming ``vendor`` and a sysfs
    cache directory whose level-2 cache is ``l2`` (sysfs's own spelling, e.g. "2048K")."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nvendor_id\t: {vendor}\n")
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                             (2, "Unified", l2), (3, "Unified", "32768K")]):
        d = tmp_path / "cache" / f"index{i}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(f"{value}\n")
    return bytecopy.describe_cpu(str(tmp_path / "cpuinfo"), str(tmp_path / "cache"))


@pytest.fixture
def host_rule(tmp_path):
    """Installs the rule the code computes for a described host; restores this host's after."""
    def install(vendor: str, l2: str) -> bytecopy.SkewRule:
        rule = bytecopy.skew_rule(_describe_host(tmp_path, vendor, l2))
        bytecopy.use_rule(rule)
        return rule
    saved = bytecopy.RULE
    yield install
    bytecopy.use_rule(saved)


def test_the_rule_applies_on_amd_below_its_l2_and_nowhere_else(tmp_path):
    # glibc's rep movsb stops at the L2 size on AMD only; Intel has no slow case to avoid
    assert bytecopy.skew_rule(_describe_host(tmp_path / "amd", "AuthenticAMD", "512K")) == \
        bytecopy.SkewRule(trap_max=512 << 10, kernel=True)
    intel = _describe_host(tmp_path / "intel", "GenuineIntel", "2048K")
    assert intel == bytecopy.HostCpu("GenuineIntel", 2 << 20)
    assert bytecopy.skew_rule(intel) == bytecopy.SkewRule(trap_max=0, kernel=False)
    assert bytecopy.skew_rule(intel, "on") == bytecopy.SkewRule(trap_max=2 << 20, kernel=True)
    amd = _describe_host(tmp_path / "amd2", "AuthenticAMD", "1024K")
    assert bytecopy.skew_rule(amd, "off") == bytecopy.SkewRule(trap_max=0, kernel=False)
    assert bytecopy.skew_rule(bytecopy.describe_cpu(str(tmp_path / "none"),
                                                    str(tmp_path / "none"))) == \
        bytecopy.SkewRule(trap_max=0, kernel=False)              # nothing said: no vendor
    with pytest.raises(ValueError, match=bytecopy.SKEW_ENV):
        bytecopy.skew_rule(amd, "yes")


def test_a_bad_skew_copy_setting_is_an_error_naming_it():
    env = dict(os.environ, **{bytecopy.SKEW_ENV: "sometimes"})
    r = subprocess.run([sys.executable, "-c", "import minicomm.transports.bytecopy"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"{bytecopy.SKEW_ENV}='sometimes'" in r.stderr, r.stderr


@pytest.mark.parametrize("vendor, l2", [("AuthenticAMD", "512K"), ("AuthenticAMD", "1024K"),
                                        ("AuthenticAMD", "2048K"), ("GenuineIntel", "2048K")])
def test_skewed_copies_take_the_ufunc_and_the_rest_memmove(monkeypatch, host_rule, vendor, l2):
    rule = host_rule(vendor, l2)
    calls = []
    real = bytecopy.skewed_copy
    monkeypatch.setattr(bytecopy, "skewed_copy", lambda d, s: (calls.append(d.nbytes), real(d, s)))
    n = 256 << 10
    cases = [(16, n, True), (31, n, True), (0, n, False), (32, n, False), (48, n, False),
             (16, bytecopy.TRAP_MIN - 16, False), (16, rule.trap_max, False)]
    # the arena holds the largest case twice over, at the sizes the code computed for this host
    largest = max(size for _, size, _ in cases)
    dst_at = PAGE + -(-largest // PAGE) * PAGE + PAGE               # a page past the source
    arena = _arena(dst_at + 48 + largest + PAGE)
    for skew, size, skewed in cases:
        calls.clear()
        s = arena[PAGE:PAGE + size]
        d = arena[dst_at + skew:dst_at + skew + size]
        assert d.nbytes == size
        s[:] = 3
        bytecopy.copy(d, s)
        assert bool(calls) == (skewed and rule.trap_max > 0), (skew, size)
        assert (d == 3).all()


def _skewed_buffers(comm, nbytes):
    """A root buffer at page offset 0 and a receiving one 16 bytes past it: what two ranks get
    from equal heap allocations made one after the other (module doc of bytecopy)."""
    arena = _arena(nbytes + 3 * PAGE)
    return arena[:nbytes] if comm.rank == 0 else arena[16:16 + nbytes]


# the executor's local copies and shm's registered reads both go in pieces of this many bytes
PIECE = 256 << 10


def _ufunc_bytes(total: int) -> int:
    """The bytes of a skewed ``total``-byte copy made in ``PIECE``s that this process's rule
    sends through the ufunc: all where a piece lies in [``TRAP_MIN``, ``TRAP_MAX``), else none
    (the bounds as the code computed them)."""
    return total if bytecopy.TRAP_MIN <= PIECE < bytecopy.TRAP_MAX else 0


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
        return ok, (sum(calls) if comm.rank == 0 else None), _ufunc_bytes(1 << 20)
    finally:
        bytecopy.skewed_copy = real


@pytest.mark.parametrize("setting", ["on", "off"])
def test_a_roots_own_copy_between_skewed_buffers_avoids_memmove(monkeypatch, setting):
    # The root copies its 1 MiB input into its output in PIECEs (executor.py): with the output
    # 16 bytes past the input modulo a page, each piece goes through the ufunc where the rule
    # holds. The setting forces the rule, so every host takes both branches.
    monkeypatch.setenv(bytecopy.SKEW_ENV, setting)
    res = mc.spawn(_own_block_copy, 2, transport="shm", timeout=60)
    ok, ufunc, expect = res[0]
    assert ok and res[1][0] is True
    assert ufunc == (expect if setting == "on" else 0)


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
        return ok, reads, comm.transport.received_single_copy["cma"], bytecopy.RULE.kernel
    finally:
        cma.read = real


@pytest.mark.skipif(cma.disabled() is not None,
                    reason=f"single copy unavailable: {cma.disabled()}")
@pytest.mark.parametrize("setting", ["on", "off"])
def test_a_single_copy_read_into_a_skewed_destination_reads_through_an_aligned_scratch(
        monkeypatch, setting):
    # The receiver's buffer lies 16 bytes past the sender's modulo a page: where the rule holds
    # (forced on here, whatever the host) the kernel's copy must never be asked for that pair;
    # either way the bytes must arrive whole.
    monkeypatch.setenv(bytecopy.SKEW_ENV, setting)
    monkeypatch.setenv(cma.MIN_ENV, str(cma.DEFAULT_MIN))   # 1 MiB single-copy, whatever the pace
    res = mc.spawn(_single_copy_reads, 2, transport="shm", timeout=60)
    ok, reads, received, kernel_rule = res[1]
    assert ok and res[0][0] and received == 1
    assert kernel_rule == (setting == "on")
    assert reads and sum(n for _, _, n in reads) == 1 << 20
    skewed = [r for r in reads if bytecopy.page_skewed(r[1], r[0])]
    assert (not skewed) if kernel_rule else skewed == reads, reads


# above a ring chunk (1 MiB), so it goes as a registered descriptor, and whole PIECEs
REGISTERED_BYTES = (1 << 20) + PIECE


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
        return (ok, sum(calls), comm.transport.received_single_copy["registered"],
                _ufunc_bytes(REGISTERED_BYTES))
    finally:
        bytecopy.skewed_copy = real


@pytest.mark.parametrize("setting", ["on", "off"])
def test_a_registered_message_into_a_skewed_plain_buffer_avoids_memmove(monkeypatch, setting):
    # the receiver copies straight from the sender's registered segment (page-aligned) into a
    # plain buffer 16 bytes past a page: every PIECE through the ufunc where the rule holds
    monkeypatch.setenv(bytecopy.SKEW_ENV, setting)
    res = mc.spawn(_registered_into_plain, 2, transport="shm", timeout=60)
    ok, ufunc, received, expect = res[1]
    assert res[0][0] and (ok, received) == (True, 1)
    assert ufunc == (expect if setting == "on" else 0)
