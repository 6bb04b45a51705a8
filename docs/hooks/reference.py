"""MkDocs hook: the generated reference pages.

``reference/settings.md`` holds the line ``<!-- generated: settings -->``, replaced at build time
by the tables of ``minicomm.settings.SETTINGS``; ``reference/cli.md`` holds
``<!-- generated: cli -->``, replaced by every command of ``minicomm.cli.build_parser()`` with
its options. A generated page without its marker fails the build (the reference would silently
be missing). The generators are plain functions, so tests call them too.
"""
from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path
from typing import Iterable, List

REPO = Path(__file__).resolve().parents[2]
SETTINGS_MARKER = "<!-- generated: settings -->"
CLI_MARKER = "<!-- generated: cli -->"
USAGE_WIDTH = 88          # the usage lines wrap here, whatever the terminal building the site


def _import_path() -> None:
    # the repository's own package, even where minicomm is not installed into the environment
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def _cell(text: str) -> str:
    """Text for one markdown table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def setting_anchor(name: str) -> str:
    """The anchor of a variable's row: ``settings.md#minicomm_timeout``."""
    return name.lower()


# ------------------------------------------------------------------------------------ settings
def settings_markdown(settings: Iterable = None) -> str:
    """One section per group, each a table of its variables (name, values, default, meaning)."""
    if settings is None:
        _import_path()
        from minicomm.settings import SETTINGS as settings
    groups: dict = {}
    for s in settings:
        groups.setdefault(s.group, []).append(s)
    out: List[str] = []
    for group, rows in groups.items():
        out += [f"## {group}", "", "| Variable | Values | Default | Meaning |",
                "| --- | --- | --- | --- |"]
        for s in rows:
            meaning = s.description
            if s.set_by:
                meaning += f" Set for every rank by {s.set_by}."
            out.append(f"| <span id=\"{setting_anchor(s.name)}\"></span>`{s.name}` "
                       f"| {_cell(s.kind)} | {_cell(s.default)} | {_cell(meaning)} |")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ cli
def _subparsers(parser: argparse.ArgumentParser):
    """(name, one-line help, subparser) of every subcommand of ``parser``, in order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name) or "", sub


def _option_name(action: argparse.Action, fmt: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        return action.metavar or action.dest
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    metavar = fmt._format_args(action, fmt._get_default_metavar_for_optional(action))
    return ", ".join(f"{o} {metavar}" for o in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0:           # a flag: its default is off (store_true) or on (store_false)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return "on" if action.default else "off"
        return ""
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def _arguments_table(parser: argparse.ArgumentParser) -> List[str]:
    fmt = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    rows = []
    for action in parser._actions:
        if action.help is argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                   argparse._SubParsersAction)):
            continue
        text = fmt._expand_help(action) if action.help else ""
        if action.choices is not None:
            text += (" " if text else "") + "Choices: " + ", ".join(map(str, action.choices)) + "."
        rows.append(f"| `{_cell(_option_name(action, fmt))}` | {_cell(text)} "
                    f"| {_cell(_default(action))} |")
    if not rows:
        return []
    return ["| Argument | Meaning | Default |", "| --- | --- | --- |"] + rows + [""]


def _usage(parser: argparse.ArgumentParser) -> str:
    fmt = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return fmt.format_help().strip()


def _command(parser: argparse.ArgumentParser, summary: str, level: int) -> List[str]:
    out = [f"{'#' * level} {html.escape(parser.prog)}", ""]
    if summary:
        out += [summary + ("" if summary.endswith(".") else "."), ""]
    out += ["```text", _usage(parser), "```", ""]
    if parser.description:
        out += ["```text", parser.description.strip("\n"), "```", ""]
    out += _arguments_table(parser)
    for name, help_text, sub in _subparsers(parser):
        out += _command(sub, help_text, level + 1)
    return out


def cli_markdown(parser: argparse.ArgumentParser = None) -> str:
    """Every command of ``parser`` (default: ``minicomm.cli.build_parser()``): its summary, usage,
    description and a table of its arguments with their help and defaults, subcommands nested."""
    if parser is None:
        _import_path()
        from minicomm.cli import build_parser
        parser = build_parser()
    # the page's own title and text stand for the top-level command: its usage, then each command
    out = ["```text", _usage(parser), "```", ""] + _arguments_table(parser)
    for name, help_text, sub in _subparsers(parser):
        out += _command(sub, help_text, 2)
    return "\n".join(out)


# ------------------------------------------------------------------------------------ the hook
GENERATED = {"reference/settings.md": (SETTINGS_MARKER, settings_markdown),
             "reference/cli.md": (CLI_MARKER, cli_markdown)}


def on_page_markdown(markdown: str, page, config, files) -> str:
    entry = GENERATED.get(page.file.src_uri)
    if entry is None:
        return markdown
    marker, generate = entry
    if marker not in markdown:
        from mkdocs.exceptions import PluginError
        raise PluginError(f"{page.file.src_uri}: the line {marker} is missing: the generated "
                          f"reference has nowhere to go")
    return markdown.replace(marker, generate())
