"""`loramesh up --placement NAME` reaches every scheduler's command line and the background `up`
of `--detach`; by default the schedulers' own default, prefix-aware."""

from __future__ import annotations

import pytest

from loramesh_cli.main import build_parser
from loramesh_cli.mesh_layout import service_processes
from loramesh_cli.up_arguments import detached_argv
from services.runtime.config import parse_config
from services.scheduler.config import SchedulerConfig
from services.scheduler.policies import PLACEMENT_POLICIES
from tests.cli.test_up_batch_policy import flag_value


def scheduler_commands(tmp_path, *flags: str) -> list[list[str]]:
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--schedulers", "2", *flags])
    processes, _ = service_processes(args, tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "keys.json", None)
    return [p.command() for name, p in processes.items() if name.startswith("scheduler")]


def scheduler_configs(tmp_path, *flags: str) -> list[SchedulerConfig]:
    commands = scheduler_commands(tmp_path, *flags)
    assert len(commands) == 2
    argvs = [c[c.index("services.scheduler") + 1 :] for c in commands]
    return [parse_config(SchedulerConfig, argv=argv, environ={}) for argv in argvs]


@pytest.mark.parametrize("name", sorted(PLACEMENT_POLICIES))
def test_the_placement_is_passed_to_every_scheduler(tmp_path, name):
    assert [c.placement for c in scheduler_configs(tmp_path, "--placement", name)] == [name, name]


def test_the_schedulers_default_by_default(tmp_path):
    assert not any(flag_value(c, "--placement") for c in scheduler_commands(tmp_path))
    assert [c.placement for c in scheduler_configs(tmp_path)] == [SchedulerConfig.placement] * 2
    assert SchedulerConfig.placement == "prefix-aware"


def test_detach_passes_it_to_the_background_up(tmp_path):
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--placement", "round-robin"])
    argv = detached_argv(args, tmp_path)
    assert build_parser().parse_args(argv[argv.index("--state-dir") :]).placement == "round-robin"


def test_an_unknown_placement_is_refused_by_up(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--placement", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err
