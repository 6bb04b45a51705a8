"""Launching: everything that starts rank processes, and the world bootstrap they run.

- ``local``: ``mc.spawn`` (threads or processes on this machine) and ``minicomm run -n``;
- ``worker``: the child side of ``spawn`` (``python -m minicomm.launch.worker``);
- ``env``: ``mc.init`` from a launcher's environment (minicomm run, torchrun, mpirun, srun);
- ``world``: ``connect_world``, the configuration -> world ``Communicator`` step all of them end in;
- ``ssh``: ``minicomm run --hosts / --hostfile``: one ssh session per host, each running the
- ``agent``: the per-host agent (``python -m minicomm.launch.agent``) that starts a host's ranks.

Nothing below this package starts a process.
"""
from .env import init
from .local import run_local, spawn
from .world import TRANSPORTS, connect_world, node_map

__all__ = ["spawn", "init", "run_local", "connect_world", "node_map", "TRANSPORTS"]
