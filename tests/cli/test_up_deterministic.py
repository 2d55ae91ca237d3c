"""`loramesh up --deterministic` reaches every gpu_worker's command line (the one the supervisor
starts) as a setting the worker parses; without it the workers keep their default."""

from __future__ import annotations

from loramesh_cli.main import build_parser
from loramesh_cli.mesh_layout import service_processes
from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config


def worker_commands(tmp_path, *flags: str) -> list[list[str]]:
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--workers", "2", *flags])
    processes, _ = service_processes(args, tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "keys.json", None)
    return [p.command() for name, p in processes.items() if name.startswith("gpu_worker")]


def worker_config(command: list[str]) -> WorkerConfig:
    """The settings the worker parses from its command line (after `-m services.gpu_worker`)."""
    return parse_config(WorkerConfig, argv=command[command.index("services.gpu_worker") + 1 :], environ={})


def test_deterministic_is_passed_to_every_worker(tmp_path):
    commands = worker_commands(tmp_path, "--deterministic")
    assert len(commands) == 2
    assert all(worker_config(c).deterministic for c in commands)


def test_without_the_flag_the_workers_keep_their_default(tmp_path):
    commands = worker_commands(tmp_path)
    assert all("--deterministic" not in c for c in commands)
    assert all(worker_config(c).deterministic is WorkerConfig.deterministic for c in commands)


def test_the_worker_reads_it_from_its_environment_too():
    assert parse_config(WorkerConfig, argv=[], environ={"LORAMESH_DETERMINISTIC": "true"}).deterministic
    assert not parse_config(WorkerConfig, argv=["--deterministic", "false"], environ={}).deterministic
