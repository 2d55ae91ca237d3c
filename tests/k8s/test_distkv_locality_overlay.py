"""Both overlays spell out how long a worker waits for a lender (``LORAMESH_LOAN_WAIT_S`` and
``LORAMESH_LOAN_WAIT_ROUNDS``, its own defaults as shipped), a wait that outlasts a kv_manager leader's failover, and label each
worker with its node (``LORAMESH_TOPOLOGY`` from ``spec.nodeName``), so the kv_manager suggests
creditors on the debtor's node first."""

from __future__ import annotations

from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config
from tests.k8s.test_policy_overlays import env_of, rendered  # noqa: F401 (the fixture)


def test_the_workers_loan_wait_is_set(rendered):  # noqa: F811
    env = env_of(rendered, "gpu-worker")
    keys = ("LORAMESH_LOAN_WAIT_S", "LORAMESH_LOAN_WAIT_ROUNDS")
    config = parse_config(WorkerConfig, argv=[], environ={key: env[key] for key in keys})
    assert config.loan_wait_s == WorkerConfig.loan_wait_s
    assert config.loan_wait_rounds == WorkerConfig.loan_wait_rounds


def test_the_wait_for_a_lender_outlasts_a_kv_manager_leaders_failover(rendered):  # noqa: F811
    """The leader's lease (the TTL of ``loramesh-common``) expires, then a standby's next election
    round (every TTL/3) takes the lead; meanwhile the standby answers that it is not the leader
    and no creditor is suggested (a wait of 20 rounds alone refused a borrowing request 11 s into
    one, in the nemesis's kill of the leader's node)."""
    (common,) = [
        o
        for o in rendered
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("loramesh-common")
    ]
    ttl_s = float(common["data"]["LORAMESH_LEASE_TTL_S"])
    waits = {k: v for k, v in env_of(rendered, "gpu-worker").items() if k.startswith("LORAMESH_LOAN_WAIT")}
    config = parse_config(WorkerConfig, argv=[], environ=waits)
    assert config.loan_wait_s > ttl_s + ttl_s / 3, (config.loan_wait_s, ttl_s)


def test_each_worker_is_labelled_with_its_node(rendered):  # noqa: F811
    (workload,) = [o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == "gpu-worker"]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    (topology,) = [var for var in container["env"] if var["name"] == "LORAMESH_TOPOLOGY"]
    assert topology["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
