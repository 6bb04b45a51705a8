"""mc.init()'s launcher detection, Slurm node lists, the PMI-1 client, store membership and the
setup timeout — the unit level, with no launcher installed.

The PMI client is checked against a small in-test PMI-1 server (``FakePMI``: socketpairs, one
thread per client, a KVS and a barrier), and ``mc.init`` is run end to end over it in real
processes. The real engines (mpiexec, mpirun, srun, torchrun) are tests/test_launchers.py.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import minicomm as mc
from minicomm.launch import env as launch_env
from minicomm.launch.env import (
    BootstrapError,
    derived_token,
    detect,
    expand_nodelist,
    first_node,
    ompi_port,
    slurm_port,
)
from minicomm.launch.pmi import PMIClient, PMIError, parse_line
from minicomm.rendezvous import RendezvousError, StoreClient, StoreServer, new_token

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every variable a launcher could have left in the test runner's own environment.
_LAUNCHER_PREFIXES = ("MINICOMM_", "SLURM_", "OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "TORCHELASTIC_",
                      "HYDI_", "GROUP_", "LOCAL_", "ROLE_")
_GENERIC = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _GENERIC}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------- node lists
@pytest.mark.parametrize("nodelist, hosts", [
    ("vm", ["vm"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("gpu[5]", ["gpu5"]),
    ("c1 c2", ["c1", "c2"]),
    ("node[1-2]x", ["node1x", "node2x"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_node(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["node[1-", "node1-3]", "node[a-b]", "node[3-1]", "n[1]]", "n[1,]"])
def test_malformed_nodelist_is_a_value_error(bad):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(bad)


def test_slurm_port_follows_lightning():
    # PyTorch Lightning's SLURMEnvironment.main_port: 15000 + int(job_id[-4:])
    assert slurm_port("12345") == 15000 + 2345
    assert slurm_port("7") == 15007
    assert slurm_port("990001") == 15001
    assert 25000 <= ompi_port("1345912833") < 29000


# -------------------------------------------------------------------------------- detection
def slurm_step(**over):
    env = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_NTASKS="4",
               SLURM_STEP_NUM_TASKS="4", SLURM_STEP_NODELIST="node[07-08]",
               SLURM_JOB_NODELIST="node[07-09]", SLURM_STEP_NUM_NODES="2", SLURM_LOCALID="1")
    env.update(over)
    return env


def test_slurm_step_derives_port_and_first_host():
    launch = detect(slurm_step())
    assert (launch.kind, launch.rank, launch.size) == ("slurm", 1, 4)
    assert (launch.addr, launch.port) == ("node07", 15000 + 4242)
    assert launch.identity == "slurm:4242.0"
    assert not launch.host_store
    text = launch.describe()
    for var in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_ID"):
        assert var in text
    assert detect(slurm_step(SLURM_PROCID="0")).host_store


def test_slurm_step_on_one_node_uses_loopback_and_master_overrides():
    one = detect(slurm_step(SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="vm"))
    assert (one.addr, one.bind) == ("127.0.0.1", "127.0.0.1")
    forced = detect(slurm_step(MASTER_ADDR="head", MASTER_PORT="23456"))
    assert (forced.addr, forced.port) == ("head", 23456)
    assert "MASTER_PORT" in forced.port_from and "MASTER_ADDR" in forced.addr_from


def test_launcher_beats_leftover_generic_variables():
    launch = detect(slurm_step(RANK="3", WORLD_SIZE="9", MASTER_PORT="1234"))
    assert (launch.kind, launch.rank, launch.size) == ("slurm", 1, 4)
    assert any("RANK=3 ignored" in n for n in launch.notes)
    assert any("WORLD_SIZE=9 ignored" in n for n in launch.notes)
    # mpirun started us inside a Slurm step: Open MPI's ranks, not the step's
    ompi = detect(slurm_step(OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="3",
                             PMIX_NAMESPACE="77", OMPI_MCA_orte_num_nodes="1"))
    assert (ompi.kind, ompi.rank, ompi.size) == ("openmpi", 2, 3)
    # torchrun inside srun: torchrun's
    tr = detect(slurm_step(TORCHELASTIC_RUN_ID="r1", RANK="5", WORLD_SIZE="8", MASTER_PORT="29500",
                           MASTER_ADDR="h", TORCHELASTIC_USE_AGENT_STORE="True",
                           GROUP_WORLD_SIZE="2", GROUP_RANK="1"))
    assert (tr.kind, tr.rank, tr.size, tr.bootstrap) == ("torchrun", 5, 8, "torch")


def test_pmi_beats_slurm_and_generic():
    r, w = os.pipe()
    try:
        launch = detect(slurm_step(PMI_FD=str(r), PMI_RANK="2", PMI_SIZE="3", MPI_LOCALNRANKS="3",
                                   RANK="0", WORLD_SIZE="5"))
        assert (launch.kind, launch.rank, launch.size, launch.bootstrap) == ("pmi", 2, 3, "pmi")
        assert launch.bind == "127.0.0.1"          # every rank on this host
        # a PMI_FD that is not an open descriptor is a leftover, not a launcher
        closed = detect(dict(PMI_FD="987654", PMI_RANK="0", PMI_SIZE="2", RANK="1",
                             WORLD_SIZE="2", MASTER_PORT="1"))
        assert closed.kind == "env"
    finally:
        os.close(r)
        os.close(w)


def test_openmpi_single_node_and_several_nodes():
    base = dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4", PMIX_NAMESPACE="1345912833",
                OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="4",
                OMPI_MCA_orte_num_nodes="1",
                OMPI_MCA_orte_hnp_uri="1345912832.0;tcp://127.0.0.1:51819;tcp6://[fd00::2]:33853")
    one = detect(base)
    assert (one.addr, one.port, one.host_store) == ("127.0.0.1", ompi_port("1345912833"), True)
    assert one.identity == "openmpi:1345912833"
    assert "PMIX_NAMESPACE" in one.port_from
    several = detect(dict(base, OMPI_MCA_orte_num_nodes="2", OMPI_COMM_WORLD_LOCAL_SIZE="2"))
    assert several.addr == "127.0.0.1"             # mpirun's host, from orte_hnp_uri
    assert several.host_store                       # local rank 0, and that address is ours
    remote = detect(dict(base, OMPI_MCA_orte_num_nodes="2", OMPI_COMM_WORLD_LOCAL_SIZE="2",
                         OMPI_MCA_orte_hnp_uri="1.0;tcp://192.0.2.77:1"))
    assert remote.addr == "192.0.2.77" and not remote.host_store
    assert detect(dict(base, MASTER_PORT="24000")).port == 24000


def test_torchrun_agent_store_and_fallback():
    env = dict(TORCHELASTIC_RUN_ID="abc", TORCHELASTIC_RESTART_COUNT="1", RANK="0", WORLD_SIZE="2",
               MASTER_ADDR="localhost", MASTER_PORT="29500", LOCAL_WORLD_SIZE="2",
               GROUP_WORLD_SIZE="1", GROUP_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True")
    launch = detect(env)
    assert launch.bootstrap == "torch" and launch.agent_store == ("localhost", 29500)
    assert launch.identity == "torchrun:abc:1"
    old = detect(dict(env, TORCHELASTIC_USE_AGENT_STORE="False"))
    assert (old.bootstrap, old.port, old.host_store) == ("store", 29501, True)


def test_generic_and_minicomm_run():
    g = detect(dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))
    assert (g.kind, g.addr, g.port, g.identity, g.host_store) == ("env", "10.0.0.1", 29500, "", False)
    with pytest.raises(BootstrapError, match="MASTER_PORT.*RANK=1"):
        detect(dict(RANK="1", WORLD_SIZE="2"))
    tagged = detect(dict(RANK="1", WORLD_SIZE="2", MASTER_PORT="29500", MINICOMM_JOB_ID="exp7"))
    assert tagged.identity == "exp7"
    m = detect(dict(MINICOMM_RANK="0", MINICOMM_SIZE="2", MINICOMM_MASTER_PORT="4000",
                    MINICOMM_JOB_ID="j", MINICOMM_JOB_TOKEN="ab" * 32, RANK="7", WORLD_SIZE="9"))
    assert (m.kind, m.rank, m.size, m.token, m.foreign) == ("minicomm", 0, 2, b"\xab" * 32, False)
    with pytest.raises(BootstrapError, match="no launcher environment"):
        detect({})
    with pytest.raises(BootstrapError, match="not an integer"):
        detect(dict(RANK="x", WORLD_SIZE="2"))
    with pytest.raises(BootstrapError, match="rank 5 is not in a world of 2"):
        detect(dict(RANK="5", WORLD_SIZE="2", MASTER_PORT="1"))


def test_a_world_of_one_needs_no_port():
    for env in (dict(RANK="0", WORLD_SIZE="1"), slurm_step(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1"),
                dict(SLURM_JOB_ID="9", SLURM_NTASKS="1", SLURM_PROCID="0")):
        launch = detect(env)
        assert (launch.port, launch.addr, launch.host_store) == (0, "127.0.0.1", True)


def test_slurm_batch_script_fails_at_once():
    batch = dict(SLURM_JOB_ID="31", SLURM_NTASKS="4", SLURM_PROCID="0", SLURM_JOB_NODELIST="vm")
    with pytest.raises(BootstrapError, match=r"batch script of Slurm job 31.*SLURM_NTASKS=4.*srun"):
        detect(batch)
    # ranks started by hand inside the batch script: their RANK/WORLD_SIZE describe the world
    assert detect(dict(batch, RANK="1", WORLD_SIZE="2", MASTER_PORT="5")).kind == "env"


def test_derived_token_binds_identity_and_size():
    a, b = detect(slurm_step()), detect(slurm_step(SLURM_JOB_ID="14242"))    # same derived port
    assert a.port == b.port
    assert derived_token(a) != derived_token(b)
    c = detect(slurm_step(SLURM_STEP_ID="1"))
    assert derived_token(a) != derived_token(c)
    assert derived_token(a) == derived_token(detect(slurm_step(SLURM_PROCID="3")))


# ---------------------------------------------------------------------------------- fake PMI
class FakePMI:
    """A PMI-1 server for ``n`` clients on socketpairs (the launcher's side of PMI_FD)."""

    def __init__(self, n: int, kvsname: str = "kvs_test_0", fail: str = ""):
        self.n, self.kvsname, self.fail = n, kvsname, fail
        self.kvs, self.log = {}, []
        self.pairs = [socket.socketpair() for _ in range(n)]
        self._barrier, self._lock = [], threading.Lock()
        self.finalized = 0
        self.threads = [threading.Thread(target=self._serve, args=(i,), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def client_fd(self, i: int) -> int:
        return self.pairs[i][1].fileno()

    def _reply(self, i, line):
        try:
            self.pairs[i][0].sendall((line + "\n").encode())
        except OSError:           # the test hung up this client on purpose
            pass

    def hang_up(self, i):
        """The launcher goes away: the client's next read sees the connection closed."""
        self.pairs[i][0].shutdown(socket.SHUT_RDWR)

    def _serve(self, i):
        sock = self.pairs[i][0]
        buf = b""
        while True:
            try:
                chunk = sock.recv(4096)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                raw, buf = buf.split(b"\n", 1)
                req = parse_line(raw.decode())
                with self._lock:
                    self.log.append((i, req))
                cmd = req["cmd"]
                if cmd == self.fail:
                    reply = {"get": "get_result", "put": "put_result"}.get(cmd, cmd)
                    self._reply(i, f"cmd={reply} rc=-1 msg=injected_failure")
                elif cmd == "init":
                    self._reply(i, "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0")
                elif cmd == "get_maxes":
                    self._reply(i, "cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024")
                elif cmd == "get_appnum":
                    self._reply(i, "cmd=appnum appnum=0")
                elif cmd == "get_my_kvsname":
                    self._reply(i, f"cmd=my_kvsname kvsname={self.kvsname}")
                elif cmd == "put":
                    self.kvs[req["key"]] = req["value"]
                    self._reply(i, "cmd=put_result rc=0 msg=success")
                elif cmd == "get":
                    if req["key"] in self.kvs:
                        self._reply(i, f"cmd=get_result rc=0 msg=success value={self.kvs[req['key']]}")
                    else:
                        self._reply(i, "cmd=get_result rc=-1 msg=key_not_found")
                elif cmd == "barrier_in":
                    with self._lock:
                        self._barrier.append(i)
                        done = len(self._barrier) == self.n
                        waiting = list(self._barrier) if done else []
                        if done:
                            self._barrier.clear()
                    for j in waiting:
                        self._reply(j, "cmd=barrier_out")
                elif cmd == "finalize":
                    self.finalized += 1
                    self._reply(i, "cmd=finalize_ack")
                else:
                    self._reply(i, f"cmd={cmd}_unknown rc=-1")

    def close(self):
        for a, b in self.pairs:
            a.close()
            b.close()


def test_pmi_client_speaks_the_wire_protocol():
    srv = FakePMI(2)
    try:
        clients = [PMIClient(fd=srv.client_fd(i), timeout=10) for i in range(2)]
        for c in clients:
            c.init()
            assert c.get_maxes()["vallen_max"] == 1024
            assert c.get_appnum() == 0
            assert c.get_my_kvsname() == "kvs_test_0"
        clients[0].put("addr", "127.0.0.1:5000:vm")
        results = [None, None]

        def second():
            clients[1].barrier()
            results[1] = clients[1].get("addr")
        t = threading.Thread(target=second)
        t.start()
        clients[0].barrier()
        t.join(10)
        assert results[1] == "127.0.0.1:5000:vm"
        with pytest.raises(PMIError, match="key_not_found"):
            clients[0].get("missing")
        with pytest.raises(ValueError):
            clients[0].put("k", "has space")
        for c in clients:
            c.finalize()
        assert srv.finalized == 2
        sent = [req["cmd"] for i, req in srv.log if i == 0]
        assert sent[:4] == ["init", "get_maxes", "get_appnum", "get_my_kvsname"]
        assert sent[-1] == "finalize"
        init = next(req for i, req in srv.log if req["cmd"] == "init")
        assert (init["pmi_version"], init["pmi_subversion"]) == ("1", "1")
    finally:
        srv.close()


def test_pmi_client_errors_are_named():
    srv = FakePMI(2, fail="put")
    try:
        c = PMIClient(fd=srv.client_fd(0), timeout=2)
        c.init()
        c.get_my_kvsname()
        with pytest.raises(PMIError, match="put failed: rc=-1 injected_failure"):
            c.put("k", "v")
        with pytest.raises(mc.CommTimeout, match="barrier"):     # the other rank never comes
            c.barrier()
        c.close()
        lone = PMIClient(fd=srv.client_fd(1), timeout=2)
        srv.hang_up(1)
        with pytest.raises(PMIError, match="closed the connection"):
            lone.init()
        lone.close()
    finally:
        srv.close()


_INIT_SCRIPT = """
import numpy as np, minicomm as mc
comm = mc.init()
y = comm.allreduce(np.full(3, comm.rank + 1, dtype=np.int64))
print("RESULT", comm.rank, comm.size, int(y[0]), flush=True)
comm.close()
"""


def run_ranks(envs, script=_INIT_SCRIPT, pass_fds=(), timeout=60):
    procs = [subprocess.Popen([sys.executable, "-c", script], env=e, pass_fds=pass_fds,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for e in envs]
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
        out.append((p.returncode, o, e))
    return out


def test_init_over_pmi_end_to_end():
    """mc.init() in 3 real processes whose only launcher is the fake PMI server: the store's
    address and a random token travel through the KVS."""
    srv = FakePMI(3, kvsname="kvs_e2e_1")
    try:
        envs = [clean_env(PMI_FD=srv.client_fd(i), PMI_RANK=i, PMI_SIZE=3, MPI_LOCALNRANKS=3)
                for i in range(3)]
        out = run_ranks(envs, pass_fds=[srv.client_fd(i) for i in range(3)])
        for rank, (rc, o, e) in enumerate(out):
            assert rc == 0, e
            assert f"RESULT {rank} 3 6" in o
        assert srv.finalized == 3
        assert len(srv.kvs["minicomm-token"]) == 64          # 32 random bytes, hex
        assert srv.kvs["minicomm-store"].startswith("127.0.0.1:")
    finally:
        srv.close()


# -------------------------------------------------------------------------- store membership
def test_store_refuses_a_member_of_another_job():
    token = new_token()
    with StoreServer("127.0.0.1", 0, token, job=("slurm:1.0", 2)) as srv:
        with StoreClient("127.0.0.1", srv.port, token, timeout=5) as a:
            a.join("slurm:1.0", 2, 0)
            with StoreClient("127.0.0.1", srv.port, token, timeout=5) as b:
                with pytest.raises(RendezvousError, match="slurm:1.0.*slurm:2.0"):
                    b.join("slurm:2.0", 2, 1)
                with pytest.raises(RendezvousError, match="of 3 ranks"):
                    b.join("slurm:1.0", 3, 1)
                with pytest.raises(RendezvousError, match="outside"):
                    b.join("slurm:1.0", 2, 2)
                b.join("slurm:1.0", 2, 1)
            assert sorted(a.wait_world(5)) == [0, 1]


def test_duplicate_rank_before_the_world_is_complete_stops_everyone():
    token = new_token()
    with StoreServer("127.0.0.1", 0, token) as srv:
        a = StoreClient("127.0.0.1", srv.port, token, timeout=10)
        b = StoreClient("127.0.0.1", srv.port, token, timeout=10)
        c = StoreClient("127.0.0.1", srv.port, token, timeout=10)
        a.join("", 3, 0)
        b.join("", 3, 1)
        errors = []

        def waiter():
            try:
                a.wait_world(10)
            except RendezvousError as e:
                errors.append(e)
        t = threading.Thread(target=waiter)
        t.start()
        with pytest.raises(RendezvousError, match="two processes claim rank 1"):
            c.join("", 3, 1)
        t.join(10)
        assert errors and "two processes claim rank 1" in str(errors[0])   # woken, not hung
        with pytest.raises(RendezvousError, match="two processes claim rank 1"):
            b.get("anything", timeout=1)
        for x in (a, b, c):
            x.close()


def test_duplicate_rank_after_the_world_is_complete_refuses_only_the_newcomer():
    token = new_token()
    with StoreServer("127.0.0.1", 0, token) as srv:
        a = StoreClient("127.0.0.1", srv.port, token, timeout=5)
        b = StoreClient("127.0.0.1", srv.port, token, timeout=5)
        a.join("", 2, 0)
        b.join("", 2, 1)
        a.wait_world(5)
        with StoreClient("127.0.0.1", srv.port, token, timeout=5) as late:
            with pytest.raises(RendezvousError, match="already complete"):
                late.join("", 2, 1)
        a.set("k", b"v")
        assert b.get("k", timeout=5) == b"v"          # the job itself goes on
        a.close()
        b.close()


def test_wait_world_says_who_is_missing():
    token = new_token()
    with StoreServer("127.0.0.1", 0, token) as srv, \
            StoreClient("127.0.0.1", srv.port, token, timeout=5) as a:
        a.join("j", 5, 0)
        with StoreClient("127.0.0.1", srv.port, token, timeout=5) as b:
            b.join("j", 5, 3)
            with pytest.raises(mc.CommTimeout, match=r"2 of 5 ranks arrived.*missing ranks 1-2, 4") \
                    as info:
                a.wait_world(0.5)
            assert info.value.missing == [1, 2, 4]


# ---------------------------------------------------------------------- init's failure modes
def test_missing_peers_fail_within_the_setup_timeout():
    port = free_port()
    out = run_ranks([clean_env(RANK=0, WORLD_SIZE=3, MASTER_PORT=port, MINICOMM_SETUP_TIMEOUT=2)])
    rc, o, e = out[0]
    assert rc != 0
    assert "1 of 3 ranks arrived within 2s" in e
    assert "world size 3 from WORLD_SIZE=3" in e and "rank 0 from RANK=0" in e
    assert f"port {port} from MASTER_PORT={port}" in e


def test_rank_without_its_store_names_the_address_variables():
    port = free_port()
    out = run_ranks([clean_env(RANK=1, WORLD_SIZE=2, MASTER_PORT=port, MASTER_ADDR="127.0.0.1",
                               MINICOMM_SETUP_TIMEOUT=1)])
    rc, o, e = out[0]
    assert rc != 0 and "did not answer within the setup timeout" in e
    assert "address 127.0.0.1 from MASTER_ADDR" in e


def test_port_held_by_another_program_fails_fast_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run_ranks([clean_env(RANK=0, WORLD_SIZE=2, MASTER_PORT=port,
                                   MINICOMM_SETUP_TIMEOUT=20)], timeout=60)
    rc, o, e = out[0]
    assert rc != 0
    assert f"port {port} (MASTER_PORT={port}) is already in use" in e


def test_single_process_world_from_slurm_batch_runs_at_once():
    out = run_ranks([clean_env(SLURM_JOB_ID=5, SLURM_NTASKS=1, SLURM_PROCID=0)])
    rc, o, e = out[0]
    assert rc == 0, e
    assert "RESULT 0 1 1" in o


def test_setup_timeout_defaults():
    launch = detect(slurm_step())
    assert launch_env.setup_timeout_for(launch, None, None, {}) == launch_env.FOREIGN_SETUP_TIMEOUT
    assert launch_env.setup_timeout_for(launch, None, None, {"MINICOMM_SETUP_TIMEOUT": "7"}) == 7
    assert launch_env.setup_timeout_for(launch, 600, 3, {}) == 3
    own = detect(dict(MINICOMM_RANK="0", MINICOMM_SIZE="2", MINICOMM_MASTER_PORT="1"))
    assert launch_env.setup_timeout_for(own, None, None, {}) == 300
    assert launch_env.FOREIGN_SETUP_TIMEOUT < 60
    with pytest.raises(BootstrapError):
        launch_env.setup_timeout_for(launch, None, None, {"MINICOMM_SETUP_TIMEOUT": "soon"})


def test_two_anonymous_ranks_claiming_one_rank_are_both_told():
    """Generic RANK/WORLD_SIZE with nothing job-unique: a second process claiming a rank of an
    incomplete world stops the whole rendezvous, with the clear error on every process."""
    port = free_port()
    base = dict(WORLD_SIZE=3, MASTER_PORT=port, MINICOMM_SETUP_TIMEOUT=20)
    procs = []
    script = "import minicomm as mc\nmc.init()\n"
    for rank in (0, 1):
        procs.append(subprocess.Popen([sys.executable, "-c", script],
                                      env=clean_env(RANK=rank, **base), stderr=subprocess.PIPE,
                                      text=True))
    # no ordering is needed: whichever rank 1 comes second stops the rendezvous
    dup = subprocess.Popen([sys.executable, "-c", script], env=clean_env(RANK=1, **base),
                           stderr=subprocess.PIPE, text=True)
    procs.append(dup)
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    # the store's host reads the verdict first, yet keeps the store up until both claimants have
    # been sent it: every process names the conflict, none sees only a lost store
    assert all("two processes claim rank 1" in e for e in errs), [e[-700:] for e in errs]
    assert all("MASTER_PORT" in e for e in errs), [e[-700:] for e in errs]


def test_a_poisoned_store_tells_every_member_before_it_closes():
    """The race behind the test above, made deterministic: the host closes a poisoned store while
    a member has not yet asked anything since the conflict. close(linger=) must wait until that
    member has been sent the verdict (not close under it), and still return if it never asks."""
    token = new_token()
    srv = StoreServer("127.0.0.1", 0, token)
    try:
        host, first, dup = (StoreClient("127.0.0.1", srv.port, token, timeout=10)
                            for _ in range(3))
        host.join("", 3, 0)
        first.join("", 3, 1)
        with pytest.raises(RendezvousError, match="two processes claim rank 1"):
            dup.join("", 3, 1)                          # told by its own join
        with pytest.raises(RendezvousError, match="two processes claim rank 1"):
            host.wait_world(5)                          # the host reads the verdict...
        host.close()
        dup.close()
        closer = threading.Thread(target=srv.close, kwargs=dict(linger=30))
        closer.start()                                  # ...and leaves, while `first` has not asked
        closer.join(0.5)
        assert closer.is_alive()                        # not closed under `first`
        with pytest.raises(RendezvousError, match="two processes claim rank 1"):
            first.wait_world(5)                         # the verdict, not a lost store
        closer.join(10)
        assert not closer.is_alive()                    # returns once the last member is told
        first.close()
    finally:
        srv.close()
    # a member that never asks again costs at most the linger: every wait keeps its bound
    srv = StoreServer("127.0.0.1", 0, token)
    with StoreClient("127.0.0.1", srv.port, token, timeout=10) as a, \
            StoreClient("127.0.0.1", srv.port, token, timeout=10) as b, \
            StoreClient("127.0.0.1", srv.port, token, timeout=10) as silent:
        a.join("", 3, 0)
        silent.join("", 3, 1)
        with pytest.raises(RendezvousError, match="two processes claim rank 1"):
            b.join("", 3, 1)
        start = time.monotonic()
        srv.close(linger=0.5)
        assert 0.5 <= time.monotonic() - start < 10
        with pytest.raises(mc.PeerFailure):
            silent.wait_world(5)                        # the host has gone: a lost store
