"""The emulated in-network switch: one process per job that reduces and multicasts.

What it emulates. An aggregation switch (NVIDIA SHARP on an InfiniBand fat-tree, NVLink SHARP
inside an NVSwitch server): every rank sends it its data once, it reduces the group's
contributions and sends each rank the result once. It runs the switch's side of the ``innet``
schedules (minicomm/algorithms/innet.py) with the executor, the same schedule the verifier proves
and the simulator prices, with one switch above the group's ranks. Multi-level aggregation trees
are proved and priced, not emulated: here one process is the whole tree.

Starting. Rank 0 of a job that asks for a switch (``mc.spawn(..., switch=True)``,
``minicomm run --switch``, or ``MINICOMM_SWITCH=1`` under any launcher) starts it as its child:
``python -m minicomm.launch.switchagent <rank 0's pid>``, its configuration on stdin (the job token
never on a command line). It joins the job's store as its auxiliary member (rendezvous.py), links
to every rank through ``transports.connect`` with the ranks as its only peers, under the store
keys ``switch/...`` (shm on rank 0's host, tcp to the others; the job token authenticates each
link), and announces ``switch/ready``: its pid and limits. Every rank links to it in
``connect_world`` (``connect_link``) and keeps the link for all its communicators.

Serving. Headers and verdicts (communicator/switchlink.py): it keeps one header receive posted
per rank; when every member of a group has sent the header of one operation it compares them,
answers each with a verdict and, on OK, runs the operation. Operations run one at a time (a
group's members all wait for it, so the order cannot deadlock). Limits, as SHARP has them: at
most ``max_groups`` aggregation groups held at once (``MINICOMM_SWITCH_GROUPS``; a group is held
from its first operation until its communicator closes) and ``max_bytes`` per operation
(``MINICOMM_SWITCH_MAX_BYTES``).

Failures. A rank that dies: operations of its groups get ``FAILED`` verdicts, one under way is
aborted (its other members get an abort notice: PeerFailure). The switch leaves when every link
has ended or its parent (rank 0) is gone (PR_SET_PDEATHSIG, lifeline.py); its shm segment is
unlinked once the ranks attached, so a killed switch leaves nothing. Rank 0 reaps it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Optional, Sequence

from ..communicator.switchlink import (
    SwitchLink,
)
from ..errors import CommTimeout
from ..rendezvous import PrefixedStore
from ..transports import connect

PREFIX = "switch/"
IDLE_S = 1.0            # the serve loop's wait between checks that rank 0 is still there
REAP_S = 30.0           # rank 0 waits this long for the switch to leave after the links close


def link_kind(kind: str) -> str:
    """The transport of the ranks' links to the switch: the job's where it is shm or tcp, else
    shm on the switch's host and tcp to the others."""
    return kind if kind in ("shm", "tcp") else "auto"


# ------------------------------------------------------------------------------------ rank side
def start(cfg: dict, topology: Sequence[int], hosts: Sequence[str], bind_host: str,
          setup_s: float) -> subprocess.Popen:
    """Rank 0 starts the job's switch (module doc) and hands it its configuration."""
    conf = dict(master_addr=cfg["master_addr"], master_port=cfg["master_port"],
                token=cfg["token"], job_id=cfg["job_id"],
                identity=str(cfg.get("identity") or cfg["job_id"]), size=cfg["size"],
                kind=link_kind(cfg["transport"]), topology=list(topology), hosts=list(hosts),
                bind_host=bind_host, setup_s=setup_s, timeout=cfg.get("timeout"),
                sys_path=list(sys.path))
    p = subprocess.Popen([sys.executable, "-m", "minicomm.launch.switchagent", str(os.getpid())],
                         stdin=subprocess.PIPE, cwd=os.getcwd())
    try:
        p.stdin.write(json.dumps(conf).encode())
        p.stdin.close()
    except OSError:
        pass                  # it died at once: connect_link reports the missing switch
    return p


def connect_link(cfg: dict, store, topology: Sequence[int], hosts: Sequence[str],
                 bind_host: str, deadline: float,
                 process: Optional[subprocess.Popen] = None) -> SwitchLink:
    """This rank's link to the switch, once the switch has announced itself. ``process``: rank
    0's handle on it, reaped when the link closes."""
    rank, size = cfg["rank"], cfg["size"]
    left = max(0.0, deadline - time.monotonic())
    prefixed = PrefixedStore(store, PREFIX)
    try:
        t = connect(link_kind(cfg["transport"]), rank, size + 1, prefixed,
                    f"{cfg['job_id']}-sw", bytes.fromhex(cfg["token"]),
                    tuple(topology) + (topology[0],), left, bind_host=bind_host,
                    host_of_rank=tuple(hosts) + (hosts[0],), peers=[size])
    except CommTimeout as e:
        raise CommTimeout(f"rank {rank}: the job's in-network switch did not link to this rank "
                          f"within the setup timeout ({e}); rank 0 starts it") from None
    try:
        ready = json.loads(prefixed.get("ready", max(0.0, deadline - time.monotonic())))
    except BaseException:
        t.close()
        raise

    def reap() -> None:
        if process is not None:
            try:
                process.wait(REAP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return SwitchLink(t, size, int(ready["pid"]), int(ready["max_bytes"]),
                      int(ready["max_groups"]), on_close=reap)


def stop(process: Optional[subprocess.Popen]) -> None:
    """A failed setup: end the switch rank 0 started."""
    if process is not None and process.poll() is None:
        process.kill()
    if process is not None:
        process.wait()
