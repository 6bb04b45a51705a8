"""The switch process: ``python -m minicomm.launch.switchagent <rank 0's pid>``, its
configuration on stdin. What it does, and how the ranks reach it: switch.py's doc.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, Sequence, Tuple

import numpy as np

from .. import ops as _ops
from ..algorithms import innet
from ..communicator.switchlink import (
    BUSY,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_GROUPS,
    FAILED,
    HEADER_FIELDS,
    MISMATCH,
    OK,
    OP,
    RELEASE,
    TOO_LARGE,
    VERDICT_FIELDS,
    control_tag,
    operation_bytes,
)
from ..errors import CommError, CommTimeout, PeerFailure, decode_call
from ..executor import Plan, run_plan
from ..rendezvous import AUX_SWITCH, PrefixedStore, StoreClient
from ..settings import byte_setting, env_int, env_timeout
from ..transports import connect
from ..transports.base import ABORT_CALL, ABORT_KINDS, Tag
from .switch import PREFIX

IDLE_S = 1.0            # the serve loop's wait between checks that rank 0 is still there


# ---------------------------------------------------------------------------------- switch side
class Switch:
    """The serve loop (module doc) over the star of links ``transport`` (rank ``size``)."""

    def __init__(self, transport, size: int, max_bytes: int, max_groups: int, timeout: float,
                 orphaned=lambda: False):
        self.t, self.size = transport, size
        self.max_bytes, self.max_groups, self.timeout = max_bytes, max_groups, timeout
        self.orphaned = orphaned
        self.headers = [0] * size            # headers received from each rank (its tags)
        self.verdicts = [0] * size           # verdicts sent to each rank
        self.posted: Dict[int, Tuple[object, np.ndarray]] = {}
        self.pending: Dict[Tuple, Dict[int, np.ndarray]] = {}   # operation -> member headers
        self.groups: Dict[Tuple, set] = {}   # held group (ctx, members) -> members released
        self.dead: Dict[int, str] = {}
        self.plans: Dict[Tuple, Tuple[Plan, tuple]] = {}   # operation -> plan, buffers

    def serve(self) -> None:
        for r in range(self.size):
            self._post(r)
        while self.posted:
            try:
                self.t.wait_any([req for req, _ in self.posted.values()],
                                time.monotonic() + IDLE_S, "switch: waiting for headers")
            except CommTimeout:
                if self.orphaned():
                    return
                continue
            except PeerFailure:
                for r, why in self.t.dead_peers().items():
                    if r in self.posted:
                        self._lost(r, why)
                continue
            for r, (req, buf) in list(self.posted.items()):
                if req.done:
                    self._post(r)
                    self._header(r, buf)

    def _post(self, r: int) -> None:
        buf = np.empty(HEADER_FIELDS + self.size, dtype=np.int64)
        self.headers[r] += 1
        self.posted[r] = (self.t.irecv(r, buf, control_tag(self.headers[r], False, buf.size)),
                          buf)

    def _lost(self, r: int, why: str) -> None:
        del self.posted[r]
        self.dead[r] = why
        for key, got in list(self.pending.items()):
            if r in key[1]:
                del self.pending[key]
                self._answer(got, FAILED, r)

    def _answer(self, members: Sequence[int], status: int, a: int = 0, b: int = 0,
                c: int = 0, per_member=None) -> None:
        reqs = []
        for m in members:
            if m in self.dead:
                continue
            v = np.array(per_member(m) if per_member else (status, a, b, c), dtype=np.int64)
            self.verdicts[m] += 1
            reqs.append(self.t.isend(m, v, control_tag(self.verdicts[m], True, VERDICT_FIELDS)))
        try:
            self.t.wait_all(reqs, time.monotonic() + self.timeout, "switch: verdicts")
        except PeerFailure:
            pass                  # a member that died is found by the serve loop's next wait

    def _header(self, r: int, h: np.ndarray) -> None:
        kind, ctx, seq, call, count, root, g = (int(x) for x in h[:7])
        members = tuple(int(x) for x in h[HEADER_FIELDS:HEADER_FIELDS + g])
        group = (ctx, members)
        if kind == RELEASE:
            released = self.groups.get(group)
            if released is not None:
                released.add(r)
                if released >= set(members):
                    del self.groups[group]
            return
        if kind != OP:
            return
        lost = next((m for m in members if m in self.dead), None)
        if lost is not None:
            self._answer((r,), FAILED, members.index(lost))
            return
        key = (ctx, members, seq)
        got = self.pending.setdefault(key, {})
        got[r] = h[:7].copy()
        if len(got) < g:
            return
        del self.pending[key]
        self._operation(group, seq, got)

    def _operation(self, group: Tuple, seq: int, got: Dict[int, np.ndarray]) -> None:
        ctx, members = group
        sigs = {m: tuple(int(x) for x in got[m][3:6]) for m in members}
        if len(set(sigs.values())) > 1:
            def differing(m):
                other = next(o for o in members if sigs[o] != sigs[m])
                return (MISMATCH, members.index(other), sigs[other][0], sigs[other][1])
            self._answer(members, MISMATCH, per_member=differing)
            return
        call, count, root = sigs[members[0]]
        coll, op, dtype = decode_call(call)
        g = len(members)
        if operation_bytes(coll, g, count, dtype.itemsize) > self.max_bytes:
            self._answer(members, TOO_LARGE, self.max_bytes)
            return
        if group not in self.groups:
            if len(self.groups) >= self.max_groups:
                self._answer(members, BUSY, len(self.groups))
                return
            self.groups[group] = set()
        self._answer(members, OK)
        self._run(ctx, seq, call, coll, op, dtype, count, max(root, 0), members)

    def _run(self, ctx, seq, call, coll, op, dtype, count, root, members) -> None:
        g = len(members)
        key = (coll, g, count, root, members, dtype)
        bound = self.plans.get(key)
        if bound is None:           # the plan and its scratch, kept: operations repeat
            if len(self.plans) >= 256:
                self.plans.clear()
            sched = innet.build(coll, g, g, count, root, (0,) * g, radix=max(2, g))
            plan = Plan(sched, members + (self.size,))
            bound = self.plans[key] = (plan, (np.empty(0, dtype), np.empty(0, dtype),
                                              np.empty(plan.tmp_count, dtype)))
        plan, bufs = bound
        # "none" (barrier): its reductions are of zero elements, any kernel does them
        kernel = _ops.get_kernel(op if op != "none" else "sum")
        try:
            run_plan(plan, self.t, bufs, kernel, Tag(ctx, seq, 0, call, count),
                     time.monotonic() + self.timeout, f"{coll} (innet, the switch)")
        except CommError as e:
            self._abort(ctx, seq, members, e)

    def _abort(self, ctx: int, seq: int, members, e: CommError) -> None:
        """An operation failed (a member died or timed out): the others must not wait for the
        switch's part of it."""
        kind = type(e).__name__
        step = ABORT_KINDS.index(kind if kind in ABORT_KINDS else "CommError")
        notice = Tag(ctx, seq, step, ABORT_CALL, 0)
        empty = np.empty(0, dtype=np.uint8)
        for m in members:
            if m not in self.dead and m not in self.t.dead_peers():
                try:
                    self.t.isend(m, empty, notice)
                except CommError:
                    pass
        self.t.cancel_context(ctx, e)


def main() -> int:
    from . import lifeline
    parent = int(sys.argv[1])
    if lifeline.arm_parent_death(parent) is False:
        os._exit(lifeline.ORPHAN_EXIT)
    lifeline.install_orderly_exit(parent)
    conf = json.loads(sys.stdin.buffer.read().decode())
    lifeline.install_orderly_exit(job_id=conf["job_id"])
    size = int(conf["size"])
    deadline = time.monotonic() + float(conf["setup_s"])
    token = bytes.fromhex(conf["token"])
    store = StoreClient(conf["master_addr"], conf["master_port"], token,
                        timeout=max(0.0, deadline - time.monotonic()))
    try:
        store.join(conf["identity"], size, size, role=AUX_SWITCH)
        topology, hosts = conf["topology"], conf["hosts"]
        t = connect(conf["kind"], size, size + 1, PrefixedStore(store, PREFIX),
                    f"{conf['job_id']}-sw", token, tuple(topology) + (topology[0],),
                    max(0.0, deadline - time.monotonic()), bind_host=conf["bind_host"],
                    host_of_rank=tuple(hosts) + (hosts[0],), peers=range(size))
        max_bytes = byte_setting("MINICOMM_SWITCH_MAX_BYTES", DEFAULT_MAX_BYTES)
        max_groups = env_int("MINICOMM_SWITCH_GROUPS", DEFAULT_MAX_GROUPS, minimum=0,
                             what="a number of aggregation groups")
        store.set(PREFIX + "ready", json.dumps(dict(pid=os.getpid(), max_bytes=max_bytes,
                                                    max_groups=max_groups)).encode())
        timeout = float(conf["timeout"]) if conf.get("timeout") else None
        try:
            Switch(t, size, max_bytes, max_groups, timeout or env_timeout(),
                   lifeline.orphaned).serve()
        finally:
            t.close()
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
