"""The documentation site builds with ``mkdocs build --strict``, and the README's links resolve.

--strict fails on every warning mkdocs.yml's ``validation`` turns on: a broken link or anchor
between pages, a page left out of the navigation, a griffe warning from the API reference. The
built pages are then checked for what a warning would not catch: every public name of the four
API modules has its entry, and the generated CLI and settings references list every command,
option and variable. The README is checked on its own (it is not a page of the site): every
relative link names a file of the repository, and every #anchor a heading of its target.
"""
import argparse
import ast
import html
import importlib
import inspect
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from extras import module_missing, require

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 600


def _docs_missing():
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            missing = module_missing(module, "docs")
        except ModuleNotFoundError:          # the parent package of a dotted name is absent
            missing = f"{module} is not installed (pip install -e '.[docs]')"
        if missing:
            return missing
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for this module's tests: (its directory, mkdocs's output)."""
    require(_docs_missing())
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")   # Material's banner is not a warning of ours
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
                           "-f", str(REPO / "mkdocs.yml"), "-d", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(
        ln for ln in log.splitlines() if not ln.startswith("INFO"))[-8000:]
    return out, log


def _ids(page: Path) -> set:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text()))


def test_site_builds_strict(site):
    out, log = site
    assert (out / "index.html").is_file()
    warnings = [ln for ln in log.splitlines() if ln.startswith("WARNING")]
    assert not warnings, warnings


# ---------------------------------------------------------------- the API reference
API_PAGES = {"minicomm": "minicomm", "minicomm.ps": "ps", "minicomm.torch": "torch",
             "minicomm.schedule": "schedule"}


def public_names(module):
    """``__all__``; for a module without one (minicomm.schedule), the public names it defines at
    its top level (classes, functions, constants; not what it imports)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    defined = set()
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            defined.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    defined.add(n.id)
    return sorted(n for n in defined if not n.startswith("_"))


@pytest.mark.parametrize("modname", sorted(API_PAGES))
def test_api_reference_has_every_public_name(site, modname):
    if modname == "minicomm.torch":
        require(module_missing("torch", "dev"))
    out, _ = site
    ids = _ids(out / "reference" / "api" / API_PAGES[modname] / "index.html")
    module = importlib.import_module(modname)
    names = public_names(module)
    assert names, modname
    missing = [n for n in names if f"{modname}.{n}" not in ids]
    assert not missing, f"docs/reference/api/{API_PAGES[modname]}.md lacks {missing}"


def test_api_reference_has_every_communicator_and_window_method(site):
    import minicomm as mc
    from minicomm.window import Window
    out, _ = site
    ids = _ids(out / "reference" / "api" / "minicomm" / "index.html")
    for cls, qual in ((mc.Communicator, "minicomm.Communicator"),
                      (mc.Work, "minicomm.Work"), (Window, "minicomm.window.Window")):
        methods = [n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))]
        assert methods, qual
        missing = [n for n in methods if f"{qual}.{n}" not in ids]
        assert not missing, f"{qual}: no entry for {missing} (inherited members included?)"


def test_api_reference_shows_signatures_and_parameters(site):
    out, _ = site
    page = (out / "reference" / "api" / "minicomm" / "index.html").read_text()
    start = page.index('id="minicomm.Communicator.allreduce"')
    entry = page[start:start + 20000]
    assert "doc-signature" in entry            # separate_signature: the signature block
    assert 'doc-section-title">Parameters:' in entry     # the Args: section as a table
    assert "<code>async_op</code>" in entry


# ---------------------------------------------------------------- the generated references
def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _words(text: str) -> str:
    # markup the page adds or drops (code spans, escaped pipes) aside: the words, in order
    return " ".join(re.findall(r"[A-Za-z0-9]+", text))


def test_cli_reference_lists_every_command_and_option(site):
    from minicomm.cli import build_parser
    out, _ = site
    text = _text(out / "reference" / "cli" / "index.html")
    ids = _ids(out / "reference" / "cli" / "index.html")

    def walk(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield sub
                    yield from walk(sub)
    subs = list(walk(build_parser()))
    assert {p.prog for p in subs} >= {"minicomm run", "minicomm sim", "minicomm bench"}
    for sub in subs:
        assert sub.prog.replace(" ", "-") in ids, f"no section for {sub.prog}"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.help is argparse.SUPPRESS:
                continue
            for option in action.option_strings or [action.metavar or action.dest]:
                assert option in text, f"{sub.prog}: {option} is not on the CLI page"
            if action.help:
                help_text = argparse.HelpFormatter(sub.prog)._expand_help(action)
                assert _words(help_text)[:60] in _words(text), (sub.prog, action.help)


def test_settings_reference_lists_every_variable(site):
    from minicomm.settings import SETTINGS
    out, _ = site
    page = out / "reference" / "settings" / "index.html"
    ids, text = _ids(page), _text(page)
    for s in SETTINGS:
        assert s.name.lower() in ids and s.name in text, s.name


# ---------------------------------------------------------------- the README's links
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
FENCED = re.compile(r"^(\s*)(`{3,}|~{3,}).*?^\1\2\s*$", re.M | re.S)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _prose(markdown: str) -> str:
    """The markdown without its code: fenced blocks, then inline code spans."""
    text = FENCED.sub("", markdown)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation other
    than - and _ dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)       # links: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's toc slug (what the docs site's anchors are)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> set:
    """Every anchor a markdown file offers: its headings' slugs (both conventions, numbered as
    GitHub numbers repeats) and explicit ids (``{#id}``, ``<a id=...>``, ``<a name=...>``)."""
    out, seen = set(), {}
    for _, title in HEADING.findall(FENCED.sub("", markdown)):
        explicit = re.search(r"\{\s*#([\w-]+)[^}]*\}\s*$", title)
        if explicit:
            out.add(explicit.group(1))
            title = title[:explicit.start()]
        for slug in {github_slug(title), mkdocs_slug(title)}:
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(re.findall(r"<(?:a|span|div)\s[^>]*(?:id|name)=\"([^\"]+)\"", markdown))
    return out


def links(markdown: str) -> list:
    text = _prose(markdown)
    return LINK.findall(text) + REFDEF.findall(text)


def broken_links(path: Path) -> list:
    """(link, why) for every relative link of ``path`` that does not resolve."""
    out = []
    for target in links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue                                # http(s), mailto: another site's business
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append((target, f"{dest.relative_to(REPO) if REPO in dest.parents else dest} "
                                f"does not exist"))
            continue
        if REPO not in dest.parents and dest != REPO:
            out.append((target, "points outside the repository"))
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            out.append((target, f"no heading of {dest.relative_to(REPO)} has the anchor "
                                f"#{anchor}"))
    return out


def test_link_checker_finds_what_is_broken(tmp_path, monkeypatch):
    # the checker against a README whose good and bad links are known
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# A page\n\n## Launching: `mc.spawn` & run\n\n## Twice\n\n## Twice\n\n```sh\n# not a heading\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\n## Quick start\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#launching-mcspawn--run) [ok](#quick-start)\n"
        "[ok](docs/page.md#twice-1) [web](https://example.org/x.md#nope) ![img](docs/page.md)\n"
        "[bad](docs/missing.md) [bad](docs/page.md#not-there) [bad](#nowhere)\n"
        "[bad](docs/page.md#not-a-heading)\n"
        "`[code](docs/ignored.md)`\n\n```md\n[code](docs/also-ignored.md)\n```\n"
        "[ref]: docs/gone.md\n")
    assert sorted(t for t, _ in broken_links(readme)) == sorted(
        ["docs/missing.md", "docs/page.md#not-there", "#nowhere", "docs/page.md#not-a-heading",
         "docs/gone.md"])


def test_readme_links_resolve():
    readme = REPO / "README.md"
    assert links(readme.read_text()), "the README links nothing: the parser is broken"
    broken = broken_links(readme)
    assert not broken, "README.md: " + "; ".join(f"{t}: {why}" for t, why in broken)
