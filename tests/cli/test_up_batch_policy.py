"""`loramesh up --batch-policy NAME` reaches every gpu_worker's command line (the one the
supervisor starts); without it the workers keep their own default."""

from __future__ import annotations

import pytest

from loramesh_cli.main import build_parser
from loramesh_cli.mesh_layout import service_processes


def worker_commands(tmp_path, *flags: str) -> list[list[str]]:
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--workers", "2", *flags])
    processes, _ = service_processes(args, tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "keys.json", None)
    return [p.command() for name, p in processes.items() if name.startswith("gpu_worker")]


def flag_value(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_the_batch_policy_is_passed_to_every_worker(tmp_path):
    commands = worker_commands(tmp_path, "--batch-policy", "dlora")
    assert len(commands) == 2
    assert all(flag_value(c, "--batch-policy") == "dlora" for c in commands)


def test_without_the_flag_the_workers_keep_their_default(tmp_path):
    assert all("--batch-policy" not in c for c in worker_commands(tmp_path))


def test_an_unknown_batch_policy_is_refused_by_up(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--batch-policy", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_the_preemption_policy_is_passed_to_every_worker(tmp_path):
    commands = worker_commands(tmp_path, "--preemption-policy", "fewest_computed")
    assert all(flag_value(c, "--preemption-policy") == "fewest_computed" for c in commands)
    assert all("--preemption-policy" not in c for c in worker_commands(tmp_path))
