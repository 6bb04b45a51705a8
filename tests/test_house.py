"""The house's size rules, measured with ast: no class over 450 code lines and no function over
90, in minicomm/ and transports/. A code line holds a token that is not a comment and is not
part of a docstring (docstrings are required on public names, so they do not count against a
body); blank lines do not count."""
import ast
import io
import pathlib
import tokenize

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("minicomm", "transports")
MAX_CLASS_LINES = 450
MAX_FUNCTION_LINES = 90
_NON_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENCODING, tokenize.ENDMARKER}


def _sources():
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def _docstring_lines(tree) -> set:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str) -> tuple:
    """(the set of line numbers that hold code, the parsed tree)."""
    tree = ast.parse(source)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NON_CODE:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - _docstring_lines(tree), tree


def oversized(source: str, where: str) -> list:
    """Every class or function of `source` over its limit, as 'where:line name: N code lines'."""
    lines, tree = code_lines(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = MAX_FUNCTION_LINES
        else:
            continue
        n = len([ln for ln in lines if node.lineno <= ln <= node.end_lineno])
        if n > limit:
            found.append(f"{where}:{node.lineno} {node.name}: {n} code lines (limit {limit})")
    return found


def test_measure_counts_code_not_docstrings_or_comments():
    body = "\n".join(f"    x{i} = {i}  # note" for i in range(91))
    src = f'def f():\n    """A docstring\n    of three\n    lines."""\n    # a comment\n\n{body}\n'
    assert len([ln for ln in code_lines(src)[0]]) == 92          # the def line and 91 statements
    assert oversized(src, "s.py") == ["s.py:1 f: 92 code lines (limit 90)"]
    short = 'def g():\n    """Doc."""\n' + "\n".join(f"    y{i} = {i}" for i in range(89)) + "\n"
    assert oversized(short, "s.py") == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_class_or_function_over_its_limit(package):
    found = []
    for path in _sources():
        if path.relative_to(REPO).parts[0] == package:
            found += oversized(path.read_text(), str(path.relative_to(REPO)))
    assert found == [], "split these:\n" + "\n".join(found)
