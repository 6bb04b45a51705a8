"""``mc.init()``: the world communicator of a process another launcher started.

Which launcher started this process decides where rank, world size and the rendezvous come from
(first match wins; a launcher's own variables beat generic ``RANK`` / ``WORLD_SIZE`` left over
in the environment, which are then named in a one-line note):

==================  ============================  ===========================================
launcher            rank / size                   rendezvous (rank 0 hosts the store)
==================  ============================  ===========================================
minicomm run, ssh   MINICOMM_RANK / MINICOMM_SIZE  the launcher's store, MINICOMM_MASTER_*;
                                                  real token MINICOMM_JOB_TOKEN
torchrun            RANK / WORLD_SIZE             rank 0 listens on a free port and publishes it
                    (+ TORCHELASTIC_RUN_ID)       with a random token through torchrun's agent
                                                  store (MASTER_ADDR:MASTER_PORT; costs each
                                                  rank an ``import torch.distributed``); without
                                                  it MASTER_PORT + 1, or MINICOMM_MASTER_PORT,
                                                  derived token
mpiexec (hydra),    PMI_RANK / PMI_SIZE, PMI_FD   PMI-1 on PMI_FD (``pmi.py``): rank 0 listens on
Intel MPI, srun                                   a free port and publishes address + a random
--mpi=pmi2                                        token in the job's KVS; identity: the kvsname
Open MPI mpirun     OMPI_COMM_WORLD_RANK / _SIZE  MASTER_ADDR or (one node) loopback or mpirun's
                                                  host (OMPI_MCA_orte_hnp_uri); MASTER_PORT or a
                                                  port derived from PMIX_NAMESPACE; derived token
srun (a job step)   SLURM_PROCID /                MASTER_ADDR or the first host of
                    SLURM_STEP_NUM_TASKS          SLURM_STEP_NODELIST; MASTER_PORT or
                                                  15000 + last 4 digits of SLURM_JOB_ID
                                                  (PyTorch Lightning's convention); identity
                                                  SLURM_JOB_ID.SLURM_STEP_ID; derived token
generic             RANK / WORLD_SIZE             MASTER_ADDR (default 127.0.0.1), MASTER_PORT;
                                                  identity only MINICOMM_JOB_ID; derived token
==================  ============================  ===========================================

Under mpiexec a process that already initialized MPI (``from mpi4py import MPI`` before
``mc.init()``) bootstraps by a broadcast on MPI_COMM_WORLD instead: hydra serves one PMI client
per process, and that is MPI. The other order (``mc.init()``, then MPI_Init) is refused by hydra
(``PMI_Init returned -1``): import mpi4py first.

A world of one rank listens on a free loopback port whatever the launcher said. The Slurm batch
script itself (no job step) is not a rank of ``SLURM_NTASKS``: with more than one task it fails
at once, telling the user to start the ranks with ``srun``.

Job identity and token. Where the launcher names the job (kvsname, PMIx namespace, Slurm job and
step, torchrun run id and restart), that identity is part of the job id, of the derived token and
of every rank's join record: the rendezvous store refuses a member of another job, so two jobs
that share a port never mix (the second fails fast, naming the port). A *derived* token is not a
secret — any process that can read the job's environment can compute it; it keeps jobs apart, it
keeps no attacker out. ``MINICOMM_JOB_TOKEN`` (hex) sets a real one; the PMI and torchrun paths
make a random one and hand it over through the launcher's own channel.

Where the store listens (``store_bind``). Only where the ranks will come from, never every
interface by default: loopback when the address the ranks use is loopback or every rank is on
this host; otherwise the one interface that address names (MASTER_ADDR, or the address rank 0
publishes through PMI / MPI), which must then be an address of this host (BootstrapError naming
the variable otherwise). ``MINICOMM_BIND`` forces an address (``0.0.0.0``: every interface). A host name that resolves
to loopback here (Debian's ``127.0.1.1``) means loopback, unless the launcher says the ranks span
hosts: then this host's address on its default route.
Ranks on rank 0's host reach a store bound to one interface through that address, not loopback.

Setup timeout. Under a foreign launcher, rendezvous (reaching rank 0's store, every rank
arriving, connecting the transports) must finish within ``MINICOMM_SETUP_TIMEOUT`` seconds
(default 30, or ``init(setup_timeout=)``); the error says how many ranks arrived and which
variable claimed the world size. Every bootstrap error names the variables rank, size and
address came from.

``MINICOMM_NODE`` names this rank's node (logical; default: the hostname) and ``MINICOMM_HOST``
its machine (default: the node). Starts no process.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from ..communicator import Communicator
from ..errors import CommError, CommTimeout
from ..rendezvous import StoreServer, new_token
from ..settings import env_choice, env_seconds, env_timeout, timeout_arg
from . import lifeline
from .world import TRANSPORTS, connect_world

FOREIGN_SETUP_TIMEOUT = 30.0      # seconds, under launchers other than minicomm's own
SLURM_PORT_BASE = 15000           # PyTorch Lightning: 15000 + last 4 digits of SLURM_JOB_ID
OMPI_PORT_BASE, OMPI_PORT_SPAN = 25000, 4000     # 25000..28999, below torch's 29500


class BootstrapError(CommError):
    """``mc.init()`` cannot build the world from this process's environment."""


class BadSettingError(BootstrapError, ValueError):
    """A MINICOMM_* setting (or an argument of ``mc.init``) that ``mc.init()`` cannot use; the
    message names it and what is allowed. A ValueError too, like every bad setting."""


@dataclass
class Launch:
    """What the environment says about this process's world (``detect``), before connecting."""
    launcher: str                 # who started us, in words ("srun", "torchrun", ...)
    kind: str                     # short key: minicomm, torchrun, pmi, openmpi, slurm, env
    rank: int
    size: int
    rank_from: str                # the variable(s) that gave it, e.g. "SLURM_PROCID=3"
    size_from: str
    identity: str = ""            # job-unique identity the launcher gives ("" none)
    identity_from: str = ""
    addr: Optional[str] = None    # the store's address (None: learnt at bootstrap)
    addr_from: str = ""
    port: Optional[int] = None
    port_from: str = ""
    host_store: bool = False      # this process hosts the rendezvous store
    bind: str = ""                # where the store listens when we host it ("": store_bind)
    spans_hosts: bool = False     # the launcher says ranks run on more than one host
    token: Optional[bytes] = None  # a real token (MINICOMM_JOB_TOKEN, or random at bootstrap)
    job_id: Optional[str] = None
    bootstrap: str = "store"      # store (address known) | pmi | torch (agent store)
    foreign: bool = True          # started by a launcher other than minicomm's own
    agent_store: Optional[Tuple[str, int]] = None   # torchrun's agent TCPStore (host, port)
    same_host_as_rank0: bool = False                # torchrun: reach rank 0 on loopback
    pmi: Optional[Dict[str, object]] = None         # PMI_FD / PMI_PORT / PMI_ID
    notes: List[str] = field(default_factory=list)
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        """Where each part of the world came from, for error messages."""
        parts = [f"launcher: {self.launcher}", f"rank {self.rank} from {self.rank_from}",
                 f"world size {self.size} from {self.size_from}"]
        if self.addr is not None:
            parts.append(f"address {self.addr} from {self.addr_from}")
        if self.port is not None:
            how = self.port_from
            parts.append(f"port {self.port} " + (how if how.startswith(("derived", "a ")) else
                                                 f"from {how}"))
        if self.identity:
            parts.append(f"job identity {self.identity!r} from {self.identity_from}")
        return "; ".join(parts)


# ------------------------------------------------------------------------- Slurm node lists
_NODELIST_ITEM = re.compile(r"([^\[\],]*)\[([^\]]*)\]|([^\[\],]+)")


def expand_nodelist(nodelist: str) -> List[str]:
    """Slurm's compressed host list -> host names, in order.

    ``"node[01-03,07],gpu5"`` -> node01 node02 node03 node07 gpu5; ``"rack[1-2]-n[1,3]"`` is the
    product (rack1-n1 rack1-n3 rack2-n1 rack2-n3); zero padding follows the range's first bound.
    Spaces separate hosts as commas do. ValueError on anything malformed."""
    hosts: List[str] = []
    for item in _split_top_level(nodelist.replace(" ", ",")):
        if not item:
            continue
        pos, groups = 0, []
        for m in _NODELIST_ITEM.finditer(item):
            if m.start() != pos:
                raise ValueError(f"malformed Slurm node list {nodelist!r} near {item[pos:]!r}")
            pos = m.end()
            if m.group(3) is not None:
                groups.append([m.group(3)])
            else:
                groups.append([m.group(1)])
                groups.append(_expand_ranges(m.group(2), nodelist))
        if pos != len(item):
            raise ValueError(f"malformed Slurm node list {nodelist!r} near {item[pos:]!r}")
        names = [""]
        for g in groups:
            names = [n + x for n in names for x in g]
        hosts.extend(names)
    return hosts


def _split_top_level(text: str) -> List[str]:
    out, depth, cur = [], 0, []
    for c in text:
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"malformed Slurm node list {text!r}: unbalanced ']'")
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if depth:
        raise ValueError(f"malformed Slurm node list {text!r}: unbalanced '['")
    out.append("".join(cur))
    return out


def _expand_ranges(spec: str, whole: str) -> List[str]:
    out: List[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"malformed range {part!r} in Slurm node list {whole!r}")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"descending range {part!r} in Slurm node list {whole!r}")
        if b - a > 1_000_000:
            raise ValueError(f"range {part!r} in Slurm node list {whole!r} is too large")
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(a, b + 1))
    return out


def first_node(nodelist: str) -> str:
    """The first host of a compressed Slurm node list, without expanding all of it."""
    item = _split_top_level(nodelist.replace(" ", ",").strip(","))[0]
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return expand_nodelist(item)[0]
    first = _expand_ranges(m.group(2).split(",")[0].split("-")[0], nodelist)[0]
    rest = m.group(3)
    return m.group(1) + first + (first_node(rest) if rest else "")


def slurm_port(job_id: str) -> int:
    """PyTorch Lightning's SLURM convention: 15000 + the last 4 digits of the job id."""
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        raise ValueError(f"SLURM_JOB_ID={job_id!r} has no digits")
    return SLURM_PORT_BASE + int(digits[-4:])


def ompi_port(namespace: str) -> int:
    """A port derived from Open MPI's job namespace: 25000 + crc32(namespace) mod 4000."""
    return OMPI_PORT_BASE + zlib.crc32(namespace.encode()) % OMPI_PORT_SPAN


# ------------------------------------------------------------------------------ detection
def _int(env: Mapping[str, str], *names: str) -> Tuple[Optional[int], str]:
    """The first of ``names`` that is set, as (int value, "NAME=value"); ValueError if not int."""
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v), f"{n}={v}"
            except ValueError:
                raise BootstrapError(f"mc.init(): {n}={v!r} is not an integer") from None
    return None, ""


def _fd_open(value: Optional[str]) -> bool:
    try:
        os.fstat(int(value))
        return True
    except (TypeError, ValueError, OSError):
        return False


def _common(env: Mapping[str, str], launch: Launch) -> Launch:
    """Settings every launcher shares: a real token, an extra identity, a forced address."""
    token_hex = env.get("MINICOMM_JOB_TOKEN")
    if token_hex and launch.token is None:
        try:
            launch.token = bytes.fromhex(token_hex)
        except ValueError:
            raise BootstrapError("mc.init(): MINICOMM_JOB_TOKEN is not hex") from None
    extra = env.get("MINICOMM_JOB_ID")
    if extra and launch.kind != "minicomm":
        launch.identity = f"{launch.identity}/{extra}" if launch.identity else extra
        launch.identity_from = " + ".join(x for x in (launch.identity_from, "MINICOMM_JOB_ID") if x)
    launch.env = env
    return launch


def _leftovers(env: Mapping[str, str], launch: Launch) -> None:
    """Name generic RANK / WORLD_SIZE that disagree with the launcher that started us."""
    for name, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.size)):
        v = env.get(name)
        if v not in (None, "") and v != str(value):
            launch.notes.append(f"{name}={v} ignored: this process was started by "
                                f"{launch.launcher} ({launch.rank_from}, {launch.size_from})")


def detect(env: Optional[Mapping[str, str]] = None) -> Launch:
    """Which launcher started this process, and what it says about the world (no I/O beyond
    checking that ``PMI_FD`` is an open descriptor). BootstrapError if nothing describes one."""
    env = os.environ if env is None else env
    for probe in (_detect_minicomm, _detect_torchrun, _detect_pmi, _detect_openmpi,
                  _detect_slurm_step, _detect_generic, _detect_slurm_batch):
        launch = probe(env)
        if launch is not None:
            launch = _common(env, launch)
            if launch.kind not in ("env", "torchrun", "minicomm"):
                _leftovers(env, launch)
            if launch.size < 1 or not 0 <= launch.rank < launch.size:
                raise BootstrapError(f"mc.init(): rank {launch.rank} is not in a world of "
                                     f"{launch.size} ({launch.describe()})")
            if launch.size == 1:
                _world_of_one(launch)
            return launch
    raise BootstrapError(
        "mc.init(): no launcher environment found: none of MINICOMM_RANK/SIZE (minicomm run), "
        "TORCHELASTIC_RUN_ID (torchrun), PMI_FD (mpiexec), OMPI_COMM_WORLD_RANK (Open MPI "
        "mpirun), SLURM_PROCID + SLURM_STEP_ID (srun), RANK/WORLD_SIZE is set. Start the "
        "script with `minicomm run -n N script.py`, or use mc.spawn")


def _world_of_one(launch: Launch) -> None:
    """A single rank needs no well-known port: listen on a free loopback one (no clash ever)."""
    if launch.kind == "minicomm":
        return                    # minicomm run's own store is already there
    launch.bootstrap = "store"
    launch.addr, launch.addr_from = "127.0.0.1", "a world of one rank (loopback)"
    launch.port, launch.port_from = 0, "a world of one rank (any free port)"
    launch.bind, launch.host_store = "127.0.0.1", True


def _detect_minicomm(env) -> Optional[Launch]:
    rank, rank_from = _int(env, "MINICOMM_RANK")
    size, size_from = _int(env, "MINICOMM_SIZE")
    if rank is None or size is None:
        return None
    port, port_from = _int(env, "MINICOMM_MASTER_PORT")
    if port is None:
        # MINICOMM_RANK / SIZE by hand, with a generic MASTER_PORT: rank 0 hosts the store
        launch = _generic(env, rank, size, rank_from, size_from)
        launch.rank_from, launch.size_from = rank_from, size_from
        return launch
    addr = env.get("MINICOMM_MASTER_ADDR") or "127.0.0.1"
    return Launch("minicomm run", "minicomm", rank, size, rank_from, size_from,
                  identity=env.get("MINICOMM_JOB_ID", ""), identity_from="MINICOMM_JOB_ID",
                  addr=addr, addr_from="MINICOMM_MASTER_ADDR", port=port, port_from=port_from,
                  job_id=env.get("MINICOMM_JOB_ID") or None, foreign=False)


def _detect_torchrun(env) -> Optional[Launch]:
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    rank, rank_from = _int(env, "RANK")
    size, size_from = _int(env, "WORLD_SIZE")
    port, port_from = _int(env, "MASTER_PORT")
    if rank is None or size is None or port is None:
        raise BootstrapError("mc.init(): TORCHELASTIC_RUN_ID is set (torchrun) but RANK, "
                             "WORLD_SIZE or MASTER_PORT is not")
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    addr = env.get("MASTER_ADDR") or "127.0.0.1"
    groups, _ = _int(env, "GROUP_WORLD_SIZE")
    group, _ = _int(env, "GROUP_RANK")
    launch = Launch("torchrun", "torchrun", rank, size, rank_from, size_from,
                    identity=f"torchrun:{run_id}:{restart}",
                    identity_from="TORCHELASTIC_RUN_ID + TORCHELASTIC_RESTART_COUNT",
                    addr=addr, addr_from=f"MASTER_ADDR={addr}", port=port, port_from=port_from)
    one_host = groups == 1 or (groups is None and _int(env, "LOCAL_WORLD_SIZE")[0] == size)
    if one_host:
        launch.addr, launch.addr_from = "127.0.0.1", "one torchrun agent (loopback)"
        launch.bind = "127.0.0.1"
    else:
        launch.spans_hosts = bool(groups and groups > 1)
        if group == 0:
            launch.addr_from += " (rank 0's agent host)"
    forced, forced_from = _int(env, "MINICOMM_MASTER_PORT")
    if forced is not None:        # the user's own port: no agent store (no torch import)
        launch.port, launch.port_from, launch.host_store = forced, forced_from, rank == 0
        return launch
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        launch.bootstrap = "torch"        # publish a free port + random token in the agent store
        launch.agent_store = (env.get("MASTER_ADDR") or "127.0.0.1", port)
        launch.same_host_as_rank0 = one_host or group == 0
        launch.port, launch.port_from = None, "a free port published in torchrun's agent store"
        return launch
    # workers own MASTER_PORT (torch's env:// rank 0 binds it): minicomm takes the next one
    launch.port, launch.port_from = port + 1, f"{port_from} + 1 (torchrun without agent store)"
    launch.host_store = rank == 0
    return launch


def _detect_pmi(env) -> Optional[Launch]:
    fd, port = env.get("PMI_FD"), env.get("PMI_PORT")
    if not _fd_open(fd) and not port:
        return None
    rank, rank_from = _int(env, "PMI_RANK")
    size, size_from = _int(env, "PMI_SIZE")
    if rank is None or size is None:
        raise BootstrapError(f"mc.init(): {'PMI_FD' if fd else 'PMI_PORT'} is set (mpiexec) but "
                             f"PMI_RANK / PMI_SIZE are not")
    local, _ = _int(env, "MPI_LOCALNRANKS")
    launch = Launch("mpiexec (PMI-1)", "pmi", rank, size, rank_from, size_from,
                    identity_from="the PMI kvsname", bootstrap="pmi",
                    addr_from="rank 0, published in the PMI KVS",
                    port_from="a free port rank 0 published in the PMI KVS")
    if local == size:
        launch.bind = "127.0.0.1"
    elif local is not None:
        launch.spans_hosts = True
    launch.pmi = {"fd": int(fd) if _fd_open(fd) else None, "port": port,
                  "id": env.get("PMI_ID")}
    return launch


def _detect_openmpi(env) -> Optional[Launch]:
    rank, rank_from = _int(env, "OMPI_COMM_WORLD_RANK")
    if rank is None:
        return None
    size, size_from = _int(env, "OMPI_COMM_WORLD_SIZE")
    if size is None:
        raise BootstrapError("mc.init(): OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE "
                             "is not")
    ns = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or ""
    ns_from = "PMIX_NAMESPACE" if env.get("PMIX_NAMESPACE") else "OMPI_MCA_ess_base_jobid"
    launch = Launch("Open MPI mpirun", "openmpi", rank, size, rank_from, size_from,
                    identity=f"openmpi:{ns}" if ns else "", identity_from=f"{ns_from}={ns}")
    port, port_from = _int(env, "MINICOMM_MASTER_PORT", "MASTER_PORT")
    if port is None:
        if not ns:
            raise BootstrapError("mc.init(): Open MPI gave no job namespace (PMIX_NAMESPACE); "
                                 f"set MASTER_PORT ({launch.describe()})")
        port, port_from = ompi_port(ns), (f"derived from {ns_from}={ns} (25000 + crc32 mod "
                                          f"4000; set MASTER_PORT to choose)")
    launch.port, launch.port_from = port, port_from
    nodes, _ = _int(env, "OMPI_MCA_orte_num_nodes")
    local, _ = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    launch.spans_hosts = bool((nodes and nodes > 1) or (local is not None and local < size))
    forced = env.get("MINICOMM_MASTER_ADDR") or env.get("MASTER_ADDR")
    if forced:
        launch.addr = forced
        launch.addr_from = "MINICOMM_MASTER_ADDR" if env.get("MINICOMM_MASTER_ADDR") else "MASTER_ADDR"
        launch.host_store = rank == 0
    elif nodes == 1 or local == size:
        launch.addr, launch.addr_from = "127.0.0.1", "one node (OMPI_MCA_orte_num_nodes=1)"
        launch.bind, launch.host_store = "127.0.0.1", rank == 0
    else:
        hnp = _hnp_address(env.get("OMPI_MCA_orte_hnp_uri", ""))
        if hnp is None:
            raise BootstrapError("mc.init(): Open MPI job on several nodes and no mpirun address "
                                 "(OMPI_MCA_orte_hnp_uri): set MASTER_ADDR to rank 0's host")
        # the store lives on mpirun's node, hosted by that node's first local rank
        launch.addr, launch.addr_from = hnp, "mpirun's host (OMPI_MCA_orte_hnp_uri)"
        launch.host_store = (env.get("OMPI_COMM_WORLD_LOCAL_RANK") == "0"
                             and _is_local_address(hnp))
    return launch


def _hnp_address(uri: str) -> Optional[str]:
    """``"1345912832.0;tcp://192.0.2.2:51819;tcp6://[fd00::2]:33853"`` -> ``"192.0.2.2"``."""
    m = re.search(r"tcp://([^,;:]+)", uri)
    return m.group(1) if m else None


def _is_local_address(addr: str, family: int = socket.AF_INET) -> bool:
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _slurm_addr(env, launch: Launch) -> None:
    nodes, _ = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    launch.spans_hosts = bool(nodes and nodes > 1)
    forced = env.get("MINICOMM_MASTER_ADDR") or env.get("MASTER_ADDR")
    if forced:
        launch.addr = forced
        launch.addr_from = "MINICOMM_MASTER_ADDR" if env.get("MINICOMM_MASTER_ADDR") else "MASTER_ADDR"
        return
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        nodelist = env.get(name)
        if nodelist:
            try:
                launch.addr = first_node(nodelist)
            except ValueError as e:
                raise BootstrapError(f"mc.init(): {name}: {e}") from None
            launch.addr_from = f"the first host of {name}={nodelist}"
            break
    else:
        raise BootstrapError("mc.init(): srun gave no node list (SLURM_STEP_NODELIST); set "
                             "MASTER_ADDR")
    if nodes == 1:                # one node: everyone reaches rank 0 on loopback
        launch.addr_from += " (one node: loopback)"
        launch.addr, launch.bind = "127.0.0.1", "127.0.0.1"


def _slurm_port(env, launch: Launch) -> None:
    port, port_from = _int(env, "MINICOMM_MASTER_PORT", "MASTER_PORT")
    if port is None:
        job = env["SLURM_JOB_ID"]
        port, port_from = slurm_port(job), (f"derived from SLURM_JOB_ID={job} (15000 + last 4 "
                                            f"digits; set MASTER_PORT to choose)")
    launch.port, launch.port_from = port, port_from


def _detect_slurm_step(env) -> Optional[Launch]:
    if env.get("SLURM_JOB_ID") is None or env.get("SLURM_STEP_ID") in (None, ""):
        return None
    rank, rank_from = _int(env, "SLURM_PROCID")
    size, size_from = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if rank is None or size is None:
        return None
    job, step = env["SLURM_JOB_ID"], env["SLURM_STEP_ID"]
    launch = Launch("srun", "slurm", rank, size, rank_from, size_from,
                    identity=f"slurm:{job}.{step}", identity_from="SLURM_JOB_ID.SLURM_STEP_ID",
                    host_store=rank == 0)
    _slurm_addr(env, launch)
    _slurm_port(env, launch)
    return launch


def _detect_slurm_batch(env) -> Optional[Launch]:
    """The batch script (or an salloc shell): Slurm did not start this process as a task."""
    job = env.get("SLURM_JOB_ID")
    if job is None:
        return None
    ntasks, ntasks_from = _int(env, "SLURM_NTASKS")
    if ntasks is None or ntasks <= 1:
        return Launch("Slurm batch script", "slurm", 0, 1, "the batch script (one process)",
                      f"{ntasks_from or 'SLURM_NTASKS unset'}: one process runs the script",
                      identity=f"slurm:{job}.batch", identity_from="SLURM_JOB_ID")
    raise BootstrapError(
        f"mc.init(): this process is the batch script of Slurm job {job} (SLURM_STEP_ID is "
        f"unset: it is not a task of a job step), and {ntasks_from} describes the allocation, "
        f"not ranks that were started. Start the ranks with `srun python script.py` (or "
        f"`minicomm run -n {ntasks} script.py` inside the batch script)")


def _generic(env, rank, size, rank_from, size_from) -> Launch:
    port, port_from = _int(env, "MINICOMM_MASTER_PORT", "MASTER_PORT")
    launch = Launch("RANK/WORLD_SIZE environment", "env", rank, size, rank_from, size_from,
                    host_store=rank == 0)
    addr = env.get("MINICOMM_MASTER_ADDR") or env.get("MASTER_ADDR")
    launch.addr = addr or "127.0.0.1"
    launch.addr_from = ("MINICOMM_MASTER_ADDR" if env.get("MINICOMM_MASTER_ADDR") else
                        "MASTER_ADDR" if addr else "the default (MASTER_ADDR unset)")
    if launch.addr in ("127.0.0.1", "localhost"):
        launch.bind = "127.0.0.1"
    if port is None and size > 1:
        raise BootstrapError(f"mc.init(): MASTER_PORT (or MINICOMM_MASTER_PORT) is not set "
                             f"({launch.describe()})")
    launch.port, launch.port_from = port, port_from
    return launch


def _detect_generic(env) -> Optional[Launch]:
    rank, rank_from = _int(env, "RANK")
    size, size_from = _int(env, "WORLD_SIZE")
    if rank is None or size is None:
        return None
    return _generic(env, rank, size, rank_from, size_from)


# ------------------------------------------------------------------------------ bootstrap
def derived_token(launch: Launch) -> bytes:
    """The token every rank can compute alike: binds the launcher, the job identity, the world
    size and the address. Not a secret (see the module header)."""
    text = (f"minicomm-derived-token-v2\0{launch.kind}\0{launch.identity}\0{launch.size}\0"
            f"{launch.addr}\0{launch.port}")
    return hashlib.sha256(text.encode()).digest()


def _job_id(launch: Launch, token: bytes) -> str:
    """A short name for shm segments (letters, digits, '-'): the same on every rank (it hashes
    only what they agree on: the token, the identity, the size), different for jobs that differ
    in any of them."""
    digest = hashlib.sha256(token + f"\0{launch.kind}\0{launch.identity}\0{launch.size}"
                            .encode()).hexdigest()[:12]
    return f"{launch.kind}-{digest}"


def _resolve(addr: str) -> Optional[str]:
    """``addr`` (a name or a literal) as one IP literal, IPv4 preferred; None if unresolvable."""
    for family in (socket.AF_INET, socket.AF_UNSPEC):
        try:
            return socket.getaddrinfo(addr, None, family, socket.SOCK_STREAM)[0][4][0]
        except (OSError, IndexError):
            continue
    return None


def store_bind(launch: Launch) -> str:
    """The address the store listens on when this rank hosts it (see the module header):
    ``MINICOMM_BIND`` if set; loopback when ``detect`` found every rank on this host or the
    store's address is loopback; else that address's own interface. Never the wildcard unless
    forced. BootstrapError when the address is not one of this host's."""
    forced = launch.env.get("MINICOMM_BIND")
    if forced:
        return forced
    if launch.bind:
        return launch.bind            # decided by detect (every rank on this host: loopback)
    addr, addr_from = launch.addr, launch.addr_from or "the store address"
    if addr is None:                  # PMI / MPI: rank 0 publishes an address of its own
        addr = launch.env.get("MINICOMM_MASTER_ADDR") or _my_address()
        addr_from = ("MINICOMM_MASTER_ADDR" if launch.env.get("MINICOMM_MASTER_ADDR") else
                     "this host's name")
    ip = _resolve(addr)
    if ip is not None:
        import ipaddress
        if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
            if not launch.spans_hosts or addr == "localhost" or _is_literal(addr):
                return ip
            # a host name that resolves to loopback here (Debian's 127.0.1.1) while the ranks
            # span hosts: the others reach this host on its outbound interface
            out = _outbound_address()
            if out is not None:
                return out
        if _is_local_address(ip, socket.AF_INET6 if ":" in ip else socket.AF_INET):
            return ip
    raise BootstrapError(
        f"mc.init(): rank {launch.rank} hosts the rendezvous store, but {addr_from} gives "
        f"{addr!r}" + (f" ({ip})" if ip and ip != addr else "") + ", which is not an address "
        "of this host: set MASTER_ADDR to this host's address as the other ranks reach it, or "
        "MINICOMM_BIND to the local address to listen on (0.0.0.0 listens on every interface)")


def _is_literal(addr: str) -> bool:
    import ipaddress
    try:
        ipaddress.ip_address(addr.split("%")[0])
        return True
    except ValueError:
        return False


def _outbound_address() -> Optional[str]:
    """This host's address on its default route (a UDP connect sends nothing), else None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def _publish_host(launch: Launch) -> str:
    """The host name rank 0 publishes with its store address: ranks on that host then use
    loopback. Empty when the store listens on one interface only (loopback would not reach
    it): then every rank uses the published address."""
    return socket.gethostname() if launch.bind in ("0.0.0.0", "::") else ""


def _my_address() -> str:
    """An address of this host that other hosts can use (its name's, unless that is loopback)."""
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return name
    return name if addr.startswith("127.") else addr


def _bootstrap_pmi(launch: Launch, timeout: float) -> StoreServer:
    """Rank 0 listens on a free port; address and a random token go through the PMI KVS."""
    from .pmi import PMIClient
    p = launch.pmi
    client = PMIClient(fd=p["fd"], port=p["port"], pmi_id=p["id"], timeout=timeout)
    server = None
    try:
        client.init()
        client.get_maxes()
        client.get_appnum()
        kvs = client.get_my_kvsname()
        launch.identity = f"pmi:{kvs}" + (f"/{launch.identity}" if launch.identity else "")
        launch.identity_from = f"the PMI kvsname ({client.where})"
        if launch.rank == 0:
            token = launch.token or new_token()
            server = StoreServer(launch.bind, 0, token, job=(launch.identity, launch.size))
            addr = launch.bind if launch.bind not in ("0.0.0.0", "::") else (
                launch.env.get("MINICOMM_MASTER_ADDR") or _my_address())
            client.put("minicomm-store", f"{addr}:{server.port}:{_publish_host(launch)}")
            if launch.token is None:
                client.put("minicomm-token", token.hex())
            launch.token, launch.addr, launch.port = token, addr, server.port
        client.barrier()
        if launch.rank != 0:
            addr, port, host = client.get("minicomm-store").rsplit(":", 2)
            launch.addr = "127.0.0.1" if host and host == socket.gethostname() else addr
            launch.port = int(port)
            if launch.token is None:
                launch.token = bytes.fromhex(client.get("minicomm-token"))
        client.finalize()
    except BaseException:
        client.close()
        if server is not None:
            server.close()
        raise
    return server


def _mpi_in_use():
    """mpi4py's MPI module when this process already initialized MPI (then PMI belongs to MPI:
    hydra refuses a second PMI client on PMI_FD), else None. Never imports mpi4py itself."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            else None
    except Exception:
        return None


def _bootstrap_mpi(launch: Launch, mpi, timeout: float) -> Optional[StoreServer]:
    """Under mpiexec in a process that already called MPI_Init: rank 0's store address, a random
    token and a random job identity go to every rank by a broadcast on MPI_COMM_WORLD
    (non-blocking, polled until the setup deadline: a rank that never calls mc.init cannot hang
    the others)."""
    import numpy as np
    world = mpi.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (launch.rank, launch.size):
        raise BootstrapError(f"mc.init(): MPI_COMM_WORLD is rank {world.Get_rank()} of "
                             f"{world.Get_size()}, the environment says {launch.rank} of "
                             f"{launch.size}")
    buf = np.zeros(1024, dtype=np.uint8)
    server = None
    if launch.rank == 0:
        token = launch.token or new_token()
        launch.identity = f"mpi:{secrets.token_hex(8)}" + (
            f"/{launch.identity}" if launch.identity else "")
        server = StoreServer(launch.bind, 0, token, job=(launch.identity, launch.size))
        addr = launch.bind if launch.bind not in ("0.0.0.0", "::") else (
            launch.env.get("MINICOMM_MASTER_ADDR") or _my_address())
        msg = json.dumps([addr, server.port, _publish_host(launch), token.hex(),
                          launch.identity]).encode()
        buf[:len(msg)] = np.frombuffer(msg, dtype=np.uint8)
    req = world.Ibcast(buf, root=0)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not req.Test():     # MPI offers no wait with a timeout: poll, backing off to 50 ms
        if time.monotonic() > deadline:
            if server is not None:
                server.close()
            raise CommTimeout(f"not every MPI rank reached mc.init() within {timeout:g}s (the "
                              f"setup timeout, MINICOMM_SETUP_TIMEOUT)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    addr, port, host, token_hex, identity = json.loads(bytes(buf).rstrip(b"\0").decode())
    launch.identity, launch.identity_from = identity, "rank 0 (MPI_COMM_WORLD broadcast)"
    launch.addr = "127.0.0.1" if host and host == socket.gethostname() else addr
    launch.port, launch.token = int(port), launch.token or bytes.fromhex(token_hex)
    launch.addr_from = launch.port_from = "rank 0, broadcast on MPI_COMM_WORLD"
    return server


def _bootstrap_torch(launch: Launch, timeout: float) -> Optional[StoreServer]:
    """Rank 0 listens on a free port and publishes it with a random token in torchrun's agent
    store (a TCPStore client of MASTER_ADDR:MASTER_PORT); the others read it there."""
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore
    except ImportError:           # torchrun without torch.distributed: the port-next-door rule
        base = launch.agent_store[1]
        launch.port, launch.port_from = base + 1, f"MASTER_PORT={base} + 1 (torch not importable)"
        launch.host_store, launch.bootstrap = launch.rank == 0, "store"
        return None
    host, port = launch.agent_store
    key = f"minicomm/{launch.identity}/store"
    try:
        agent = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as e:        # torch raises RuntimeError / DistStoreError
        raise CommTimeout(f"cannot reach torchrun's agent store at {host}:{port}: {e}") from None
    server = None
    try:
        if launch.rank == 0:
            token = launch.token or new_token()
            server = StoreServer(launch.bind, 0, token, job=(launch.identity, launch.size))
            agent.set(key, f"{server.port} {token.hex()}")
            launch.token, launch.port = token, server.port
        else:
            try:
                value = agent.get(key).decode()
            except Exception as e:
                raise CommTimeout(f"rank 0 did not publish its store in torchrun's agent store "
                                  f"({host}:{port}, key {key!r}) within {timeout:g}s: {e}") \
                    from None
            port_s, token_hex = value.split()
            launch.port = int(port_s)
            if launch.token is None:
                launch.token = bytes.fromhex(token_hex)
        if launch.same_host_as_rank0 and (launch.bind.startswith("127.") or
                                          launch.env.get("MINICOMM_BIND") in ("0.0.0.0", "::")):
            launch.addr, launch.addr_from = "127.0.0.1", "rank 0's host (loopback)"
    except BaseException:
        if server is not None:
            server.close()
        raise
    finally:
        del agent
    return server


def setup_timeout_for(launch: Launch, timeout: Optional[float],
                      setup_timeout: Optional[float], env: Mapping[str, str]) -> float:
    try:
        if setup_timeout is not None:
            return timeout_arg("setup_timeout", setup_timeout)
        value = env_seconds("MINICOMM_SETUP_TIMEOUT", None, env)
        if value is not None:
            return value
        timeout = timeout_arg("timeout", timeout)
        env_value = env_timeout(env)     # checked even when not used: a bad value is named early
    except (TypeError, ValueError) as e:
        raise BadSettingError(f"mc.init(): {e}") from None
    if launch.foreign:
        return FOREIGN_SETUP_TIMEOUT
    return timeout if timeout is not None else env_value


def init(transport: Optional[str] = None, timeout: Optional[float] = None,
         setup_timeout: Optional[float] = None) -> Communicator:
    """The world communicator of a process that a launcher started.

    The launchers: ``minicomm run``, torchrun, mpiexec, mpirun and srun. Which one started the
    process decides where rank, world size and the rendezvous come from (the table is in the
    module docstring of ``minicomm.launch.env``).

    Args:
        transport (str | None): "auto", "shm", "tcp", "rdma" or "ub" (default
            ``MINICOMM_TRANSPORT``, else "auto").
        timeout (float | None): The communicator's default per-call timeout (default
            ``MINICOMM_TIMEOUT``).
        setup_timeout (float | None): The bound on rendezvous (default
            ``MINICOMM_SETUP_TIMEOUT``, else 30 s under foreign launchers).

    Returns:
        (Communicator): The world communicator of this process.

    Raises:
        ValueError: An unknown transport or a bad setting.
        BootstrapError: The environment does not describe a job this process can join (the
            error names the variables rank, size and address came from).
        CommTimeout: Not every rank arrived within the setup timeout (the error says how many
            did).

    Examples:
        >>> import minicomm as mc
        >>> comm = mc.init()  # doctest: +SKIP
        >>> total = comm.allreduce(np.ones(4))  # doctest: +SKIP
        >>> comm.close()  # doctest: +SKIP
    """
    env = dict(os.environ)
    transport = transport or env_choice("MINICOMM_TRANSPORT", "auto", TRANSPORTS, env)
    if transport not in TRANSPORTS:
        raise ValueError(f"mc.init(): transport={transport!r}: choose one of {', '.join(TRANSPORTS)}")
    launch = detect(env)
    if env.get("MINICOMM_LAUNCHER_PID", "").isdigit():
        # started by minicomm run / the ssh agent through the lifeline: SIGTERM (the launcher's,
        # or the kernel's when the launcher died) is an orderly exit that unlinks our segments
        lifeline.install_orderly_exit(int(env["MINICOMM_LAUNCHER_PID"]),
                                      env.get("MINICOMM_JOB_ID"))
    if launch.rank == 0:          # once per job, not once per rank
        for note in launch.notes:
            print(f"minicomm: {note}", file=sys.stderr)
    setup = setup_timeout_for(launch, timeout, setup_timeout, env)
    server = None
    try:
        if launch.host_store or (launch.rank == 0 and launch.bootstrap in ("pmi", "torch")):
            launch.bind = store_bind(launch)
        if launch.bootstrap == "pmi":
            mpi = _mpi_in_use()
            server = _bootstrap_mpi(launch, mpi, setup) if mpi else _bootstrap_pmi(launch, setup)
        elif launch.bootstrap == "torch":
            server = _bootstrap_torch(launch, setup)
        if launch.host_store and server is None and launch.port == 0:
            token = launch.token or new_token()
            server = StoreServer(launch.bind, 0, token, job=(launch.identity, launch.size))
            launch.token, launch.port = token, server.port
        token = launch.token or derived_token(launch)
        node = env.get("MINICOMM_NODE") or socket.gethostname()
        host = env.get("MINICOMM_HOST") or node
        cfg = dict(rank=launch.rank, size=launch.size, node=node, host=host, topology=None,
                   master_addr=launch.addr, master_port=launch.port, token=token.hex(),
                   host_store=launch.host_store and server is None, store_server=server,
                   store_bind=launch.bind, identity=launch.identity,
                   job_id=launch.job_id or _job_id(launch, token),
                   transport=transport,
                   timeout=timeout, setup_timeout=setup, describe=launch.describe(),
                   port_from=launch.port_from)
    except CommError as e:
        if server is not None:
            server.close()
        raise _with_context(e, launch) from None
    except BaseException:
        if server is not None:
            server.close()
        raise
    try:
        return connect_world(cfg)
    except CommError as e:
        raise _with_context(e, launch) from None


def _with_context(e: CommError, launch: Launch) -> CommError:
    text = str(e)
    context = launch.describe()
    if context in text:
        return e
    try:
        out = type(e)(f"mc.init(): {text}\n  ({context})")
    except TypeError:
        out = BootstrapError(f"mc.init(): {text}\n  ({context})")
    for attr in ("arrived", "missing", "peer"):
        if hasattr(e, attr):
            setattr(out, attr, getattr(e, attr))
    return out
