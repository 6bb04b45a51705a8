"""What the A/B examples (small_path_ab.py, registered_ab.py, hot_case_ab.py,
scatter_header_ab.py) share: one call of every collective on given buffers, and the timing
loop -- every case under every mode, interleaved round by round in the same processes, so drift
on a shared machine hits all alike; the barriers make the loop's time the slowest rank's."""
import statistics
import time

import numpy as np

from minicomm.transports.bytecopy import page_aligned


def aligned(shape) -> np.ndarray:
    """Page-aligned float32 ones: the bench's buffers (benchspec.page_aligned_empty)."""
    a = page_aligned(max(int(np.prod(shape)), 1) * 4).view(np.float32)[:int(np.prod(shape))]
    a = a.reshape(shape)
    a[...] = 1
    return a


def calls_on(comm, make, n: int) -> dict:
    """One call of every collective on ``n`` float32 elements (blocks of ``n // size``), its
    buffers from ``make(shape)``, out-of-place as the bench's."""
    p, r = comm.size, comm.rank
    block, blocks, vec, out_vec = make((n // p,)), make((p, n // p)), make((n,)), make((n,))
    mine, out_blocks = make((n // p,)), make((p, n // p))
    return {
        "broadcast": lambda: comm.broadcast(vec, root=0, out=out_vec),
        "reduce": lambda: comm.reduce(vec, root=0, out=out_vec if r == 0 else None),
        "allreduce": lambda: comm.allreduce(vec, out=out_vec),
        "allgather": lambda: comm.allgather(block, out=out_blocks),
        "reduce_scatter": lambda: comm.reduce_scatter(blocks, out=mine),
        "gather": lambda: comm.gather(block, root=0, out=out_blocks if r == 0 else None),
        "scatter": lambda: comm.scatter(blocks if r == 0 else None, root=0, out=mine),
        "alltoall": lambda: comm.alltoall(blocks, out=out_blocks),
    }


def interleaved(comm, modes: dict, cases: dict, rounds: int, calls: int, warmup: int = 10) -> dict:
    """``modes``: name -> a function that switches to that mode (or a mode's own ``cases``
    dict); ``cases``: name -> a function making one call. Returns {(case, mode): median
    seconds per call} over ``rounds``."""
    times = {}
    for _ in range(rounds):
        for mode, switch in modes.items():
            mode_cases = switch() or cases
            for case, call in mode_cases.items():
                for _ in range(warmup):
                    call()
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                comm.barrier()
                times.setdefault((case, mode), []).append((time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def report(comm, label: str, medians: dict, modes) -> None:
    """Rank 0 prints each case's median per mode and the first mode's time / the second's."""
    if comm.rank != 0:
        return
    a_mode, b_mode = list(modes)[:2]
    for case in dict.fromkeys(c for c, _ in medians):
        a, b = medians[(case, a_mode)] * 1e6, medians[(case, b_mode)] * 1e6
        print(f"n={comm.size} {label} {case:15s} {a_mode} {a:8.1f} us   {b_mode} {b:8.1f} us   "
              f"{a_mode}/{b_mode} {a / b:.2f}", flush=True)
