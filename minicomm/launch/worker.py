"""Child side of ``mc.spawn``: ``python -m minicomm.launch.worker`` (not a public entry point).

Reads its configuration and the cloudpickled (fn, args) from stdin, runs ``fn(comm, *args)``, and
writes one record — ("ok", result) or ("error", (time, summary, lost_a_peer, traceback)) — to the
result pipe the parent passed. Then keeps nothing: the communicator is closed on every path.
"""
from __future__ import annotations

import os
import struct
import sys
import threading
import time
import traceback


def _read_exact(stream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise SystemExit("minicomm worker: parent closed stdin before sending the job")
        data += chunk
    return data


def _watch_parent(stream) -> None:
    """The parent holds our stdin open for the whole job: EOF means it died. Leave at once."""
    while stream.read(4096):
        pass
    try:                      # os._exit skips atexit: unlink our segments ourselves
        from minicomm.transports import segment, shm
        shm._unlink_at_exit()
        segment._unlink_at_exit()         # rdma / ub arenas and shm windows
    except Exception:
        pass
    os._exit(70)


def main() -> int:
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1)   # `kill -USR1 <pid>` prints where a hung rank is
    stdin = sys.stdin.buffer
    cfg_len, blob_len = struct.unpack("!QQ", _read_exact(stdin, 16))
    import cloudpickle
    cfg = cloudpickle.loads(_read_exact(stdin, cfg_len))
    sys.path[:] = cfg["sys_path"]      # as multiprocessing's spawn does: the parent's modules import
    os.chdir(cfg["cwd"])
    blob = _read_exact(stdin, blob_len)
    threading.Thread(target=_watch_parent, args=(stdin,), daemon=True).start()
    out_fd = cfg["result_fd"]
    comm = None
    code = 1
    try:
        fn, args = cloudpickle.loads(blob)
        from minicomm.launch.world import connect_world
        comm = connect_world(cfg)
        record = ("ok", fn(comm, *args))
        code = 0
    except BaseException as e:   # everything goes back to the parent, then we exit non-zero
        from minicomm.errors import PeerFailure
        record = ("error", (time.time(), f"{type(e).__name__}: {e}", isinstance(e, PeerFailure),
                            traceback.format_exc()))
        code = 1
    finally:
        if comm is not None:
            try:
                if code != 0:
                    # a failing rank is not a finished one: peers must see a failure (abort),
                    # not the orderly goodbye that close() sends
                    comm.transport.abort(record[1][1])
                comm.close()
            except Exception:
                pass
    try:
        data = cloudpickle.dumps(record)
    except Exception as e:
        data = cloudpickle.dumps(("error", (time.time(), f"result of rank {cfg['rank']} cannot be "
                                            f"pickled: {e}", False, traceback.format_exc())))
        code = 1
    with os.fdopen(out_fd, "wb") as f:
        f.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
