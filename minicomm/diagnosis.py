"""A hang diagnosis from every rank's flight record at once (minicomm.flightrecord).

One rank's timeout says whom it waited on; the job's records together say who is at fault.
``diagnose`` reads the dumps of a job (and, from a launcher, how each rank ended) and returns
lines that begin ``diagnosis:``, naming each rank at fault as ``rank K`` and each call by its op
and number (``#N``). The cases, checked in this order on each communicator:

1. a rank that died (it exited without a record of a communication error, or a launcher saw it
   killed), and the call the others were in when they last saw it;
2. ranks that entered different collectives at the same sequence number (op, root, count,
   dtype or algorithm differ): the ranks in the minority are named;
3. a rank that never entered call #N that the others are in (still computing, or it skipped
   the call), with the last call it made;
4. a cycle of point-to-point waits (each rank blocked in a send or receive on the next).

Nothing found is said too, with each rank's last call. ``minicomm doctor DIR`` runs it on dumps
collected by hand; ``mc.spawn`` and ``minicomm run`` run it when a rank fails.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Tuple

from .flightrecord import DONE, FAILED, RUNNING, load

PREFIX = "diagnosis:"
FINISHED = "finished"         # a launcher's word for a rank that returned (exit status 0)
COMM_ERRORS = ("CommTimeout", "PeerFailure", "MismatchError", "Revoked")


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _call(c: dict) -> str:
    """A record as the user reads it: '#12 allreduce' or 'recv from rank 1 (p2p #3, tag 0)'."""
    if c["kind"] == "p2p":
        peer = "any source" if c["peer"] == -1 else f"rank {c['peer']}"
        way = "from" if c["op"] == "recv" else "to"
        return f"{c['op']} {way} {peer} (p2p #{c['number']}, tag {c['tag']})"
    return f"#{c['number']} {c['op']}"


def _signature(c: dict) -> str:
    parts = [f"count={c['count']}", f"dtype={c['dtype']}", f"algorithm={c['algorithm']}"]
    if c.get("root") is not None:
        parts.append(f"root={c['root']}")
    return f"{c['op']}({', '.join(parts)})"


def _blocked(c: Optional[dict]) -> bool:
    """A call the rank was stuck in: still running, or ended by a failure (its own timeout, or
    the peer it waited on ending first: in a deadlock the first rank to time out exits)."""
    return c is not None and c["state"] in (RUNNING, FAILED)


class _Comm:
    """One communicator as the dumps of its members show it (world ranks throughout)."""

    def __init__(self, comm_id: int, group: List[int]):
        self.comm_id, self.group = comm_id, group
        self.calls: Dict[int, List[dict]] = {}        # world rank -> its records, oldest first

    def collectives(self, rank: int) -> List[dict]:
        return [c for c in self.calls.get(rank, ()) if c["kind"] == "collective"
                and c["number"] is not None]

    def last(self, rank: int) -> Optional[dict]:
        calls = self.calls.get(rank)
        return calls[-1] if calls else None

    def name(self) -> str:
        return "the world" if self.comm_id == 1 else f"communicator {self.comm_id}"


def _communicators(dumps: Dict[int, dict]) -> List[_Comm]:
    comms: Dict[int, _Comm] = {}
    for world_rank, doc in dumps.items():
        for part in doc.get("communicators", ()):
            comm = comms.setdefault(part["comm_id"], _Comm(part["comm_id"], list(part["group"])))
            comm.calls[world_rank] = [c for c in part["calls"] if c["state"] != "started"]
    return [comms[k] for k in sorted(comms)]


def _dead(dumps: Dict[int, dict], exits: Dict[int, Optional[str]], size: int) -> Dict[int, str]:
    """The ranks that died, with how: no record of a communication error of their own."""
    dead = {}
    for r in range(size):
        how = exits.get(r)
        doc = dumps.get(r)
        own_error = doc is not None and (str(doc.get("reason", "")).startswith(COMM_ERRORS) or any(
            str(c.get("error") or "").startswith(COMM_ERRORS)
            for part in doc.get("communicators", ()) for c in part["calls"]))
        if how == FINISHED:
            continue
        if how is not None and not own_error:
            dead[r] = how
        elif how is None and doc is None and r not in exits:
            dead[r] = "no flight record: it died before writing one (SIGKILL?), or never started"
    return dead


def _died_lines(comm: _Comm, dead: Dict[int, str]) -> List[str]:
    lines = []
    for k in sorted(set(dead) & set(comm.group)):
        seen = [(r, c) for r in comm.group if r not in dead
                for c in [comm.last(r)] if c is not None and c["kind"] == "collective"
                and c["number"] is not None and c["state"] != DONE]    # queued: no number yet
        if seen:
            number = max(c["number"] for _, c in seen)
            at = next(c for _, c in seen if c["number"] == number)
            where = (f"in or before {_call(at)}, the call "
                     f"{_ranks(r for r, c in seen if c['number'] == number)} were in")
        else:
            where = "while the others were not in a collective with it"
        mine = comm.collectives(k)
        last = f"; its own last record: {_call(mine[-1])}, {mine[-1]['state']}" if mine else ""
        lines.append(f"{PREFIX} rank {k} died ({dead[k]}) {where} on {comm.name()}{last}")
    return lines


def _mismatch_lines(comm: _Comm) -> Tuple[List[str], set]:
    """The first sequence number where the members' collectives differ."""
    by_number: Dict[int, Dict[int, dict]] = {}
    for r in comm.group:
        for c in comm.collectives(r):
            by_number.setdefault(c["number"], {})[r] = c
    for number in sorted(by_number):
        calls = by_number[number]
        sigs = {r: _signature(c) for r, c in calls.items()}
        if len(set(sigs.values())) < 2:
            continue
        counts = Counter(sigs.values())
        major = counts.most_common(1)[0][0] if list(counts.values()).count(
            max(counts.values())) == 1 else None
        groups = "; ".join(f"{_ranks(r for r in sigs if sigs[r] == s)} in {s}"
                           for s in sorted(counts, key=lambda s: -counts[s]))
        fault = sorted(r for r in sigs if major is not None and sigs[r] != major)
        blame = (f": {_ranks(fault)} at fault (the others agree)" if fault else "")
        return ([f"{PREFIX} ranks entered different collectives at #{number} on "
                 f"{comm.name()}: {groups}{blame}"], set(fault))
    return [], set()


def _never_entered_lines(comm: _Comm, dead: Dict[int, str], skip: set,
                         exits: Dict[int, Optional[str]]) -> List[str]:
    stuck = {r: c for r in comm.group for c in [comm.last(r)]
             if c is not None and c["kind"] == "collective" and c["number"] is not None
             and _blocked(c)}
    if not stuck:
        return []
    number = Counter(c["number"] for c in stuck.values()).most_common(1)[0][0]
    waiting = sorted(r for r, c in stuck.items() if c["number"] == number)
    op = stuck[waiting[0]]["op"]
    lines = []
    for r in comm.group:
        if r in dead or r in skip or r in waiting:
            continue
        mine = comm.collectives(r)
        if r not in comm.calls:
            why = ("it returned without making the call" if exits.get(r) == FINISHED
                   else "it wrote no record of this communicator")
            lines.append(f"{PREFIX} rank {r} never entered #{number} {op}, which "
                         f"{_ranks(waiting)} are in on {comm.name()}: {why}")
            continue
        if mine and mine[-1]["number"] >= number:
            continue
        last = comm.last(r)
        now = ("it returned without making the call" if exits.get(r) == FINISHED else
               f"it is in {_call(last)}" if last is not None and last["state"] == RUNNING
               else "it is still computing, or it skipped the call")
        made = f"; its last collective: {_call(mine[-1])}, {mine[-1]['state']}" if mine else ""
        lines.append(f"{PREFIX} rank {r} never entered #{number} {op}, which "
                     f"{_ranks(waiting)} are in on {comm.name()}: {now}{made}")
    return lines


def _cycle_lines(comm: _Comm) -> List[str]:
    waits = {}
    for r in comm.group:
        c = comm.last(r)
        if c is not None and c["kind"] == "p2p" and _blocked(c) and c["peer"] not in (None, -1):
            waits[r] = (comm.group[c["peer"]], c)
    seen, lines = set(), []
    for start in sorted(waits):
        path, r = [], start
        while r in waits and r not in path and r not in seen:
            path.append(r)
            r = waits[r][0]
        seen.update(path)
        if r in path:
            cycle = path[path.index(r):]
            steps = ", ".join(f"rank {k} in {_call(waits[k][1])}" for k in cycle)
            lines.append(f"{PREFIX} a cycle of point-to-point waits on {comm.name()}: {steps}, "
                         f"back to rank {cycle[0]}: each waits on the next (a deadlock in the "
                         f"program's own sends and receives)")
    return lines


def diagnose(dumps: Dict[int, dict], exits: Optional[Dict[int, Optional[str]]] = None,
             size: Optional[int] = None) -> List[str]:
    """The diagnosis lines (module doc) of a job's dumps (world rank -> flight record).

    ``exits``: what a launcher saw of each rank (world rank -> "exit status 3", "killed by signal
    9", ``FINISHED``, or None while it ran); ``size``: the world size (else the world's size in the dumps)."""
    exits = dict(exits or {})
    comms = _communicators(dumps)
    if size is None:
        size = max([len(c.group) for c in comms if c.comm_id == 1] + [len(dumps)]
                   + [r + 1 for r in list(dumps) + list(exits)])
    dead = _dead(dumps, exits, size)
    lines: List[str] = []
    for comm in comms:
        lines += _died_lines(comm, dead)
        found, fault = _mismatch_lines(comm)
        lines += found
        lines += _never_entered_lines(comm, dead, fault, exits)
        lines += _cycle_lines(comm)
    if not comms:
        lines += [f"{PREFIX} rank {k} died ({how})" for k, how in sorted(dead.items())]
    if not lines:
        lines.append(f"{PREFIX} nothing at fault found in the records of "
                     f"{_ranks(dumps) if dumps else 'no rank'}")
    for comm in comms[:1]:
        lasts = ", ".join(f"rank {r}: {_call(c)} {c['state']}" for r in comm.group
                          for c in [comm.last(r)] if c is not None)
        if lasts:
            lines.append(f"{PREFIX} last calls on {comm.name()}: {lasts}")
    return lines


def diagnose_dir(directory: str, exits: Optional[Dict[int, Optional[str]]] = None,
                 size: Optional[int] = None) -> List[str]:
    """``diagnose`` on the dumps in ``directory``."""
    return diagnose(load(directory), exits, size)
