"""One refusal style for every command: with no mesh up, each command of the parser (found by
walking it, so a new command is covered the day it is added) exits 1 with one line on stderr,
``loramesh: <reason>``, and no traceback; a reason about the mesh names the mesh.json it read, and
a hint names a flag or variable of the CLI, not an argument of the SDK. No command waits in
retries for a mesh that is not there: a retry would print a second line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import loramesh

from loramesh.client import STATE_DIR_ENV
from loramesh_cli import generate_commands
from loramesh_cli.main import build_parser, main
from tests.cli.test_cli_reference_doc import parser_commands

STARTS_WORK = {
    "loramesh up": "starts a mesh; its refusals before starting: test_up_settings.py",
    "loramesh dev bench": "runs a benchmark, which needs no mesh",
    "loramesh dev bench-distkv": "runs a benchmark, which needs no mesh",
    "loramesh dev bench-policies": "runs a benchmark, which needs no mesh",
    "loramesh demo": "trains the demo adapters and starts a mesh of its own",
    "loramesh certs": "writes certificates, which needs no mesh",
}
"""Commands that do work of their own rather than act on a running mesh, left out here."""

SDK_HINTS = ("address=", "api_key=")
"""How the SDK names what is missing; a CLI user has flags instead."""


def leaf_commands() -> dict[str, argparse.ArgumentParser]:
    """Every command that runs something (``loramesh adapters list``, not ``loramesh adapters``)."""
    commands = parser_commands(build_parser())
    return {
        name: parser
        for name, parser in commands.items()
        if not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    }


def dummy_argv(command: str, parser: argparse.ArgumentParser) -> list[str]:
    """The command's words and a dummy value for each required argument."""
    argv = command.split()[1:]
    for action in parser._actions:
        if not action.required:
            continue
        value = "1" if action.type in (int, float) else "x"
        argv += [action.option_strings[0], value] if action.option_strings else [value]
    return argv


def stale_mesh_file(state_dir: Path) -> None:
    """A mesh.json left by an `up` that is gone (killed -9, say): its pid is of a reaped child."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "mesh.json").write_text(
        json.dumps({
            "up_pid": gone.pid, "etcd_endpoint": "127.0.0.1:1", "etcd_pid": 0, "admin_api_key": "lm-k",
            "gateway_addresses": ["127.0.0.1:1"],
            "services": {"gateway": {"address": "127.0.0.1:1", "http_address": "", "pid": 0, "log": ""}},
        })
    )  # fmt: skip


def test_the_walk_finds_every_command_and_the_left_out_ones_exist():
    commands = leaf_commands()
    assert {"loramesh generate", "loramesh chat", "loramesh adapters list", "loramesh down"} <= set(commands)
    assert set(STARTS_WORK) <= set(commands), "a command left out here no longer exists"


@pytest.mark.parametrize("state", ["no mesh.json", "mesh.json of a gone up"])
@pytest.mark.parametrize("command", sorted(set(leaf_commands()) - set(STARTS_WORK)))
def test_every_command_without_a_mesh_refuses_in_one_line(command, state, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    monkeypatch.delenv("LORAMESH_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # a dummy path argument names nothing that exists
    state_dir = tmp_path / "state"
    if state == "mesh.json of a gone up":
        stale_mesh_file(state_dir)
    argv = dummy_argv(command, leaf_commands()[command])

    status = main(["--state-dir", str(state_dir), *argv])

    err = capsys.readouterr().err
    assert status == 1, f"`{command}` exited {status}: {err}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("loramesh: "), f"`{command}` said:\n{err}"
    assert not any(hint in err for hint in SDK_HINTS), err
    if "no mesh is up" in err:
        assert str(state_dir / "mesh.json") in err, err


def test_generate_without_a_mesh_has_no_traceback(tmp_path):
    """The issue's reproduction, as a user runs it: a traceback ending in the SDK's ValueError."""
    done = loramesh(tmp_path / "state", "generate", "hi", check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("loramesh: no mesh is up: ") and "--gateway" in done.stderr
    assert not done.stdout


def test_no_api_key_names_the_flag_and_the_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LORAMESH_API_KEY", raising=False)
    assert main(["--state-dir", str(tmp_path), "generate", "--gateway", "127.0.0.1:1", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loramesh: no API key for the gateway at 127.0.0.1:1: ")
    assert "--api-key" in err and "$LORAMESH_API_KEY" in err and "api_key=" not in err


def test_a_file_the_command_cannot_write_is_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert main(["certs", "--out", str(tmp_path / "a-file" / "certs")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loramesh: ") and str(tmp_path / "a-file") in err and len(err.splitlines()) == 1, (
        err
    )


def test_ctrl_c_ends_a_command_without_a_traceback(monkeypatch, capsys):
    def interrupted(args) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_commands, "cmd_chat", interrupted)
    assert main(["chat"]) == 130  # the shell's status for SIGINT
    assert capsys.readouterr().err == ""
