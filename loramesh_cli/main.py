"""The ``loramesh`` command. Each subcommand lives in its own module; this one only dispatches,
and turns every refusal into one line on stderr, ``loramesh: <reason>``, and exit status 1."""

from __future__ import annotations

import argparse
import sys

import grpc

from loramesh.client import STATE_DIR_ENV, default_state_dir
from loramesh.errors import LoraMeshError
from loramesh_cli import (
    adapter_commands,
    bench_commands,
    cert_commands,
    chaos_commands,
    demo,
    etcd_rbac_commands,
    generate_commands,
    mesh_commands,
)
from loramesh_cli.config_file import with_config_file
from loramesh_cli.errors import CommandError
from loramesh_cli.tls_options import add_tls_flags
from mesh_api.version import VERSION


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: argparse would read a subcommand's `--tls` as an ambiguous prefix of these
    # global `--tls-*` flags.
    parser = argparse.ArgumentParser(
        prog="loramesh", description="Serve many LoRA adapters of one base LLM.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"loramesh {VERSION}")
    # The default is read when the parser is built (each run), never at import.
    parser.add_argument("--state-dir", default=str(default_state_dir()), metavar="DIR",
                        help="local mesh state: mesh.json, logs, data, certificates "
                             f"(default: ${STATE_DIR_ENV}, else .loramesh)")  # fmt: skip
    add_tls_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    mesh_commands.add_parsers(sub)
    adapter_commands.add_parsers(sub)
    generate_commands.add_parsers(sub)
    demo.add_parsers(sub)
    cert_commands.add_parsers(sub)
    etcd_rbac_commands.add_parsers(sub)
    dev = sub.add_parser(
        "dev", help="development commands: the benchmarks and the chaos run (need a checkout)"
    )
    dev_commands = dev.add_subparsers(dest="dev_command", required=True)
    for commands in (sub, dev_commands):
        bench_commands.add_parsers(commands)
        chaos_commands.add_parsers(commands)
    # `loramesh bench` and `loramesh chaos` still run (make bench, scripts), out of the top-level
    # help: the user's commands are listed, the development ones under `dev`.
    hide_commands(sub, set(dev_commands.choices))
    return parser


def hide_commands(sub: argparse._SubParsersAction, names: set[str]) -> None:
    """Leaves ``names`` out of the help of ``sub``'s parser; they still parse and run."""
    sub._choices_actions = [action for action in sub._choices_actions if action.dest not in names]
    sub.metavar = "{" + ",".join(name for name in sub.choices if name not in names) + "}"


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of the top-level command ``name``."""
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", ""):  # `up --config FILE`: the file's flags under the command line's
            args = with_config_file(parser, subcommand(parser, args.command), argv, args.config)
        return args.func(args)
    except CommandError as error:
        print(f"loramesh: {error}", file=sys.stderr)
        return 1
    except grpc.RpcError as error:
        print(f"loramesh: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except LoraMeshError as error:
        print(f"loramesh: {error.code}: {error.details}", file=sys.stderr)
        return 1
    except OSError as error:  # a file or port the command needs, named by the error
        print(f"loramesh: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # Ctrl-C: the shell's status for SIGINT, no traceback


if __name__ == "__main__":
    sys.exit(main())
