"""The memory layout of the shm transport.

Each rank creates one segment, ``/dev/shm/minicomm-<job_id>-<rank>``, holding one inbound ring per
peer on its node (sender -> this rank). The segment's first page holds its header (``_SEG``), the
owner's ``sleeping`` word and futex word (doorbell.py), its setup probe (``_PROBE``, segments.py)
and, from ``_RANKS_AT``, the ranks that send into it. A ring is a control page (``head``: bytes
the sender has published, ``tail``: bytes the receiver has consumed, on separate cache lines,
each written by one side only) and a byte ring of records: a 64-byte header (the Tag, the
message length, the chunk's offset and length) followed by the chunk, padded to 64 bytes. A
record never wraps (a marker sends the reader back to the start), so every chunk is contiguous:
the receiver copies it, or hands it to ``req.reduce(dst, chunk_view)`` straight out of the shared
memory. Messages larger than a chunk (``CHUNK``; ``MINICOMM_SHM_CHUNK``, a multiple of 4096, at
most a quarter of the ring) are streamed record by record, so the sender's copy-in of chunk k+1
overlaps the receiver's reduce-out of chunk k, and messages larger than the ring simply flow
through it. Chunks other than a message's last are multiples of 4096 bytes, so they always end
on an element boundary. Descriptor records (chunk length ``_CMA_REC`` or ``_REG_REC``) carry an
address instead of bytes (singlecopy.py, registered.py). Ring and chunk sizes:
docs/decisions/shm-ring-and-chunk-size.md.

Ordering. ``head``/``tail`` are stored through a ``memoryview`` cast to int64: one aligned
8-byte store, made after the record is written (``struct.pack_into`` would not do: it zeroes the
field before writing it, and a reader can see the zero). On x86-64 (TSO) that store publishes
the record. Weakly ordered CPUs (arm64) would need fences pure Python cannot issue: a known
limitation of this transport.
"""
from __future__ import annotations

import mmap
import os
import re
import struct

import numpy as np

from minicomm.settings import byte_setting

SHM_DIR = "/dev/shm"
PAGE = 4096
HDR = 64                              # record header: 8 int64
CHUNK = 1 << 20                       # streaming unit of large messages
EAGER = 16 << 10                      # isend/irecv move a message this small on the spot
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
_PIECE = 256 << 10                    # single-copy and registered copies go in pieces this large
# Fault the pages in at setup, not on the first large transfer.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_JOB_ID = re.compile(r"[A-Za-z0-9_.-]+")


def segment_path(job_id: str, rank: int) -> str:
    return os.path.join(SHM_DIR, f"minicomm-{job_id}-{rank}")


def _default_ring_bytes(npeers: int) -> int:
    ring = byte_setting("MINICOMM_SHM_RING_BYTES", 0, minimum=16 * PAGE, multiple=PAGE)
    if ring:
        return ring
    # 4 chunks in flight per ring, a rank's inbound rings capped at 64 MiB (reserved up front: a
    # full /dev/shm fails here, not with a SIGBUS later): docs/decisions/shm-ring-and-chunk-size.md
    ring = 4 << 20
    while ring > (256 << 10) and ring * npeers > (64 << 20):
        ring //= 2
    return ring
