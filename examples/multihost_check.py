"""Every collective x every algorithm, checked against numpy, on whatever world it is started in.

    minicomm run --hostfile hosts examples/multihost_check.py       # across hosts (ssh)
    minicomm run -n 4 --nodes 2 examples/multihost_check.py         # or on one box

Each rank's input has a closed form in (rank, element), so every rank builds every other rank's
input and computes the expected result with plain numpy (``ufunc.reduce`` over the stacked
inputs, indexing for the data movement) — nothing of minicomm computes what is expected. Values
are small integers, so sums and products are exact in any reduction order and results compare
with ``array_equal``. A wrong result raises AssertionError naming the case (non-zero exit).

Each rank prints one JSON line: its rank, host, node, local rank, the transports it uses to each
peer (``comm.transport.describe()``) and the number of checks that passed.
"""
import json
import socket
import sys

import numpy as np

import minicomm as mc

ALGORITHMS = ("ring", "tree", "rhd", "hier", "auto")
COUNTS = (0, 1, 7, 3001)       # empty, one element, odd, and large enough to split into chunks
OPS = {"float32": ("sum", "max", "avg"), "int64": ("sum", "prod", "bxor")}
UFUNC = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "bxor": np.bitwise_xor,
         "avg": np.add}


def rank_input(rank, shape, dtype, salt):
    """Values in {-1, 0, 1, 2}, different per rank, element and call (salt)."""
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    return ((i * (rank + 2) + 3 * rank + salt) % 4 - 1).astype(dtype).reshape(shape)


class Checker:
    def __init__(self, comm):
        self.comm, self.p, self.r = comm, comm.size, comm.rank
        self.n = 0
        self.salt = 0

    def inputs(self, shape, dtype):
        self.salt += 1      # a fresh pattern per call: a result left over from the last call fails
        return [rank_input(q, shape, dtype, self.salt) for q in range(self.p)]

    def expect(self, got, want, case, approx=False):
        ok = (got is None) if want is None else (
            got is not None and got.shape == want.shape and got.dtype == want.dtype and
            (np.allclose(got, want, rtol=1e-6) if approx else np.array_equal(got, want)))
        assert ok, f"rank {self.r}: wrong result for {case}\n got {got!r}\nwant {want!r}"
        self.n += 1

    def collectives(self, algo, count, dtype):
        c, p, r = self.comm, self.p, self.r
        where = f"algorithm={algo} p={p} count={count} dtype={dtype}"
        for op in OPS[dtype]:
            for coll in ("allreduce", "reduce_scatter"):
                shape = (count,) if coll == "allreduce" else (p, count)
                xs = self.inputs(shape, dtype)
                want = UFUNC[op].reduce(np.stack(xs), axis=0, dtype=dtype)
                if op == "avg":
                    want = want / p
                if coll == "allreduce":
                    got = c.allreduce(xs[r], op=op, algorithm=algo)
                else:
                    got, want = c.reduce_scatter(xs[r], op=op, algorithm=algo), want[r]
                self.expect(got, want, f"{coll} op={op} {where}", approx=op == "avg")
            for root in range(p):
                xs = self.inputs((count,), dtype)
                want = UFUNC[op].reduce(np.stack(xs), axis=0, dtype=dtype)
                if op == "avg":
                    want = want / p
                got = c.reduce(xs[r], root=root, op=op, algorithm=algo)
                self.expect(got, want if r == root else None, f"reduce op={op} root={root} {where}",
                            approx=op == "avg")
        for root in range(p):
            xs = self.inputs((count,), dtype)
            self.expect(c.broadcast(xs[r], root=root, algorithm=algo), xs[root],
                        f"broadcast root={root} {where}")
            xs = self.inputs((count,), dtype)
            self.expect(c.gather(xs[r], root=root, algorithm=algo),
                        np.stack(xs) if r == root else None, f"gather root={root} {where}")
            xs = self.inputs((p, count), dtype)
            self.expect(c.scatter(xs[r] if r == root else None, root=root, algorithm=algo),
                        xs[root][r], f"scatter root={root} {where}")
        xs = self.inputs((count,), dtype)
        self.expect(c.allgather(xs[r], algorithm=algo), np.stack(xs), f"allgather {where}")
        xs = self.inputs((p, count), dtype)
        self.expect(c.alltoall(xs[r], algorithm=algo), np.stack(xs)[:, r], f"alltoall {where}")
        x = xs[r].copy()                                         # in place: out is the input
        self.expect(c.alltoall(x, algorithm=algo, out=x), np.stack(xs)[:, r],
                    f"alltoall in place {where}")
        c.barrier(algorithm=algo)
        self.n += 1

    def point_to_point(self):
        """Every ordered pair, in one global order all ranks follow (so blocking calls cannot
        wait in a cycle): intra-host and inter-host pairs, shape and dtype learnt by recv."""
        c, p, r = self.comm, self.p, self.r
        for a in range(p):
            for b in range(p):
                if a == b or r not in (a, b):
                    continue
                want = rank_input(a, (3, b + 1), "int64" if (a + b) % 2 else "float32", a * p + b)
                if r == a:
                    c.send(want, b, tag=a * p + b)
                else:
                    self.expect(c.recv(a, tag=a * p + b), want, f"send {a} -> recv {b}")


def main():
    comm = mc.init()
    check = Checker(comm)
    algorithms = sys.argv[1].split(",") if len(sys.argv) > 1 else ALGORITHMS
    for algo in algorithms:
        for dtype in OPS:
            for count in COUNTS:
                check.collectives(algo, count, dtype)
    check.point_to_point()
    comm.barrier()
    describe = comm.caps.describe() if comm.caps.describe else comm.transport.name
    print(json.dumps(dict(rank=comm.rank, size=comm.size, host=socket.gethostname(),
                          node=comm.node, local_rank=comm.local_rank, transports=describe,
                          algorithms=list(algorithms), checks=check.n)), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
