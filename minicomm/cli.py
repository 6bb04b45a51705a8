"""The ``minicomm`` command: verify | run | bench | demo | sim."""
from __future__ import annotations

import argparse
import os
import sys


def _cmd_verify(a) -> int:
    from .tools.verify import run_matrix
    ok = run_matrix(a.max_world, all_roots=a.all_roots, jobs=a.jobs,
                    collectives=a.collective or None, families=a.algorithm or None)
    return 0 if ok else 1


def _cmd_run(a) -> int:
    argv = list(a.script)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("minicomm run: no script given", file=sys.stderr)
        return 2
    if a.servers is not None:
        # ps.start(comm) reads it; the local launcher copies the environment into every rank and
        # the ssh launcher forwards MINICOMM_* variables, so one place serves both
        if a.servers < 1 or (a.n is not None and a.servers >= a.n):
            print(f"minicomm run: --servers {a.servers} needs 1 <= servers < -n "
                  f"(at least one worker)", file=sys.stderr)
            return 2
        os.environ["MINICOMM_NUM_SERVERS"] = str(a.servers)
    if a.hosts or a.hostfile:
        from .launch import ssh as sshlaunch
        try:
            hosts = (sshlaunch.parse_hostfile(a.hostfile) if a.hostfile
                     else sshlaunch.parse_hosts(a.hosts))
        except sshlaunch.LaunchError as e:       # a bad host list is a usage error
            print(f"minicomm run: {e}", file=sys.stderr)
            return 2
        return sshlaunch.main_from_cli(a, hosts, argv)
    if a.n is None:
        print("minicomm run: give -n N (or --hosts / --hostfile)", file=sys.stderr)
        return 2
    from .launch.local import run_local
    return run_local(a.n, argv, nodes=a.nodes, transport=a.transport, timeout=a.timeout)


def _cmd_bench(a) -> int:
    from .tools.bench import main_from_cli
    return main_from_cli(a)


def _cmd_demo(a) -> int:
    from .tools.demo import main_from_args
    return main_from_args(a)


def _cmd_sim(a) -> int:
    from .sim.cli import main
    return main(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minicomm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="prove every algorithm correct and deadlock-free")
    v.add_argument("--max-world", type=int, default=64)
    v.add_argument("--exhaustive", dest="all_roots", action="store_true",
                   help="every root, count and node map at every world size (slow)")
    v.add_argument("--jobs", type=int, default=0, help="processes (default: all cores)")
    v.add_argument("--collective", action="append", help="restrict to these (repeatable)")
    v.add_argument("--algorithm", action="append", help="restrict to these families (repeatable)")
    v.set_defaults(func=_cmd_verify)

    r = sub.add_parser("run", help="launch a script on N ranks (this box, or hosts over ssh)")
    r.add_argument("-n", type=int, help="number of ranks (with --hosts: cap on the total)")
    r.add_argument("--nodes", type=int, default=1, help="emulated nodes on this box")
    r.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "rdma", "ub"])
    r.add_argument("--timeout", type=float, default=None, help="per-wait timeout (s)")
    r.add_argument("--servers", type=int, default=None,
                   help="parameter servers: ranks 0..K-1 serve in ps.start(comm), the rest are "
                        "workers (sets MINICOMM_NUM_SERVERS)")
    r.add_argument("--hosts", help="host:slots,host:slots (ssh)")
    r.add_argument("--hostfile", help="file of 'host [slots=N]' lines (ssh)")
    r.add_argument("--ssh-opts", default=None, help="extra ssh options (or MINICOMM_SSH)")
    r.add_argument("--python", default=None, help="interpreter on the hosts (default: this one)")
    r.add_argument("--master-addr", default=None, help="address the hosts reach this machine at")
    r.add_argument("--connect-timeout", type=float, default=10.0)
    r.add_argument("script", nargs=argparse.REMAINDER)
    r.set_defaults(func=_cmd_run)

    from .tools import bench
    b = sub.add_parser("bench", help="nccl-tests-style benchmark (with MPICH / gloo side by side)",
                       description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(b)
    b.set_defaults(func=_cmd_bench)

    from .tools import demo
    d = sub.add_parser("demo", help="train a numpy MLP every way: single, allreduce, parameter "
                       "server", description=demo.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(d)
    d.set_defaults(func=_cmd_demo)

    from .sim import cli as sim_cli
    s = sub.add_parser("sim", help="predict collectives and the parameter server on a modelled "
                       "cluster", description=sim_cli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sim_cli.add_arguments(s)
    s.set_defaults(func=_cmd_sim)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
