"""One rank of a job in tests/test_launchers.py's "two jobs on one port" runs (not a test module).

Each job's data depends on JOB_TAG, so a world that mixed ranks of two jobs sums to a value
neither job expects: a mix cannot pass unnoticed. Prints exactly one line per rank:
``OK <tag> <rank>`` or ``WRONG ...`` (exit 2), or ``CLEANERR <exception>: <first line>`` when
mc.init() refused the job (exit 3).
"""
import os
import sys

import numpy as np

import minicomm as mc

tag = int(os.environ["JOB_TAG"])
try:
    comm = mc.init()
except mc.CommError as e:
    os.write(1, f"CLEANERR {type(e).__name__}: {str(e).splitlines()[0]}\n".encode())
    sys.exit(3)
x = np.full(5, 1000 * tag + comm.rank, dtype=np.int64)
y = comm.allreduce(x)
want = sum(1000 * tag + r for r in range(comm.size))
ok = bool((y == want).all())
# one write per line: the ranks of a job may share one stdout
os.write(1, (f"OK {tag} {comm.rank}\n" if ok
             else f"WRONG {tag} {comm.rank}: got {y.tolist()} want {want}\n").encode())
comm.close()
sys.exit(0 if ok else 2)
