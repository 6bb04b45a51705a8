"""A thread-world stand-in for the issue-9 point-to-point API (send/isend/recv/irecv, tags,
ANY_SOURCE, status, timeouts, PeerFailure with .peer), used to drive the parameter server's loops
before and independently of the real transports. Eager: a send copies into the receiver's
mailbox and completes at once."""
from __future__ import annotations

import threading
import time
import traceback

import numpy as np

from minicomm.errors import CommTimeout, PeerFailure

ANY = -1


class Status:
    source = tag = nbytes = dtype = shape = None


class Fabric:
    def __init__(self, size):
        self.size = size
        self.cond = threading.Condition()
        self.boxes = [[] for _ in range(size)]       # (context, src, tag, array)
        self.dead = set()
        self.reported = [set() for _ in range(size)]

    def kill(self, rank, clean=False):
        """``rank`` is gone; a clean exit (its function returned) is, as on the real transports,
        no failure for ANY_SOURCE receivers: only receives naming it fail."""
        with self.cond:
            self.dead.add(rank)
            if clean:
                for seen in self.reported:
                    seen.add(rank)
            self.cond.notify_all()


class _Done:
    def __init__(self, fn=None, value=None):
        self.fn, self.value, self.status = fn, value, Status()

    def wait(self, timeout=None):
        if self.fn is not None:
            self.value = self.fn(timeout, self.status)
            self.fn = None
        return self.value


class FakeComm:
    def __init__(self, fabric, rank, context=0, timeout=30.0):
        self.fabric, self.rank, self.size, self.context = fabric, rank, fabric.size, context
        self.timeout = timeout
        self._splits = 0

    def split(self, color, key=None):
        self._splits += 1
        return FakeComm(self.fabric, self.rank, self.context * 31 + self._splits, self.timeout)

    def close(self):
        pass

    def send(self, x, dst, tag=0):
        f = self.fabric
        with f.cond:
            if dst in f.dead:
                e = PeerFailure(f"rank {dst} is dead")
                e.peer = dst
                raise e
            f.boxes[dst].append((self.context, self.rank, tag, np.array(x, copy=True)))
            f.cond.notify_all()

    def isend(self, x, dst, tag=0):
        self.send(x, dst, tag)
        return _Done()

    def recv(self, src, tag=0, out=None, status=None, timeout=None):
        f = self.fabric
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        with f.cond:
            while True:
                box = f.boxes[self.rank]
                for i, (ctx, s, t, a) in enumerate(box):
                    if ctx == self.context and (src == ANY or s == src) and (tag == ANY or t == tag):
                        if out is not None:
                            if out.dtype != a.dtype:
                                raise TypeError(f"dtype {a.dtype} into {out.dtype}")
                            if out.size != a.size:
                                raise ValueError(f"{a.size} elements into {out.size}")
                        del box[i]
                        if status is not None:
                            status.source, status.tag, status.nbytes = s, t, a.nbytes
                            status.dtype, status.shape = a.dtype, a.shape
                        if out is not None:
                            out.reshape(-1)[...] = a.reshape(-1)
                            return out
                        return a
                if src != ANY and src in f.dead:
                    e = PeerFailure(f"rank {src} is dead")
                    e.peer = src
                    raise e
                if src == ANY:
                    fresh = sorted(f.dead - f.reported[self.rank] - {self.rank})
                    if fresh:
                        f.reported[self.rank].add(fresh[0])
                        e = PeerFailure(f"rank {fresh[0]} is dead")
                        e.peer = fresh[0]
                        raise e
                    if f.dead >= set(range(f.size)) - {self.rank}:
                        e = PeerFailure("every other rank failed")
                        e.peer = min(f.dead - {self.rank})
                        raise e
                left = end - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"recv from {src} tag {tag} timed out")
                f.cond.wait(left)

    def irecv(self, src, tag=0, out=None):
        return _Done(lambda timeout, st: self.recv(src, tag, out, st, timeout))


def run_threads(fn, size, timeout=30.0):
    """fn(comm) on ``size`` threads; a rank that raises is marked dead (its peers see
    PeerFailure). Returns (results, {rank: (time, error, traceback)})."""
    fabric = Fabric(size)
    results, errors = [None] * size, {}

    def body(r):
        try:
            results[r] = fn(FakeComm(fabric, r, timeout=timeout))
        except BaseException as e:
            errors[r] = (time.monotonic(), e, traceback.format_exc())
        finally:
            fabric.kill(r, clean=r not in errors)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 3)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors
