"""`loramesh up --quantization` reaches every gpu_worker's command line, `auto` by default; the
Kubernetes overlays pick q4_1 on CPUs and none on GPUs, values the worker accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loramesh_cli.main import build_parser
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.quantization_setting import resolve_quantization
from services.runtime.config import parse_config
from tests.cli.test_up_batch_policy import flag_value, worker_commands
from tests.cli.test_up_deterministic import worker_config

OVERLAYS = Path(__file__).resolve().parents[2] / "k8s" / "overlays"


@pytest.mark.parametrize("value", ["q4_1", "q8_0", "none"])
def test_the_format_is_passed_to_every_worker(tmp_path, value):
    commands = worker_commands(tmp_path, "--quantization", value)
    assert len(commands) == 2 and all(flag_value(c, "--quantization") == value for c in commands)


def test_the_workers_default_auto_by_default(tmp_path):
    commands = worker_commands(tmp_path)
    assert all(flag_value(c, "--quantization") is None for c in commands)
    assert all(worker_config(c).quantization == "auto" for c in commands)


def test_an_unknown_format_is_refused_by_up(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--quantization", "q3_k"])
    assert "invalid choice: 'q3_k'" in capsys.readouterr().err


@pytest.mark.parametrize(("overlay", "device", "expected"), [("cpu", "cpu", "q4_1"), ("gpu", "cuda", "none")])
def test_overlays(overlay, device, expected):
    patch = yaml.safe_load((OVERLAYS / overlay / "gpu-worker.yaml").read_text())
    env = {e["name"]: e["value"] for e in patch["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = parse_config(
        WorkerConfig, argv=[], environ={"LORAMESH_QUANTIZATION": env["LORAMESH_QUANTIZATION"]}
    )
    assert resolve_quantization(config.quantization, device) == expected
