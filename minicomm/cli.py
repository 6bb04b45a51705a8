"""The minicomm command: verify | run | bench | demo | sim | trace | doctor.

    minicomm verify                       # prove every algorithm correct and deadlock-free
    minicomm run -n 4 script.py           # the script on 4 ranks of this machine
    minicomm bench allreduce -n 2         # nccl-tests-style benchmark
    minicomm demo                         # one MLP trained every way minicomm can train it
    minicomm sim --advise --model-bytes 350GB --gpus 1024   # a modelled cluster
    minicomm trace merge traces/          # one timeline of a MINICOMM_TRACE=traces/ job
    minicomm doctor /tmp/minicomm-flight-JOB   # who is at fault in a failed or hung job

Each command's own --help says more (minicomm sim --help, ...).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

VERIFY_DESCRIPTION = """\
Prove every algorithm of the matrix correct and deadlock-free: for every collective, every
algorithm family and every world size 1..--max-world, the schedules of all ranks are run
symbolically (every output element must come from the right input element of exactly the right
ranks, each counted once; a send completes only when its receive is posted, so a schedule that
passes cannot deadlock on any transport), over roots, element counts and, for hier, node maps.
No processes talk: it runs on the CPU in a process pool (--jobs). Prints a
collective x algorithm table of "ok N" (N schedule sets verified) or "FAIL", then the first
failing case of each failing cell. Exit status 0 when every cell passes, 1 otherwise.
"""

RUN_DESCRIPTION = """\
Launch a Python script on N ranks: -n N processes on this machine (each rank calls
minicomm.init() to join), or over ssh on --hosts / --hostfile. Every line a rank prints is
prefixed with [rank]; when one rank fails, the others are stopped and the exit status says why.

    minicomm run -n 4 examples/hello_allreduce.py
    minicomm run -n 4 --nodes 2 script.py            # two emulated nodes of 2 ranks
    minicomm run --hosts a:4,b:4 script.py --its-own-args
"""


def plain(doc: str) -> str:
    """A module docstring as help text: reStructuredText's ``literal`` marks dropped."""
    return re.sub(r"``(.+?)``", r"\1", doc or "")


def _cmd_verify(a) -> int:
    from .tools.verify import run_matrix
    fams = (a.algorithm or []) + [x.strip() for x in (a.algorithms or "").split(",")
                                  if x.strip()]
    from .algorithms import names
    bad = [f for f in fams if f not in names()]
    if bad:           # a usage error, as argparse words one (registered names come from --load)
        print(f"minicomm verify: error: argument --algorithm: invalid choice: {bad[0]!r} "
              f"(choose from {', '.join(map(repr, names()))})", file=sys.stderr)
        raise SystemExit(2)
    ok = run_matrix(a.max_world, all_roots=a.all_roots, jobs=a.jobs,
                    collectives=a.collective or None, families=fams or None, loads=a.load)
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
    if a.switch:
        os.environ["MINICOMM_SWITCH"] = "1"     # rank 0 starts it (launch/switch.py)
    if a.on_failure != "end" and (a.hosts or a.hostfile):
        print("minicomm run: --on-failure continue is for jobs on this box (not --hosts)",
              file=sys.stderr)
        return 2
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
    return run_local(a.n, argv, nodes=a.nodes, transport=a.transport, timeout=a.timeout,
                     on_failure=a.on_failure)


def _cmd_bench(a) -> int:
    from .tools.bench import main_from_cli
    return main_from_cli(a)


def _cmd_demo(a) -> int:
    from .tools.demo import main_from_args
    return main_from_args(a)


def _cmd_sim(a) -> int:
    from .sim.cli import main
    return main(a)


TRACE_DESCRIPTION = """\
Timelines of collective calls and their schedule steps. A job run with MINICOMM_TRACE=DIR
writes DIR/rank-<R>.json per rank; minicomm sim ... --trace FILE writes the same format for
the modelled cluster. Perfetto (https://ui.perfetto.dev) and Chrome's Trace Viewer open both.
minicomm trace merge DIR joins a job's files into one; exit status 2 when DIR holds no rank
files or a file is not a trace.

    MINICOMM_TRACE=traces minicomm run -n 4 script.py
    minicomm trace merge traces                       # -> traces/merged.json
    minicomm trace merge traces --sim sim.json -o side-by-side.json
"""


def _cmd_trace_merge(a) -> int:
    from .trace import merge
    try:
        path, ranks, calls = merge(a.dir, a.output, a.sim)
    except (OSError, ValueError) as e:
        print(f"minicomm trace merge: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({ranks} ranks, {calls} calls)")
    return 0


DOCTOR_DESCRIPTION = """\
Read a job's flight records (the rank-R.json files a failure, SIGUSR1 or
comm.dump_flight_record() wrote: MINICOMM_FLIGHT_DIR, or the directory minicomm run names)
and print the diagnosis: the ranks at fault and the calls, as lines beginning "diagnosis:".
A rank with no file is taken as dead (killed before it could write one). Exit status 0 when
nothing is at fault, 1 when something is, 2 when DIR holds no flight record.

    minicomm doctor /tmp/minicomm-flight-<job>
"""


def _cmd_doctor(a) -> int:
    from .diagnosis import diagnose
    from .flightrecord import load
    dumps = load(a.dir)
    if not dumps:
        print(f"minicomm doctor: no flight record (rank-R.json) in {a.dir}", file=sys.stderr)
        return 2
    lines = diagnose(dumps, size=a.size)
    print("\n".join(lines))
    return 0 if lines[0].startswith("diagnosis: nothing at fault") else 1


def _add_verify(sub) -> None:
    """The ``verify`` command's options."""
    from .algorithms import FAMILIES
    from .schedule import ALL_COLLECTIVES
    v = sub.add_parser("verify", help="prove every algorithm correct and deadlock-free",
                       description=VERIFY_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--max-world", type=int, default=64, metavar="P",
                   help="verify world sizes 1..P (default: %(default)s)")
    v.add_argument("--exhaustive", dest="all_roots", action="store_true",
                   help="every root, count and node map at every world size (slow)")
    v.add_argument("--jobs", type=int, default=0, help="processes (default: all cores)")
    v.add_argument("--collective", action="append", choices=ALL_COLLECTIVES,
                   metavar="COLLECTIVE",
                   help=f"restrict to this collective (repeatable): "
                        f"{', '.join(ALL_COLLECTIVES)} (the uneven ones up to p=32)")
    v.add_argument("--algorithm", action="append", metavar="FAMILY",
                   help=f"restrict to this algorithm family (repeatable): {', '.join(FAMILIES)}; "
                        f"innet, in-network reduction with its switches, when named; or a "
                        f"registered one (--load)")
    v.add_argument("--algorithms", default=None, metavar="LIST",
                   help="the same, as a comma list")
    v.add_argument("--load", action="append", metavar="FILE", help=LOAD_HELP)
    v.set_defaults(func=_cmd_verify)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minicomm", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    _add_verify(sub)

    r = sub.add_parser("run", help="launch a script on N ranks (this box, or hosts over ssh)",
                       description=RUN_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("-n", type=int, help="number of ranks (with --hosts: cap on the total)")
    r.add_argument("--nodes", type=int, default=1, help="emulated nodes on this box")
    r.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "rdma", "ub"],
                   help="how ranks talk (auto: shared memory within a node, tcp between)")
    r.add_argument("--timeout", type=float, default=None, help="per-wait timeout (s)")
    r.add_argument("--on-failure", default="end", choices=["end", "continue"],
                   help="end: a failed rank ends the job; continue: the others go on, e.g. "
                        "to shrink() and train on (default: %(default)s)")
    r.add_argument("--servers", type=int, default=None,
                   help="parameter servers: ranks 0..K-1 serve in ps.start(comm), the rest are "
                        "workers (sets MINICOMM_NUM_SERVERS)")
    r.add_argument("--switch", action="store_true",
                   help="start the job's emulated in-network switch, which algorithm='innet' "
                        "runs through (sets MINICOMM_SWITCH=1)")
    r.add_argument("--hosts", help="host:slots,host:slots (ssh)")
    r.add_argument("--hostfile", help="file of 'host [slots=N]' lines (ssh)")
    r.add_argument("--ssh-opts", default=None, help="extra ssh options (or MINICOMM_SSH)")
    r.add_argument("--python", default=None, help="interpreter on the hosts (default: this one)")
    r.add_argument("--master-addr", default=None, help="address the hosts reach this machine at")
    r.add_argument("--connect-timeout", type=float, default=10.0,
                   help="seconds to wait for each ssh host to start its agent (default: 10)")
    r.add_argument("script", nargs=argparse.REMAINDER,
                   help="the Python script and its arguments (a module: -- -m module args)")
    r.set_defaults(func=_cmd_run)

    from .tools import bench
    b = sub.add_parser("bench", help="nccl-tests-style benchmark (with MPICH / gloo side by side)",
                       description=plain(bench.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(b)
    b.add_argument("--load", action="append", metavar="FILE", help=LOAD_HELP)
    b.set_defaults(func=_cmd_bench)

    from .tools import demo
    d = sub.add_parser("demo", help="train a numpy MLP every way: single, allreduce, parameter "
                       "server", description=plain(demo.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(d)
    d.set_defaults(func=_cmd_demo)

    from .sim import cli as sim_cli
    s = sub.add_parser("sim", help="predict collectives and the parameter server on a modelled "
                       "cluster", description=plain(sim_cli.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sim_cli.add_arguments(s)
    s.add_argument("--load", action="append", metavar="FILE", help=LOAD_HELP)
    from .trace import SimulatedTrace
    s.set_defaults(func=_cmd_sim, new_timeline=SimulatedTrace)    # what --trace writes with

    t = sub.add_parser("trace", help="timelines of calls and their steps (MINICOMM_TRACE, "
                       "sim --trace)", description=TRACE_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("action", choices=["merge"], metavar="merge",
                   help="join every rank's file of DIR into one trace, aligned by the time each "
                        "process started tracing")
    t.add_argument("dir", metavar="DIR", help="the directory MINICOMM_TRACE named")
    t.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="the merged trace (default: DIR/merged.json)")
    t.add_argument("--sim", metavar="FILE", default=None,
                   help="a minicomm sim --trace file to show beside the measured ranks, as "
                        "processes 'rank R (simulated)'")
    t.set_defaults(func=_cmd_trace_merge)

    dr = sub.add_parser("doctor", help="diagnose a failed or hung job from its ranks' flight "
                        "records", description=DOCTOR_DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    dr.add_argument("dir", metavar="DIR", help="the directory of the job's rank-R.json files")
    dr.add_argument("--size", type=int, default=None,
                    help="the world size (default: the world communicator's, from the records)")
    dr.set_defaults(func=_cmd_doctor)
    return p


LOAD_HELP = ("a Python file whose top level registers algorithms (mc.algorithms.register); "
             "repeatable")


def load_algorithms(paths) -> None:
    """Run each ``--load`` file: its top level registers algorithms."""
    import runpy
    for path in paths or ():
        if not os.path.isfile(path):
            raise SystemExit(f"minicomm: --load {path}: no such file")
        runpy.run_path(path, run_name="__minicomm_load__")


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    load_algorithms(getattr(a, "load", None))
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
