"""Where a latency-bound call's time goes, split by layer: the 8 B latency rows.

What it found: docs/decisions/small-message-latency-floor.md.

    minicomm run -n 2 examples/layer_profile.py
    minicomm run -n 4 examples/layer_profile.py          # CALLS=5000 by default

For an 8 B allreduce (float32 sum) and a barrier, rank 0 prints per call:

- ``wall``: the call in a loop, the slowest rank's time per call;
- ``cpu``: each rank's CPU per call in that loop (``time.process_time``: user + system), the
  mean over ranks; at n > cores the ranks share the cores, so wall >= cpu * n / cores;
- ``comm+plan``: the same call on a communicator of the same rank, size and link model whose
  transport answers at once (no peer, no shared memory; in this process): the Python above the
  transport -- argument checks, the call cache, the guard, the generated plan (smallpath), the
  reduction kernel;
- ``plan``: the generated straight-line plan alone on that transport;
- ``kernel``: one in-place reduction of the call's message (numpy);
- ``transport``: ``cpu`` - ``comm+plan``: the shm transport's calls (records written and taken,
  doorbell checks) and the polling while the peer's message is on its way;
- ``off-cpu``: ``wall`` - ``cpu``: time the rank did not run (another rank's turn on the core,
  a futex sleep).

The in-process figures are the minimum over repeats (``timeit``): the machine's noise only
adds. Both communicators must choose the same algorithm; the script checks that.
"""
import os
import time
import timeit

import numpy as np

import minicomm as mc
from minicomm.communicator import Communicator
from minicomm.transports.base import Capabilities


class Answering:
    """A transport whose peer has always answered: every message is sent and received on the
    spot (a receive that reduces adds zeros). It declares the eager channel with the real
    transport's ``small_bytes``, so the communicator compiles the same plan; its two-sided core
    is never reached (every eager call succeeds)."""
    name = "answering"

    def __init__(self, rank: int, size: int, small_bytes: int):
        self.rank, self.size, self.small_bytes = rank, size, small_bytes
        self._zeros = {}

    def capabilities(self) -> Capabilities:
        return Capabilities(eager=self)

    def _reduce(self, reduce, buf):
        z = self._zeros.get((buf.dtype, buf.size))
        if z is None:
            z = self._zeros[(buf.dtype, buf.size)] = np.zeros(buf.size, buf.dtype)
        reduce(buf, z)

    def send_now(self, peer, buf, tag):
        return True

    def recv_now(self, peer, buf, tag, reduce, spin):
        if reduce is not None:
            self._reduce(reduce, buf)
        return True

    def sendrecv_now(self, peer, sbuf, rbuf, tag, reduce, spin):
        if reduce is not None:
            self._reduce(reduce, rbuf)
        return 3

    def recv_now_many(self, waiting, tag, spin):
        for _, buf, reduce in waiting:
            if reduce is not None:
                self._reduce(reduce, buf)
        return []

    # the two-sided core: a posted message would mean the plans differ, which main() rules out
    def _posted(self, *args, **kwargs):
        raise NotImplementedError("the answering transport moves eager messages only")

    isend = irecv = wait_all = wait_any = detach = _posted

    def cancel_context(self, ctx, error):
        pass

    def abort(self, reason):
        pass

    def close(self):
        pass


def best_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def main():
    comm = mc.init()
    calls = int(os.environ.get("CALLS", "5000"))
    if comm.caps.eager is None:
        raise SystemExit(f"the {comm.transport.name} transport has no eager channel: the small "
                         "path this profiles runs on shm")
    answering = Answering(comm.rank, comm.size, comm.caps.eager.small_bytes)
    solo = Communicator(answering, comm.rank, comm.size, link_model=comm.link_model)
    x, y = np.ones(2, np.float32), np.empty(2, np.float32)
    cases = {"allreduce 8 B": (lambda c: c.allreduce(x, out=y), "allreduce", 2),
             "barrier": (lambda c: c.barrier(), "barrier", 0)}
    rows = []
    for name, (call, coll, count) in cases.items():
        algo = comm._resolve_algorithm(coll, None, count * 4)
        if solo._resolve_algorithm(coll, None, count * 4) != algo:
            raise SystemExit(f"{name}: the answering communicator chose another algorithm")
        for _ in range(200):
            call(comm)
        comm.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            call(comm)
        wall = time.perf_counter() - t0
        cpu = (time.process_time() - c0) / calls * 1e6
        wall = float(comm.allreduce(np.array([wall / calls * 1e6]), op="max")[0])
        cpu = float(comm.allreduce(np.array([cpu]), op="avg")[0])
        call(solo)
        key = (coll, "sum" if coll == "allreduce" else "none", "auto",
               x.dtype if coll == "allreduce" else np.dtype(np.uint8), count, 0)
        c = solo._calls[key]
        above = best_us(lambda: call(solo), 20000)
        bufs = (x, y, c.tmp if c.tmp is not None else np.empty(0, np.float32))
        plan = best_us(lambda: c.run(bufs, solo.transport, c.kernel, solo._ctx, 1, c.call,
                                     count, 1e12, c.label, 0.0), 20000)
        kernel = best_us(lambda: c.kernel(y, x), 20000) if c.kernel is not None else 0.0
        rows.append((f"{name} ({algo})", wall, cpu, above, plan, kernel, cpu - above,
                     wall - cpu))
    if comm.rank == 0:
        print(f"n={comm.size}, {os.cpu_count()} cores, {calls} calls; us per call")
        head = ("call", "wall", "cpu", "comm+plan", "plan", "kernel", "transport", "off-cpu")
        print(f"{head[0]:24s}" + "".join(f"{h:>11s}" for h in head[1:]))
        for r in rows:
            print(f"{r[0]:24s}" + "".join(f"{v:11.2f}" for v in r[1:]))
    solo.close()
    comm.close()


if __name__ == "__main__":
    main()
