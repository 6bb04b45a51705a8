"""Every Python code block of README.md and docs/**/*.md runs, each in a fresh `python -`; one
that cannot run alone follows `<!-- fragment: <why> -->` and is skipped by name. Ids: the file
(relative to docs/ for pages) and the line of the block's opening fence."""
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PY_LANGS = {"python", "py", "pycon"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`{]*)")
MARKER = re.compile(r"^\s*<!--\s*fragment\b:?(.*?)-->\s*$")
TIMEOUT_S = 120


def doc_files():
    # collected at import time: pages other work adds later are picked up by the next run
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def label(path):
    return str(path.relative_to(REPO / "docs" if REPO / "docs" in path.parents else REPO))


class Block(NamedTuple):
    name: str
    line: int               # of the opening fence
    lang: str
    code: str | None        # None: the fence is never closed
    why: str | None         # the fragment marker's reason; None: not a fragment

    def __repr__(self):     # pytest prints a failure's arguments: the place, not the code
        return f"{self.name}:{self.line}"


def blocks(path):
    """Every fenced block; its code keeps the file's line numbers (blank lines stand for
    everything above it), so a traceback's `<stdin>` line is the file's line."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        marker = MARKER.match(next((ln for ln in reversed(lines[:i]) if ln.strip()), ""))
        closing = re.compile(rf"\s*{fence[0]}{{{len(fence)},}}\s*")
        end = next((j for j in range(i + 1, len(lines)) if closing.fullmatch(lines[j])), None)
        body = [ln[indent:] if not ln[:indent].strip() else ln.lstrip() for ln in lines[i + 1:end]]
        code = None if end is None else "\n" * (i + 1) + "\n".join(body) + "\n"
        out.append(Block(label(path), i + 1, lang, code, marker and marker.group(1).strip()))
        i = len(lines) if end is None else end + 1
    return out


ALL = [b for p in doc_files() for b in blocks(p) if b.lang in PY_LANGS]


def doctest_program(code, name):
    # interactive blocks show their output, so it is compared (doctest): a stale output is a failure
    return ("import doctest, sys\n"
            f"t = doctest.DocTestParser().get_doctest({code!r}, {{}}, {name!r}, {name!r}, 0)\n"
            "sys.exit(1 if doctest.DocTestRunner().run(t, out=sys.stderr.write).failed else 0)\n")


def run_block(source, cwd):
    """(returncode or None on timeout, stderr); the block's whole process group is gone after."""
    proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=dict(os.environ),
                            start_new_session=True)
    try:
        _, err = proc.communicate(source, timeout=TIMEOUT_S)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err
    finally:                # whatever the block started and left in its session goes too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)       # SIGKILLed: bounded anyway


@pytest.mark.parametrize("block", ALL, ids=repr)
def test_block_runs(block, tmp_path):
    name, line, lang, code, why = block
    assert code is not None, f"{name}:{line}: the code fence is never closed"
    if why is not None:
        assert why, f"{name}:{line}: a fragment marker must say why the block cannot run"
        pytest.skip(f"fragment ({name}:{line}): {why}")
    interactive = lang == "pycon" or code.lstrip().startswith(">>>")
    source = doctest_program(code, name) if interactive else code
    rc, err = run_block(source, tmp_path)
    tail = "\n".join(err.splitlines()[-30:])
    assert rc is not None, f"{name}:{line} still ran after {TIMEOUT_S} s; stderr:\n{tail}"
    assert rc == 0, f"{name}:{line} exited {rc} (<stdin> lines are the file's lines):\n{tail}"


def test_collection_is_complete():
    assert any(b.name == "README.md" for b in ALL), "no Python block found in README.md"
    for path in doc_files():
        text = path.read_text().splitlines()
        # an independent count of opening python fences: none escapes the parser above
        opened = [n + 1 for n, ln in enumerate(text)
                  if re.match(r"\s*(```|~~~)\s*(python|py|pycon)\b", ln, re.I)]
        found = blocks(path)     # read again: the pages may have changed since collection
        assert opened == [b.line for b in found if b.lang in PY_LANGS], label(path)
        # a marker before anything but a python block would mark nothing
        langs = {b.line: b.lang for b in found}
        for n in (n for n, ln in enumerate(text) if MARKER.match(ln)):
            nxt = next((k for k in range(n + 1, len(text)) if text[k].strip()), -1)
            assert langs.get(nxt + 1) in PY_LANGS, f"{label(path)}:{n + 1}: marker before no block"
