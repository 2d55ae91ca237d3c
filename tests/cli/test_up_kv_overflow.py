"""`loramesh up --kv-overflow preempt|borrow` and `--lend-cap-blocks N` reach every gpu_worker's
command line (the one the supervisor starts, and restarts) and the background `up` of `--detach`.
Without them the workers borrow where a kv_manager runs (preempt with ``--kv-managers 0``) and
keep their own lend cap (three quarters of the pool)."""

from __future__ import annotations

import pytest

from loramesh_cli.errors import CommandError
from loramesh_cli.main import build_parser
from loramesh_cli.mesh_commands import cmd_up
from loramesh_cli.up_arguments import detached_argv
from services.gpu_worker.config import WorkerConfig
from tests.cli.test_up_batch_policy import flag_value, worker_commands
from tests.cli.test_up_deterministic import worker_config


def up_args(tmp_path, *flags: str):
    return build_parser().parse_args(["--state-dir", str(tmp_path), "up", *flags])


@pytest.mark.parametrize("policy", ["borrow", "preempt"])
def test_the_overflow_policy_lend_cap_and_lane_are_passed_to_every_worker(tmp_path, policy):
    commands = worker_commands(
        tmp_path, "--kv-overflow", policy, "--lend-cap-blocks", "40", "--lending-lane", "off"
    )
    assert len(commands) == 2
    assert all(flag_value(c, "--kv-overflow") == policy for c in commands)
    configs = [worker_config(c) for c in commands]
    assert all(
        c.kv_overflow == policy and c.lend_cap_blocks == 40 and c.lending_lane == "off" for c in configs
    )
    defaults = [worker_config(c).lending_lane for c in worker_commands(tmp_path)]
    assert defaults == ["shared-memory"] * 2  # the pools mapped by default


def test_without_the_flags_the_workers_borrow_where_a_kv_manager_runs(tmp_path):
    commands = worker_commands(tmp_path)
    assert all("--lend-cap-blocks" not in c for c in commands)
    configs = [worker_config(c) for c in commands]
    assert all(c.kv_overflow == "borrow" and c.lend_cap_blocks == -1 for c in configs)
    assert (WorkerConfig.kv_overflow, WorkerConfig.lend_cap_blocks) == ("preempt", -1)
    alone = [worker_config(c) for c in worker_commands(tmp_path, "--kv-managers", "0")]
    assert all(c.kv_overflow == "preempt" for c in alone)  # nobody to suggest creditors


def test_detach_passes_them_to_the_background_up(tmp_path):
    argv = detached_argv(up_args(tmp_path, "--kv-overflow", "borrow", "--lend-cap-blocks", "7"), tmp_path)
    again = build_parser().parse_args(argv[argv.index("--state-dir") :])
    assert (again.kv_overflow, again.lend_cap_blocks) == ("borrow", 7)
    plain = detached_argv(up_args(tmp_path), tmp_path)
    assert "--kv-overflow" not in plain and "--lend-cap-blocks" not in plain
    # The background `up` decides as this one would (borrow, with its 2 kv_managers: above).
    again = build_parser().parse_args(plain[plain.index("--state-dir") :])
    assert (again.kv_overflow, again.kv_managers) == (None, 2)


def test_an_unknown_policy_and_a_negative_cap_are_refused_by_up(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--kv-overflow", "swap"])
    assert "invalid choice: 'swap'" in capsys.readouterr().err
    with pytest.raises(CommandError, match="--lend-cap-blocks"):
        cmd_up(up_args(tmp_path, "--lend-cap-blocks", "-2"))
