"""A launcher's side of the flight records (minicomm.flightrecord): the job's dump directory,
asking the ranks still running for their records (SIGUSR1), and the diagnosis of a failed job
(minicomm.diagnosis) that ``SpawnError`` and ``minicomm run`` print."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from typing import Dict, List, Optional

from ..diagnosis import FINISHED, diagnose_dir
from ..settings import env_path

DUMP_WAIT_S = 2.0             # how long a launcher waits for the records it asked for
DUMP_POLL_S = 0.02            # ... looking for each rank's file this often
ASK_AFTER_TIMEOUT_S = 1.0     # a timeout's peers time out together; then ask the rest


def exit_text(returncode: int) -> str:
    """How a rank process ended, as the diagnosis says it."""
    if returncode == 0:
        return FINISHED
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class JobRecords:
    """The dump directory of one job: ``MINICOMM_FLIGHT_DIR`` when the user chose one (kept),
    else a private temporary one, removed by ``close`` unless asked to keep it."""

    def __init__(self, job_id: str):
        chosen = env_path("MINICOMM_FLIGHT_DIR")
        self.owned = not chosen
        self.directory = chosen or tempfile.mkdtemp(prefix=f"minicomm-flight-{job_id}-")

    def ask(self, pids: Dict[int, int], wait_s: float = DUMP_WAIT_S) -> List[int]:
        """SIGUSR1 each running rank (world rank -> pid), then wait, bounded, until each has
        written its record; returns the ranks that did not in time."""
        asked_at = time.time()
        waiting = set()
        for rank, pid in pids.items():
            try:
                os.kill(pid, signal.SIGUSR1)
                waiting.add(rank)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while waiting:
            waiting = {r for r in waiting if not self._written_since(r, asked_at)}
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(DUMP_POLL_S)
        return sorted(waiting)

    def _written_since(self, rank: int, t: float) -> bool:
        try:
            return os.stat(os.path.join(self.directory, f"rank-{rank}.json")).st_mtime >= t - 0.01
        except OSError:
            return False

    def diagnosis(self, exits: Dict[int, Optional[str]], size: int) -> List[str]:
        """The diagnosis lines of the records written so far."""
        return diagnose_dir(self.directory, exits, size)

    def close(self, keep: bool = False) -> None:
        if self.owned and not keep:
            shutil.rmtree(self.directory, ignore_errors=True)
