"""``minicomm demo``: one numpy MLP trained on this machine every way minicomm can train it.

    minicomm demo                       # single, allreduce ring/rhd/auto, PS sync/async/ssp
    minicomm demo --workers 4 --servers 2 --steps 300 --transport tcp
    minicomm demo --json                # one JSON object on stdout, nothing else

Runs, all on the same data and seed (``minicomm.training``):
  single     one process, large-batch SGD on the global batch (the reference);
  allreduce  ``--workers`` processes, DDP-style gradient buckets averaged by async allreduce
             (ring, rhd and auto by default; ``--modes`` picks others: tree, hier);
  ps-sync    ``--servers`` server + ``--workers`` worker processes, ``minicomm.ps`` staleness 0;
  ps-async   the same, staleness None; ps-ssp: staleness ``--staleness`` (2).
The synchronous modes follow the single-process trajectory to float tolerance; async and SSP
take W smaller steps per global batch and end near it. The PS modes need ``minicomm.ps``; where
it cannot be imported they are skipped with a note (the JSON lists them under "skipped").

Every run draws a progress bar on stderr (tqdm when installed, else one plain line); its
batch_loss is the loss of the last batch (worker 0's shard of it). At the end: one table — mode,
algorithm, workers, servers, train-split loss (the final model's mean cross-entropy over the
whole training split), test accuracy, wall time of the training loop (process start-up
excluded), samples/s, and the payload bytes one worker sends and receives per step — a legend
line under it (auto(rhd+tree): the algorithms auto chose per gradient bucket; (2w/2s) in the
plots: 2 workers, 2 servers), then a comparison of this run's timings in terms of the bytes
through the busiest endpoint (a server's link vs a worker's). Timings move with the machine's
load: they describe this run on this machine, not the library.
Byte counts: allreduce = the Send/Recv ops of each bucket's schedule
(``minicomm.algorithms.build_schedule``) x itemsize; PS = the gradients a worker pushes and the
parameters it pulls; a server's share comes from the parameter server's sharding plan
(``--chunk-bytes`` 8 KiB spreads the small model over the servers).
With matplotlib installed it writes loss-vs-step, loss-vs-time and throughput plots to ``--out``
(``./minicomm-demo``); the loss plots say which curves coincide (the synchronous runs do).

``--kill-worker STEP`` adds a failure drill: every distributed mode runs a second time, and its
last worker ends itself with ``os._exit`` before step STEP. Allreduce modes train elastically
(``train_elastic``: the survivors shrink, roll back to the last commit and go on with the global
batch re-sharded over them); ps-sync drops the dead worker at the clock it held back
(``on_worker_failure="drop"``); ps-async and ps-ssp drop it anyway. A second table reports per run
the steps lost (completed steps rolled back), the time to recover (how much longer the step
training resumed at took than the run's median step: detection, shrink and lost work included)
and the test accuracy against the run without a failure; with matplotlib, failure.png shows it.
A kill needs processes: with ``--transport auto`` or ``inproc`` the drill runs on shm.

Defaults (2 workers, 2 servers, 400 steps of a 64-sample global batch, lr 0.2) finish in well
under a minute on a 2-core machine; most of that is starting processes. They are chosen so the
synchronous runs are near convergence (test accuracy on digits about 0.96), where async and SSP,
which take W smaller steps per global batch, end within about a point of them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence

from ..training.data import DATASETS, Dataset, load_dataset
from ..training.data_parallel import DEFAULT_BUCKET_CAP, train_data_parallel
from ..training.elastic import train_elastic
from ..training.ps_trainer import ps_available, train_ps
from ..training.single import RankLog, TrainConfig, evaluate, train_single

ALLREDUCE_ALGORITHMS = ("ring", "tree", "rhd", "hier", "auto")
PS_MODES = ("ps-sync", "ps-async", "ps-ssp")
ALL_MODES = ("single",) + ALLREDUCE_ALGORITHMS + PS_MODES
DEFAULT_MODES = ("single", "ring", "rhd", "auto") + PS_MODES
TRANSPORTS = ("auto", "shm", "tcp", "inproc")
SPAWN_TIMEOUT = 300.0      # seconds per wait inside a run: a hang fails the run, never the box
# The demo's model is ~38 KB: with ps.start's 4 MiB default every array would sit whole on one
# server (w1 alone is 85 % of the model). 8 KiB pieces spread it over the servers, BytePS-style.
DEMO_CHUNK_BYTES = 8 << 10
KILLED_EXIT = 86           # the exit status of a worker a failure drill ends (``DieAt``)


@dataclass(frozen=True)
class RunSpec:
    mode: str                   # single | allreduce | ps-sync | ps-async | ps-ssp
    algorithm: Optional[str]    # allreduce only
    workers: int
    servers: int
    staleness: Optional[int]    # PS only (None for async)

    @property
    def label(self) -> str:
        return f"{self.mode} {self.algorithm}" if self.algorithm else self.mode


def plan_runs(modes: Sequence[str], workers: int, servers: int, staleness: int) -> List[RunSpec]:
    specs = []
    for m in modes:
        if m == "single":
            specs.append(RunSpec("single", None, 1, 0, None))
        elif m in ALLREDUCE_ALGORITHMS:
            specs.append(RunSpec("allreduce", m, workers, 0, None))
        elif m == "ps-sync":
            specs.append(RunSpec(m, None, workers, servers, 0))
        elif m == "ps-async":
            specs.append(RunSpec(m, None, workers, servers, None))
        elif m == "ps-ssp":
            specs.append(RunSpec(m, None, workers, servers, staleness))
        else:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(ALL_MODES)}")
    return specs


# ------------------------------------------------------------------------------ progress
class Progress:
    """A per-run progress bar on stderr: tqdm when importable, else one rewritten plain line.
    It shows the loss of the last batch this rank computed (``batch_loss``: worker 0's shard in
    a distributed run), not the table's loss over the whole training split."""

    def __init__(self, label: str, total: int, enabled: bool = True, mininterval: float = 0.2):
        self.label, self.total, self.enabled = label, total, enabled
        self._bar = None
        self._last = 0.0
        self._done = 0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._write(0, None)
        else:
            self._bar = tqdm(total=total, desc=f"{label:<16}", file=sys.stderr, leave=True,
                             unit="step", dynamic_ncols=True, mininterval=mininterval)

    def _write(self, done: int, loss: Optional[float]) -> None:
        tail = "" if loss is None else f"  batch loss {loss:.4f}"
        sys.stderr.write(f"\r{self.label:<16} {done:>6}/{self.total} steps{tail}")
        sys.stderr.flush()

    def __call__(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        self._done = step + 1
        if self._bar is not None:
            # the postfix goes in before the redraw, so a frame never shows an older batch's loss
            self._bar.set_postfix_str(f"batch_loss={loss:.4f}", refresh=False)
            if self._done < self.total:
                # after an elastic rollback the step goes back: the update is then negative
                self._bar.update(self._done - self._bar.n)
            else:
                # close() draws the final frame; update(1) here would draw it a second time
                # whenever the last step came more than mininterval after the previous frame
                self._bar.n = self._done
            return
        now = time.monotonic()
        if now - self._last >= 0.2 or self._done == self.total:
            self._last = now
            self._write(self._done, loss)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ------------------------------------------------------------------------------ runs
def _allreduce_rank(comm, dataset, config, algorithm, bucket_cap, show_progress, label):
    bar = Progress(label, config.steps, show_progress and comm.rank == 0)
    try:
        return train_data_parallel(comm, dataset, config, algorithm, bucket_cap, on_step=bar)
    finally:
        bar.close()


def _ps_rank(comm, dataset, config, servers, staleness, chunk_bytes, show_progress, label):
    bar = Progress(label, config.steps, show_progress and comm.rank == servers)
    try:
        return train_ps(comm, dataset, config, num_servers=servers, staleness=staleness,
                        chunk_bytes=chunk_bytes, on_step=bar)
    finally:
        bar.close()


def execute(spec: RunSpec, dataset: Dataset, config: TrainConfig, transport: str = "auto",
            show_progress: bool = True, bucket_cap: int = DEFAULT_BUCKET_CAP,
            chunk_bytes: int = DEMO_CHUNK_BYTES, timeout: float = SPAWN_TIMEOUT
            ) -> List[RankLog]:
    """Run one spec; the training ranks' logs (servers dropped), first worker first."""
    from ..launch import spawn
    if spec.mode == "single":
        bar = Progress(spec.label, config.steps, show_progress)
        try:
            return [train_single(dataset, config, on_step=bar)]
        finally:
            bar.close()
    if spec.mode == "allreduce":
        logs = spawn(_allreduce_rank, spec.workers, transport=transport, timeout=timeout,
                        args=(dataset, config, spec.algorithm, bucket_cap, show_progress,
                              spec.label))
    else:
        logs = spawn(_ps_rank, spec.servers + spec.workers, transport=transport,
                        timeout=timeout,
                        args=(dataset, config, spec.servers, spec.staleness, chunk_bytes,
                              show_progress, spec.label))
    return [log for log in logs if log is not None]


# ------------------------------------------------------------------------------ failure drill
class DieAt:
    """A ``before_step`` hook that ends this process with ``os._exit(KILLED_EXIT)`` before step
    ``step``: the failure drill's dead worker (a crash: no goodbye on any link)."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self, step: int) -> None:
        if step == self.step:
            os._exit(KILLED_EXIT)


def drill_transport(transport: str) -> str:
    """The transport of a failure drill: a process transport, since a kill in inproc's threads
    would end the demo itself; shm for auto and inproc."""
    return "shm" if transport in ("auto", "inproc") else transport


def _elastic_rank(comm, dataset, config, algorithm, bucket_cap, kill_step, show_progress, label):
    victim = comm.rank == comm.size - 1
    bar = Progress(label, config.steps, show_progress and comm.rank == 0)
    try:
        return train_elastic(comm, dataset, config, algorithm, bucket_cap_bytes=bucket_cap,
                             on_step=bar, before_step=DieAt(kill_step) if victim else None)
    finally:
        bar.close()


def _ps_drill_rank(comm, dataset, config, servers, staleness, chunk_bytes, kill_step,
                   show_progress, label):
    victim = comm.rank == comm.size - 1
    bar = Progress(label, config.steps, show_progress and comm.rank == servers)
    try:
        return train_ps(comm, dataset, config, num_servers=servers, staleness=staleness,
                        chunk_bytes=chunk_bytes, on_step=bar, on_worker_failure="drop",
                        before_step=DieAt(kill_step) if victim else None)
    finally:
        bar.close()


def execute_with_failure(spec: RunSpec, dataset: Dataset, config: TrainConfig, kill_step: int,
                         transport: str = "shm", show_progress: bool = True,
                         bucket_cap: int = DEFAULT_BUCKET_CAP,
                         chunk_bytes: int = DEMO_CHUNK_BYTES,
                         timeout: float = SPAWN_TIMEOUT) -> List[RankLog]:
    """Run a distributed spec whose last worker dies before ``kill_step`` (allreduce modes train
    elastically, PS modes drop the dead worker); the survivors' training logs, the one holding
    the final parameters first. Raises the ``SpawnError`` if any other rank failed."""
    from ..errors import SpawnError
    from ..launch import spawn
    label = f"{spec.label} kill@{kill_step}"
    if spec.mode == "allreduce":
        fn, world = _elastic_rank, spec.workers
        args = (dataset, config, spec.algorithm, bucket_cap, kill_step, show_progress, label)
    else:
        fn, world = _ps_drill_rank, spec.servers + spec.workers
        args = (dataset, config, spec.servers, spec.staleness, chunk_bytes, kill_step,
                show_progress, label)
    try:
        spawn(fn, world, args=args, transport=transport, timeout=timeout, on_failure="continue")
    except SpawnError as e:
        if [rank for rank, _ in e.failures] != [world - 1]:
            raise
        logs = [log for log in e.results if log is not None]
    else:
        raise RuntimeError(f"{label}: worker rank {world - 1} was to die before step "
                           f"{kill_step}, but it finished")
    return sorted(logs, key=lambda log: log.params is None)


def recovery_stall(logs: List[RankLog], step: int) -> float:
    """How much longer ``step`` took than the run's median step, on the slowest survivor."""
    worst = 0.0
    for log in logs:
        times = [0.0] + list(log.step_times)
        durations = sorted(b - a for a, b in zip(times, times[1:]))
        median = durations[len(durations) // 2]
        worst = max(worst, times[step + 1] - times[step] - median)
    return worst


def failure_record(spec: RunSpec, baseline: Dict[str, object], logs: List[RankLog],
                   dataset: Dataset, config: TrainConfig, kill_step: int) -> Dict[str, object]:
    """One drill's record: steps lost, time to recover, accuracy against ``baseline`` (the same
    spec's run without a failure), and the curves for failure.png (keys starting with '_')."""
    killed = summarize(spec, logs, dataset, config)
    recoveries = [r for log in logs for r in log.info.get("recoveries", ())]
    resumed = min((r["resumed_at"] for r in recoveries), default=kill_step)
    return {
        "mode": spec.mode, "algorithm": spec.algorithm, "workers": spec.workers,
        "servers": spec.servers, "staleness": spec.staleness, "kill_step": kill_step,
        "survivors": spec.workers - 1, "resumed_at": resumed,
        "steps_lost": max((r["steps_lost"] for r in recoveries), default=0),
        "recover_s": recovery_stall(logs, resumed),
        "test_accuracy_no_failure": baseline["test_accuracy"],
        "test_accuracy": killed["test_accuracy"],
        "accuracy_change_points": 100.0 * (killed["test_accuracy"]
                                           - baseline["test_accuracy"]),
        "_losses": killed["_losses"], "_baseline_losses": baseline["_losses"],
    }


def format_failure_table(failures: List[Dict[str, object]]) -> str:
    """The failure drill's table: one row per distributed run."""
    head = ("mode", "algorithm", "workers", "killed before step", "steps lost", "recover s",
            "test acc (no failure)", "test acc (killed)", "change (points)")
    rows = []
    for f in failures:
        rows.append((
            f["mode"] if f["mode"] != "ps-ssp" else f"ps-ssp(k={f['staleness']})",
            str(f["algorithm"] or "-"), f"{f['workers']} -> {f['survivors']}",
            str(f["kill_step"]), str(f["steps_lost"]), f"{f['recover_s']:.3f}",
            f"{f['test_accuracy_no_failure']:.3f}", f"{f['test_accuracy']:.3f}",
            f"{f['accuracy_change_points']:+.1f}"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


FAILURE_LEGEND = ("Legend: the last worker ends itself (os._exit) before the step named; "
                  "allreduce runs train elastically (shrink, roll back to the last commit, the "
                  "global batch re-sharded over the survivors), ps-sync drops the dead worker at "
                  "the clock it held back, ps-async and ps-ssp drop it at once. steps lost: "
                  "completed steps rolled back; recover s: how much longer the step training "
                  "resumed at took than the run's median step (detection, shrink, lost work).")


def build_failure_figure(failures: List[Dict[str, object]]):
    """failure.png: loss with and without the failure per run, and the test accuracies.
    Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, f in enumerate(failures):
        color = f"C{i % 10}"
        label = _failure_label(f)
        base = _moving_average(f["_baseline_losses"], SMOOTHING)
        killed = _moving_average(f["_losses"], SMOOTHING)
        left.plot(range(1, len(base) + 1), base, color=color, linestyle=":", linewidth=1.0)
        left.plot(range(1, len(killed) + 1), killed, color=color, linewidth=1.2, label=label)
    left.axvline(failures[0]["kill_step"], color="red", linewidth=1, alpha=0.6)
    left.set_yscale("log")
    left.set_xlabel("step (red: a worker dies)")
    left.set_ylabel(f"batch loss ({SMOOTHING}-step moving average)")
    left.set_title("loss with the failure (solid) and without (dotted)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    xs = range(len(failures))
    right.bar([x - 0.2 for x in xs], [f["test_accuracy_no_failure"] for f in failures], 0.4,
              color="tab:gray", label="no failure")
    bars = right.bar([x + 0.2 for x in xs], [f["test_accuracy"] for f in failures], 0.4,
                     color="tab:red", label="a worker killed")
    for bar, f in zip(bars, failures):
        right.annotate(f"lost {f['steps_lost']}\n{f['recover_s']:.2f} s",
                       (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                       va="bottom", fontsize=7)
    low = min(min(f["test_accuracy"], f["test_accuracy_no_failure"]) for f in failures)
    right.set_ylim(max(0.0, low - 0.1), 1.04)
    right.set_xticks(list(xs))
    right.set_xticklabels([_failure_label(f) for f in failures], rotation=30, ha="right",
                          fontsize=8)
    right.set_ylabel("test accuracy")
    right.set_title("test accuracy; above: steps lost, time to recover")
    right.legend(fontsize=8, loc="upper left")
    right.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"minicomm demo: one worker killed before step {failures[0]['kill_step']}")
    fig.tight_layout()
    return fig


def _failure_label(f: Dict[str, object]) -> str:
    if f["mode"] == "allreduce":
        return f"elastic {f['algorithm']} ({f['workers']}w)"
    return f"{f['mode']} ({f['workers']}w/{f['servers']}s)"


def summarize(spec: RunSpec, logs: List[RankLog], dataset: Dataset,
              config: TrainConfig) -> Dict[str, object]:
    """One run's record: the JSON keys, plus curves (keys starting with '_') for the plots."""
    model = config.model(dataset)
    final = next(log.params for log in logs if log.params is not None)
    final_loss, accuracy = evaluate(model, final, dataset)
    wall = max(log.wall_s for log in logs)
    sent = max(log.bytes_sent_per_step for log in logs)
    received = max(log.bytes_received_per_step for log in logs)
    model_bytes = sum(p.nbytes for p in final.values())
    if spec.mode.startswith("ps-"):
        # the busiest server receives its share from every worker and sends it back to each
        shares = logs[0].info.get("server_bytes") or [model_bytes / spec.servers]
        server_bytes = 2.0 * spec.workers * max(shares)
        worker_bytes = sent + received
        busiest = ("server", server_bytes) if server_bytes >= worker_bytes else \
            ("worker", worker_bytes)
    elif spec.mode == "allreduce":
        busiest = ("worker", max(log.bytes_sent_per_step + log.bytes_received_per_step
                                 for log in logs))
    else:
        busiest = ("none", 0.0)
    steps = config.steps
    # per-step loss averaged over workers (equal shards: the global batch's mean loss)
    curve = [sum(log.losses[s] for log in logs) / len(logs) for s in range(steps)]
    times = [max(log.step_times[s] for log in logs) for s in range(steps)]
    record = {
        "mode": spec.mode, "algorithm": spec.algorithm, "workers": spec.workers,
        "servers": spec.servers, "staleness": spec.staleness,
        "final_loss": final_loss, "test_accuracy": accuracy, "wall_s": wall,
        "samples_per_s": steps * config.global_batch / wall if wall > 0 else float("inf"),
        "bytes_per_step_per_worker": sent,
        "bytes_received_per_step_per_worker": received,
        "busiest_endpoint": busiest[0], "busiest_endpoint_bytes_per_step": busiest[1],
        "model_bytes": model_bytes,
        "_losses": curve, "_times": times,
    }
    if spec.mode == "allreduce":
        record["bucket_algorithms"] = logs[0].info.get("bucket_algorithms")
        record["message_rounds_per_step"] = logs[0].info.get("message_rounds_per_step")
    return record


# ------------------------------------------------------------------------------ report
def _human_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _algorithm_cell(r: Dict[str, object]) -> str:
    if r["algorithm"] is None:
        return "-"
    if r["algorithm"] == "auto" and r.get("bucket_algorithms"):
        picked = sorted(set(r["bucket_algorithms"]))
        return "auto(" + "+".join(picked) + ")"
    return str(r["algorithm"])


def format_table(results: List[Dict[str, object]]) -> str:
    head = ("mode", "algorithm", "workers", "servers", "train-split loss", "test acc", "wall s",
            "samples/s", "sent/step/worker", "recv/step/worker")
    rows = []
    for r in results:
        rows.append((
            r["mode"] if r["mode"] != "ps-ssp" else f"ps-ssp(k={r['staleness']})",
            _algorithm_cell(r), str(r["workers"]), str(r["servers"]),
            f"{r['final_loss']:.4f}", f"{r['test_accuracy']:.3f}", f"{r['wall_s']:.2f}",
            f"{r['samples_per_s']:,.0f}",
            _human_bytes(r["bytes_per_step_per_worker"]),
            _human_bytes(r["bytes_received_per_step_per_worker"])))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), line(["-" * w for w in widths])]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def table_legend(results: List[Dict[str, object]]) -> str:
    """The one line under the table: what its loss is, what auto(...) and the plots' (Nw/Ms)
    mean, from this run's own rows."""
    parts = ["train-split loss: mean cross-entropy of the final model over the whole training "
             "split (a progress bar's batch_loss is the last batch only)"]
    for r in results:
        cell = _algorithm_cell(r)
        if cell.startswith("auto("):
            picked = sorted(set(r["bucket_algorithms"]))
            parts.append(f"{cell} = algorithm auto, which chose {' or '.join(picked)} per "
                         f"gradient bucket")
            break
    ps = next((r for r in results if str(r["mode"]).startswith("ps-")), None)
    dist = next((r for r in results if r["mode"] != "single"), None)
    if ps is not None:
        parts.append(f"plots: ({ps['workers']}w/{ps['servers']}s) = {ps['workers']} workers, "
                     f"{ps['servers']} servers")
    elif dist is not None:
        parts.append(f"plots: ({dist['workers']}w) = {dist['workers']} workers")
    return "Legend: " + "; ".join(parts) + "."


def comparison(results: List[Dict[str, object]]) -> List[str]:
    """Two or three sentences on this run's timings: which architecture was faster here, and
    why, in terms of the bytes through the busiest endpoint (a server's link vs a worker's)."""
    ar = [r for r in results if r["mode"] == "allreduce"]
    ps = [r for r in results if r["mode"].startswith("ps-")]
    if not ar or not ps:
        missing = "the PS modes need minicomm.ps" if ar else "no allreduce run"
        return [f"No architecture comparison: {missing}."]
    best_ar = max(ar, key=lambda r: r["samples_per_s"])
    best_ps = max(ps, key=lambda r: r["samples_per_s"])
    sync_ps = next((r for r in ps if r["mode"] == "ps-sync"), best_ps)
    w, s = sync_ps["workers"], sync_ps["servers"]
    ar_fast = best_ar["samples_per_s"] >= best_ps["samples_per_s"]
    fast, slow = (best_ar, best_ps) if ar_fast else (best_ps, best_ar)
    ratio = fast["samples_per_s"] / max(slow["samples_per_s"], 1e-12)
    verdict = ("allreduce" if ar_fast else "the parameter server") + " was faster here"
    if ratio < 1.10:
        verdict = "neither architecture was clearly faster here (within 10 %)"
    lines = [f"This run: {verdict}: {_label(best_ar)} {best_ar['samples_per_s']:,.0f} samples/s "
             f"vs {_label(best_ps)} {best_ps['samples_per_s']:,.0f} samples/s ({ratio:.2f}x)."]
    ar_bytes = best_ar["busiest_endpoint_bytes_per_step"]
    ps_bytes = sync_ps["busiest_endpoint_bytes_per_step"]
    bytes_ratio = ps_bytes / max(ar_bytes, 1.0)          # > 1: the PS endpoint carries more
    # how much slower the PS was than allreduce (< 1: faster)
    time_ratio = best_ar["samples_per_s"] / max(best_ps["samples_per_s"], 1e-12)
    rounds = best_ar.get("message_rounds_per_step")
    latency = (f"a step of this {_human_bytes(best_ar['model_bytes'])} model is latency-bound: "
               f"a PS step is a push and a pull round trip to each of {s} servers, through "
               f"{w + s} processes on {os.cpu_count() or '?'} cores, an allreduce step "
               + (f"{rounds} schedule steps" if rounds else "a few schedule steps")
               + f" between {best_ar['workers']} processes")
    if ratio < 1.10:
        why = "the bytes " + ("are about equal" if 0.9 <= bytes_ratio <= 1.1 else
                              f"differ {max(bytes_ratio, 1 / bytes_ratio):.1f}x") + \
              ", and here neither endpoint limited the step"
    elif time_ratio > 1 and bytes_ratio >= 0.7 * time_ratio:
        why = f"the server link is the bottleneck: {bytes_ratio:.1f}x the bytes, {ratio:.1f}x slower"
    elif time_ratio < 1 and bytes_ratio <= 1.4 * time_ratio:
        why = f"the workers' links are the bottleneck: {1 / bytes_ratio:.1f}x the bytes of a server's"
    else:
        why = (f"the bytes differ only {max(bytes_ratio, 1 / bytes_ratio):.1f}x, so most of the "
               f"{ratio:.1f}x is per-message cost: {latency}")
    lines.append(f"Bytes through the busiest endpoint per step (sent+received): allreduce "
                 f"{_human_bytes(ar_bytes)} per worker link, PS {_human_bytes(ps_bytes)} per "
                 f"{sync_ps['busiest_endpoint']} link ({w} workers, {s} servers): {why}.")
    model = best_ar["model_bytes"]
    lines.append(f"In general a ring worker carries 2(W-1)/W x model each way per step "
                 f"({_human_bytes(2 * (w - 1) / w * model)} here), a PS server W/S x model "
                 f"({_human_bytes(w / s * model)}): a PS needs about S >= W/2 servers to keep "
                 f"up, and its async modes trade the barrier for stale gradients.")
    return lines


def _label(r: Dict[str, object]) -> str:
    return _algorithm_cell(r) if r["mode"] == "allreduce" else str(r["mode"])


def coinciding_runs(results: List[Dict[str, object]], rtol: float = 1e-4) -> List[List[str]]:
    """Plot labels of the runs whose loss curves lie on one another (every step within ``rtol``):
    groups of two or more, largest first. The synchronous modes are the same large-batch SGD, so
    they coincide; this finds that from the curves, not from the mode names."""
    groups: List[List[Dict[str, object]]] = []
    for r in results:
        for g in groups:
            ref = g[0]["_losses"]
            if len(ref) == len(r["_losses"]) and all(
                    math.isclose(a, b, rel_tol=rtol) for a, b in zip(ref, r["_losses"])):
                g.append(r)
                break
        else:
            groups.append([r])
    keep = sorted((g for g in groups if len(g) > 1), key=len, reverse=True)
    return [[_plot_label(r) for r in g] for g in keep]


def build_figures(results: List[Dict[str, object]]) -> Dict[str, object]:
    """The demo's three figures (matplotlib, Agg), by file name: loss_vs_step.png,
    loss_vs_time.png, throughput.png. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [_plot_label(r) for r in results]
    same = coinciding_runs(results)
    # a caption under the axes: lines that lie on one another would otherwise look missing
    note = "\n".join(textwrap.fill(f"{', '.join(g)} coincide (the same large-batch SGD): "
                                   f"their lines lie on one another", 100) for g in same)
    figs: Dict[str, object] = {}
    for name, xkey, xlabel in (("loss_vs_step.png", None, "step"),
                               ("loss_vs_time.png", "_times", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(7, 4.2 + 0.35 * note.count("\n") + 0.35 * bool(note)))
        for r, label in zip(results, labels):
            ys = _moving_average(r["_losses"], SMOOTHING)
            xs = list(range(1, len(ys) + 1)) if xkey is None else r[xkey]
            style = _LINE_STYLES.get(r["mode"], {})
            ax.plot(xs, ys, label=label, **style)
        ax.set_yscale("log")
        if xkey is not None:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"batch loss ({SMOOTHING}-step moving average)")
        ax.set_title(f"minicomm demo: loss vs {xlabel.split(' (')[0]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        if note:
            ax.text(0.0, -0.16, note, transform=ax.transAxes, fontsize=7, va="top", ha="left")
        fig.tight_layout()
        figs[name] = fig
    fig, ax = plt.subplots(figsize=(7, 4.2))
    values = [r["samples_per_s"] for r in results]
    colors = ["tab:gray" if r["mode"] == "single" else "tab:blue" if r["mode"] == "allreduce"
              else "tab:orange" for r in results]
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.set_yscale("log")
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("run: mode, algorithm (w = workers, s = servers)")
    ax.set_ylabel("samples / s (log)")
    ax.set_title("minicomm demo: training throughput per mode (this machine, this run)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    figs["throughput.png"] = fig
    return figs


def write_plots(results: List[Dict[str, object]], out_dir: str,
                failures: Sequence[Dict[str, object]] = ()) -> List[str]:
    """loss_vs_step.png, loss_vs_time.png, throughput.png (and failure.png when a failure drill
    ran) in ``out_dir``; [] without matplotlib."""
    try:
        figs = build_figures(results)
        if failures:
            figs["failure.png"] = build_failure_figure(list(failures))
    except ImportError:
        return []
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in figs.items():
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


SMOOTHING = 10
# Synchronous modes follow one trajectory: dashed and dotted lines let the overlap show.
_LINE_STYLES = {
    "single": dict(color="black", linewidth=2.4, alpha=0.5),
    "allreduce": dict(linestyle="--", linewidth=1.2),
    "ps-sync": dict(linestyle=":", linewidth=1.8),
    "ps-async": dict(linewidth=1.2),
    "ps-ssp": dict(linewidth=1.2),
}


def _moving_average(values: Sequence[float], window: int) -> List[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _plot_label(r: Dict[str, object]) -> str:
    if r["mode"] == "single":
        return "single"
    if r["mode"] == "allreduce":
        return f"allreduce {_algorithm_cell(r)} ({r['workers']}w)"
    return f"{r['mode']} ({r['workers']}w/{r['servers']}s)"


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser, modes: bool = True) -> None:
    """The demo's options (``modes=False``: all but ``--modes``, for scripts making one run)."""
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps, help=f"SGD steps per run ({d.steps})")
    p.add_argument("--workers", type=int, default=2, help="training processes per distributed "
                   "run (2)")
    p.add_argument("--servers", type=int, default=2, help="parameter-server processes (2)")
    p.add_argument("--transport", default="auto", choices=TRANSPORTS,
                   help="how ranks talk (inproc: threads of this process)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the "
                   "table (no progress bars unless stderr is a terminal)")
    p.add_argument("--out", default="minicomm-demo", help="plot directory (./minicomm-demo)")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    if modes:
        p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                       help=f"comma list from {','.join(ALL_MODES)} (default: %(default)s)")
    p.add_argument("--staleness", type=int, default=2, help="bound k of ps-ssp (2)")
    p.add_argument("--batch", type=int, default=d.global_batch,
                   help=f"global batch, split across workers ({d.global_batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"SGD learning rate ({d.lr})")
    p.add_argument("--hidden", default=",".join(map(str, d.hidden)),
                   help="hidden layer widths, comma separated (64)")
    p.add_argument("--chunk-bytes", type=int, default=DEMO_CHUNK_BYTES,
                   help="PS: arrays above this are split across servers (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of the data split, the initial weights and the batches ({d.seed})")
    p.add_argument("--dataset", default="auto", choices=DATASETS,
                   help="digits (needs scikit-learn), synthetic, or auto (digits if available)")
    p.add_argument("--kill-worker", type=int, default=None, metavar="STEP",
                   help="failure drill: the last worker dies (os._exit) before step STEP; "
                   "needs processes, so transport auto or inproc runs the drill on shm")


def config_from_args(a) -> TrainConfig:
    try:
        hidden = tuple(int(h) for h in str(a.hidden).split(",") if h.strip())
    except ValueError:
        raise ValueError(f"--hidden {a.hidden!r}: give comma-separated integers") from None
    return TrainConfig(hidden=hidden, steps=a.steps, global_batch=a.batch, lr=a.lr, seed=a.seed)


class DemoPlan(NamedTuple):
    """What ``minicomm demo`` will run, checked before anything runs."""
    config: TrainConfig
    specs: List[RunSpec]
    skipped: List[str]
    dataset: Dataset
    kill: Optional[int]


def plan_demo(a, log=None) -> DemoPlan:
    """The runs the arguments ask for; ValueError naming the argument when they are wrong. Notes
    go to ``log`` (default: stderr as it is at the call)."""
    log = sys.stderr if log is None else log
    config = config_from_args(a)
    if a.workers < 1 or a.servers < 1:
        raise ValueError("--workers and --servers must be >= 1")
    if config.global_batch % a.workers:
        raise ValueError(f"--batch {config.global_batch} must be a multiple of --workers "
                         f"{a.workers} (every worker takes an equal shard)")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    specs = plan_runs(modes, a.workers, a.servers, a.staleness)
    kill = getattr(a, "kill_worker", None)
    if kill is not None:
        check_kill_step(kill, config.steps, a.workers)
        if drill_transport(a.transport) != a.transport:
            print(f"minicomm demo: --kill-worker needs processes: the failure drill runs on shm "
                  f"(not {a.transport})", file=log)
    skipped = []
    if any(s.mode.startswith("ps-") for s in specs) and not ps_available():
        skipped = [s.mode for s in specs if s.mode.startswith("ps-")]
        specs = [s for s in specs if not s.mode.startswith("ps-")]
        print(f"minicomm demo: minicomm.ps is not importable here; skipping {', '.join(skipped)}",
              file=log)
    dataset = load_dataset(a.dataset, seed=config.seed)
    if config.global_batch > len(dataset.y_train):
        raise ValueError(f"--batch {config.global_batch} exceeds the {len(dataset.y_train)} "
                         f"training samples of the {dataset.name} dataset")
    return DemoPlan(config, specs, skipped, dataset, kill)


def run_demo(a, log=None, plan: Optional[DemoPlan] = None) -> Dict[str, object]:
    """Everything ``minicomm demo`` does except printing; returns the JSON document. ``plan``:
    ``plan_demo(a, log)`` when not given."""
    config, specs, skipped, dataset, kill = plan_demo(a, log) if plan is None else plan
    show = (not a.json) or sys.stderr.isatty()
    if not a.json:                        # stdout: the output says which data was used
        print(f"minicomm demo: {dataset.name} dataset ({len(dataset.y_train)} train / "
              f"{len(dataset.y_test)} test samples, {dataset.num_features} features, "
              f"{dataset.num_classes} classes); MLP {config.model(dataset).sizes}; "
              f"{config.steps} steps of a {config.global_batch}-sample global batch, "
              f"lr {config.lr}; transport {a.transport}", flush=True)
    results = []
    for spec in specs:
        logs = execute(spec, dataset, config, a.transport, show_progress=show,
                       chunk_bytes=a.chunk_bytes)
        results.append(summarize(spec, logs, dataset, config))
    doc = {"dataset": dataset.name, "steps": config.steps, "runs": results, "skipped": skipped}
    if kill is not None:
        doc["failures"] = []
        for spec, record in zip(specs, results):
            if spec.mode != "single":
                logs = execute_with_failure(spec, dataset, config, kill,
                                            drill_transport(a.transport), show_progress=show,
                                            chunk_bytes=a.chunk_bytes)
                doc["failures"].append(failure_record(spec, record, logs, dataset, config,
                                                      kill))
    return doc


def check_kill_step(kill_step: int, steps: int, workers: int) -> None:
    """ValueError naming --kill-worker unless a worker can die at ``kill_step`` and leave one."""
    if not 1 <= kill_step < steps:
        raise ValueError(f"--kill-worker {kill_step} must be a step in 1..{steps - 1} "
                         f"(--steps {steps})")
    if workers < 2:
        raise ValueError(f"--kill-worker needs at least 2 workers (--workers {workers}): a "
                         f"survivor must go on")


def public_json(doc: Dict[str, object]) -> Dict[str, object]:
    """The document without the plot curves (keys starting with '_'); a non-finite number (a
    diverged loss) becomes null, so the output is strict JSON."""
    def public(records):
        return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in r.items() if not k.startswith("_")} for r in records]
    out = {**doc, "runs": public(doc["runs"])}
    if "failures" in doc:
        out["failures"] = public(doc["failures"])
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    # help is plain text: the docstring's ``literal`` marks dropped
    p = argparse.ArgumentParser(prog="minicomm demo", description=re.sub(r"``(.+?)``", r"\1", __doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main_from_args(p.parse_args(argv))


def main_from_args(a) -> int:
    start = time.perf_counter()
    try:                                  # only the arguments' errors are usage errors
        plan = plan_demo(a)
    except ValueError as e:
        print(f"minicomm demo: {e}", file=sys.stderr)
        return 2
    doc = run_demo(a, plan=plan)
    if a.json:
        print(json.dumps(public_json(doc), allow_nan=False))
        return 0
    results = doc["runs"]
    print()
    print(format_table(results))
    print(table_legend(results))
    print()
    for line in comparison(results):
        print(line)
    if doc["skipped"]:
        print(f"(skipped: {', '.join(doc['skipped'])} — minicomm.ps is not importable)")
    failures = doc.get("failures") or []
    if failures:
        print()
        print(format_failure_table(failures))
        print(FAILURE_LEGEND)
    if not a.no_plots:
        paths = write_plots(results, a.out, failures)
        if paths:
            print(f"plots: {', '.join(paths)}")
        else:
            print("plots: none (install matplotlib: pip install 'minicomm[demo]')")
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
