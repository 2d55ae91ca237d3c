"""`loramesh up --early-abort-slo-s S` reaches every gpu_worker's command line and the background
`up` of `--detach`; the worker parses it into its config and builds its early_abort policy with
it; without the flag the workers keep their 6 s."""

from __future__ import annotations

import pytest

from loramesh_cli.errors import CommandError
from loramesh_cli.main import build_parser
from loramesh_cli.mesh_commands import cmd_up
from loramesh_cli.up_arguments import detached_argv
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine.policies import make_batch_policy
from services.runtime.config import parse_config
from tests.cli.test_up_batch_policy import worker_commands
from tests.cli.test_up_deterministic import worker_config


def test_the_slo_is_passed_to_every_worker(tmp_path):
    commands = worker_commands(tmp_path, "--batch-policy", "early_abort", "--early-abort-slo-s", "2.5")
    assert len(commands) == 2
    assert all(worker_config(c).early_abort_slo_s == 2.5 for c in commands)
    assert all(worker_config(c).batch_policy == "early_abort" for c in commands)


def test_without_the_flag_the_workers_keep_their_default(tmp_path):
    commands = worker_commands(tmp_path)
    assert all("--early-abort-slo-s" not in c for c in commands)
    assert all(worker_config(c).early_abort_slo_s == 6.0 for c in commands)


def test_detach_passes_it_to_the_background_up(tmp_path):
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--early-abort-slo-s", "3"])
    argv = detached_argv(args, tmp_path)
    assert build_parser().parse_args(argv[argv.index("--state-dir") :]).early_abort_slo_s == 3.0


@pytest.mark.parametrize("value", ["0", "-1"])
def test_an_slo_of_zero_or_less_is_refused_by_up(tmp_path, value):
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--early-abort-slo-s", value])
    with pytest.raises(CommandError, match="--early-abort-slo-s"):
        cmd_up(args)


def test_the_worker_reads_it_from_its_environment_and_builds_the_policy_with_it():
    config = parse_config(WorkerConfig, argv=[], environ={"LORAMESH_EARLY_ABORT_SLO_S": "1.5"})
    assert config.early_abort_slo_s == 1.5
    assert make_batch_policy("early_abort", config.early_abort_slo_s).config.first_token_slo_s == 1.5
    assert make_batch_policy("early_abort").config.first_token_slo_s == 6.0
    assert make_batch_policy("fcfs", 1.5).name == "fcfs"  # other policies ignore it
