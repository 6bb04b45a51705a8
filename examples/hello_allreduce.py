"""Hello, allreduce: `minicomm run -n 4 examples/hello_allreduce.py` prints one line per rank.

Each rank contributes [rank, rank, rank, rank]; the sum over ranks is 0+1+...+(n-1) everywhere.
It runs unchanged under other launchers too (docs/guide/launching.md):
`mpiexec -n 4 python examples/hello_allreduce.py`, `mpirun -n 4 ...`, `srun -n 4 ...`,
`torchrun --standalone --nproc-per-node 4 examples/hello_allreduce.py`.
"""
import sys

import numpy as np

import minicomm as mc

comm = mc.init()
x = np.full(4, comm.rank, dtype=np.int64)
y = comm.allreduce(x)
expected = sum(range(comm.size))
status = "ok" if (y == expected).all() else "WRONG"
# one write per line: under torchrun or srun the ranks may share one stdout
sys.stdout.write(f"rank {comm.rank}/{comm.size} on node {comm.node}: allreduce sum = "
                 f"{y.tolist()} (expected {expected}) {status}\n")
sys.stdout.flush()
comm.close()
