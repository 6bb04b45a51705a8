"""The floor under the 8 B allreduce latency row: the least a pure-Python exchange costs here.

What it found: docs/decisions/small-message-latency-floor.md.

    python examples/latency_floor.py            # ROUNDS=5 CALLS=20000 by default

Two processes (fork) share one page of memory. Each "allreduce" of two float32 is what any
pure-Python shared-memory implementation must do at the least: write its 8 B and a sequence
number into its own cache line, spin until the peer's sequence number arrives (no yield, no
sleep, no timeout, no lock), read the peer's 8 B and add them with numpy. No communicator, no
argument checks, no tags, no mismatch detection, no dead-peer check: everything a library adds
is left out, so a library's call costs at least this.

Printed per round (the two processes run ``CALLS`` exchanges back to back): microseconds per
exchange for

- ``floor``: the exchange above, with the numpy add of the peer's values (what an allreduce needs);
- ``no numpy``: the same exchange, the sum done in Python on the two unpacked floats;
- ``seq only``: only the sequence numbers cross (a barrier's floor).

The parent prints the median over rounds. Compare with MPICH's 8 B allreduce
(``minicomm bench allreduce -b 8 -e 8 -n 2 --peers mpi``) and the target (6 us).
"""
import mmap
import os
import signal
import statistics
import struct
import time

import numpy as np

LINE = 64                                 # each side writes its own cache line
PHASE_AT = 2 * LINE                       # then each side's phase word, its own line too
_SEQ = struct.Struct("@q")
_SLOT = struct.Struct("@q2f")             # sequence number, then the two float32 values
LIMIT_S = 300                             # SIGALRM ends both processes if anything hangs


def run(me: int, mm: mmap.mmap, first: int, calls: int, mode: str) -> float:
    """``calls`` exchanges, sequence numbers ``first`` .. ``first + calls - 1``; s per call."""
    mine, theirs = me * LINE, (1 - me) * LINE
    values = np.zeros(2, np.float32)        # 0 + 0 stays 0: no scaling to keep values bounded
    words = memoryview(mm).cast("q")
    peer_word = theirs // 8
    t0 = time.perf_counter()
    for seq in range(first, first + calls):
        if mode == "seq only":
            _SEQ.pack_into(mm, mine, seq)
        else:
            _SLOT.pack_into(mm, mine, seq, values[0], values[1])
        while words[peer_word] < seq:
            pass
        if mode == "floor":
            np.add(values, np.frombuffer(mm, np.float32, 2, theirs + 8), out=values)
        elif mode == "no numpy":
            _, a, b = _SLOT.unpack_from(mm, theirs)
            values[0], values[1] = values[0] + a, values[1] + b
    return (time.perf_counter() - t0) / calls


def phase(me: int, mm: mmap.mmap, k: int) -> None:
    """Both processes reach phase ``k`` before either goes on (the timed loops start together)."""
    words = memoryview(mm).cast("q")
    _SEQ.pack_into(mm, PHASE_AT + me * LINE, k)
    while words[(PHASE_AT + (1 - me) * LINE) // 8] < k:
        pass


def main() -> None:
    rounds = int(os.environ.get("ROUNDS", 5))
    calls = int(os.environ.get("CALLS", 20000))
    modes = ("floor", "no numpy", "seq only")
    mm = mmap.mmap(-1, mmap.PAGESIZE)
    results = {m: [] for m in modes}
    signal.alarm(LIMIT_S)
    pid = os.fork()
    me = 1 if pid == 0 else 0
    try:
        seq, k = 1, 0
        for _ in range(rounds):
            for mode in modes:
                k += 1
                phase(me, mm, k)
                results[mode].append(run(me, mm, seq, calls, mode))
                seq += calls
    finally:
        if pid == 0:
            os._exit(0)
    os.waitpid(pid, 0)
    signal.alarm(0)
    print(f"bare pure-Python exchange between two processes, {calls} calls x {rounds} rounds, "
          f"{os.cpu_count()} cores; us per exchange (median of rounds):")
    for mode in modes:
        print(f"  {mode:10s} {statistics.median(results[mode]) * 1e6:6.2f}   "
              f"(rounds: {', '.join(f'{t * 1e6:.2f}' for t in results[mode])})")


if __name__ == "__main__":
    main()
