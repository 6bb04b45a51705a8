"""``mc.init()``: the world communicator of a process another launcher started.

Reads ``MINICOMM_*`` (``minicomm run``, the ssh agent), else torchrun's ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT``, else Open MPI's ``OMPI_COMM_WORLD_*``, PMI's ``PMI_*``
(MPICH, Intel MPI) or Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS``, and connects the world
(``world.connect_world``). Starts no process.

``MINICOMM_NODE`` names this rank's node (logical; default: the hostname) and ``MINICOMM_HOST``
its machine (default: the node). ``minicomm run -n N --nodes k`` emulates k nodes on one
machine (one host, so a forced ``--transport shm`` reaches every node); the ssh agent sets both to
its host's index (each host is a machine).
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Optional

from ..communicator import Communicator
from ..errors import CommError
from .world import connect_world


def _env_int(*names: str) -> Optional[int]:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return None


def init(transport: Optional[str] = None, timeout: Optional[float] = None) -> Communicator:
    """The world communicator of a process started by ``minicomm run``, torchrun, mpirun or srun."""
    rank = _env_int("MINICOMM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
    size = _env_int("MINICOMM_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
    if rank is None or size is None:
        raise CommError("mc.init(): no launcher environment found (MINICOMM_RANK/SIZE, RANK/"
                        "WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*, SLURM_*); start the script with "
                        "`minicomm run -n N script.py` or use mc.spawn")
    addr = os.environ.get("MINICOMM_MASTER_ADDR") or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MINICOMM_MASTER_PORT")
    foreign = port is None
    if foreign:
        base = _env_int("MASTER_PORT")
        if base is None:
            raise CommError("mc.init(): MASTER_PORT (or MINICOMM_MASTER_PORT) is not set")
        # torchrun's agent already serves its own store on MASTER_PORT: use the next port.
        port = base + (1 if os.environ.get("TORCHELASTIC_RUN_ID") else 0)
    token_hex = os.environ.get("MINICOMM_JOB_TOKEN")
    if token_hex:
        token = bytes.fromhex(token_hex)
    else:
        # Foreign launchers give no secret: derive one all ranks share (no protection against a
        # local attacker — say so once).
        token = f"minicomm:{addr}:{port}:{size}".encode()
        if rank == 0:
            print("minicomm: no MINICOMM_JOB_TOKEN set; connections are authenticated with a "
                  "token derived from MASTER_ADDR/PORT only", file=sys.stderr)
    # The node (logical: minicomm run --nodes emulates several on one machine) and the host (the
    # machine: what shared memory can reach). Without MINICOMM_NODE both are the hostname.
    node = os.environ.get("MINICOMM_NODE")
    if node is None:
        node = socket.gethostname()
    host = os.environ.get("MINICOMM_HOST") or node
    cfg = dict(rank=rank, size=size, node=node, host=host, topology=None, master_addr=addr,
               master_port=port, token=token.hex(), host_store=foreign and rank == 0,
               job_id=os.environ.get("MINICOMM_JOB_ID") or f"{port}",
               transport=transport or os.environ.get("MINICOMM_TRANSPORT", "auto"),
               timeout=timeout)
    return connect_world(cfg)
