"""docs/cli.md, the CLI reference, is the parser's, flag for flag.

The "Reference" part of docs/cli.md has one ``### `loramesh <command>` `` section per command of
the real argparse parser (``loramesh_cli.main.build_parser``: the global flags under ``loramesh``,
nested commands such as ``loramesh adapters upload`` in sections of their own; a command hidden
from its parent's help, such as ``loramesh bench`` beside ``loramesh dev bench``, has none), each
with a
``| flag | default | meaning |`` table. The first cell of a row names an option as it is typed
(`` `--workers N` ``) and a positional argument by its dest (`` `prompt` ``). A flag added to the
parser without a row, or a row whose flag is gone, fails here, naming the command and the flag.
A row's default must agree with the parser's where the parser has a plain one (a number or a
word), every flag of ``up`` says its default in ``--help``, and the environment variables the CLI
reads are documented.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from loramesh.client import STATE_DIR_ENV
from loramesh_cli.config_flags import default_words
from loramesh_cli.gateway_client import API_KEY_ENV
from loramesh_cli.main import build_parser
from loramesh_cli.up_arguments import SERVICE_SETTINGS

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
CLI_PART = "## Reference"
SECTION = re.compile(r"^### `(loramesh(?: [a-z][a-z0-9-]*)*)`\s*$")
TABLE_HEADER = ["flag", "default", "meaning"]


def parser_commands(
    parser: argparse.ArgumentParser, path: str = "loramesh"
) -> dict[str, argparse.ArgumentParser]:
    """Every command of the parser its help lists, by its full name (``loramesh``,
    ``loramesh adapters upload``)."""
    commands = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            # A command without a help line has no row in its parent's help; when its siblings
            # have theirs, it is one left out on purpose (main.hide_commands).
            listed = {choice.dest for choice in action._choices_actions} or set(action.choices)
            for name, subparser in action.choices.items():
                if name in listed:
                    commands.update(parser_commands(subparser, f"{path} {name}"))
    return commands


def documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments of one command the doc lists (see :func:`parser_arguments`)."""
    return [
        action
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and action.help != argparse.SUPPRESS
    ]


def plain_default(action: argparse.Action) -> str | None:
    """The parser's default as a doc row writes it, when it is a number or a word (``512``,
    ``0.5``, ``auto``); None for a switch, none, an empty string or a list, which rows describe
    in words."""
    default = action.default
    if isinstance(default, bool) or default in (None, "", argparse.SUPPRESS) or isinstance(default, list):
        return None
    return f"{default:g}" if isinstance(default, float) else str(default)


def parser_arguments(parser: argparse.ArgumentParser) -> set[str]:
    """What the doc must list for one command: its option strings and its positionals' dests;
    ``--help``, the choice of a subcommand (those have sections of their own) and hidden arguments
    (``help=argparse.SUPPRESS``: not in ``--help`` either, e.g. a removed flag kept to say what
    replaced it) excepted."""
    names: set[str] = set()
    for action in documented_actions(parser):
        names.update(action.option_strings or [action.dest])
    return names


def row_cells(line: str) -> list[str]:
    """A table row's cells; ``\\|`` is a pipe inside a cell, as Markdown escapes it."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().removeprefix("|").removesuffix("|"))]


def row_arguments(first_cell: str) -> set[str]:
    """The option strings a row documents (`` `-o, --out DIR` ``), or the positional it names."""
    span = re.search(r"`([^`]+)`", first_cell)
    if span is None:
        raise AssertionError(f"a row's first cell names no argument in backticks: {first_cell!r}")
    tokens = [t for t in re.split(r"[\s,/]+", span.group(1)) if t]
    flags = {t for t in tokens if t.startswith("-")}
    return flags or {tokens[0]}


def doc_sections(text: str) -> dict[str, list[list[str]]]:
    """The CLI part's sections: command name → its table's rows (header and rule left out)."""
    lines = text.splitlines()
    if CLI_PART not in lines:
        raise AssertionError(f"{API_DOC.name} has no {CLI_PART!r} heading")
    sections: dict[str, list[list[str]]] = {}
    current: str | None = None
    for line in lines[lines.index(CLI_PART) + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("### "):
            match = SECTION.match(line)
            assert match, f"{API_DOC.name}: CLI heading {line!r} is not ### `loramesh <command>`"
            current = match.group(1)
            assert current not in sections, f"{API_DOC.name}: two sections for `{current}`"
            sections[current] = []
        elif current is not None and line.startswith("|"):
            cells = row_cells(line)
            if cells == TABLE_HEADER or all(set(c) <= set("-: ") for c in cells):
                continue
            sections[current].append(cells)
    return sections


COMMANDS = parser_commands(build_parser())
SECTIONS = doc_sections(API_DOC.read_text(encoding="utf-8"))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_doc_table_lists_exactly_the_parsers_flags(command):
    assert command in SECTIONS, f"{API_DOC.name} has no section ### `{command}`"
    rows = SECTIONS[command]
    documented: set[str] = set()
    for cells in rows:
        assert len(cells) == len(TABLE_HEADER), (
            f"`{command}`: row {cells} is not | flag | default | meaning |"
        )
        assert cells[2], f"`{command}`: row {cells[0]} has no meaning"
        documented |= row_arguments(cells[0])
    expected = parser_arguments(COMMANDS[command])
    missing = sorted(expected - documented)
    extra = sorted(documented - expected)
    problems = []
    if missing:
        problems.append(f"missing (in the parser, not in the table): {', '.join(missing)}")
    if extra:
        problems.append(f"extra (in the table, not in the parser): {', '.join(extra)}")
    assert not problems, f"{API_DOC.name}, section `{command}`: " + "; ".join(problems)


def forwarded_default(action: argparse.Action) -> str | None:
    """For a service setting `loramesh up` passes on (its parser default None: the service
    decides), the default its help states, when that is a plain value (``fcfs``, ``6.0``)."""
    owners = [group for group in SERVICE_SETTINGS if action.dest in group.names]
    if not owners or action.default is not None:
        return None
    words = default_words(action.dest, owners)
    return None if " " in words or not words else words


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_doc_defaults_agree_with_the_parser(command, monkeypatch):
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)  # --state-dir's default is read from it
    parser = parser_commands(build_parser())[command]
    rows = {name: cells for cells in SECTIONS[command] for name in row_arguments(cells[0])}
    wrong = []
    for action in documented_actions(parser):
        value = plain_default(action)
        if value is None and command == "loramesh up":
            value = forwarded_default(action)
        if value is None:
            continue
        if re.fullmatch(r"-?\d+\.\d+", value):
            value = f"{float(value):g}"  # the doc writes 6, not 6.0
        name = (action.option_strings or [action.dest])[0]
        cell = rows[name][1]
        # The value as a whole word: `1` is not found in `1024`, nor `0.5` in `0.55`.
        if not re.search(rf"(?<![\w.-]){re.escape(value)}(?![\w-]|\.\d)", cell):
            wrong.append(f"{name}: parser {value!r}, doc {cell!r}")
    assert not wrong, f"{API_DOC.name}, section `{command}`, defaults differ: " + "; ".join(wrong)


def test_every_up_flag_states_its_default_in_help():
    up = COMMANDS["loramesh up"]
    silent = [a.option_strings[0] for a in documented_actions(up) if "default" not in (a.help or "")]
    assert not silent, f"`loramesh up --help` gives no default for {', '.join(silent)}"


def test_loramesh_help_names_both_ways_up_runs():
    """`up` runs in the foreground or, with --detach, in the background: its one line in
    `loramesh --help` may not call it a foreground command only."""
    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (up_help,) = [c.help for c in subcommands._choices_actions if c.dest == "up"]
    assert "--detach" in up_help and "background" in up_help, up_help


@pytest.mark.parametrize("variable", [STATE_DIR_ENV, API_KEY_ENV])
def test_the_cli_environment_variables_are_documented(variable):
    text = API_DOC.read_text(encoding="utf-8")
    assert f"| `{variable}` |" in text, f"{API_DOC.name} has no row for ${variable}"


def test_doc_has_no_section_for_a_command_the_parser_lacks():
    unknown = sorted(set(SECTIONS) - set(COMMANDS))
    assert not unknown, f"{API_DOC.name} documents commands the parser does not have: {unknown}"


def test_reading_the_tables():
    """The parsing rules above on a small table, so a wrong rule cannot pass vacuously."""
    text = """\
## Reference
### `loramesh x y`
| flag | default | meaning |
|---|---|---|
| `-o, --out DIR` | `a\\|b` | where |
| `name` | — | positional |
## Next
| `--not-cli` | | |
"""
    sections = doc_sections(text)
    assert list(sections) == ["loramesh x y"]
    assert [row_arguments(cells[0]) for cells in sections["loramesh x y"]] == [{"-o", "--out"}, {"name"}]
    assert sections["loramesh x y"][0][1:] == ["`a\\|b`", "where"]
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("-o", "--out")
    parser.add_argument("name")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_subparsers(dest="verb").add_parser("y").add_argument("--flag", action="store_true")
    assert parser_arguments(parser) == {"-o", "--out", "name"}
    assert parser_arguments(parser_commands(parser, "x")["x y"]) == {"--flag"}
