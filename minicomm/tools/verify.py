"""minicomm verify: the verifier run over the whole algorithm matrix, in a process pool.

Every (collective, family, world size 1..max_world) cell is proved with ``minicomm.verifier``
over roots, counts and, for hier, node maps; a channelled collective's ring cell, and tree's
allreduce (the double binary tree), also with ``CHANNEL_COUNTS`` channels over those node maps
(their orders and trees depend on them); hier's and the double binary tree's allreduce also with
their pipeline cut short (``short_segments``), so that their many-segment paths are proved; the
matrix is printed. Lives with the tools: it
starts processes (``ProcessPoolExecutor``, ``--jobs`` of them, default one per core), which
nothing below the launcher does.
"""
from __future__ import annotations

import gc
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

from ..algorithms import FAMILIES, build_schedule, hier, innet, registered, ring, tree
from ..schedule import ALL_COLLECTIVES, PREFIX, ROOTED, UNEVEN
from ..verifier import collector_paused, verify

EXHAUSTIVE_UP_TO = 16    # world sizes verified with every root, count and node map
PROVABLE = FAMILIES + ("innet",)   # innet: switches included (verified when named)
CHANNEL_COUNTS = (2, 3, 8)   # even, odd, and a DGX server's NICs
TREE_CHANNEL_COUNTS = (2, 3, 16)   # one pair of trees, an odd count, two trees per DGX NIC
UNEVEN_MAX_WORLD = 32    # the uneven collectives are proved up to this world size


def count_vectors(collective: str, p: int):
    """The uneven collectives' blocks: all zero, one non-zero, ascending, random with zeros
    (seeded by p), one huge; alltoallv's as p x p matrices of the same kinds, row-major."""
    rng = random.Random(p)
    k = p * p if collective == "alltoallv" else p
    return [tuple([0] * k),
            tuple(5 if i == k // 2 else 0 for i in range(k)),
            tuple(i % 5 for i in range(k)),
            tuple(rng.choice((0, 0, 1, 3, 7)) for _ in range(k)),
            tuple(1000 if i == 0 else 1 for i in range(k))]


def topologies_for(p: int, exhaustive: bool = False):
    """Node maps hier is verified on: one node, two equal nodes, uneven nodes (p-1 and 1, and
    2,2,rest), one rank per node; above EXHAUSTIVE_UP_TO the two equal and the 2,2,rest maps."""
    two = tuple(r * 2 // p for r in range(p))
    uneven = tuple(min(r // 2, 2) for r in range(p))
    if p > EXHAUSTIVE_UP_TO and not exhaustive:
        return sorted({two, uneven})
    maps = {(0,) * p, two, uneven, tuple(range(p))}
    if p >= 3:
        maps.add(tuple(0 if r < p - 1 else 1 for r in range(p)))
    return sorted(maps)


def roots_for(p: int, exhaustive: bool = False):
    if exhaustive or p <= EXHAUSTIVE_UP_TO:
        return range(p)
    return sorted({0, p // 2, p - 1})


def counts_for(p: int, exhaustive: bool = False):
    """0, 1, a count below p, and one above p not divisible by it (p + 1)."""
    if exhaustive or p <= EXHAUSTIVE_UP_TO:
        return sorted({0, 1, 5, p + 1})
    return [1, p + 1]


@contextmanager
def short_segments():
    """hier's pipeline segments, the double binary tree's and innet's chunks cut at 2 elements,
    so that the small counts verified take the pipelined paths of large calls (same code, more
    pieces)."""
    saved = hier.PIPELINE_MIN_SEGMENT, tree.TREE_MIN_CHUNK, innet.CHUNK_SCALE, ring.SEGMENT
    build_schedule.cache_clear()
    hier.PIPELINE_MIN_SEGMENT = tree.TREE_MIN_CHUNK = innet.CHUNK_SCALE = ring.SEGMENT = 2
    try:
        yield
    finally:
        (hier.PIPELINE_MIN_SEGMENT, tree.TREE_MIN_CHUNK, innet.CHUNK_SCALE,
         ring.SEGMENT) = saved
        build_schedule.cache_clear()


def pipelined_counts(p: int):
    """Counts that cut into several segments or chunks (with ``short_segments``)."""
    return sorted({4 * p + 3, 9 * p + 1}) if p <= EXHAUSTIVE_UP_TO else [4 * p + 3]


def verify_cell(args):
    """Verify one (collective, family, world size) over roots, counts and node maps.
    Returns (collective, family, p, cases, error or None)."""
    with collector_paused():   # the cell's schedules are freed (cache_clear) before it resumes
        return _verify_cell(args)


def _verify_cell(args):
    coll, fam, p, all_roots = args
    if not _has(fam, coll):
        return coll, fam, p, 0, None
    if fam == "innet":
        return _verify_innet_cell(coll, p, all_roots)
    if coll in UNEVEN or coll in PREFIX:
        return _verify_uneven_cell(coll, fam, p, all_roots)
    cases = 0
    roots = roots_for(p, all_roots) if coll in ROOTED else [0]
    topos = topologies_for(p, all_roots) if fam == "hier" else [None]
    variants = [(topo, 1) for topo in topos]
    if p > 1 and ((fam == "ring" and coll in ring.CHANNELLED)
                  or (fam == "tree" and coll == "allreduce")):
        variants += [(topo, k) for topo in topologies_for(p, all_roots)
                     for k in (CHANNEL_COUNTS if fam == "ring" else TREE_CHANNEL_COUNTS)]
    counts = [0] if coll == "barrier" else counts_for(p, all_roots)
    pipelined = []
    if coll == "allreduce" and p > 1 and fam in ("hier", "tree"):
        pipelined = [(topo, k) for topo, k in variants if fam == "hier" or k in (2, 3)]
    topo, k, n, root = None, 1, 0, 0
    try:
        for topo, k in variants:
            for n in counts:
                for root in roots:
                    scheds = [build_schedule(coll, fam, r, p, n, root, topo, k)
                              for r in range(p)]
                    verify(scheds)
                    cases += 1
        with short_segments():
            for topo, k in pipelined:
                for n in pipelined_counts(p):
                    verify([build_schedule(coll, fam, r, p, n, 0, topo, k) for r in range(p)])
                    cases += 1
        build_schedule.cache_clear()
        return coll, fam, p, cases, None
    except Exception as e:   # reported in the matrix, with the failing case
        build_schedule.cache_clear()
        return coll, fam, p, cases, (f"p={p} topology={topo} channels={k} count={n} root={root}: "
                                     f"{type(e).__name__}: {e}")


def _verify_uneven_cell(coll: str, fam: str, p: int, all_roots: bool):
    """An uneven collective's cell over ``count_vectors`` (a prefix reduction's over counts,
    its pipelined chain cut short too), roots and, for hier, node maps; p <= UNEVEN_MAX_WORLD."""
    if p > UNEVEN_MAX_WORLD:
        return coll, fam, p, 0, None
    cases = 0
    roots = roots_for(p, all_roots) if coll in ROOTED else [0]
    topos = topologies_for(p, all_roots) if fam == "hier" else [None]
    vectors = ([((), n) for n in counts_for(p, all_roots)] if coll in PREFIX
               else [(v, sum(v)) for v in count_vectors(coll, p)])
    topo, v, root = None, (), 0
    try:
        for topo in topos:
            for v, n in vectors:
                for root in roots:
                    verify([build_schedule(coll, fam, r, p, n, root, topo, 1, v)
                            for r in range(p)])
                    cases += 1
        if coll in PREFIX:
            with short_segments():
                for topo in topos:
                    for n in pipelined_counts(p):
                        verify([build_schedule(coll, fam, r, p, n, 0, topo) for r in range(p)])
                        cases += 1
        build_schedule.cache_clear()
        return coll, fam, p, cases, None
    except Exception as e:   # reported in the matrix, with the failing case
        build_schedule.cache_clear()
        return coll, fam, p, cases, (f"p={p} topology={topo} counts={list(v)[:16]} root={root}: "
                                     f"{type(e).__name__}: {e}")


def _verify_innet_cell(coll: str, p: int, all_roots: bool):
    """innet's cell: its schedules with their switches over the node maps (a switch per server,
    RADIX per switch above: multi-level trees from p > RADIX), and with chunks cut short."""
    if coll not in innet.COLLECTIVES:
        return coll, "innet", p, 0, None
    cases = 0
    roots = roots_for(p, all_roots) if coll in ROOTED else [0]
    counts = [0] if coll == "barrier" else counts_for(p, all_roots)
    topo, n, root = None, 0, 0

    def prove(counts):
        nonlocal topo, n, root, cases
        for topo in topologies_for(p, all_roots):
            for n in counts:
                for root in roots:
                    verify(innet.build_all(coll, p, n, root, topo))
                    cases += 1
    try:
        prove(counts)
        if coll != "barrier":
            with short_segments():
                prove(pipelined_counts(p))
        return coll, "innet", p, cases, None
    except Exception as e:   # reported in the matrix, with the failing case
        return coll, "innet", p, cases, (f"p={p} topology={topo} count={n} root={root}: "
                                         f"{type(e).__name__}: {e}")


def _has(fam: str, coll: str) -> bool:
    """Whether ``fam`` builds ``coll``: innet and registered algorithms have some only."""
    if fam == "innet":
        return coll in innet.COLLECTIVES
    reg = {r.name: r for r in registered()}.get(fam)
    return reg is None or coll in reg.collectives


def _start_worker(paths) -> None:
    """A pool process: the cyclic collector off for good, then the ``--load`` files. Its cells
    make no reference cycles (schedules and symbolic state go by reference counting); between
    cells the collector would only traverse the long-lived schedule caches again."""
    gc.disable()
    _load(paths)


def _load(paths) -> None:
    """A pool process runs the ``--load`` files, so their algorithms are registered there
    (unless it was forked from the parent, and has them already)."""
    import runpy
    if registered():
        return
    for path in paths:
        runpy.run_path(path, run_name="__minicomm_load__")


def run_matrix(max_world: int = 64, all_roots: bool = False, jobs: int = 0, out=None,
               collectives=None, families=None, loads=None) -> bool:
    """Verify every cell of the algorithm matrix; print it; True if every cell passes.
    ``loads``: files that register algorithms (already run here; the pool runs them too)."""
    out = out or sys.stdout
    colls = list(collectives or ALL_COLLECTIVES)
    fams = list(families or FAMILIES)
    # a misspelt name is the caller's mistake, not a cell that fails its proof
    provable = PROVABLE + tuple(r.name for r in registered())
    for kind, names, known in (("collective", colls, ALL_COLLECTIVES),
                               ("algorithm", fams, provable)):
        bad = [x for x in names if x not in known]
        if bad:
            raise ValueError(f"unknown {kind} {', '.join(map(repr, bad))}; choose from "
                             f"{', '.join(known)}")
    # Largest world sizes first so the pool's tail is short.
    tasks = [(c, f, p, all_roots) for p in range(max_world, 0, -1) for c in colls for f in fams]
    jobs = jobs or os.cpu_count() or 1
    t0 = time.monotonic()
    cells = {(c, f): [0, 0, None] for c in colls for f in fams}   # sizes passed, cases, first error
    if jobs > 1:
        with ProcessPoolExecutor(jobs, initializer=_start_worker,
                                 initargs=(list(loads or ()),)) as pool:
            results = list(pool.map(verify_cell, tasks, chunksize=4))
    else:
        results = [verify_cell(t) for t in tasks]
    for c, f, p, cases, err in results:
        cell = cells[(c, f)]
        cell[1] += cases
        if err is None:
            cell[0] += 1
        elif cell[2] is None:
            cell[2] = err
    width = 16
    if all_roots:
        scope = "every root, counts {0, 1, 5, p+1}, hier on 5 node maps, at every size"
    else:
        scope = (f"up to p={EXHAUSTIVE_UP_TO}: every root, counts {{0, 1, 5, p+1}}, hier on 1 node, "
                 f"2 equal, uneven (p-1,1 and 2,2,rest) and 1 rank per node; above: roots "
                 f"{{0, p/2, p-1}}, counts {{1, p+1}}, 2 node maps (--exhaustive for all)")
    print(f"minicomm verify: world sizes 1..{max_world}; {scope}", file=out)
    print("collective".ljust(16) + "".join(f.ljust(width) for f in fams), file=out)
    ok_cells = 0
    absent = {(c, f) for c in colls for f in fams if not _has(f, c)}
    for c in colls:
        row = c.ljust(16)
        for f in fams:
            passed, cases, err = cells[(c, f)]
            good = passed == max_world
            ok_cells += good and (c, f) not in absent
            row += ("n/a" if (c, f) in absent
                    else f"{'ok' if good else 'FAIL'} {cases}").ljust(width)
        print(row, file=out)
    total = len(colls) * len(fams) - len(absent)
    print(f"{ok_cells}/{total} cells pass ({sum(v[1] for v in cells.values())} schedule sets "
          f"verified in {time.monotonic() - t0:.1f} s)", file=out)
    for (c, f), (_, _, err) in cells.items():
        if err:
            print(f"FAIL {c}/{f}: {err}", file=out)
    return ok_cells == total
