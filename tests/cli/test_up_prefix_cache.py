"""`loramesh up --prefix-cache on|off` reaches every gpu_worker's command line; without it the
workers keep their own default, and the worker parses the value into its config."""

from __future__ import annotations

from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config
from tests.cli.test_up_batch_policy import flag_value, worker_commands


def test_the_prefix_cache_setting_is_passed_to_every_worker(tmp_path):
    commands = worker_commands(tmp_path, "--prefix-cache", "off")
    assert len(commands) == 2
    assert all(flag_value(c, "--prefix-cache") == "off" for c in commands)
    assert all("--prefix-cache" not in c for c in worker_commands(tmp_path))


def test_the_worker_reads_on_and_off():
    assert parse_config(WorkerConfig, ["--prefix-cache", "off"], environ={}).prefix_cache is False
    assert parse_config(WorkerConfig, ["--prefix-cache", "on"], environ={}).prefix_cache is True
    assert parse_config(WorkerConfig, [], environ={}).prefix_cache is True
