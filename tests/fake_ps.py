"""A deliberately tiny stand-in for ``minicomm.ps`` (tests of the PS *trainer* only).

It follows the ``ps.start`` contract of issue 10 with one real server (rank 0; other server
ranks return None at once), no sharding, chunking or checkpoints: one thread per worker, each on
its own two-rank communicator, and a condition variable for the clocks. The real parameter
server is tested by its own tests; this only lets the trainer's call sequence (init, pull,
pushpull, push, final pull, close) run before ``minicomm.ps`` exists.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class SGD:
    def __init__(self, lr, momentum=0.0):
        self.lr = lr


class _Server:
    def __init__(self, num_workers, staleness, lr):
        self.params = None
        self.w, self.staleness, self.lr = num_workers, staleness, lr
        self.clock = [0] * num_workers           # pushes applied per worker
        self.pending = {}                        # sync: clock -> list of gradients
        self.cond = threading.Condition()

    def handle(self, worker, msg):
        kind = msg[0]
        with self.cond:
            if kind == "init":
                if self.params is None or worker == 0:
                    self.params = OrderedDict((k, np.array(v, dtype=np.float64))
                                              for k, v in msg[1].items())
                return None
            if kind == "pull":
                c = self.clock[worker]
                bound = 0 if self.staleness is None else self.staleness
                if self.staleness is not None:
                    self.cond.wait_for(lambda: min(self.clock) >= c - bound, timeout=60)
                return OrderedDict((k, self.params[k].copy()) for k in msg[1])
            if kind == "push":
                grads = msg[1]
                if self.staleness == 0:
                    c = self.clock[worker]
                    self.pending.setdefault(c, []).append(grads)
                    if len(self.pending[c]) == self.w:
                        clock_grads = self.pending.pop(c)
                        for k in self.params:
                            self.params[k] -= self.lr * (sum(g[k] for g in clock_grads) / self.w)
                    self.clock[worker] += 1
                    self.cond.notify_all()
                    self.cond.wait_for(lambda: c not in self.pending, timeout=60)
                else:
                    for k in self.params:
                        self.params[k] -= self.lr * grads[k]
                    self.clock[worker] += 1
                    self.cond.notify_all()
                return None
        raise ValueError(kind)


class Worker:
    def __init__(self, link):
        self.link = link

    def _call(self, *msg):
        self.link.send_object(msg, 0)
        return self.link.recv_object(0)

    def init(self, params):
        self._call("init", dict(params))
        self.link.barrier()

    def pull(self, names):
        return self._call("pull", list(names))

    def push(self, grads, wait=True):
        self._call("push", dict(grads))
        return 0

    def wait(self, ts):
        pass

    def pushpull(self, grads):
        self.push(grads)
        return self.pull(list(grads))

    def close(self):
        self.link.send_object(("close",), 0)


def start(comm, num_servers=2, staleness=0, optimizer=None, checkpoint_dir=None,
          checkpoint_every=0, resume=False, chunk_bytes=4 << 20):
    workers = list(range(num_servers, comm.size))
    links = {w: comm.split(0 if comm.rank in (0, w) else None) for w in workers}
    if comm.rank >= num_servers:
        return Worker(links[comm.rank])
    if comm.rank != 0:
        return None
    server = _Server(len(workers), staleness, optimizer.lr)
    init_done = threading.Barrier(len(workers))

    def serve(w):
        link = links[w]
        while True:
            msg = link.recv_object(1)
            if msg[0] == "close":
                return
            reply = server.handle(w - num_servers, msg)
            link.send_object(reply, 1)
            if msg[0] == "init":
                init_done.wait(60)
                link.barrier()

    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return None
