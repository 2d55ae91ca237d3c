"""Both overlays spell out how long a worker waits for a lender (``LORAMESH_LOAN_WAIT_ROUNDS``,
its own default as shipped), and label each worker with its node (``LORAMESH_TOPOLOGY`` from
``spec.nodeName``), so the kv_manager suggests creditors on the debtor's node first."""

from __future__ import annotations

from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config
from tests.k8s.test_policy_overlays import env_of, rendered  # noqa: F401 (the fixture)


def test_the_workers_loan_wait_is_set(rendered):  # noqa: F811
    env = env_of(rendered, "gpu-worker")
    key = "LORAMESH_LOAN_WAIT_ROUNDS"
    config = parse_config(WorkerConfig, argv=[], environ={key: env[key]})
    assert config.loan_wait_rounds == WorkerConfig.loan_wait_rounds


def test_each_worker_is_labelled_with_its_node(rendered):  # noqa: F811
    (workload,) = [o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == "gpu-worker"]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    (topology,) = [var for var in container["env"] if var["name"] == "LORAMESH_TOPOLOGY"]
    assert topology["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
