"""A shared counter with one-sided fetch_and_op: every rank takes tickets from rank 0's window.

    minicomm run -n 4 examples/rma_counter.py                       # shm windows
    minicomm run -n 4 --nodes 2 --transport rdma examples/rma_counter.py   # simulated RDMA NIC
    minicomm run -n 4 --nodes 2 --transport ub examples/rma_counter.py     # simulated UB

Rank 0 holds the counter and does nothing for it (passive target: it just waits at the closing
fence). Each rank takes 1,000 tickets with ``fetch_and_op(1, target=0)``; every ticket is handed
out exactly once, so the union of all tickets is 0 .. 1000 * size - 1 and the counter ends there.
"""
import numpy as np

import minicomm as mc

TICKETS = 1000

comm = mc.init()
win = comm.window(np.zeros(1, dtype=np.int64))     # rank 0's element is the counter
win.lock(0, exclusive=False)                       # a shared lock: everyone at once
mine = [int(win.fetch_and_op(1, target=0, offset=0)) for _ in range(TICKETS)]
win.unlock(0)
win.fence()
final = int(win.get(0, 0, 1)[0])
win.free()

every = comm.gather_object(mine, root=0)
if comm.rank == 0:
    tickets = sorted(t for ts in every for t in ts)
    ok = tickets == list(range(TICKETS * comm.size)) and final == TICKETS * comm.size
    print(f"{comm.size} ranks over {comm.transport.name}: {len(tickets)} tickets, counter = "
          f"{final}, each ticket once: {'ok' if ok else 'WRONG'}")
comm.close()
