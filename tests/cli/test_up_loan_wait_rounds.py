"""`loramesh up --loan-wait-s S` and `--loan-wait-rounds N` (how long a worker lets a request wait
for a lender of KV blocks: S seconds, and at least N admission rounds) reach every gpu_worker's
command line and the background `up` of `--detach`; without them the workers keep their
defaults (30 s, 20); fewer than 0 s or 1 round is refused by `up`."""

from __future__ import annotations

import pytest

from loramesh_cli.errors import CommandError
from loramesh_cli.mesh_commands import cmd_up
from loramesh_cli.up_arguments import detached_argv
from services.gpu_worker.config import WorkerConfig
from tests.cli.test_up_batch_policy import flag_value, worker_commands
from tests.cli.test_up_deterministic import worker_config
from tests.cli.test_up_kv_overflow import up_args


def test_the_rounds_are_passed_to_every_worker(tmp_path):
    commands = worker_commands(tmp_path, "--loan-wait-rounds", "60")
    assert len(commands) == 2
    assert all(flag_value(c, "--loan-wait-rounds") == "60" for c in commands)
    assert all(worker_config(c).loan_wait_rounds == 60 for c in commands)


def test_without_it_the_workers_keep_their_default(tmp_path):
    commands = worker_commands(tmp_path)
    assert all("--loan-wait-rounds" not in c for c in commands)
    assert all(worker_config(c).loan_wait_rounds == WorkerConfig.loan_wait_rounds == 20 for c in commands)


def test_detach_passes_it_to_the_background_up(tmp_path):
    argv = detached_argv(up_args(tmp_path, "--loan-wait-rounds", "5"), tmp_path)
    assert argv[argv.index("--loan-wait-rounds") + 1] == "5"
    assert "--loan-wait-rounds" not in detached_argv(up_args(tmp_path), tmp_path)


def test_fewer_than_one_round_is_refused_by_up(tmp_path):
    with pytest.raises(CommandError, match="--loan-wait-rounds must be at least 1, got 0"):
        cmd_up(up_args(tmp_path, "--loan-wait-rounds", "0"))


def test_the_seconds_are_passed_to_every_worker(tmp_path):
    commands = worker_commands(tmp_path, "--loan-wait-s", "45")
    assert all(flag_value(c, "--loan-wait-s") == "45.0" for c in commands)
    assert all(worker_config(c).loan_wait_s == 45.0 for c in commands)
    assert WorkerConfig.loan_wait_s == 30.0  # the default, which up does not pass


def test_a_negative_wait_is_refused_by_up(tmp_path):
    with pytest.raises(CommandError, match="--loan-wait-s must be at least 0, got -1"):
        cmd_up(up_args(tmp_path, "--loan-wait-s", "-1"))
