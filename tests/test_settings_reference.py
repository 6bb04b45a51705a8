"""The settings reference names every MINICOMM_* variable the code reads, and nothing else (issue 34).

The registry ``minicomm.settings.SETTINGS`` is what docs/reference/settings.md is generated from
(docs/hooks/reference.py). These tests scan the source of the library (minicomm/) and of the
transports (transports/) with ``ast``: a ``MINICOMM_*`` name in a string literal (a call's
argument, an ``os.environ`` lookup, an ``ENV = "MINICOMM_..."`` constant, a set of names) is a
read; a keyword (``env.update(MINICOMM_RANK=...)``) or a subscript store (``env["..."] = ``) is
a launcher setting it for the ranks. Docstrings, comments and messages (f-strings) are prose,
not reads. tests/ and examples/ are left out: the tests' own knobs (MINICOMM_REQUIRE_EXTRAS,
MINICOMM_CHAOS_SEED...) are not settings of the library, and the examples read only variables
the launchers set.
"""
import ast
import importlib.util
import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Set, Tuple

import pytest

from minicomm.settings import SETTINGS

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"MINICOMM_[A-Z0-9]+(?:_[A-Z0-9]+)*")
HOOK = REPO / "docs" / "hooks" / "reference.py"


class Uses(NamedTuple):
    reads: Dict[str, List[str]]     # variable -> places ("file:line") that read it
    sets: Dict[str, List[str]]      # variable -> places that set it for a child process


def _docstring_nodes(tree: ast.AST) -> Set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                out.add(id(body[0].value))
    return out


def scan_source(text: str, where: str, uses: Uses) -> Uses:
    """Add the MINICOMM_* reads and sets of one module's source to ``uses``."""
    tree = ast.parse(text)
    skip = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):          # a message, not a variable's name
            skip.update(id(v) for v in node.values)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "Setting"):        # the registry's own entries
            skip.update(id(a) for a in node.args[:1])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str) \
                    and NAME.fullmatch(key.value):
                uses.sets.setdefault(key.value, []).append(f"{where}:{node.lineno}")
                skip.add(id(key))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg and NAME.fullmatch(node.arg):
            uses.sets.setdefault(node.arg, []).append(f"{where}:{node.value.lineno}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in skip and NAME.fullmatch(node.value)):
            uses.reads.setdefault(node.value, []).append(f"{where}:{node.lineno}")
    return uses


def source_files() -> List[Path]:
    # minicomm/transports is a symlink to transports/: scanned once, under its own name
    files = [p for p in (REPO / "minicomm").rglob("*.py")
             if "transports" not in p.relative_to(REPO / "minicomm").parts[:1]]
    return sorted(files + list((REPO / "transports").rglob("*.py")))


def scan_repo() -> Uses:
    uses = Uses({}, {})
    for path in source_files():
        scan_source(path.read_text(), str(path.relative_to(REPO)), uses)
    return uses


USES = scan_repo()
REGISTRY = {s.name: s for s in SETTINGS}


def _places(places: List[str]) -> str:
    return ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")


# ---------------------------------------------------------------- the scanner itself
def test_scanner_tells_reads_from_sets_and_prose():
    src = '''"""MINICOMM_DOC in a docstring is prose."""
import os
ENV = "MINICOMM_CONST"
def f(env):
    """MINICOMM_FUNCDOC"""
    a = os.environ.get("MINICOMM_GET", "1")
    b = env["MINICOMM_INDEX"]
    env["MINICOMM_STORED"] = "1"
    os.environ.update(MINICOMM_KEYWORD="2")
    if k in ("MINICOMM_TUPLE",):
        raise ValueError(f"MINICOMM_FSTRING={a!r}")
    return Setting("MINICOMM_ENTRY", "d", "k", "text", "group")
'''
    uses = scan_source(src, "x.py", Uses({}, {}))
    assert set(uses.reads) == {"MINICOMM_CONST", "MINICOMM_GET", "MINICOMM_INDEX", "MINICOMM_TUPLE"}
    assert set(uses.sets) == {"MINICOMM_STORED", "MINICOMM_KEYWORD"}
    assert uses.reads["MINICOMM_GET"] == ["x.py:6"]


def test_scan_sees_the_library_and_the_transports():
    # one read the scan must find in each tree, known from reading the code: if these vanish the
    # scan has stopped looking, not the code stopped reading
    assert any(p.startswith("minicomm/settings.py") for p in USES.reads["MINICOMM_TIMEOUT"])
    assert any(p.startswith("transports/fault.py") for p in USES.reads["MINICOMM_FAULT"])
    assert any(p.startswith("minicomm/launch/local.py") for p in USES.sets["MINICOMM_RANK"])


# ---------------------------------------------------------------- the registry against the code
def test_every_variable_the_code_reads_is_in_the_registry():
    missing = {n: USES.reads.get(n, []) + USES.sets.get(n, [])
               for n in set(USES.reads) | set(USES.sets) if n not in REGISTRY}
    assert not missing, ("MINICOMM_* variables the code uses but minicomm.settings.SETTINGS does "
                         "not list (add a Setting for each): "
                         + "; ".join(f"{n} ({_places(p)})" for n, p in sorted(missing.items())))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registry_entry_is_used_by_the_code(name):
    s = REGISTRY[name]
    if s.set_by:
        assert name in USES.sets, (f"{name}: the registry says {s.set_by} sets it, but no code "
                                   f"under minicomm/ or transports/ does")
    else:
        assert name in USES.reads, (f"{name} is in minicomm.settings.SETTINGS but no code under "
                                    f"minicomm/ or transports/ reads it: remove the entry")


def test_registry_entries_are_complete():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names)), "a variable is listed twice"
    for s in SETTINGS:
        assert NAME.fullmatch(s.name), s
        for field in ("default", "kind", "description", "group"):
            value = getattr(s, field)
            assert value.strip() and "\n" not in value, f"{s.name}: {field} {value!r}"


# ---------------------------------------------------------------- the generated page
def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table_rows(markdown: str) -> List[Tuple[str, ...]]:
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            cells = tuple(c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1])
            rows.append(cells)
    return rows


def test_generated_table_lists_every_setting():
    rows = _table_rows(_hook().settings_markdown())
    body = [r for r in rows if r[0] != "Variable"]
    listed = {}
    for r in body:
        m = NAME.search(r[0])
        assert m, r
        listed[m.group(0)] = r
    assert sorted(listed) == sorted(REGISTRY), "the generated table and the registry differ"
    for name, (cell, values, default, meaning) in listed.items():
        s = REGISTRY[name]
        assert f'id="{name.lower()}"' in cell, cell          # linkable: settings.md#minicomm_...
        assert default == s.default.replace("|", "\\|"), name
        assert meaning.startswith(s.description.replace("|", "\\|")), name
    assert len(body) == len(REGISTRY)


def test_the_page_has_the_marker_the_hook_replaces():
    page = (REPO / "docs" / "reference" / "settings.md").read_text()
    assert _hook().SETTINGS_MARKER in page
