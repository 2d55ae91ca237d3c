"""A worker's settings fail closed: a tensor-parallel degree, count or size it cannot run with,
or an engine setting its engine would refuse, stops it at parse time (exit 2, one line naming
the setting) instead of running unsharded, unquantized or on a default."""

from __future__ import annotations

import pytest
from support.config_refusal import refusal

from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config


@pytest.mark.parametrize("degree", ["0", "-1", "-4"])
def test_a_tensor_parallel_degree_below_one_is_refused(capsys, degree):
    assert (
        refusal(capsys, WorkerConfig, ["--tp", degree])
        == f"--tp (env LORAMESH_TP) must be at least 1, got {degree}"
    )
    assert "--tp (env LORAMESH_TP)" in refusal(capsys, WorkerConfig, [], {"LORAMESH_TP": degree})


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--pool-mib", "0"], "--pool-mib (env LORAMESH_POOL_MIB) must be more than 0, got 0.0"),
        (["--max-running", "0"], "--max-running (env LORAMESH_MAX_RUNNING) must be at least 1, got 0"),
        (["--threads", "-2"], "--threads (env LORAMESH_THREADS) must be at least 0, got -2"),
        (["--lend-cap-blocks", "-2"], "--lend-cap-blocks (env LORAMESH_LEND_CAP_BLOCKS) must be at least -1"),
        (["--quantization", "q3_k"], "--quantization (env LORAMESH_QUANTIZATION) must be one of auto, none"),
        (["--batch-policy", "nope"], "batch_policy must be one of"),  # the engine's own check, now
    ],
)
def test_a_count_size_or_choice_the_worker_cannot_run_with_is_refused(capsys, argv, named):
    assert named in refusal(capsys, WorkerConfig, argv)


def test_an_unknown_word_for_on_is_refused_not_read_as_off(capsys):
    line = refusal(capsys, WorkerConfig, [], {"LORAMESH_DETERMINISTIC": "enabled"})
    assert line.startswith("LORAMESH_DETERMINISTIC (setting --deterministic): expected on (1, true, yes, on)")
    assert parse_config(WorkerConfig, [], environ={"LORAMESH_DETERMINISTIC": "Yes"}).deterministic


def test_the_defaults_and_a_group_degree_parse():
    assert parse_config(WorkerConfig, [], environ={}).tp == 1
    assert (
        parse_config(WorkerConfig, ["--tp", "3"], environ={}).tp == 3
    )  # the model divides it or not at start
