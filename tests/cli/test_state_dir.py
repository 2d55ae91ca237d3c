"""The state directory, one way everywhere: ``--state-dir``, else ``$LORAMESH_STATE_DIR`` (read
when the command runs, not at import), else ``.loramesh``. Every message about the mesh file names
the file read, and every printed hint carries the ``--state-dir`` the command was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loramesh.client import DEFAULT_STATE_DIR, STATE_DIR_ENV
from loramesh_cli.main import build_parser, main
from loramesh_cli.mesh_commands import print_summary
from loramesh_cli.mesh_file import MeshFile, ServiceEntry, command_line


def test_the_variable_is_read_when_the_command_runs(tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv(STATE_DIR_ENV, str(elsewhere))  # after loramesh_cli was imported
    assert build_parser().parse_args(["down"]).state_dir == str(elsewhere)
    assert main(["down"]) == 1
    assert f"no mesh is up: {elsewhere / 'mesh.json'} does not exist" in capsys.readouterr().err
    monkeypatch.delenv(STATE_DIR_ENV)
    assert build_parser().parse_args(["down"]).state_dir == str(DEFAULT_STATE_DIR)


def test_the_flag_wins_over_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "from-env"))
    args = build_parser().parse_args(["--state-dir", str(tmp_path / "from-flag"), "status"])
    assert args.state_dir == str(tmp_path / "from-flag")


def test_down_with_nothing_up_names_the_state_dirs_mesh_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--state-dir", "mesh2", "down"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"loramesh: no mesh is up: {tmp_path / 'mesh2' / 'mesh.json'} does not exist; nothing to stop\n"
    )


def test_hints_carry_the_state_dir_they_were_given():
    assert command_line(DEFAULT_STATE_DIR, "down") == "loramesh down"
    assert command_line(Path("/srv/mesh 2"), "down") == "loramesh --state-dir '/srv/mesh 2' down"


def test_up_says_how_to_stop_the_mesh_it_started(tmp_path, capsys):
    mesh = MeshFile(
        up_pid=os.getpid(), etcd_endpoint="127.0.0.1:2379", etcd_pid=0, admin_api_key="k",
        services={"gateway": ServiceEntry("127.0.0.1:1", "127.0.0.1:2", 1, "gateway.log", "127.0.0.1:3")},
    )  # fmt: skip
    print_summary(mesh, tmp_path)
    err = capsys.readouterr().err
    assert f"state in {tmp_path / 'mesh.json'}; stop with `loramesh --state-dir {tmp_path} down`" in err
    assert "OpenAI API http://127.0.0.1:3/v1" in err
    print_summary(mesh, DEFAULT_STATE_DIR)
    assert "stop with `loramesh down`" in capsys.readouterr().err


def test_a_second_up_names_the_running_mesh_and_how_to_stop_it(tmp_path, capsys):
    """A live `up` (this test's own pid stands for it) owns the state directory; nothing starts."""
    MeshFile(up_pid=os.getpid(), etcd_endpoint="", etcd_pid=0, admin_api_key="k").write(tmp_path)
    assert main(["--state-dir", str(tmp_path), "up", "--detach"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"loramesh: a mesh is already up (pid {os.getpid()}, {tmp_path / 'mesh.json'})")
    assert f"run `loramesh --state-dir {tmp_path} down` first" in err
    assert not (tmp_path / "logs").exists()


def test_a_mesh_file_of_a_gone_up_is_named_and_not_retried(tmp_path, capsys):
    MeshFile(up_pid=_gone_pid(), etcd_endpoint="127.0.0.1:1", etcd_pid=0, admin_api_key="k",
             gateway_addresses=["127.0.0.1:1"]).write(tmp_path)  # fmt: skip
    assert main(["--state-dir", str(tmp_path), "adapters", "list"]) == 1
    err = capsys.readouterr().err
    assert f"the `loramesh up` that wrote {tmp_path / 'mesh.json'}" in err and "is gone" in err
    assert "retrying" not in err


def test_a_mesh_file_that_is_not_one_is_named(tmp_path, capsys):
    (tmp_path / "mesh.json").write_text("{not json")
    assert main(["--state-dir", str(tmp_path), "status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"loramesh: {tmp_path / 'mesh.json'} is not a mesh file of `loramesh up`: ")
    assert len(err.splitlines()) == 1


def _gone_pid() -> int:
    """The pid of a process that ran and was reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
