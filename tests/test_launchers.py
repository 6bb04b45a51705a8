"""mc.init() under the real engines, with nothing set by hand: MPICH's mpiexec (the `mpich`
wheel's hydra, PMI-1 on PMI_FD), Open MPI's mpirun (Debian's openmpi-bin), srun on a one-node
Slurm cluster (tests/slurm/cluster; started here when it is installed and not running, as root)
and torchrun (--standalone, and c10d with two agents).

Each engine runs examples/hello_allreduce.py and the every-collective check
(examples/multihost_check.py) with 4 ranks; two jobs started at the same moment on one
MASTER_PORT never mix (10 times per engine); a Slurm batch script that is not a task fails at
once. A test skips, naming what is missing, only when its engine is not installed — except in CI
(MINICOMM_REQUIRE_EXTRAS=1: .ci/run installs every engine), where it fails instead.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from extras import require

REPO = Path(__file__).resolve().parent.parent
HELLO = str(REPO / "examples" / "hello_allreduce.py")
CHECK = str(REPO / "examples" / "multihost_check.py")
JOB = str(REPO / "tests" / "launch_job.py")
SLURM_SCRIPT = REPO / "tests" / "slurm" / "cluster"
SLURM_DIR = os.environ.get("MINICOMM_SLURM_DIR", "/tmp/minicomm-slurm")
RUN_TIMEOUT = 180          # a bound on a whole launcher run, far above what any run needs
# Trials per engine: a CI-sized sample; MINICOMM_LAUNCH_TRIALS=10 or more for a long run.
TRIALS = int(os.environ.get("MINICOMM_LAUNCH_TRIALS", "4"))

_LAUNCHER_PREFIXES = ("MINICOMM_", "SLURM_", "OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "TORCHELASTIC_",
                      "HYDI_", "GROUP_", "ROLE_")
_GENERIC = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def clean_env(**extra) -> dict:
    """The test runner's environment without any launcher's variables, minicomm importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _GENERIC}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _version(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


# ----------------------------------------------------------------------------- the engines
def mpich_mpiexec() -> str:
    """MPICH's hydra from the `mpich` wheel (next to this interpreter), never Open MPI's."""
    for cand in (Path(sys.executable).parent / "mpiexec.hydra", Path(sys.executable).parent / "mpiexec",
                 shutil.which("mpiexec.hydra"), shutil.which("mpiexec.mpich")):
        if cand and os.path.exists(cand) and "HYDRA" in _version([str(cand), "--version"]):
            return str(cand)
    require("MPICH's mpiexec (hydra) is not installed (pip install -e '.[peers]': the mpich wheel)")


def openmpi_mpirun() -> list:
    for cand in ("/usr/bin/mpirun.openmpi", shutil.which("mpirun.openmpi"), "/usr/bin/mpirun",
                 shutil.which("orterun")):
        if cand and os.path.exists(cand) and "Open MPI" in _version([cand, "--version"]):
            cmd = [cand, "--oversubscribe"]
            if os.geteuid() == 0:
                cmd.insert(1, "--allow-run-as-root")
            return cmd
    require("Open MPI's mpirun is not installed (apt-get install openmpi-bin)")


def torchrun() -> list:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        require("torch is not installed (pip install torch==2.13.0, the CPU build)")
    return [sys.executable, "-m", "torch.distributed.run"]


def _slurm_up(env) -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mix", "alloc"))


@pytest.fixture(scope="module")
def slurm():
    """Environment for srun/sbatch against a running one-node cluster (SLURM_CONF), starting
    tests/slurm/cluster for this module when Slurm is installed, nothing runs, and we are root."""
    if shutil.which("srun") is None or shutil.which("slurmd") is None:
        require("Slurm is not installed (apt-get install slurm-wlm munge; then tests/slurm/cluster up)")
    conf = os.environ.get("SLURM_CONF") or os.path.join(SLURM_DIR, "slurm.conf")
    env = clean_env(SLURM_CONF=conf)
    started = False
    if not (os.path.exists(conf) and _slurm_up(env)):
        if os.geteuid() != 0:
            require("no Slurm cluster is running and only root can start one (tests/slurm/cluster up)")
        subprocess.run([str(SLURM_SCRIPT), "up"], check=True, timeout=180,
                       env=dict(os.environ, MINICOMM_SLURM_DIR=SLURM_DIR))
        conf = os.path.join(SLURM_DIR, "slurm.conf")
        env = clean_env(SLURM_CONF=conf)
        started = True
    yield env
    if started:
        subprocess.run([str(SLURM_SCRIPT), "down"], timeout=60,
                       env=dict(os.environ, MINICOMM_SLURM_DIR=SLURM_DIR))


def command(engine: str, n: int, argv: list, slurm_env=None, env_names=()) -> list:
    py = sys.executable
    if engine == "mpiexec":
        return [mpich_mpiexec(), "-n", str(n), py, *argv]
    if engine == "mpirun":
        forward = [a for name in env_names for a in ("-x", name)]
        return [*openmpi_mpirun(), *forward, "-n", str(n), py, *argv]
    if engine == "srun":
        return ["srun", "-n", str(n), "--kill-on-bad-exit=0", py, *argv]
    if engine == "srun-pmi2":     # Slurm's PMI server: mc.init speaks PMI-1 to it too
        return ["srun", "--mpi=pmi2", "-n", str(n), py, *argv]
    if engine == "torchrun":
        return [*torchrun(), "--standalone", f"--nproc-per-node={n}", *argv]
    raise ValueError(engine)


def start(cmd, env) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=str(REPO))


def finish(p: subprocess.Popen, timeout=RUN_TIMEOUT):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{p.args[0]} still running after {timeout}s\n{out}\n{err}")
    return p.returncode, out, err


def run(cmd, env, timeout=RUN_TIMEOUT):
    return finish(start(cmd, env), timeout)


# Launchers interleave their ranks' output (a line's text and its newline are separate writes),
# so results are found by pattern in the whole output, not line by line.


def hello_ranks(out: str) -> list:
    """The ranks whose hello line reports the right sum for a world of 4."""
    return sorted(int(r) for r in re.findall(
        r"rank (\d)/4 on node \S+: allreduce sum = \[6, 6, 6, 6\] \(expected 6\) ok", out))


def check_ranks(out: str) -> list:
    """The ranks whose every-collective report (one JSON object) says all checks passed."""
    return sorted(int(m) for m in re.findall(
        r'\{"rank": (\d), "size": 4, [^{}]*"checks": [1-9]\d*\}', out))


def engine_env(engine, request, **extra):
    if engine.startswith("srun"):
        base = request.getfixturevalue("slurm")
        return dict(base, **{k: str(v) for k, v in extra.items()})
    return clean_env(**extra)


# ------------------------------------------------------------------- hello and every collective
# torchrun's hello runs in test_torchrun_c10d_with_two_agents (and --standalone in .ci/run)
@pytest.mark.parametrize("engine", ["mpiexec", "mpirun", "srun", "srun-pmi2"])
def test_hello_with_nothing_set_by_hand(engine, request):
    env = engine_env(engine, request)
    rc, out, err = run(command(engine, 4, [HELLO]), env)
    assert rc == 0, f"{out}\n{err}"
    assert hello_ranks(out) == [0, 1, 2, 3], out


@pytest.mark.parametrize("engine", ["mpiexec", "mpirun", "srun"])
def test_every_collective_and_leftover_variables_lose(engine, request):
    """The launcher that started the ranks wins over generic RANK / WORLD_SIZE left in the
    caller's environment (here: a world of 9 that does not exist). Under mpiexec MASTER_ADDR /
    MASTER_PORT are moot too (PMI); under Open MPI and Slurm a MASTER_ADDR / MASTER_PORT the user
    sets is honoured (PyTorch Lightning's convention), so they are not set here."""
    leftovers = dict(RANK=7, WORLD_SIZE=9)
    if engine == "mpiexec":
        leftovers.update(MASTER_ADDR="192.0.2.1", MASTER_PORT=9)
    env = engine_env(engine, request, **leftovers)
    rc, out, err = run(command(engine, 4, [CHECK], env_names=("RANK", "WORLD_SIZE")), env)
    assert rc == 0, f"{out}\n{err}"
    assert check_ranks(out) == [0, 1, 2, 3], out
    assert "RANK=7 ignored" in err


def test_mpiexec_with_mpi4py_initialized_first(tmp_path):
    """MPI owns the PMI connection once MPI_Init ran: mc.init() then bootstraps over
    MPI_COMM_WORLD, and both libraries work side by side in every rank."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        require("mpi4py is not installed (pip install -e '.[peers]')")
    script = tmp_path / "both.py"
    script.write_text(
        "from mpi4py import MPI\nimport numpy as np\nimport minicomm as mc\n"
        "comm = mc.init()\n"
        "y = comm.allreduce(np.full(2, comm.rank + 1.0))\n"
        "print(f'BOTH {comm.rank} {y[0]:g} {MPI.COMM_WORLD.allreduce(comm.rank + 1)}', flush=True)\n"
        "comm.close()\n")
    rc, out, err = run([mpich_mpiexec(), "-n", "3", sys.executable, str(script)], clean_env())
    assert rc == 0, f"{out}\n{err}"
    assert sorted(re.findall(r"BOTH (\d) 6 6", out)) == ["0", "1", "2"], out


def test_every_collective_under_torchrun():
    rc, out, err = run(command("torchrun", 4, [CHECK]), clean_env())
    assert rc == 0, f"{out}\n{err}"
    assert check_ranks(out) == [0, 1, 2, 3], out


def test_torchrun_c10d_with_two_agents():
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = uuid.uuid4().hex[:8]
    agents = [start([*torchrun(), "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", HELLO], clean_env())
              for _ in range(2)]
    results = [finish(a) for a in agents]
    out = "".join(o for _, o, _ in results)
    for rc, o, e in results:
        assert rc == 0, f"{o}\n{e}"
    assert hello_ranks(out) == [0, 1, 2, 3], out


# ------------------------------------------------------------------ two jobs on one MASTER_PORT
def _judge(job_out: str, rc: int, n: int, port: int, engine: str) -> str:
    """'ok' (every rank right), or 'refused' (failed with the clear error); anything else —
    a wrong result above all — fails the test."""
    assert "WRONG" not in job_out, job_out
    oks = len(re.findall(r"OK \d \d", job_out))
    if rc == 0 and oks == n:
        return "ok"
    assert oks == 0, f"a job partly ran and partly failed:\n{job_out}"
    assert rc != 0
    clear = re.findall(rf"CLEANERR [^\n]*\b{port}\b", job_out)
    if engine == "torchrun":      # torchrun's own agent store refuses the port first
        clear += re.findall(rf"EADDRINUSE[^\n]*|port: {port}\b[^\n]*EADDRINUSE", job_out)
    assert clear, f"the refused job does not name port {port}:\n{job_out}"
    return "refused"


# A job whose rank was refused while the other job ran may start its rank 0 only after that job
# has ended: rank 0 then waits the setup timeout for a rank that already gave up. Shorter here.
QUICK = {"MINICOMM_SETUP_TIMEOUT": 15}


@pytest.mark.parametrize("engine, trials", [("mpiexec", TRIALS), ("mpirun", TRIALS),
                                            ("srun", TRIALS), ("env", TRIALS), ("torchrun", 2)])
def test_two_jobs_on_one_master_port_never_mix(engine, trials, request):
    """Two jobs of 2 ranks started at the same moment with the same MASTER_PORT, ``trials``
    times: zero wrong results; each job either runs correctly on its own or fails with an error
    naming the port. mpiexec never uses MASTER_PORT (PMI: both jobs run); Open MPI and srun
    carry a job identity into the token (the second fails fast); the generic RANK/WORLD_SIZE
    path is given one with MINICOMM_JOB_ID, as docs/guide/launching.md tells users to."""
    outcomes = []
    for trial in range(trials):
        port = free_port()
        jobs = []
        for tag in (1, 2):
            if engine == "env":
                procs = [start([sys.executable, JOB], clean_env(
                    RANK=r, WORLD_SIZE=2, MASTER_PORT=port, JOB_TAG=tag, **QUICK,
                    MINICOMM_JOB_ID=f"trial{trial}-job{tag}")) for r in range(2)]
                jobs.append(procs)
                continue
            env = engine_env(engine, request, MASTER_PORT=port, JOB_TAG=tag, **QUICK)
            if engine == "torchrun":
                cmd = [*torchrun(), "--nproc-per-node=2", f"--master-port={port}", JOB]
            else:
                cmd = command(engine, 2, [JOB], env_names=("MASTER_PORT", "JOB_TAG", *QUICK))
            jobs.append([start(cmd, env)])
        verdicts = []
        for procs in jobs:
            results = [finish(p) for p in procs]
            out = "".join(o + e for _, o, e in results)
            rc = max(abs(r) for r, _, _ in results)
            verdicts.append(_judge(out, rc, 2, port, engine))
        assert "ok" in verdicts, f"trial {trial}: neither job ran ({verdicts})"
        outcomes.append(tuple(verdicts))
    if engine == "mpiexec":       # the rendezvous goes through PMI: a shared MASTER_PORT is moot
        assert all(v == ("ok", "ok") for v in outcomes), outcomes


# ----------------------------------------------------------------------------- Slurm batch
def test_slurm_batch_script_fails_at_once_instead_of_waiting(slurm, tmp_path):
    """A single process in the batch step of `sbatch -n 4` is not 4 ranks: mc.init() says so
    at once (it used to wait the 300 s timeout for peers that never come)."""
    script = tmp_path / "batch.sh"
    out = tmp_path / "batch.out"
    script.write_text(f"#!/bin/sh\ncd {REPO}\nexec {sys.executable} {HELLO}\n")
    script.chmod(0o755)
    res = subprocess.run(["sbatch", "-n", "4", "-W", "-o", str(out), str(script)], env=slurm,
                         capture_output=True, text=True, timeout=120)
    text = out.read_text()
    assert res.returncode != 0, text
    assert "batch script of Slurm job" in text and "SLURM_NTASKS=4" in text
    assert "srun python script.py" in text
