"""Every ``>>>`` example in the public docstrings runs, on every rank of a world of 2 (issue 34).

The examples are collected with ``doctest.DocTestFinder`` from the public API that
test_docstrings walks, and each docstring's examples run in order on both ranks of a fresh
``mc.spawn(fn, world_size=2, transport="inproc")`` world, as SPMD code: every rank must print
what the example shows. Globals: the docstring's module namespace (as doctest gives it), then
``comm``, ``np``, ``mc``, ``ps``; the one-sided ``Window`` examples (and ``comm.window``'s) run
on shm, which has one-sided memory (inproc has none), with ``win``, a window of 8 float64 zeros
in an open (fenced) epoch. An example that cannot run this way carries ``# doctest: +SKIP`` and
its docstring is listed in ``SKIPPED`` (or under a prefix of ``SKIPPED_PREFIXES``) with the
reason: never skipped silently. The docstring's other examples still run.
"""
import doctest
import importlib
import io
import sys
import threading
import traceback

import numpy as np
import pytest
from test_docstrings import public_api

import minicomm as mc
from minicomm import ps

SKIPPED = {
    "minicomm.init": "needs a launcher's environment (minicomm run, mpiexec, srun, torchrun)",
    "minicomm.ps.start": "makes ranks servers that serve until every worker closes",
    "minicomm.ps.Worker": "needs a parameter-server job (ps.start with servers)",
    "minicomm.ps.worker.Worker.init": "needs a parameter-server job (ps.start with servers)",
    "minicomm.ps.worker.Worker.pull": "needs a parameter-server job (ps.start with servers)",
    "minicomm.ps.worker.Worker.push": "needs a parameter-server job (ps.start with servers)",
    "minicomm.ps.worker.Worker.wait": "needs a parameter-server job (ps.start with servers)",
    "minicomm.ps.worker.Worker.pushpull": "needs a parameter-server job (ps.start with servers)",
    "minicomm.ps.worker.Worker.close": "needs a parameter-server job (ps.start with servers)",
}
# torch's process group and work: every example runs under torch.distributed
SKIPPED_PREFIXES = {"minicomm.torch.": "the torch backend runs under dist.init_process_group"}
ONE_SIDED = ("minicomm.window.Window", "minicomm.communicator.core.Communicator.window")
WORLD = 2
TIMEOUT = 30.0          # a rank whose peer failed an example waits at most this long


def collect():
    """{docstring name: (module name, [(source, want, exc_msg, options)])}, with examples."""
    finder = doctest.DocTestFinder(recurse=False)
    found = {}
    for qual, obj in public_api():
        target = obj.fget if isinstance(obj, property) else obj
        module = getattr(target, "__module__", None)
        for t in finder.find(obj, name=qual, module=False, globs={}):
            if t.examples:
                found[qual] = (module, [(e.source, e.want, e.exc_msg, dict(e.options))
                                        for e in t.examples])
    return found


EXAMPLES = collect()


def skip_reason(name):
    if name in SKIPPED:
        return SKIPPED[name]
    return next((r for p, r in SKIPPED_PREFIXES.items() if name.startswith(p)), None)


class PerThreadStdout(io.TextIOBase):
    """sys.stdout that each rank thread redirects to its own buffer (doctest's own runner swaps
    the global sys.stdout, which two ranks in one process would share)."""

    def __init__(self, real):
        self.real, self.local = real, threading.local()

    def write(self, s):
        return (getattr(self.local, "buf", None) or self.real).write(s)

    def flush(self):
        self.real.flush()


def run_examples(comm, name, module, examples, extra):
    """Run one docstring's examples on this rank; None, or what went wrong first."""
    if not isinstance(sys.stdout, PerThreadStdout):     # a spawned process: its own stdout
        sys.stdout = PerThreadStdout(sys.stdout)
    out = sys.stdout
    globs = dict(vars(importlib.import_module(module))) if module else {}
    globs.update(comm=comm, np=np, mc=mc, ps=ps, **extra)
    checker = doctest.OutputChecker()
    for source, want, exc_msg, options in examples:
        if options.get(doctest.SKIP):
            continue
        flags = sum(f for f, on in options.items() if on)
        buf = out.local.buf = io.StringIO()
        try:
            exec(compile(source, f"<docstring of {name}>", "single"), globs)
            got = buf.getvalue()
            if exc_msg is not None:
                return f"rank {comm.rank}: {source.strip()!r} raised nothing; expected {exc_msg!r}"
            if not checker.check_output(want, got, flags):
                return f"rank {comm.rank}: {source.strip()!r}\n  expected: {want!r}\n  got: {got!r}"
        except Exception as e:
            msg = traceback.format_exception_only(type(e), e)[-1]
            if exc_msg is None or not checker.check_output(exc_msg, msg, flags):
                return (f"rank {comm.rank}: {source.strip()!r} raised\n"
                        + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        finally:
            out.local.buf = None
    return None


def _inproc_rank(comm, name, module, examples):
    return run_examples(comm, name, module, examples, {})


def _one_sided_rank(comm, names_examples):
    """Every one-sided docstring on a fresh sub-communicator and window of its own."""
    failures = {}
    for name, module, examples in names_examples:
        sub = comm.split(0)
        win = sub.window(np.zeros(8))
        win.fence()
        try:
            err = run_examples(sub, name, module, examples, {"win": win})
        finally:
            try:
                win.free()
            except mc.CommError:
                pass                  # the example freed or broke it
            sub.close()
        if err:
            failures[name] = err
    return failures


# every docstring runs: a listed one runs its examples not marked +SKIP
INPROC = sorted(n for n in EXAMPLES if not n.startswith(ONE_SIDED))
ONE_SIDED_NAMES = sorted(n for n in EXAMPLES if n.startswith(ONE_SIDED))


def test_examples_were_found():
    # an independent check that the collection reaches methods, properties and mixins
    for name in ("minicomm.communicator.core.Communicator.allreduce",
                 "minicomm.communicator.core.Communicator.send",
                 "minicomm.window.Window.fence", "minicomm.spawn"):
        assert name in EXAMPLES, name
    assert len(INPROC) > 40


def test_skipped_examples_are_listed_by_name():
    """A ``+SKIP`` example is allowed only in a docstring SKIPPED names, with its reason; and a
    listed docstring must still have one (no stale entries)."""
    with_skip = {n for n, (_, exs) in EXAMPLES.items() if any(o.get(doctest.SKIP)
                                                              for *_, o in exs)}
    unlisted = sorted(n for n in with_skip if skip_reason(n) is None)
    assert not unlisted, f"+SKIP examples in docstrings SKIPPED does not list: {unlisted}"
    stale = sorted(n for n in SKIPPED if n not in with_skip)
    assert not stale, f"SKIPPED lists docstrings with no +SKIP example: {stale}"
    for name in sorted(with_skip):
        print(f"skipped by name: {name}: {skip_reason(name)}")


@pytest.fixture
def per_thread_stdout():
    real = sys.stdout
    sys.stdout = PerThreadStdout(real)
    try:
        yield
    finally:
        sys.stdout = real


@pytest.mark.parametrize("name", INPROC)
def test_docstring_examples_run_on_every_rank(name, per_thread_stdout):
    module, examples = EXAMPLES[name]
    errors = mc.spawn(_inproc_rank, WORLD, args=(name, module, examples), transport="inproc",
                      timeout=TIMEOUT)
    errors = [e for e in errors if e]
    assert not errors, f"{name}:\n" + "\n".join(errors)


def test_one_sided_examples_run_on_every_rank():
    todo = [(n, *EXAMPLES[n]) for n in ONE_SIDED_NAMES]
    assert todo
    results = mc.spawn(_one_sided_rank, WORLD, args=(todo,), transport="shm", timeout=TIMEOUT)
    failed = {n: e for per_rank in results for n, e in per_rank.items()}
    assert not failed, "\n".join(f"{n}:\n{e}" for n, e in sorted(failed.items()))
