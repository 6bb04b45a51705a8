"""shm: two-sided transport over /dev/shm for peers on the same node.

Memory. Each rank creates one segment, ``/dev/shm/minicomm-<job_id>-<rank>``, holding one inbound
ring per peer on its node (sender -> this rank). A ring is a control page (``head``: bytes the
sender has published, ``tail``: bytes the receiver has consumed, on separate cache lines, each
written by one side only) and a byte ring of records: a 64-byte header (the Tag, the message
length, the chunk's offset and length) followed by the chunk, padded to 64 bytes. A record never
wraps (a marker sends the reader back to the start), so every chunk is contiguous: the receiver
copies it, or hands it to ``req.reduce(dst, chunk_view)`` straight out of the shared memory; the
data crosses memory once on each side. Messages larger than a chunk (1 MiB;
``MINICOMM_SHM_CHUNK``, a multiple of 4096, at most a quarter of the ring) are streamed record
by record, so the sender's copy-in of chunk k+1 overlaps the receiver's reduce-out of chunk k,
and messages larger than the ring simply flow through it. Chunks other than a message's last are
multiples of 4096 bytes, so they always end on an element boundary.

The small-message path (minicomm.smallpath) hands messages of up to a chunk (``small_bytes``)
straight to ``send_now`` / ``recv_now``: one record, written if the ring has room for it whole,
taken if it is the ring's next record; anything else (no room, a send queued before it, a message
isend would stream or send as a descriptor) goes through ``isend`` / ``irecv`` as usual.

Ordering. ``head``/``tail`` are stored through a ``memoryview`` cast to int64: one aligned
8-byte store, made after the record is written (``struct.pack_into`` would not do: it zeroes the
field before writing it, and a reader can see the zero). On x86-64 (TSO) that store publishes
the record. Weakly ordered CPUs (arm64) would need fences pure Python cannot issue: a known
limitation of this transport.

Waiting. Per peer pair one authenticated AF_UNIX stream connection carries doorbells. Each rank's
listener has an abstract name with a random part, published in the store (a name guessed from
the job id cannot be squatted first); connections from another uid are refused (SO_PEERCRED),
and strays are handled as rendezvous.py describes (bounded, no thread each; dialers retry).
A waiting rank polls its rings (hot for a few microseconds, then yielding its
core between polls: at once when the node's ranks outnumber its cores, ``MINICOMM_SPIN=yield|hot``
overrides), then raises the ``sleeping`` word of its segment, fences, re-checks its rings once,
and sleeps: on the *futex word* of its segment (``sleeping`` = 2; futex.py, ctypes) when shm is
the only engine of its progress loop, else in epoll on these sockets (``sleeping`` = 1). After
publishing records or freeing ring space for a peer, a rank fences and reads that peer's
``sleeping`` word: 0 costs nothing (an awake peer), 2 a store of a fresh value into the peer's
futex word and one ``futex(FUTEX_WAKE)``, 1 one byte on the doorbell socket. The two fences make
the handshake sound (Dekker): either the sleeper's re-check sees the new head/tail, or the
publisher sees the flag and wakes it; the futex sleeper reads its word *before* the re-check, and
the kernel sleeps only while the word still holds that value, so a wake between the two is never
lost (every wake writes a value no waker wrote before: its own counter and rank). A full doorbell
socket means unread doorbells are already pending, so a failed (EAGAIN) ring loses nothing. A
futex sleeper wakes at least every 50 ms to read its doorbell sockets. A dead peer's kernel closes
its end: EOF -> PeerFailure, with no heartbeat. ``abort`` and ``close`` send a reason (or goodbye)
on the socket and then wake the peer's futex word. ``MINICOMM_FUTEX=0`` (or a platform without
futexes) keeps the socket doorbells only.

Lifetime. A segment is unlinked as soon as every peer has attached to it (every peer maps all
segments of its node before it completes the doorbell handshake, so a finished handshake with every
peer proves it), on close, on any setup error and at exit; ``sweep_job_segments`` removes what a
SIGKILLed rank left (the launcher calls it).

Single copy (cma.py). A message of at least the pair's single-copy size (what the receiver's
setup probe chose, ``cma.choose_min``: 256 KiB where its process_vm_readv keeps up with two
copies, else 16 MiB; ``MINICOMM_CMA_MIN`` fixes it; a point-to-point send's also from 2 MiB,
``cma.P2P_MIN``, so a send of up to 2 MiB returns at once, while its receiver computes) of a
call that does not reduce (broadcast, gather, scatter, allgather, alltoall, p2p), to a peer
that can read this process's memory with process_vm_readv, travels as one 128-byte
*descriptor record* (the header with chunk length ``-2``, then the buffer's address) instead of
chunks: the receiver, once its receive is posted, reads the bytes straight from the sender's
buffer into the destination then advances ``tail`` past the record. The sender's request
completes when it sees ``tail`` pass the record (the receiver's usual doorbell wakes it if it
sleeps): until then its buffer is in use, so such a send is a rendezvous send, which every
schedule is verified against. The bytes cross memory once, where the ring path copies them in
and out. A read whose destination lies 1-31 bytes past the source modulo a page (two ranks that
allocated alike: bytecopy.py) goes through a scratch at the source's page offset instead, since
the kernel's own copy is 4-5x slower at that skew. On the VM where 256 KiB was chosen,
process_vm_readv moved ~23 GB/s for a cache-warm 512 KiB, ~10 GB/s at 4 MiB, ~4.8 GB/s at 64
MiB, against ~13 GB/s for each of the ring's two cross-core copies of a cached record (on an
EPYC VM since: ~6 GB/s, the probe's 16 MiB case). Measured there (in-process A/B, interleaved,
1 MiB calls, threshold 2 MiB against 256 KiB): n=2
broadcast 155 -> 113 us, scatter 115 -> 84, alltoall 145 -> 93, allgather 124 -> 117, gather
98 -> 102; n=4 5-15% faster except gather (264 -> 292: its senders wait for the root to read);
64 MiB gather, scatter, broadcast, allgather, alltoall 1.16-1.39x. Reducing calls keep the ring
(the sender copies the next chunk while the receiver reduces this one: two cores at work;
single-copy with a scratch reduce measured 0.6-0.9x). Each rank
probes every peer at setup (reads a random token from the peer's memory, then times 256 KiB
reads of it against a local copy) and writes the verdict and the chosen size into the control
page of the ring that peer sends into; a pair whose probe fails (EPERM under
ptrace restrictions or seccomp, ESRCH across pid namespaces) or a side with ``MINICOMM_CMA=0``
keeps the ring path.

Registered memory. ``register_memory(nbytes)`` gives a page-aligned array backed by its own
segment ``minicomm-<job>-<rank>-reg<serial>`` (what ``comm.empty`` / ``comm.register`` hand out,
like NCCL's user-buffer registration or MPI_Win_allocate_shared). A message larger than the
receiver's chunk (one the ring would stream) whose bytes lie in such memory travels as a
descriptor naming (serial, offset) (chunk length ``-3``); the receiver maps the segment on first
use (cached, at most ``_REG_MAPS``) and copies -- or reduces -- straight from the sender's memory
into the destination: one memcpy, no system call, for every call including reducing ones. A
message of up to a chunk takes the ring as one record, registered or not: the small path moves
it with no request and no wait for the receiver's read, which measured faster than the
descriptor's one copy (registered buffers both ways, the descriptor switched on and off between
rounds of one job; ring time / descriptor time per collective: n=2 256 KiB calls 0.46-0.72,
1 MiB 0.62-0.96; n=4 1 MiB 0.67-1.04; above a chunk the descriptor won: n=2 4 MiB calls
1.01-2.50, n=4 1.06-2.07, where allgather's 1 MiB messages, on the ring by this rule, measured
0.75; examples/registered_ab.py times registered against plain buffers). The segment's
name stays in /dev/shm while it is registered (peers map it lazily), and goes on ``free_memory``,
close, exit and the launcher's sweep (the names match ``minicomm-<job>-*``); the pages live
until the last mapping goes. ``describe_copies()`` names the peers of each kind and why (logged at setup
under ``MINICOMM_DEBUG=info``).
"""
from __future__ import annotations

import bisect
import errno
import glob
import mmap
import os
import re
import secrets
import socket
import struct
import sys
import time
from collections import deque
from typing import Dict, List, Optional

import numpy as np

from minicomm.errors import CommError, CommTimeout, PeerFailure, call_reduces
from minicomm.rendezvous import accept_peers, dial_peer
from minicomm.settings import byte_setting
from . import bytecopy, cma, futex, segment
from .base import ReduceFn, Request, Tag
from .progress import CLEAN_CLOSE, Inbox, LinkEngine, Progress, Req, deliver, fence
from .progress import fence_acquire as _fence_acquire
from .progress import fence_release as _fence_release

SHM_DIR = "/dev/shm"
PAGE = 4096
HDR = 64                              # record header: 8 int64
CHUNK = 1 << 20                       # streaming unit of large messages
EARLY_RING = 64 << 10                 # ring the doorbell at once after a record this large
EAGER = 16 << 10                      # isend/irecv move a message this small on the spot
PEEK_RECORDS = 1024                   # records _peek_all reads before a rank blocks (bounded)
SMALL_HOT_S = 10e-6                   # recv_now polls this long without yielding (see there)
_U8 = np.dtype(np.uint8)
_MAGIC = b"MCSHM\x00\x01\x00"
_HDR = struct.Struct("@8q")           # record header; written before head publishes it
_SEG = struct.Struct("@8sqqqq")       # magic, owner rank, ring bytes, chunk bytes, number of rings
_HEAD, _TAIL = 0, 16                  # int64 index in a ring's control page (own cache lines)
_SLEEPING = 32                        # int64 index in the segment's first page: owner may sleep
_SLEEP_SOCKET, _SLEEP_FUTEX = 1, 2    # its values while asleep: on the sockets / on the futex word
_FUTEX_WORD = 80                      # int32 index (byte 320, its own cache line): the futex word
_RANKS_AT = 512                       # byte offset of the senders' ranks, after the flag's line
_CMA_OK = 32                          # int64 index in a ring's control page: its receiver reads
                                      # the sender's memory (written by the receiver at setup)
_CMA_FROM = 40                        # ... and the size its probe chose for single copy (cma.py)
_PROBE_AT = 64                        # byte offset in a segment of the owner's pid, the address
_PROBE = struct.Struct("@qq16s")      # of a token in its memory, and the token (cma.probe)
_WRAP_REC = -1                        # chunk length of a wrap marker (the next record is at 0)
_CMA_REC = -2                         # chunk length of a descriptor record
_CMA_ADDR = struct.Struct("@q")       # the descriptor's payload: the sender's buffer address
_CMA_RECORD = HDR + 64                # ring bytes of a descriptor record
_REG_REC = -3                         # chunk length of a registered-memory descriptor
_REG_DESC = struct.Struct("@qq")      # its payload: (segment serial, byte offset)
_REG_MAPS = 64                        # peers' registered segments kept mapped per rank
_PIECE = 256 << 10                    # registered copies go in pieces this large
_NOWAIT = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
# Fault the pages in at setup, not on the first large transfer.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_WAKE = b"\x01"
_ABORT = b"\x00"                      # then the reason, then EOF
_ABORTED = "it aborted: "
_BYE = b"\x02"                        # an orderly close: then EOF
_JOB_ID = re.compile(r"[A-Za-z0-9_.-]+")

# One registry of the segments this process created and has not unlinked (segment.py's, shared
# with the rdma / ub arenas and the windows), emptied at exit and when a rank's parent dies.
_linked, _unlink, _unlink_at_exit = segment._linked, segment.unlink, segment._unlink_at_exit


def segment_path(job_id: str, rank: int) -> str:
    return os.path.join(SHM_DIR, f"minicomm-{job_id}-{rank}")


def sweep_job_segments(job_id: str) -> List[str]:
    """Unlink every /dev/shm/minicomm-<job_id>-* (after ranks were killed); returns the paths."""
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"invalid job id {job_id!r}")
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"minicomm-{glob.escape(job_id)}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _oversubscribed(local_ranks: int) -> bool:
    """True if this node's ranks outnumber the cores this process may run on (then a spinning
    rank must hand its core over between polls). ``MINICOMM_SPIN=yield|hot`` overrides."""
    forced = os.environ.get("MINICOMM_SPIN", "").strip().lower()
    if forced in ("yield", "hot"):
        return forced == "yield"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return local_ranks > cores


def _reserve_and_map(fd: int, size: int, what: str, remedy: str, flags: int) -> mmap.mmap:
    """Reserve ``size`` bytes of a new segment's file now (``posix_fallocate``: a full /dev/shm
    is this CommError at setup, not a SIGBUS on a later store) and map it."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise CommError(f"shm: cannot reserve {what} in {SHM_DIR} ({e.strerror or e}); "
                        f"{remedy}") from None
    return mmap.mmap(fd, size, flags=flags)


def _default_ring_bytes(npeers: int) -> int:
    ring = byte_setting("MINICOMM_SHM_RING_BYTES", 0, minimum=16 * PAGE, multiple=PAGE)
    if ring:
        return ring
    # 4 MiB per ring keeps 4 chunks in flight; with many peers, cap a rank's inbound memory at
    # 64 MiB (the rings are reserved up front: a full /dev/shm must fail here, not SIGBUS later).
    ring = 4 << 20
    while ring > (256 << 10) and ring * npeers > (64 << 20):
        ring //= 2
    return ring


class _Peer:
    """Both directions with one peer: the outbound ring (in the peer's segment), the inbound ring
    (in ours), the doorbell socket, and the receive matching."""
    __slots__ = ("rank", "sock", "fd", "flag_q", "tx_mm", "tx_u8", "tx_ctl", "tx_data", "tx_size",
                 "tx_head", "tx_tail", "tx_chunk", "txq", "tx_q", "rx_mm", "rx_u8", "rx_ctl",
                 "rx_data", "rx_size", "rx_q", "rx_head", "rx_tail", "rx_cur", "inbox", "owed",
                 "closed", "pid", "cma", "cma_read", "cma_wait", "cma_min", "cma_pace",
                 "rx_typed", "futex_i", "futex_addr")

    def __init__(self, rank: int):
        self.rank = rank
        self.sock: Optional[socket.socket] = None
        self.fd = -1
        self.txq: deque = deque()
        self.tx_head = self.tx_tail = 0
        self.rx_head = self.rx_tail = 0
        self.rx_cur = None
        self.rx_typed: Dict[np.dtype, np.ndarray] = {}   # the inbound segment per dtype
        self.futex_i = None           # the peer's first page as int32 words (its futex word)
        self.futex_addr = 0
        self.inbox = Inbox(rank)
        self.owed = False             # a doorbell is due at the end of this pass
        self.closed: Optional[str] = None
        self.pid = 0
        self.cma = False              # our large sends to it go single-copy (it reads us)
        self.cma_read: Optional[str] = "not probed"   # None: we can read its memory; else why not
        self.cma_wait: deque = deque()  # (ring position past the descriptor, send) being read
        self.cma_min = cma.DEFAULT_MIN  # our collective sends to it of this size go single-copy
        self.cma_pace: Optional[tuple] = None   # (read s, copy s) of our setup probe of its memory


class ShmTransport(LinkEngine):
    name = "shm"

    def __init__(self, rank: int, size: int, store, job_id: str, peers, timeout: float,
                 token: Optional[bytes] = None, progress: Optional[Progress] = None):
        if not _JOB_ID.fullmatch(str(job_id)):
            raise ValueError(f"invalid job id {job_id!r}: letters, digits, '_', '.', '-' only")
        self.rank, self.size, self.job_id = rank, size, str(job_id)
        self.peer_ranks = sorted(int(p) for p in peers if p != rank)
        self._token = token if token is not None else store.token
        self._progress = progress or Progress()
        self._lock = self._progress.lock
        self._peers: Dict[int, _Peer] = {p: _Peer(p) for p in self.peer_ranks}
        self._active: Dict[_Peer, None] = {}     # peers with queued work (an ordered set)
        self._mm: Optional[mmap.mmap] = None
        self._flag_q = None                       # our segment's first page as int64 words
        self._futex_i = None                      # ... and as int32 words (our futex word)
        self._futex_addr = 0
        self._wake_seq = 0
        self.futex_ok = False                     # the progress engine may sleep on our word
        self.futex_sleeps = 0                     # how often it did (tests, profiles)
        self._path: Optional[str] = None
        self._aborted: Optional[str] = None
        self._cancelled: Dict[int, BaseException] = {}
        self._closed = False
        self._listener: Optional[socket.socket] = None
        self._cma_min, self._cma_min_p2p = cma.min_bytes(), cma.min_bytes(p2p=True)
        self._cma_off = cma.disabled()           # why this side never sends single-copy
        self._cma_reduce = False                 # reducing calls single-copy too (measured: no)
        # the setup probe's buffer: a random token at its start, and PACE_BYTES that a peer reads
        # to time its single-copy pace against ours (page-aligned: no skew, bytecopy.py)
        self._probe_buf = bytecopy.page_aligned(cma.PACE_BYTES)
        self._probe_buf[:16] = np.frombuffer(os.urandom(16), dtype=np.uint8)
        self._reg_starts: List[int] = []         # registered memory: sorted start addresses,
        self._reg: Dict[int, tuple] = {}         # start -> (end, serial, path, mmap)
        self._reg_serial = 0
        self._reg_maps: Dict[tuple, tuple] = {}  # (peer, serial) -> (mmap, u8): peers' memory
        self.received_single_copy = {"cma": 0, "registered": 0}   # messages, by path
        self._scratch: Optional[np.ndarray] = None   # a reducing single-copy receive's pieces
        # ranks of this node outnumber its cores: a waiting rank yields its core between polls
        self._spin_yields = self.oversubscribed = _oversubscribed(len(self.peer_ranks) + 1)
        try:
            if self.peer_ranks:
                self._setup(store, time.monotonic() + timeout)
        except BaseException:
            self._teardown()
            raise
        finally:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        self._progress.attach(self, True)

    # ---------------------------------------------------------------------------- setup
    def _setup(self, store, deadline: float) -> None:
        me, peers = self.rank, self.peer_ranks
        # The listener's name has a random part (published below): nobody can bind it first.
        # Its queue is the kernel's maximum, not the number of peers: strays may fill it.
        nonce = secrets.token_hex(8)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._sock_name(me, nonce))
        self._listener.listen(socket.SOMAXCONN)

        ring = _default_ring_bytes(len(peers))
        chunk = min(byte_setting("MINICOMM_SHM_CHUNK", CHUNK, minimum=PAGE, multiple=PAGE),
                    ring // 4 // PAGE * PAGE)
        self.small_bytes = max(EAGER, chunk)     # the small path's messages: one record each
        head_bytes = -(-(_RANKS_AT + 8 * len(peers)) // PAGE) * PAGE
        total = head_bytes + len(peers) * (PAGE + ring)
        path = segment_path(self.job_id, me)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            # not ours: never unlink it (the name may be guessable under a foreign launcher)
            raise CommError(f"shm: {path} already exists: another job (or another user) uses "
                            f"job id {self.job_id!r}; refusing to touch it") from None
        self._path = path             # recorded only once we created it: teardown unlinks ours
        _linked.add(path)
        try:
            self._mm = _reserve_and_map(fd, total, f"{total >> 20} MiB",
                                        "enlarge /dev/shm or lower MINICOMM_SHM_RING_BYTES",
                                        _MAP_FLAGS)
        finally:
            os.close(fd)
        _SEG.pack_into(self._mm, 0, _MAGIC, me, ring, chunk, len(peers))
        struct.pack_into(f"@{len(peers)}q", self._mm, _RANKS_AT, *peers)
        _PROBE.pack_into(self._mm, _PROBE_AT, os.getpid(),
                         bytecopy.address(self._probe_buf), self._probe_buf[:16].tobytes())
        self._flag_q = memoryview(self._mm)[:PAGE].cast("q")
        self._futex_i = memoryview(self._mm)[:PAGE].cast("i")
        if futex.AVAILABLE:
            self._futex_addr = futex.address_of(self._mm, _FUTEX_WORD * 4)
            self.futex_ok = True
        own_u8 = np.frombuffer(self._mm, dtype=np.uint8)
        for i, pr in enumerate(peers):
            p = self._peers[pr]
            p.rx_mm, p.rx_u8, p.rx_size = self._mm, own_u8, ring
            p.rx_ctl = head_bytes + i * (PAGE + ring)
            p.rx_data = p.rx_ctl + PAGE
            p.rx_q = memoryview(self._mm)[p.rx_ctl:p.rx_ctl + PAGE].cast("q")
        store.set(f"shm/{me}", f"ready {nonce}".encode())   # segment and listener exist

        nonces = {}
        for pr in peers:                       # map every peer's segment before any handshake
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeout(f"rank {me}: shm setup timed out waiting for rank {pr}")
            ready = store.get(f"shm/{pr}", timeout=left).decode(errors="replace").split()
            if len(ready) != 2 or ready[0] != "ready" or not _JOB_ID.fullmatch(ready[1]):
                raise CommError(f"shm: rank {pr}'s setup record in the store is malformed")
            nonces[pr] = ready[1]
            self._attach(self._peers[pr], segment_path(self.job_id, pr))

        for pr in peers:
            if pr < me:
                # published after listen(): a refused dial means rank pr is gone
                s = dial_peer(socket.AF_UNIX, self._sock_name(pr, nonces[pr]), self._token, me,
                              pr, deadline, refused_is_final=True)
                self._peers[pr].sock = s
        accepted = accept_peers(self._listener, self._token, me, [p for p in peers if p > me],
                                deadline)
        for pr, s in accepted.items():
            self._peers[pr].sock = s
        # Every peer mapped our segment before its handshake with us: the name can go now.
        _unlink(self._path)
        # ... and probed our memory, leaving its verdict in the ring we send it through
        for p in self._peers.values():
            p.cma = self._cma_off is None and p.tx_q[_CMA_OK] == 1
            p.cma_min = (self._cma_min if cma.min_override() or not p.tx_q[_CMA_FROM]
                         else p.tx_q[_CMA_FROM])
        if os.environ.get("MINICOMM_DEBUG", "").lower() in ("info", "detail"):
            print(f"[minicomm rank {me}] {self.describe_copies()}", file=sys.stderr, flush=True)
        for p in self._peers.values():
            p.sock.setblocking(False)
            p.fd = p.sock.fileno()
            self._progress.register(p.fd, lambda ev, p=p: self._on_doorbell(p))

    def _sock_name(self, rank: int, nonce: str) -> str:
        return f"\0minicomm-{self.job_id}-{rank}-{nonce}"

    def _attach(self, p: _Peer, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            # it said "ready", then left (failed or timed out in setup, unlinking its segment)
            err = PeerFailure(f"shm: cannot open rank {p.rank}'s segment {path} ({e.strerror}): "
                              f"it failed or exited during setup")
            err.peer = p.rank
            raise err from None
        try:
            segment.check_owner(fd, path)     # a guessable name: trust only our own file
            mm = mmap.mmap(fd, 0, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        magic, owner, ring, chunk, n = _SEG.unpack_from(mm, 0)
        if magic != _MAGIC or owner != p.rank:
            mm.close()
            raise CommError(f"shm: {path} is not rank {p.rank}'s segment of this job")
        senders = struct.unpack_from(f"@{n}q", mm, _RANKS_AT)
        if self.rank not in senders:
            mm.close()
            raise CommError(f"shm: rank {p.rank} has no ring for rank {self.rank} "
                            f"(ranks disagree on the node layout)")
        head_bytes = -(-(_RANKS_AT + 8 * n) // PAGE) * PAGE
        p.tx_mm, p.tx_u8, p.tx_size, p.tx_chunk = mm, np.frombuffer(mm, dtype=np.uint8), ring, chunk
        p.tx_ctl = head_bytes + senders.index(self.rank) * (PAGE + ring)
        p.tx_data = p.tx_ctl + PAGE
        p.tx_q = memoryview(mm)[p.tx_ctl:p.tx_ctl + PAGE].cast("q")
        p.flag_q = memoryview(mm)[:PAGE].cast("q")
        pid, addr, token = _PROBE.unpack_from(mm, _PROBE_AT)
        p.pid = pid
        p.cma_read = cma.probe(pid, addr, token)
        if p.cma_read is None:
            # how fast we read it against a copy of our own: the size from which its
            # collective sends to us should go single-copy (cma.choose_min)
            try:
                p.cma_pace = cma.pace(pid, addr, bytecopy.page_aligned(cma.PACE_BYTES),
                                      self._probe_buf)
                p.rx_q[_CMA_FROM] = cma.choose_min(*p.cma_pace)
            except cma.CmaError as e:
                p.cma_read = f"its probe buffer could not be read whole ({e})"
        p.rx_q[_CMA_OK] = int(p.cma_read is None)   # before our handshake with it
        p.futex_i = memoryview(mm)[:PAGE].cast("i")
        if futex.AVAILABLE:
            p.futex_addr = futex.address_of(mm, _FUTEX_WORD * 4)

    # ------------------------------------------------------------------------- data path
    def _peer(self, peer: int) -> _Peer:
        try:
            return self._peers[peer]
        except KeyError:
            raise ValueError(f"rank {self.rank}: no shm route to rank {peer} "
                             f"(shm peers: {self.peer_ranks})") from None

    def isend(self, peer: int, buf: np.ndarray, tag: Tag) -> Request:
        p = self._peers.get(peer) or self._peer(peer)
        with self._lock:
            q = p.txq
            if not q and p.closed is None and buf.nbytes <= EAGER and self._put(p, buf, tag):
                fence()
                self._ring_if_sleeping(p)
                req = Request(peer, buf, tag, None, True)
                req.done = True
                return req
            req = Req(self, peer, buf, tag, None, True)
            q.append(req)
            self._active[p] = None
            if len(q) == 1 and p.closed is None:
                self._push(p)         # eager: the first chunk is in the ring before wait_all
                if p.owed:
                    fence()
                    self._ring_if_sleeping(p)
        return req

    def irecv(self, peer: int, buf: np.ndarray, tag: Tag,
              reduce: Optional[ReduceFn] = None) -> Request:
        p = self._peers.get(peer) or self._peer(peer)
        with self._lock:
            if buf.nbytes <= EAGER and p.rx_cur is None and self._take(p, buf, tag, reduce):
                req = Request(peer, buf, tag, reduce, False)
                req.done = True
                return req
            req = Req(self, peer, buf, tag, reduce, False)
            ib = p.inbox
            ib.post(req)
            self._active[p] = None
            # eager: a small message that is already in the ring is taken now (a large one waits
            # for wait_all, so that the step's sends are posted first)
            if req.nbytes <= EAGER and ib.n_posted and p.rx_cur is None and self._pull(p):
                fence()
                self._ring_if_sleeping(p)
        return req

    # ------------------------------------------------------- the small-message path's calls
    # What send_now / recv_now may move as one record (minicomm.smallpath): one chunk, set by
    # _setup (EAGER until then). Above EAGER, send_now leaves to isend what isend would not put
    # in the ring as one record (``_not_one_record``), and recv_now what did not arrive as one.
    small_bytes = EAGER

    def _not_one_record(self, p: _Peer, buf: np.ndarray, tag: Tag) -> bool:
        """Whether a message above EAGER is one that isend sends otherwise than as one ring
        record: above the receiver's chunk (streamed, or a registered-memory descriptor), or
        as a descriptor the receiver reads from our memory (single copy). send_now leaves those
        to isend."""
        n = buf.nbytes
        return (n > p.tx_chunk
                or (p.cma and n >= p.cma_min and self._single_copy(tag[3], n)))

    def send_now(self, peer: int, buf: np.ndarray, tag: Tag) -> bool:
        """Write a small message into ``peer``'s ring now, with no request object; False (nothing
        written): no room now, a send to ``peer`` is queued, or the link is closed -- the caller
        posts it with ``isend``."""
        p = self._peers.get(peer) or self._peer(peer)
        lock = self._lock
        lock.acquire()
        try:
            if p.txq or p.closed is not None or (buf.nbytes > EAGER and self._not_one_record(
                    p, buf, tag)) or not self._put(p, buf, tag):
                return False
            _fence_acquire()          # fence(), inline: this runs once per small message
            _fence_release()
            if p.flag_q[_SLEEPING]:
                self._ring_if_sleeping(p)
            else:
                p.owed = False        # awake: nothing to ring (what _ring_if_sleeping decides)
        finally:
            lock.release()
        return True

    def recv_now(self, peer: int, buf: np.ndarray, tag: Tag, reduce: Optional[ReduceFn],
                 spin: float) -> bool:
        """Take (or reduce) this receive's message if it is the next record of ``peer``'s ring,
        waiting up to ``spin`` seconds for a record to arrive (polling the ring's head word, no
        lock held; between polls a yield of the core when ranks outnumber cores). False (nothing
        consumed): the caller posts it with ``irecv``."""
        p = self._peers.get(peer) or self._peer(peer)
        lock = self._lock
        lock.acquire()
        try:
            if p.rx_cur is None and self._take(p, buf, tag, reduce):
                return True
        finally:
            lock.release()
        return self._take_within(p, buf, tag, reduce, spin)

    def sendrecv_now(self, peer: int, sbuf: np.ndarray, rbuf: np.ndarray, tag: Tag,
                     reduce: Optional[ReduceFn], spin: float) -> int:
        """``send_now(peer, sbuf, tag)`` and, if it went, ``recv_now(peer, rbuf, tag, reduce,
        spin)``, as one call: a step that exchanges with one peer (every step of a 2-rank call,
        each round of recursive doubling) looks the peer up and takes the lock once. Returns 0
        (nothing sent, nothing received: the caller goes on as after a failed ``send_now``),
        1 (sent; the receive is the caller's to post) or 3 (both done).

        ``_take`` is tried under the lock only if the peer's head word has moved; else
        ``_take_within`` polls that word without the lock."""
        p = self._peers.get(peer) or self._peer(peer)
        lock = self._lock
        lock.acquire()
        try:
            if p.txq or p.closed is not None or (sbuf.nbytes > EAGER and self._not_one_record(
                    p, sbuf, tag)) or not self._put(p, sbuf, tag):
                return 0
            _fence_acquire()                  # fence(), inline (send_now)
            _fence_release()
            if p.flag_q[_SLEEPING]:
                self._ring_if_sleeping(p)
            else:
                p.owed = False
            if p.rx_cur is None and p.rx_q[_HEAD] != p.rx_tail and self._take(p, rbuf, tag,
                                                                                reduce):
                return 3
        finally:
            lock.release()
        return 3 if self._take_within(p, rbuf, tag, reduce, spin) else 1

    def _take_within(self, p: _Peer, buf: np.ndarray, tag: Tag, reduce: Optional[ReduceFn],
                     spin: float) -> bool:
        """``recv_now``'s wait: poll ``p``'s ring for up to ``spin`` seconds, then ``_take``."""
        if spin <= 0.0 or p.rx_q is None:
            return False
        q, clock = p.rx_q, time.monotonic
        now = clock()
        end = now + spin
        # poll hot for a few microseconds (a running peer answers within that), then hand the
        # core over between polls; at once when ranks outnumber cores
        hot_end = now if self._spin_yields else now + SMALL_HOT_S
        while q[_HEAD] == p.rx_tail:
            now = clock()
            if now > end:
                return False
            if now > hot_end:
                os.sched_yield()
        with self._lock:
            return p.rx_cur is None and self._take(p, buf, tag, reduce)

    def recv_now_many(self, waiting: list, tag: Tag, spin: float) -> list:
        """``recv_now`` for receives from distinct peers, ``[(peer, buf, reduce), ...]``: takes
        whichever arrive within ``spin`` seconds in all; returns the ones still waiting."""
        lock = self._lock
        end = time.monotonic() + spin
        while True:
            left = []
            with lock:
                for w in waiting:
                    p = self._peers.get(w[0]) or self._peer(w[0])
                    if not (p.rx_cur is None and self._take(p, w[1], tag, w[2])):
                        left.append(w)
            if not left or time.monotonic() > end:
                return left
            waiting = left
            if self._spin_yields:
                os.sched_yield()

    def _take(self, p: _Peer, buf: np.ndarray, tag: Tag, reduce: Optional[ReduceFn]) -> bool:
        """Receive a small message on the spot if it is the next record of the ring, whole, and
        no earlier receive of its communicator waits: no request object, no matching queue.
        False (nothing consumed): the caller posts the receive as usual."""
        ib = p.inbox
        if ib.errors or ib.posted.get(tag[0]) or ib.unexpected.get(tag[0]):
            return False
        tail = p.rx_tail
        if tail == p.rx_head:
            p.rx_head = p.rx_q[_HEAD]
            if tail == p.rx_head:
                return False
        pos = tail % p.rx_size
        h = p.rx_data + pos
        comm, seq, _, call, count, total, off, c = _HDR.unpack_from(p.rx_mm, h)
        if c == _WRAP_REC:            # the record is at the ring's start (c < 0 would
            # also match the single-copy descriptors, which are records of their own)
            tail += p.rx_size - pos
            p.rx_tail = tail
            p.rx_q[_TAIL] = tail
            if tail == p.rx_head:
                p.rx_head = p.rx_q[_HEAD]
                if tail == p.rx_head:
                    return False
            h = p.rx_data
            comm, seq, _, call, count, total, off, c = _HDR.unpack_from(p.rx_mm, h)
        n = buf.nbytes
        if not (c == total == n and comm == tag[0] and seq == tag[1] and call == tag[3]
                and count == tag[4]) or not buf.flags.c_contiguous:
            return False              # a wrap marker, a chunk, another call: the usual path
        if n:
            flat = buf if buf.ndim == 1 else buf.reshape(-1)
            dt = flat.dtype
            ring = p.rx_typed.get(dt)
            if ring is None:
                # the whole segment as this dtype, made once: a record's payload is then one
                # slice (records start on 64-byte boundaries, so every itemsize divides them)
                ring = p.rx_typed[dt] = np.frombuffer(p.rx_mm, dtype=dt)
            i = (h + HDR) // dt.itemsize
            if reduce is None:
                if n > EAGER:         # a record of the small path's upper sizes (small_bytes)
                    bytecopy.copy(flat, ring[i:i + flat.shape[0]])
                else:
                    flat[...] = ring[i:i + flat.shape[0]]
            else:
                reduce(flat, ring[i:i + flat.shape[0]])
        tail += HDR + ((n + 63) & ~63)
        p.rx_tail = tail
        p.rx_q[_TAIL] = tail          # hand the space back
        _fence_acquire()              # fence(), inline
        _fence_release()
        if p.flag_q[_SLEEPING]:
            self._ring_if_sleeping(p)
        else:
            p.owed = False
        return True

    def _put(self, p: _Peer, buf: np.ndarray, tag: Tag) -> bool:
        """Write a small message as one record if it fits where the ring's head is (the caller
        checked that no send is queued before it): no request object, no queue. False: it does
        not fit now; the caller queues it."""
        n = buf.nbytes
        size, head = p.tx_size, p.tx_head
        pos = head % size
        need = HDR + ((n + 63) & ~63)
        if need > size - pos or need > size - head + p.tx_tail:
            p.tx_tail = tail = p.tx_q[_TAIL]          # the cached tail may be stale
            if need > size - pos and size - head + tail >= size - pos + need:
                # no room before the ring's end, room at its start: a wrap marker first
                _HDR.pack_into(p.tx_mm, p.tx_data + pos, 0, 0, 0, 0, 0, 0, 0, _WRAP_REC)
                head += size - pos
                p.tx_head = head
                p.tx_q[_HEAD] = head
                pos = 0
            if need > size - pos or need > size - head + tail:
                return False
        if not buf.flags.c_contiguous:
            raise ValueError("transport buffers must be contiguous")
        h = p.tx_data + pos
        mm = p.tx_mm
        _HDR.pack_into(mm, h, tag[0], tag[1], tag[2], tag[3], tag[4], n, 0, n)
        if n:
            mm[h + HDR:h + HDR + n] = buf       # buffer protocol: a memcpy, no numpy views
        head += need
        p.tx_head = head
        p.tx_q[_HEAD] = head          # publish the record
        return True

    def progress(self) -> bool:
        """One non-blocking pass over every peer with work (called under the progress lock)."""
        active = self._active
        if not active:
            return False
        moved = False
        peers = list(active)
        for p in peers:
            if p.txq and p.closed is None and self._push(p):
                moved = True
            if (p.inbox.n_posted or p.rx_cur is not None) and self._pull(p):
                moved = True
            if p.cma_wait and self._read_done(p):
                moved = True
            if not (p.txq or p.inbox.n_posted or p.rx_cur is not None or p.cma_wait):
                del active[p]
        if moved:
            fence()                   # our head/tail stores before reading their flags
            for p in peers:
                if p.owed:
                    self._ring_if_sleeping(p)
        return moved

    def sleep(self, flag) -> None:
        """Raise (``True``: asleep on the doorbell sockets; ``_SLEEP_FUTEX``: on the futex word)
        or lower our sleeping flag, which peers read before deciding to wake us."""
        if self._flag_q is not None:
            self._flag_q[_SLEEPING] = int(flag)

    def _read_done(self, p: _Peer) -> bool:
        """Complete the single-copy sends whose descriptor the receiver has consumed."""
        tail = p.tx_q[_TAIL]
        w = p.cma_wait
        moved = False
        while w and w[0][0] <= tail:
            w.popleft()[1].done = True
            moved = True
        return moved
    def futex_value(self) -> int:
        """Our futex word, read after the flag is raised and before the last pass (Progress)."""
        return self._futex_i[_FUTEX_WORD]

    def futex_block(self, value: int, timeout: float) -> None:
        """Sleep on our futex word while it still holds ``value``, at most ``timeout`` s."""
        addr = self._futex_addr
        if addr:
            self.futex_sleeps += 1
            try:
                futex.wait(addr, value, timeout)
            except OSError:
                pass                  # unmapped under us by close(): the next pass raises

    def kick(self) -> None:
        """Wake our own futex sleeper (another thread cancelled or closed something)."""
        if self._futex_i is not None and self._futex_addr:
            self._futex_i[_FUTEX_WORD] = self._next_wake_value()
            futex.wake(self._futex_addr, 1 << 30)

    def _next_wake_value(self) -> int:
        # unique per (waker, wake): a waker can never write back the value a sleeper read
        self._wake_seq = (self._wake_seq + 1) & 0xFFFFFF
        return self._wake_seq << 7 | (self.rank & 0x7F)

    def _futex_wake(self, p: _Peer) -> None:
        if p.futex_i is not None and p.futex_addr:
            p.futex_i[_FUTEX_WORD] = self._next_wake_value()
            try:
                futex.wake(p.futex_addr, 1 << 30)
            except OSError:
                pass                  # cannot happen while mapped; never fail a send for it

    def _push(self, p: _Peer) -> bool:
        """Write records of the queued sends into the outbound ring while it has room."""
        size, data, chunk = p.tx_size, p.tx_data, p.tx_chunk
        head, tail = p.tx_head, p.tx_tail
        moved = False
        q = p.txq
        single = p.cma_min if p.cma else -1
        regs = self._reg_starts
        while q:
            req = q[0]
            off = req.off
            nbytes = req.nbytes
            where = (self._registered(req.u8) if regs and off == 0 and nbytes > chunk
                     else None)
            if where is not None or (off == 0 and 0 <= single <= nbytes
                                     and self._single_copy(req.tag[3], nbytes)):
                # one descriptor record; the receiver reads the buffer itself (module doc)
                pos = head % size
                contig = size - pos
                free = size - head + tail
                if (free if free < contig else contig) >= _CMA_RECORD:
                    h = data + pos
                    t = req.tag
                    if where is None:
                        _HDR.pack_into(p.tx_mm, h, t[0], t[1], t[2], t[3], t[4], nbytes, 0,
                                       _CMA_REC)
                        _CMA_ADDR.pack_into(p.tx_mm, h + HDR,
                                            req.u8.__array_interface__["data"][0])
                    else:
                        _HDR.pack_into(p.tx_mm, h, t[0], t[1], t[2], t[3], t[4], nbytes, 0,
                                       _REG_REC)
                        _REG_DESC.pack_into(p.tx_mm, h + HDR, *where)
                    head += _CMA_RECORD
                    p.tx_q[_HEAD] = head          # publish the record
                    moved = True
                    q.popleft()
                    req.off = nbytes
                    p.cma_wait.append((head, req))
                    fence()                       # a sleeping receiver starts reading now
                    self._ring_if_sleeping(p)
                elif contig <= free:
                    _HDR.pack_into(p.tx_mm, data + pos, 0, 0, 0, 0, 0, 0, 0, _WRAP_REC)
                    head += contig
                else:
                    tail = p.tx_q[_TAIL]
                    if size - head + tail == free:
                        break             # ring full: the receiver's doorbell will wake us
                continue
            want = nbytes - off
            if want > chunk:
                want = chunk
            pos = head % size
            contig = size - pos
            free = size - head + tail
            fit = (free if free < contig else contig) - HDR
            if fit >= want:
                c = want
            elif fit >= PAGE:
                c = fit - fit % PAGE  # not the last chunk: keep it a whole number of pages
            elif contig <= free:
                _HDR.pack_into(p.tx_mm, data + pos, 0, 0, 0, 0, 0, 0, 0, _WRAP_REC)
                head += contig
                continue
            else:
                tail = p.tx_q[_TAIL]
                if size - head + tail == free:
                    break             # ring full: the receiver's doorbell will wake us
                continue
            h = data + pos
            t = req.tag
            _HDR.pack_into(p.tx_mm, h, t[0], t[1], t[2], t[3], t[4], nbytes, off, c)
            if c == nbytes:
                p.tx_mm[h + HDR:h + HDR + c] = req.u8
            elif c:
                p.tx_mm[h + HDR:h + HDR + c] = req.u8[off:off + c]
            head += HDR + ((c + 63) & ~63)
            p.tx_q[_HEAD] = head      # publish the record
            moved = True
            p.owed = True
            if c >= EARLY_RING:       # a sleeping receiver starts on this chunk now
                fence()
                self._ring_if_sleeping(p)
            off += c
            req.off = off
            if off == nbytes:
                req.done = True
                q.popleft()
        p.tx_head, p.tx_tail = head, tail
        return moved

    def _single_copy(self, call: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` (at least ``_cma_min``) of packed call ``call`` goes as
        a single-copy descriptor: not a reducing call's (module doc), and a point-to-point
        send's only from ``_cma_min_p2p``."""
        if not call & 31:             # the collective bits of a p2p call are 0
            return nbytes >= self._cma_min_p2p
        return self._cma_reduce or not call_reduces(call)

    def _pull(self, p: _Peer) -> bool:
        """Consume records of the inbound ring into their receives (or out of the way)."""
        mm, u8, size, data = p.rx_mm, p.rx_u8, p.rx_size, p.rx_data
        ib = p.inbox
        tail, head = p.rx_tail, p.rx_head
        moved = False
        while True:
            if tail == head:
                head = p.rx_q[_HEAD]
                if tail == head:
                    break
            pos = tail % size
            h = data + pos
            comm, seq, step, call, count, total, off, c = _HDR.unpack_from(mm, h)
            if c == _WRAP_REC:
                tail += size - pos
                continue
            target = p.rx_cur
            if target is None:
                target = ib.match_header(comm, seq, step, call, count, total)
                if target is None:
                    break             # its receive is not posted yet: leave it in the ring
                p.rx_cur = target
            if c == _CMA_REC or c == _REG_REC:
                try:
                    if c == _REG_REC:
                        self._copy_registered(p, target, *_REG_DESC.unpack_from(mm, h + HDR),
                                              total)
                        self.received_single_copy["registered"] += 1
                    else:
                        self._read_from(p, target, _CMA_ADDR.unpack_from(mm, h + HDR)[0], total)
                        self.received_single_copy["cma"] += 1
                except (cma.CmaError, OSError, ValueError) as e:
                    p.closed = p.closed or (
                        "it has exited (a single-copy read found no such process)"
                        if e.errno == errno.ESRCH else f"a single-copy read from it failed: {e}")
                    break
                tail += _CMA_RECORD
                p.rx_q[_TAIL] = tail  # the sender's buffer is free again
                target.off = total
                moved = True
                p.rx_cur = None
                if target.__class__ is Req:
                    target.done = True
                else:
                    ib.complete(target)
                continue
            if c == total and target.reduce is not None and target.buf.ndim == 1:
                # a whole message reduced straight from a typed view of the landing memory
                buf = target.buf
                target.reduce(buf, np.ndarray(buf.shape, buf.dtype, mm, h + HDR))
            elif c:
                deliver(target, off, u8[h + HDR:h + HDR + c])
            tail += HDR + ((c + 63) & ~63)
            p.rx_q[_TAIL] = tail      # hand the space back at once
            off += c
            target.off = off
            moved = True
            if off == total:
                p.rx_cur = None
                if target.__class__ is Req:
                    target.done = True
                else:
                    ib.complete(target)
        if moved:
            p.owed = True
        p.rx_tail, p.rx_head = tail, head
        return moved

    # ------------------------------------------------------------------ registered memory
    def register_memory(self, nbytes: int) -> np.ndarray:
        """A page-aligned uint8 array of ``nbytes`` in a segment of its own that the peers of
        this node map when a message comes from it (module doc, "Registered memory")."""
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            self._reg_serial += 1
            serial = self._reg_serial
        path = f"{segment_path(self.job_id, self.rank)}-reg{serial}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _linked.add(path)
        try:
            mm = _reserve_and_map(fd, size, f"{size} bytes of registered memory",
                                  "enlarge /dev/shm or free registered buffers", mmap.MAP_SHARED)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        u8 = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        start = u8.__array_interface__["data"][0]
        with self._lock:
            self._reg[start] = (start + size, serial, path, mm)
            self._reg_starts = sorted(self._reg)
        return u8

    def free_memory(self, arr: np.ndarray) -> bool:
        """Stop sharing the registered memory ``arr`` lies in (its name goes; the array stays
        valid, now private). False if it is not registered here."""
        key = self._region_of(arr.__array_interface__["data"][0], 0)
        if key is None:
            return False
        with self._lock:
            entry = self._reg.pop(key, None)
            self._reg_starts = sorted(self._reg)
        if entry is not None:
            _unlink(entry[2])
        return entry is not None

    def is_registered(self, arr: np.ndarray) -> bool:
        return self._region_of(arr.__array_interface__["data"][0], arr.nbytes) is not None

    def _region_of(self, addr: int, nbytes: int) -> Optional[int]:
        starts = self._reg_starts
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0:
            return None
        start = starts[i]
        entry = self._reg.get(start)
        if entry is None or addr + nbytes > entry[0]:
            return None
        return start

    def _registered(self, u8: np.ndarray) -> Optional[tuple]:
        """(serial, offset) of a send buffer lying wholly in registered memory, else None."""
        addr = u8.__array_interface__["data"][0]
        start = self._region_of(addr, u8.nbytes)
        if start is None:
            return None
        return self._reg[start][1], addr - start

    def _copy_registered(self, p: _Peer, target, serial: int, off: int, total: int) -> None:
        """Copy (or reduce) ``total`` bytes at ``off`` of ``p``'s registered segment ``serial``
        into ``target``, mapping the segment on first use."""
        key = (p.rank, serial)
        m = self._reg_maps.pop(key, None)
        if m is None:
            path = f"{segment_path(self.job_id, p.rank)}-reg{serial}"
            fd = os.open(path, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            m = (mm, np.frombuffer(mm, dtype=np.uint8))
            while len(self._reg_maps) >= _REG_MAPS:      # forget the least recently used
                self._reg_maps.pop(next(iter(self._reg_maps)))
        self._reg_maps[key] = m                          # most recently used last
        if off + total > m[1].shape[0]:
            raise ValueError(f"registered descriptor past the end of {key}")
        src = m[1]
        # in cache-sized pieces: one memcpy (or ufunc) of many MiB runs slower here (executor.py);
        # a copy through bytecopy: a registered (page-aligned) source and a plain numpy
        # destination lie 16 bytes apart modulo a page, memmove's slow case
        for lo in range(0, total, _PIECE):
            hi = min(total, lo + _PIECE)
            if target.reduce is None:
                bytecopy.copy(target.u8[lo:hi], src[off + lo:off + hi])
            else:
                deliver(target, lo, src[off + lo:off + hi])

    def _read_from(self, p: _Peer, target, addr: int, total: int) -> None:
        """Read a single-copy message of ``total`` bytes at ``addr`` in ``p``'s memory: straight
        into ``target``'s bytes, or piecewise through a scratch that stays in cache -- for a
        reducing receive, which the collectives' reducing calls never meet (they keep the ring)
        but the transport contract allows on any message, reducing from it; and where the
        destination lies 1-31 bytes past the source modulo a page, where the kernel's copy (``rep
        movsb``) runs at a fifth of its pace (bytecopy.py; measured 1.4 against 6.1-6.9 GB/s at
        512 KiB), copying from a scratch placed at the source's page offset (the kernel's copy
        then aligned, ours through bytecopy)."""
        dst = target.u8[:total]
        if target.reduce is None and not bytecopy.page_skewed(bytecopy.address(dst), addr):
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

    def _ring_if_sleeping(self, p: _Peer) -> None:
        """Ring ``p``'s doorbell if it may be asleep; the caller fenced after its last store."""
        p.owed = False
        asleep = p.flag_q[_SLEEPING]
        if not asleep or p.sock is None:
            return
        if asleep == _SLEEP_FUTEX and p.futex_addr:
            self._futex_wake(p)
            return
        try:
            p.sock.send(_WAKE, _NOWAIT)
        except BlockingIOError:
            pass                      # unread doorbells are pending: the peer will wake anyway
        except OSError as e:
            if p.closed is None:
                p.closed = f"its shm link failed ({e.strerror or e})"

    def _on_doorbell(self, p: _Peer) -> None:
        """Drain the doorbell socket (epoll is edge-triggered); EOF means the peer is gone."""
        while p.sock is not None:
            try:
                data = p.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as e:
                p.closed = p.closed or f"its shm link failed ({e.strerror or e})"
                data = b""
            if not data:
                p.closed = p.closed or "it closed its shm link (exited or crashed)"
                self._progress.unregister(p.fd)
                return
            if p.closed is not None and p.closed.startswith(_ABORTED):
                p.closed += data.decode(errors="replace")     # the reason, continued
            elif _ABORT in data:
                p.closed = _ABORTED + data[data.index(_ABORT) + 1:].decode(errors="replace")
            elif _BYE in data and p.closed is None:
                p.closed = CLEAN_CLOSE + " (it finished)"

    def _link(self, peer: int):
        return self._peers[peer]

    def _peek_all(self, p: _Peer):
        """The headers (comm, seq, step, call, count) of the records in ``p``'s inbound ring,
        oldest first, at most ``PEEK_RECORDS``, none consumed: a rank about to block sees an
        abort notice that sits behind a message nobody has received yet (a message of this very
        call, for a later step), not only the head of the stream. A closed peer's too: what it
        published before it left stays readable (the ring is in our segment), and the notice
        of a rank that broke the communicator and then finished is its last record."""
        if p.rx_mm is None:
            return
        tail, head = p.rx_tail, p.rx_q[_HEAD]
        size, data, mm = p.rx_size, p.rx_data, p.rx_mm
        seen = 0
        while tail != head and seen < PEEK_RECORDS:
            pos = tail % size
            comm, seq, step, call, count, total, off, c = _HDR.unpack_from(mm, data + pos)
            if c == _WRAP_REC:
                tail += size - pos
                continue
            seen += 1
            yield comm, seq, step, call, count
            # a descriptor record (single copy, registered) has a fixed size, a chunk its bytes
            tail += _CMA_RECORD if c < 0 else HDR + ((c + 63) & ~63)

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

    def _links(self):
        return self._peers.values()

    # --------------------------------------------------------------------------- lifetime
    def abort(self, reason: str) -> None:
        with self._lock:
            if self._aborted is not None or self._closed:
                return
            self._aborted = reason
            for p in self._peers.values():
                if p.sock is None:
                    continue
                try:
                    p.sock.send(_ABORT + reason.encode()[:2000], _NOWAIT)
                    p.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self._futex_wake(p)   # a peer asleep on its word reads the reason now

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in self._peers.values():
                if p.fd >= 0:
                    self._progress.unregister(p.fd)
                if p.sock is not None and self._aborted is None:
                    try:
                        p.sock.send(_BYE, _NOWAIT)    # orderly: peers tell it from a crash
                    except OSError:
                        pass
                    self._futex_wake(p)
        self._progress.detach(self)
        self._teardown()

    def _teardown(self) -> None:
        """Release sockets, mappings and the segment name; safe on a half-built transport.
        Messages already in a peer's ring stay readable by it: its own mapping outlives ours."""
        if self._path is not None:
            _unlink(self._path)
        for entry in getattr(self, "_reg", {}).values():
            _unlink(entry[2])         # the arrays stay valid (private) until they are garbage
        if getattr(self, "_reg", None):
            self._reg.clear()
            self._reg_starts = []
        if getattr(self, "_reg_maps", None):
            self._reg_maps.clear()
        maps = []
        for p in self._peers.values():
            if p.sock is not None:
                p.sock.close()
                p.sock = None
            if getattr(p, "tx_mm", None) is not None:
                maps.append(p.tx_mm)
            p.futex_addr = 0
            for name in ("tx_q", "rx_q", "flag_q", "futex_i"):  # release the exports first
                view = getattr(p, name, None)
                if view is not None:
                    view.release()
            for name in ("tx_mm", "tx_u8", "tx_q", "rx_mm", "rx_u8", "rx_q", "flag_q", "futex_i"):
                setattr(p, name, None)
            p.txq.clear()
            p.cma_wait.clear()
            p.rx_cur = None
            p.rx_typed = {}
        if self._flag_q is not None:
            self._flag_q.release()
            self._flag_q = None
        self.futex_ok, self._futex_addr = False, 0
        if self._futex_i is not None:
            self._futex_i.release()
            self._futex_i = None
        if self._mm is not None:
            maps.append(self._mm)
            self._mm = None
        for mm in maps:
            try:
                mm.close()
            except BufferError:       # a caller still holds a view: the GC unmaps it later
                pass
