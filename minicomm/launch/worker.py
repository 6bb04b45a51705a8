"""Child side of ``mc.spawn``: ``python -m minicomm.launch.worker`` (not a public entry point).

Reads its configuration and the cloudpickled (fn, args) from stdin, runs ``fn(comm, *args)``, and
writes one record — ("ok", result) or ("error", (time, summary, lost_a_peer, traceback)) — to the
result pipe the parent passed. Then keeps nothing: the communicator is closed on every path.

Dying with the parent (argv[1] is its pid): the kernel sends SIGTERM when it dies
(PR_SET_PDEATHSIG, lifeline.py; a parent that died before that was armed is caught at once), and
the parent holds our stdin open for the whole job, so end-of-file is a second, portable signal.
Either way the rank leaves through the orderly SIGTERM path (``Terminated`` in the main thread:
the transport aborts, segments are unlinked, the job's are swept), bounded by a watchdog.
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
    """The parent holds our stdin open for the whole job: EOF means it died. Leave (orderly,
    bounded: see lifeline.terminate_self)."""
    while stream.read(4096):
        pass
    from minicomm.launch import lifeline
    lifeline.terminate_self()


def main() -> int:
    import faulthandler
    import signal

    from minicomm.launch import lifeline
    parent = int(sys.argv[1]) if len(sys.argv) > 1 else None
    if parent is not None and lifeline.arm_parent_death(parent) is False:
        os._exit(lifeline.ORPHAN_EXIT)      # the parent died before the death signal was armed
    lifeline.install_orderly_exit(parent)
    from minicomm import flightrecord
    flightrecord.install_signal_handler()   # `kill -USR1 <pid>` dumps the flight record ...
    faulthandler.register(signal.SIGUSR1, chain=True)   # ... and prints where a hung rank is
    stdin = sys.stdin.buffer
    cfg_len, blob_len = struct.unpack("!QQ", _read_exact(stdin, 16))
    import cloudpickle
    cfg = cloudpickle.loads(_read_exact(stdin, cfg_len))
    if cfg.get("flight_dir"):
        os.environ["MINICOMM_FLIGHT_DIR"] = cfg["flight_dir"]
    lifeline.install_orderly_exit(job_id=cfg["job_id"])
    sys.path[:] = cfg["sys_path"]      # as multiprocessing's spawn does: the parent's modules import
    os.chdir(cfg["cwd"])
    blob = _read_exact(stdin, blob_len)
    threading.Thread(target=_watch_parent, args=(stdin,), daemon=True).start()
    out_fd = cfg["result_fd"]
    comm = None
    code = 1
    try:
        fn, args, algs = cloudpickle.loads(blob)
        from minicomm import algorithms
        algorithms.adopt(algs)                          # registered in the parent
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
    try:
        with os.fdopen(out_fd, "wb") as f:
            f.write(data)
    except OSError:               # the parent is gone: nobody to report to
        pass
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        pass
    lifeline.cleanup_now()        # os._exit skips atexit
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
