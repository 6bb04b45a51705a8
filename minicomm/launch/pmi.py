"""A small client of the PMI-1 wire protocol: how ``mc.init()`` bootstraps under MPICH's hydra
(``mpiexec``), Intel MPI, and ``srun --mpi=pmi2`` (whose server also answers PMI-1).

The launcher hands each process a connected socket in ``PMI_FD`` (or a ``host:port`` in
``PMI_PORT`` plus ``PMI_ID``). Requests and replies are single text lines of ``key=value``
words::

    cmd=init pmi_version=1 pmi_subversion=1   ->  cmd=response_to_init ... rc=0
    cmd=get_maxes                             ->  cmd=maxes kvsname_max=.. keylen_max=.. vallen_max=..
    cmd=get_appnum                            ->  cmd=appnum appnum=0
    cmd=get_my_kvsname                        ->  cmd=my_kvsname kvsname=kvs_1234_0
    cmd=put kvsname=K key=k value=v           ->  cmd=put_result rc=0
    cmd=barrier_in                            ->  cmd=barrier_out        (after every rank's)
    cmd=get kvsname=K key=k                   ->  cmd=get_result rc=0 value=v
    cmd=finalize                              ->  cmd=finalize_ack

Values may not contain spaces, ``=`` or newlines: callers pass hex or plain words. The kvsname
names the job's key-value space, so it is the job's identity. Every read has a deadline
(``timeout``): a barrier whose peers never arrive raises ``CommTimeout``, it never hangs.
Cost: one round trip to the local PMI proxy per call; the barrier waits for the slowest rank.
"""
from __future__ import annotations

import os
import selectors
import socket
import time
from typing import Dict, Optional

from ..errors import CommError, CommTimeout

PMI_VERSION, PMI_SUBVERSION = 1, 1
_MAX_LINE = 1 << 16


class PMIError(CommError):
    """The PMI server answered an error, or something that is not PMI-1."""


def parse_line(line: str) -> Dict[str, str]:
    """``"cmd=get_result rc=0 value=x"`` -> ``{"cmd": "get_result", "rc": "0", "value": "x"}``."""
    out: Dict[str, str] = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if not sep:
            raise PMIError(f"PMI: malformed reply word {word!r} in {line!r}")
        out[key] = value
    return out


def _check_word(what: str, value: str) -> str:
    value = str(value)
    if not value or any(c in value for c in " =\n\t\r"):
        raise ValueError(f"PMI {what} {value!r} must be non-empty without spaces or '='")
    return value


class PMIClient:
    """One process's PMI-1 connection. ``fd``: the connected socket (``PMI_FD``); or ``port``
    ``"host:port"`` (``PMI_PORT``) with ``pmi_id`` (``PMI_ID``). ``timeout`` bounds every call."""

    def __init__(self, fd: Optional[int] = None, port: Optional[str] = None,
                 pmi_id: Optional[str] = None, timeout: float = 30.0):
        self.timeout = float(timeout)
        self._buf = b""
        self.kvsname: Optional[str] = None
        self.maxes: Dict[str, int] = {}
        self._finalized = False
        if fd is not None:
            # our own descriptor on the socket: closing it leaves the launcher's PMI_FD alone
            self._sock = socket.socket(fileno=os.dup(int(fd)))
            self.where = f"PMI_FD={fd}"
        elif port:
            host, _, p = port.rpartition(":")
            self._sock = socket.create_connection((host or "127.0.0.1", int(p)), self.timeout)
            self.where = f"PMI_PORT={port}"
        else:
            raise ValueError("PMIClient needs fd= (PMI_FD) or port= (PMI_PORT)")
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        if port and fd is None and pmi_id is not None:
            # simple_pmi: a connection by port introduces itself, then is told size/rank/debug
            self._send(f"cmd=initack pmiid={pmi_id}")
            self._expect("initack")
            for _ in range(3):
                self._expect("set")

    # ------------------------------------------------------------------ wire
    def _send(self, line: str) -> None:
        data = (line + "\n").encode()
        deadline = time.monotonic() + self.timeout
        view = memoryview(data)
        while view:
            try:
                n = self._sock.send(view)
            except BlockingIOError:
                n = 0
            except OSError as e:
                raise PMIError(f"PMI ({self.where}): the launcher closed the connection: {e}") \
                    from None
            view = view[n:]
            if view:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"PMI ({self.where}): sending {line.split()[0]} timed out")
                sel = selectors.DefaultSelector()
                sel.register(self._sock, selectors.EVENT_WRITE)
                sel.select(left)
                sel.close()

    def _read_line(self, what: str) -> str:
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise CommTimeout(f"PMI ({self.where}): no reply to {what} within "
                                  f"{self.timeout:g}s")
            try:
                chunk = self._sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError as e:
                raise PMIError(f"PMI ({self.where}): connection lost waiting for {what}: {e}") \
                    from None
            if not chunk:
                raise PMIError(f"PMI ({self.where}): the launcher closed the connection "
                               f"waiting for {what}")
            self._buf += chunk
            if len(self._buf) > _MAX_LINE:
                raise PMIError(f"PMI ({self.where}): reply to {what} longer than {_MAX_LINE} B")
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")

    def _expect(self, cmd: str, what: Optional[str] = None) -> Dict[str, str]:
        reply = parse_line(self._read_line(what or cmd))
        if reply.get("cmd") != cmd:
            raise PMIError(f"PMI ({self.where}): expected cmd={cmd}, got {reply}")
        rc = reply.get("rc", "0")
        if rc != "0":
            raise PMIError(f"PMI ({self.where}): {what or cmd} failed: rc={rc} "
                           f"{reply.get('msg', '')}".rstrip())
        return reply

    def _call(self, request: str, reply_cmd: str) -> Dict[str, str]:
        self._send(request)
        return self._expect(reply_cmd, request.split()[0][4:])

    # ------------------------------------------------------------------ API
    def init(self) -> None:
        reply = self._call(f"cmd=init pmi_version={PMI_VERSION} pmi_subversion={PMI_SUBVERSION}",
                           "response_to_init")
        if reply.get("pmi_version") != str(PMI_VERSION):
            raise PMIError(f"PMI ({self.where}): the launcher speaks PMI version "
                           f"{reply.get('pmi_version')}, not {PMI_VERSION}")

    def get_maxes(self) -> Dict[str, int]:
        reply = self._call("cmd=get_maxes", "maxes")
        self.maxes = {k: int(v) for k, v in reply.items() if k.endswith("_max")}
        return self.maxes

    def get_appnum(self) -> int:
        return int(self._call("cmd=get_appnum", "appnum").get("appnum", "0"))

    def get_my_kvsname(self) -> str:
        self.kvsname = self._call("cmd=get_my_kvsname", "my_kvsname")["kvsname"]
        return self.kvsname

    def _limit(self, what: str, value: str) -> str:
        limit = self.maxes.get(f"{what}_max")
        if limit is not None and len(value) >= limit:
            raise ValueError(f"PMI {what} of {len(value)} characters exceeds the launcher's "
                             f"{what}_max={limit}")
        return value

    def put(self, key: str, value: str) -> None:
        key = self._limit("keylen", _check_word("key", key))
        value = self._limit("vallen", _check_word("value", value))
        self._call(f"cmd=put kvsname={self.kvsname} key={key} value={value}", "put_result")

    def barrier(self) -> None:
        """Returns once every process of the job has entered the barrier (puts before it are
        visible to gets after it)."""
        try:
            self._call("cmd=barrier_in", "barrier_out")
        except CommTimeout:
            raise CommTimeout(f"PMI ({self.where}): not every process of the job reached the PMI "
                              f"barrier within {self.timeout:g}s (the setup timeout, "
                              f"MINICOMM_SETUP_TIMEOUT): one exited or is stuck before "
                              f"mc.init()") from None

    def get(self, key: str) -> str:
        reply = self._call(f"cmd=get kvsname={self.kvsname} key={_check_word('key', key)}",
                           "get_result")
        return reply["value"]

    def finalize(self) -> None:
        """Tell the launcher this process is done with PMI (it then exits without being taken
        for a crashed MPI process), and close our descriptor."""
        if self._finalized:
            return
        self._finalized = True
        try:
            self._call("cmd=finalize", "finalize_ack")
        finally:
            self.close()

    def close(self) -> None:
        try:
            self._sel.close()
        finally:
            self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
