"""UB memory semantics: rank 0's array read and written by the others with load / store.

    minicomm run -n 3 --transport ub examples/ub_load_store.py              # one node
    minicomm run -n 3 --nodes 3 --transport ub examples/ub_load_store.py    # every rank a node

Rank 0 registers a segment (read / write / atomic access, a token) and publishes its (EID, VA)
description; each other rank imports it with the token -- the owner checks it -- and then works
on rank 0's memory with plain synchronous loads and stores: rank r stores its row, loads rank
0's header, and bumps a shared word with an atomic fetch-and-add. Rank 0 only waits at a
barrier meanwhile; nothing of it serves the accesses (inside a node they are real loads and
stores on its mapped memory; across nodes its UB agent thread serves them). A wrong token is
refused, as the URMA model requires.
"""
import numpy as np

import minicomm as mc
from minicomm.transports import ub

comm = mc.init()
if comm.transport.name != "ub":
    raise SystemExit("run this with --transport ub")
ep = comm.transport.ub
ROW = 16                                            # bytes per rank in rank 0's segment
TOKEN = 0x5EED

info = None
if comm.rank == 0:
    seg = ep.register_segment(8 + ROW * comm.size, ub.ACCESS_READ | ub.ACCESS_WRITE |
                              ub.ACCESS_ATOMIC, token=TOKEN)
    seg.buf[:8] = np.frombuffer(b"UB-HELLO", dtype=np.uint8)
    info = seg.info.pack()
info = ub.SegmentInfo.unpack(comm.broadcast_object(info, root=0))
comm.barrier()

if comm.rank != 0:
    try:
        ep.import_segment(info, token=TOKEN + 1)
    except mc.RMAError as e:
        refused = e.status
    tseg = ep.import_segment(info, token=TOKEN)
    hello = tseg.load(info.va, 8).tobytes().decode()
    row = np.full(ROW, comm.rank, dtype=np.uint8)
    tseg.store(info.va + 8 + ROW * comm.rank, row)                  # our row of rank 0's array
    back = tseg.load(info.va + 8 + ROW * comm.rank, ROW)
    tseg.fadd(info.va + 8, 1)                                       # rank 0's row 0: a counter
    print(f"rank {comm.rank} (eid {ub.format_eid(ep.eid)}): loaded {hello!r}, stored and read "
          f"back its row: {'ok' if np.array_equal(back, row) else 'WRONG'}; a wrong token: {refused}")
comm.barrier()                                      # everyone's stores are done
if comm.rank == 0:
    rows = seg.buf[8:].reshape(comm.size, ROW)
    count = int(seg.buf[8:16].view(np.int64)[0])
    ok = all((rows[r] == r).all() for r in range(1, comm.size)) and count == comm.size - 1
    print(f"rank 0: rows {[int(rows[r, 0]) for r in range(1, comm.size)]} from the others, "
          f"counter {count}: {'ok' if ok else 'WRONG'}")
    ep.unregister_segment(seg)
comm.close()
