"""Calibration of the simulator's host machine against minicomm's own recorded times.

Pure functions over recorded benchmark runs (``examples/sim_calibrate.py`` records them; it is
what starts ranks): no process is started here, so a test can recompute the calibration table
from the committed raw runs through the *current* engine (``minicomm.cost.schedule_time`` on
``minicomm.sim.engine.run_host``) and fail when a model change breaks it.

A recorded run (one world size n, one transport) holds:
  - ``memory``: this machine's memory by working set, probed just before the run
    (``minicomm.tuning.links.measure_memory``: δ, γ, contention of two copiers);
  - ``probe``: benchmark rows of a two-rank link sweep run just before it (broadcast and
    allgather, 8 B .. 4 MiB), from which ``fit_links`` fits the link's per-message CPU cost o,
    its latency, and (tcp) its per-byte cost β by least squares through the engine;
  - ``wake`` (the world start's probe), ``cores`` (sched_getaffinity), load averages;
  - ``rows``: the timed benchmark rows (allreduce / allgather / broadcast, ring / tree / rhd).

Estimator, the same for fitted and compared numbers: the fastest batch of each benchmark row
(on a machine shared with other jobs, the batch least disturbed by them; every batch is the
slowest rank's time per call). A row is predicted as the benchmark runs it: ``calls`` =
min(the row's iterations per batch, ``MAX_CALLS``) calls back to back, time per call.

Error of a row: predicted / timed - 1. Summary (``geomean_error``): exp(mean |ln(pred /
meas)|) - 1, so a 2x over- and a 2x under-prediction both count as 100%.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import cost

MAX_CALLS = 4           # back-to-back calls simulated per row (the steady state is reached by then)
FIT_ITERATIONS = 12


# Fitted to the probe sweeps: o, latency, (not for a copying transport, whose β is its
# memory's) β, and (only where the transport has a small-message path: the others run every
# call through the executor, so o holds it) the executor's extra o. ``background`` (other runnable threads) stays 0: on a quiet machine the ranks are
# alone, and a fitted one also slows every large copy, which β (tcp) or δ (shm) already price.
FITTED = ("overhead", "latency", "beta", "exec_overhead")
START = {"overhead": 3e-6, "latency": 10e-6, "call_overhead": 0.0, "background": 0.0,
         "beta": 1 / 2e9, "exec_overhead": 0.0}
STEP = {"overhead": 1e-6, "latency": 5e-6, "call_overhead": 5e-6, "background": 0.2,
        "beta": 1e-11, "exec_overhead": 1e-6}
FLOOR = {"overhead": 0.2e-6, "latency": 0.0, "call_overhead": 0.0, "background": 0.0,
         "beta": 1e-12, "exec_overhead": 0.0}


# The single-copy threshold runs recorded before they carried one ran with (cma.py's 2 MiB).
UNRECORDED_SINGLE_COPY = {"shm": 2 << 20}


def recorded_single_copy(run: Dict[str, Any]) -> int:
    """The single-copy threshold a recorded run's shm ran with (0: none)."""
    kind = run["transport"]
    return int(run.get("single_copy", UNRECORDED_SINGLE_COPY.get(kind, 0)))


# The small path's message limit runs recorded before they carried one ran with (shm's EAGER,
# 16 KiB, until the path took messages up to a ring chunk).
UNRECORDED_SMALL_BYTES = {"shm": 16 << 10}


def recorded_small_bytes(run: Dict[str, Any]) -> int:
    """The small-message path's limit a recorded run ran with (0: no such path)."""
    kind = run["transport"]
    return int(run.get("small_bytes", UNRECORDED_SMALL_BYTES.get(kind, 0)))


def _link_model(kind: str, th: Dict[str, float], wake: float, cores: int,
                memory: Sequence[Sequence[float]], single_copy: int,
                small_bytes: int = -1) -> cost.LinkModel:
    o, a, beta = th["overhead"], 3 * th["overhead"] + th["latency"], th["beta"]
    # the memory's two-copier contention is not used: under other jobs' load that probe mostly
    # measures them, which the fitted background already holds (it would count twice)
    return cost.LinkModel(a, beta, a, beta, overhead_intra=o, overhead_inter=o, wake=wake,
                          cores=cores, intra=kind, inter=kind,
                          memory=tuple((float(r[0]), float(r[1]), float(r[2]), 0.0)
                                       for r in memory),
                          call_overhead=th.get("call_overhead", 0.0),
                          background=th.get("background", 0.0),
                          exec_overhead=th.get("exec_overhead", 0.0),
                          # shm reads a non-reducing call's messages of at least this many
                          # bytes single-copy (cma.py): the value the run was recorded with
                          single_copy=single_copy, small_bytes=small_bytes)


def run_model(run: Dict[str, Any]) -> cost.LinkModel:
    """The LinkModel of one recorded run: its fitted link, memory table, wake and cores."""
    return _link_model(run["transport"], run["links"], run.get("wake", 0.0),
                       int(run.get("cores", 0)), run.get("memory", ()), recorded_single_copy(run),
                       recorded_small_bytes(run))


def row_calls(row: Dict[str, Any]) -> int:
    return max(1, min(int(row.get("iters", 1)), MAX_CALLS))


def row_time(row: Dict[str, Any]) -> float:
    """The row's figure: its fastest batch (module doc), seconds per call."""
    return min(row["batches_us"]) * 1e-6


def predict_row(row: Dict[str, Any], m: cost.LinkModel) -> float:
    n = int(row["nranks"])
    return cost.schedule_time(row["collective"], row["algo"], n, int(row["count"]), (0,) * n, m,
                              calls=row_calls(row))


def fit_links(probe_rows: Sequence[Dict[str, Any]], kind: str, memory: Sequence[Sequence[float]],
              wake: float, cores: int, start: Optional[Dict[str, float]] = None,
              fit: Sequence[str] = FITTED, single_copy: int = 0,
              small_bytes: int = -1) -> Dict[str, float]:
    """The host machine's per-message CPU cost o, latency, per-call CPU cost, background load
    (other runnable threads sharing the cores) and β (s/byte; not in ``fit`` for shm, whose β
    is its two copies by the model) of one link, by least squares on the relative residuals pred/meas - 1
    of the probe rows, predicted through the engine (Gauss-Newton, ``FIT_ITERATIONS`` steps,
    every value kept >= its floor). Values not fitted stay at ``start``'s."""
    import numpy as np
    rows = [r for r in probe_rows if r.get("library", "minicomm") == "minicomm"]
    if not rows:
        raise ValueError("no probe rows to fit")
    th = dict(START, **(start or {}))
    meas = np.array([row_time(r) for r in rows])

    def preds(t: Dict[str, float]) -> np.ndarray:
        m = _link_model(kind, t, wake, cores, memory, single_copy, small_bytes)
        return np.array([predict_row(r, m) for r in rows])
    def cost_of(t: Dict[str, float]) -> Tuple[float, np.ndarray]:
        p = preds(t)
        return float(((p / meas - 1) ** 2).sum()), p
    best, base = cost_of(th)
    for _ in range(FIT_ITERATIONS):
        cols = []
        for k in fit:
            h = max(abs(th[k]) * 0.05, STEP[k] * 0.1)
            cols.append((preds(dict(th, **{k: th[k] + h})) - base) / h)
        J = np.stack(cols, axis=1) / meas[:, None]
        step = np.linalg.lstsq(J, 1 - base / meas, rcond=None)[0]
        # damped: halve the step until the squared relative error falls (the prediction is
        # piecewise linear: a wake-up or a pipeline stall switches on at some value)
        for scale in (1.0, 0.5, 0.25, 0.125, 0.0625):
            trial = dict(th)
            for k, s in zip(fit, step):
                trial[k] = max(FLOOR[k], th[k] + scale * float(s))
            c, p = cost_of(trial)
            if c < best:
                th, best, base = trial, c, p
                break
        else:
            break
    return {k: float(th[k]) for k in START}


def _merged_rows(groups: Sequence[Sequence[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """The rows of several rounds of one benchmark, each row's batches those of every round
    (so its fastest batch is the fastest over all rounds)."""
    out: Dict[Tuple, Dict[str, Any]] = {}
    for rows in groups:
        for r in rows:
            if r.get("library", "minicomm") != "minicomm":
                continue
            key = (r["collective"], r["algo"], r["size"])
            if key not in out:
                out[key] = dict(r, batches_us=list(r["batches_us"]), medians_us=[r["time_us"]])
            else:
                out[key]["batches_us"] += r["batches_us"]
                out[key]["medians_us"].append(r["time_us"])
                out[key]["iters"] = min(out[key]["iters"], r["iters"])
    return list(out.values())


def _merged_memory(runs: Sequence[Dict[str, Any]]) -> List[List[float]]:
    import statistics
    mems = [run["memory"] for run in runs]
    return [[mems[0][i][0], min(m[i][1] for m in mems), min(m[i][2] for m in mems),
             statistics.median(m[i][3] for m in mems)] for i in range(len(mems[0]))]


def merge_rounds(raw: Dict[str, Any], fit: bool = True) -> List[Dict[str, Any]]:
    """One cell per (transport, world size): the rounds' timed rows merged
    (``_merged_rows``), the memory table's δ and γ the fastest over rounds and its contention
    their median, wake the median. The link is one per transport: every run's probe is the same
    two-rank sweep, so all of a transport's probes (every world size and round) are merged and
    the link fitted once to them (one noisy sweep cannot skew one cell's fit)."""
    import statistics
    cells: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
    by_transport: Dict[str, List[Dict[str, Any]]] = {}
    for run in raw["runs"]:
        cells.setdefault((run["transport"], int(run["ranks"])), []).append(run)
        by_transport.setdefault(run["transport"], []).append(run)
    links: Dict[str, Dict[str, float]] = {}
    if fit:
        for t, runs in sorted(by_transport.items()):
            names = [f for f in FITTED
                     if not (f == "beta" and t in cost.COPY_TRANSPORTS)
                     and not (f == "exec_overhead" and t not in cost.SMALL_BYTES)]
            ws = runs[0]["world_start_links"]["links"][t]
            links[t] = fit_links(_merged_rows([run["probe"] for run in runs]), t,
                                 _merged_memory(runs),
                                 statistics.median(run.get("wake", 0.0) for run in runs),
                                 int(runs[0].get("cores", 0)), {"beta": ws["beta"]}, names,
                                 recorded_single_copy(runs[0]), recorded_small_bytes(runs[0]))
    out = []
    for (t, n), runs in sorted(cells.items()):
        cell = {"transport": t, "ranks": n, "cores": int(runs[0].get("cores", 0)),
                "single_copy": recorded_single_copy(runs[0]),
                "small_bytes": recorded_small_bytes(runs[0]),
                "memory": _merged_memory(runs),
                "wake": statistics.median(run.get("wake", 0.0) for run in runs),
                "probe": _merged_rows([run["probe"] for run in runs]),
                "rows": _merged_rows([run["rows"] for run in runs]),
                "load": [(run["load_before"][0], run["load_after"][0]) for run in runs]}
        if fit:
            cell["links"] = links[t]
        out.append(cell)
    return out


def calibration_rows(raw: Dict[str, Any], cells: Optional[List[Dict[str, Any]]] = None
                     ) -> List[Dict[str, Any]]:
    """Every timed row of the recorded runs (rounds merged) with its prediction by the
    current engine, the links fitted by it too."""
    out = []
    for cell in cells if cells is not None else merge_rounds(raw):
        m = run_model(cell)
        for r in cell["rows"]:
            if r["algo"] not in cost.FAMILIES:
                continue
            meas, pred = row_time(r), predict_row(r, m)
            out.append({"transport": cell["transport"], "ranks": cell["ranks"],
                        "collective": r["collective"], "algorithm": r["algo"],
                        "bytes": r["size"], "calls": row_calls(r), "timed_s": meas,
                        "median_s": statistics_median(r["medians_us"]) * 1e-6,
                        "predicted_s": pred, "error": pred / meas - 1})
    return out


def statistics_median(xs: Sequence[float]) -> float:
    import statistics
    return float(statistics.median(xs))


def _exp_mean(logs: Sequence[float], what: str) -> float:
    """exp(mean of ``logs``): the geometric mean of the values they are the logarithms of."""
    if not logs:
        raise ValueError(f"no {what}")
    return math.exp(sum(logs) / len(logs))


def geomean_error(rows: Iterable[Dict[str, Any]]) -> float:
    return _exp_mean([abs(math.log(1 + r["error"])) for r in rows], "rows") - 1


# ---------------------------------------------------------------------------------- auto's picks
def pick_rows(cells: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """What ``algorithm="auto"`` would have picked on the recorded runs, against what was
    fastest there: per cell (transport, world size), collective and size, the cost model's
    family (``cost.model_choice`` on the cell's fitted LinkModel, as a world without a tuned
    table chooses) and the fastest of the recorded families. The estimator here is the
    median over rounds of each round's median batch: a pick is judged by what a user's calls
    usually take, not by one lucky batch. ``regret`` = time(pick) / time(best) >= 1."""
    out = []
    for cell in cells:
        m = run_model(cell)
        n = int(cell["ranks"])
        by_case: Dict[Tuple[str, int], Dict[str, Dict[str, Any]]] = {}
        for r in cell["rows"]:
            if r["algo"] in cost.FAMILIES:
                by_case.setdefault((r["collective"], int(r["size"])), {})[r["algo"]] = r
        for (coll, size), fams in sorted(by_case.items()):
            med = {a: statistics_median(r["medians_us"]) * 1e-6 for a, r in fams.items()}
            count = int(next(iter(fams.values()))["count"])
            pick = cost.model_choice(coll, n, count * cost.ITEMSIZE, (0,) * n, m)
            best = min(med, key=med.get)
            if pick not in med:
                raise ValueError(f"{cell['transport']} n={n} {coll} {size} B: auto picks "
                                 f"{pick}, which the run did not measure")
            out.append({"transport": cell["transport"], "ranks": n, "collective": coll,
                        "bytes": size, "pick": pick, "best": best, "median_s": med,
                        "regret": med[pick] / med[best]})
    return out


def geomean_regret(picks: Iterable[Dict[str, Any]]) -> float:
    """exp(mean ln(regret)): 1.0 when every pick was the fastest."""
    return _exp_mean([math.log(p["regret"]) for p in picks], "picks")
