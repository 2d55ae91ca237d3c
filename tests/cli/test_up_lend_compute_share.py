"""`loramesh up --lend-compute-share S` (DistKV-LLM's compute cap) reaches every gpu_worker's
command line and the background `up` of `--detach`; without it the workers keep their default
(0.5); a share outside [0, 1] is refused by `up`."""

from __future__ import annotations

import pytest

from loramesh_cli.errors import CommandError
from loramesh_cli.mesh_commands import cmd_up
from loramesh_cli.up_arguments import detached_argv
from services.gpu_worker.config import WorkerConfig
from tests.cli.test_up_batch_policy import flag_value, worker_commands
from tests.cli.test_up_deterministic import worker_config
from tests.cli.test_up_kv_overflow import up_args


def test_the_share_is_passed_to_every_worker(tmp_path):
    commands = worker_commands(tmp_path, "--kv-overflow", "borrow", "--lend-compute-share", "0.25")
    assert len(commands) == 2
    assert all(flag_value(c, "--lend-compute-share") == "0.25" for c in commands)
    assert all(worker_config(c).lend_compute_share == 0.25 for c in commands)


def test_without_it_the_workers_keep_their_default(tmp_path):
    commands = worker_commands(tmp_path)
    assert all("--lend-compute-share" not in c for c in commands)
    assert all(worker_config(c).lend_compute_share == WorkerConfig.lend_compute_share for c in commands)
    assert WorkerConfig.lend_compute_share == 0.5


def test_detach_passes_it_to_the_background_up(tmp_path):
    argv = detached_argv(up_args(tmp_path, "--lend-compute-share", "1"), tmp_path)
    assert argv[argv.index("--lend-compute-share") + 1] == "1.0"
    assert "--lend-compute-share" not in detached_argv(up_args(tmp_path), tmp_path)


@pytest.mark.parametrize("share", ["-0.1", "1.5"])
def test_a_share_outside_0_1_is_refused_by_up(tmp_path, share):
    with pytest.raises(CommandError, match="--lend-compute-share must be in"):
        cmd_up(up_args(tmp_path, "--lend-compute-share", share))
