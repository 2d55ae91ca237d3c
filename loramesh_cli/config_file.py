"""``loramesh up --config FILE``: the command's flags from a TOML or YAML file.

Each key is a flag's long name, with dashes or underscores (``max-loras``, ``max_loras``,
``port``); a value is what the flag takes: a number or a string, true/false for a switch
(``detach = true``, ``prefix-cache = false``), a list for a flag of several values
(``lora-modules``, whose entries may also be tables in vLLM's JSON form). The file's values are
read by the command's own parser, so they are checked exactly as flags are, and they become its
defaults: a flag given on the command line wins over the file.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loramesh_cli.errors import CommandError


def read_config_file(path: str) -> dict[str, Any]:
    """The file's table: TOML for ``.toml``, YAML for ``.yaml``/``.yml`` (PyYAML, which
    huggingface_hub installs); a :class:`CommandError` naming the file otherwise."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        raise CommandError(f"--config {path}: {error.strerror or error}") from None
    try:
        if file.suffix == ".toml":
            table = tomllib.loads(text)
        elif file.suffix in (".yaml", ".yml"):
            import yaml

            table = yaml.safe_load(text) or {}
        else:
            raise CommandError(f"--config {path}: expected a .toml, .yaml or .yml file")
    except (tomllib.TOMLDecodeError, ValueError) as error:
        raise CommandError(f"--config {path}: {error}") from None
    except ImportError:
        raise CommandError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml)") from None
    if not isinstance(table, dict):
        raise CommandError(f"--config {path}: expected a table of flags, got {type(table).__name__}")
    return table


def config_tokens(
    parser: argparse.ArgumentParser, table: Mapping[str, Any], path: str
) -> tuple[list[str], set[str]]:
    """The table as the command-line tokens that set the same flags of ``parser``, and the
    destinations they set; a :class:`CommandError` naming the key that is no flag or whose
    value cannot be one."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    tokens: list[str] = []
    dests: set[str] = set()
    for key, value in table.items():
        option = "--" + str(key).replace("_", "-")
        action = actions.get(option)
        if action is None or option in ("--help", "--config"):
            raise CommandError(f"--config {path}: {key!r} is not a flag of `{parser.prog}`")
        if action.dest in dests:
            raise CommandError(f"--config {path}: {key!r} sets {option} again")
        dests.add(action.dest)
        tokens += _flag_tokens(option, action, value, f"--config {path}: {key!r}")
    return tokens, dests


def _flag_tokens(option: str, action: argparse.Action, value: Any, where: str) -> list[str]:
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise CommandError(f"{where} is a switch: true or false, got {value!r}")
        return [option] if value else []
    if isinstance(value, bool):
        if action.const != "on":  # only an on|off switch takes true/false
            raise CommandError(f"{where} takes a value, not {str(value).lower()}")
        return [option, "on" if value else "off"]
    if action.nargs == "+":
        values = value if isinstance(value, list) else [value]
        return [option, *(_text(item, where) for item in values)] if values else []
    if isinstance(value, (list, dict)):
        raise CommandError(f"{where} takes one value, got {value!r}")
    return [option, str(value)]


def _text(item: Any, where: str) -> str:
    """One value of a several-valued flag: a table (vLLM's JSON form of --lora-modules) as JSON."""
    if isinstance(item, dict):
        return json.dumps(item)
    if isinstance(item, (list, bool)):
        raise CommandError(f"{where}: each value is a string or a table, got {item!r}")
    return str(item)


def with_config_file(
    parser: argparse.ArgumentParser, command: argparse.ArgumentParser, argv: Sequence[str] | None, path: str
) -> argparse.Namespace:
    """``argv`` parsed again by ``parser`` with the file's flags as ``command``'s defaults: the
    file's values read by ``command`` itself (the same types and choices as on the command
    line), the command line's winning."""
    tokens, given = config_tokens(command, read_config_file(path), path)
    exit_on_error, command.exit_on_error = command.exit_on_error, False
    try:
        from_file, extra = command.parse_known_args(tokens, argparse.Namespace())
    except argparse.ArgumentError as error:
        raise CommandError(f"--config {path}: {error}") from None
    finally:
        command.exit_on_error = exit_on_error
    if extra:
        raise CommandError(f"--config {path}: cannot read {' '.join(extra)}")
    command.set_defaults(**{dest: getattr(from_file, dest) for dest in given})
    return parser.parse_args(argv)
