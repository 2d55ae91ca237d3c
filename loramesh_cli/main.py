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
    etcd_rbac_commands,
    generate_commands,
    mesh_commands,
)
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
    bench_commands.add_parsers(sub)
    chaos_commands.add_parsers(sub)
    cert_commands.add_parsers(sub)
    etcd_rbac_commands.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
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
