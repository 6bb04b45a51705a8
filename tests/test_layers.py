"""The architecture as checked facts: the import-linter contract (pyproject.toml) holds, no two
modules import each other even indirectly (top-level and function-level imports alike), and the
constants the pure cost model mirrors from the transports are the transports' own."""
import ast
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    """The console script of the test interpreter's environment (CI installs the dev extra)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else shutil.which(name)


def test_import_linter_contract_is_kept():
    exe = _tool("lint-imports")
    assert exe, "lint-imports is not installed: pip install -e '.[dev]'"
    res = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_ruff_is_clean():
    exe = _tool("ruff")
    assert exe, "ruff is not installed: pip install -e '.[dev]'"
    res = subprocess.run([exe, "check", "."], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------------------- import cycles
def package_modules():
    """{module name: file} for minicomm, with minicomm.transports read from transports/ (its
    real home; minicomm/transports is only a symlink to it)."""
    roots = [("minicomm", os.path.join(REPO, "minicomm")),
             ("minicomm.transports", os.path.join(REPO, "transports"))]
    mods = {}
    for prefix, top in roots:
        for dirpath, dirnames, files in os.walk(top):         # does not follow the symlink
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, top)
            pkg = prefix if rel == "." else prefix + "." + rel.replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    name = pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"
                    mods[name] = os.path.join(dirpath, f)
    return mods


def import_graph(mods):
    """Module -> the package modules it imports anywhere in its file (module level, functions,
    ``if`` blocks). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
    else to ``pkg``. A module importing itself (``python -m`` entry points) is not an edge."""
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = mod.split(".")
                    base = parts if is_pkg else parts[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src
                           for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:       # import a.b.c of a module a.b
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    mods = package_modules()
    assert {"minicomm.cost", "minicomm.launch.world", "minicomm.transports.shm"} <= set(mods)
    graph = import_graph(mods)
    assert "minicomm.communicator" in graph["minicomm.launch.world"]   # the finder sees edges
    assert "minicomm.launch" in graph["minicomm.tuning.table"]        # inside functions too
    found = cycles(graph)
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_nothing_imports_the_package_root():
    """``import minicomm`` inside the package would import everything above the importer."""
    graph = import_graph(package_modules())
    assert [m for m, deps in graph.items() if "minicomm" in deps] == []


# ---------------------------------------------------------------------------- mirrored constants
def test_cost_model_mirrors_the_transports():
    from minicomm import cost
    from minicomm.transports import progress, shm
    assert cost.SPIN_S == progress.SPIN_S
    assert cost.PIPELINE_CHUNK["shm"] == shm.CHUNK
    assert cost.LinkModel.for_transports("shm", "tcp").spin == progress.SPIN_S
    from minicomm.transports import cma
    assert cost.RING_BYTES["shm"] == shm.layout._default_ring_bytes(1)
    assert cost.SINGLE_COPY_MIN["shm"] == cma.DEFAULT_MIN
    assert cost.SMALL_BYTES["shm"] == shm.CHUNK    # what a transport's _setup sets small_bytes to
