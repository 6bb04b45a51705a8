"""The collective matrix, run inside every rank against an independent numpy reference.

Inputs have a closed form per (rank, element), so every rank can build every other rank's input
and compute the expected result with plain numpy (``ufunc.reduce`` over the stacked inputs, fancy
indexing for the data movement) — nothing of minicomm is used to compute what is expected.
Values are small integers (floats too), so sums and products are exact in every reduction order
and results can be compared with ``array_equal``; ``avg`` is compared with a tolerance.
"""
from __future__ import annotations

import numpy as np

REFERENCE_UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
                   "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
                   "avg": np.add}


def rank_input(rank: int, shape, dtype, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: small values in {-1, 0, 1, 2} (bool: a rank-dependent pattern)."""
    n = int(np.prod(shape)) if len(shape) else 1
    i = np.arange(n, dtype=np.int64)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        v = ((i * (rank + 1) + salt) % 3) == 0
    else:
        v = (i * (rank + 2) + 3 * rank + salt) % 4 - 1
        if dtype.kind == "u":
            v = v + 1
    return v.astype(dtype).reshape(shape)


def ops_for(dtype) -> list:
    kind = np.dtype(dtype).kind
    if kind == "b":
        return ["sum", "min", "max", "band", "bor", "bxor"]
    if kind in "iu":
        return ["sum", "prod", "min", "max", "band", "bor", "bxor"]
    return ["sum", "prod", "min", "max", "avg"]


def reference(coll: str, p: int, rank: int, inputs, op=None, root=0):
    """Expected output on ``rank`` given every rank's input (list indexed by rank)."""
    stack = np.stack(inputs)
    if coll in ("allreduce", "reduce", "reduce_scatter"):
        red = REFERENCE_UFUNC[op].reduce(stack, axis=0, dtype=stack.dtype)
        if op == "avg":
            red = red / p
        if coll == "reduce":
            return red if rank == root else None
        if coll == "reduce_scatter":
            return red[rank]
        return red
    if coll == "broadcast":
        return inputs[root]
    if coll == "allgather":
        return stack
    if coll == "gather":
        return stack if rank == root else None
    if coll == "scatter":
        return inputs[root][rank]
    if coll == "alltoall":
        return stack[:, rank]
    raise ValueError(coll)


def _same(got, want, op) -> bool:
    if want is None:
        return got is None
    if got is None or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if op == "avg":
        return np.allclose(got, want, rtol=1e-5, atol=1e-6)
    return np.array_equal(got, want)


def run_call(comm, coll, x, op, root, algorithm, out=None):
    if coll == "allreduce":
        return comm.allreduce(x, op=op, algorithm=algorithm, out=out)
    if coll == "reduce":
        return comm.reduce(x, root=root, op=op, algorithm=algorithm, out=out)
    if coll == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algorithm=algorithm, out=out)
    if coll == "broadcast":
        return comm.broadcast(x, root=root, algorithm=algorithm, out=out)
    if coll == "allgather":
        return comm.allgather(x, algorithm=algorithm, out=out)
    if coll == "gather":
        return comm.gather(x, root=root, algorithm=algorithm, out=out)
    if coll == "scatter":
        return comm.scatter(x if comm.rank == root else None, root=root, algorithm=algorithm, out=out)
    if coll == "alltoall":
        return comm.alltoall(x, algorithm=algorithm, out=out)
    raise ValueError(coll)


BLOCKED = ("reduce_scatter", "scatter", "alltoall")   # inputs of shape (p, *block)
COLLS = ("allreduce", "reduce", "reduce_scatter", "broadcast", "allgather", "gather", "scatter",
         "alltoall")


def check_one(comm, coll, algorithm, count, dtype, op=None, root=0, inplace=False, salt=0) -> int:
    """One call, checked. Returns 1; raises AssertionError with the case on a wrong result."""
    p, r = comm.size, comm.rank
    shape = (p, count) if coll in BLOCKED else (count,)
    inputs = [rank_input(q, shape, dtype, salt) for q in range(p)]
    x = inputs[r].copy()
    before = x.copy()
    want = reference(coll, p, r, inputs, op, root)
    out = None
    if inplace and coll in ("allreduce", "broadcast", "alltoall") or (
            inplace and coll == "reduce" and r == root):
        out = x
    got = run_call(comm, coll, x, op, root, algorithm, out=out)
    case = (f"{coll} algorithm={algorithm} p={p} rank={r} count={count} dtype={np.dtype(dtype)} "
            f"op={op} root={root} inplace={out is not None}")
    assert _same(got, want, op), f"wrong result: {case}\n got {got!r}\nwant {want!r}"
    if out is not None:
        assert got is out, f"out= not returned: {case}"
    else:
        assert np.array_equal(x, before), f"input modified by out-of-place call: {case}"
    return 1


def matrix(comm, algorithm, counts=(0, 1, 7), dtypes=("int32", "float64", "bool"),
           all_roots=True, every_op=True, colls=COLLS, barrier=True) -> int:
    """The Gloo-style matrix for one communicator and one algorithm (its collectives ``colls``,
    and its barrier unless ``barrier`` is False: then auto's); returns the number of checks."""
    p = comm.size
    n = 0
    roots = range(p) if all_roots else sorted({0, p - 1})
    for dtype in dtypes:
        ops = ops_for(dtype) if every_op else ops_for(dtype)[:1]
        for count in counts:
            for coll in colls:
                if coll in ("allreduce", "reduce", "reduce_scatter"):
                    for op in ops:
                        for root in (roots if coll == "reduce" else [0]):
                            n += check_one(comm, coll, algorithm, count, dtype, op, root,
                                           inplace=(op == ops[0] and count > 1))
                elif coll in ("broadcast", "gather", "scatter"):
                    for root in roots:
                        n += check_one(comm, coll, algorithm, count, dtype, None, root,
                                       inplace=(root == 0 and count > 1))
                else:
                    for inplace in (False, True):
                        n += check_one(comm, coll, algorithm, count, dtype, None, 0, inplace)
    comm.barrier(algorithm=algorithm if barrier else "auto")
    return n
