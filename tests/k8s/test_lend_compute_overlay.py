"""Both overlays spell out the workers' compute cap (``LORAMESH_LEND_COMPUTE_SHARE``) as a value
the worker parses: its own default as shipped."""

from __future__ import annotations

from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config
from tests.k8s.test_policy_overlays import env_of, rendered  # noqa: F401 (the fixture)


def test_the_workers_compute_cap_is_set(rendered):  # noqa: F811
    env = env_of(rendered, "gpu-worker")
    key = "LORAMESH_LEND_COMPUTE_SHARE"
    config = parse_config(WorkerConfig, argv=[], environ={key: env[key]})
    assert config.lend_compute_share == WorkerConfig.lend_compute_share
