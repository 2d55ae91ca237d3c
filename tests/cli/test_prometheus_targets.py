"""The targets file `loramesh up` writes for Prometheus: every process's /metrics and etcd, each
labelled with its Kubernetes Service name, as the alert rules read them."""

from __future__ import annotations

import json

from loramesh_cli.mesh_file import MeshFile, ServiceEntry
from loramesh_cli.prometheus_targets import TARGETS_FILE_NAME, write_prometheus_targets


def test_every_process_and_etcd_is_a_target_labelled_by_its_service(tmp_path):
    names = (
        "gateway",
        "gateway-1",
        "gpu_worker-0",
        "gpu_worker-1",
        "adapter_store",
        "scheduler",
        "kv_manager",
    )
    services = {
        name: ServiceEntry(f"127.0.0.1:{i}", f"127.0.0.1:{100 + i}", i, "log") for i, name in enumerate(names)
    }
    mesh = MeshFile(1, "127.0.0.1:2379", 2, "key", services, tls={"ca_file": "ca.pem"})
    write_prometheus_targets(mesh, tmp_path)
    groups = json.loads((tmp_path / TARGETS_FILE_NAME).read_text())
    labels = {group["labels"]["instance_name"]: group["labels"]["service"] for group in groups}
    assert labels == {
        "gateway": "gateway", "gateway-1": "gateway", "gpu_worker-0": "gpu-worker", "gpu_worker-1": "gpu-worker",
        "adapter_store": "adapter-store", "scheduler": "scheduler", "kv_manager": "kv-manager", "etcd": "etcd",
    }  # fmt: skip
    by_name = {group["labels"]["instance_name"]: group for group in groups}
    assert by_name["gpu_worker-1"]["targets"] == ["127.0.0.1:103"]
    assert by_name["etcd"]["targets"] == ["127.0.0.1:2379"]
    assert {group["labels"]["__scheme__"] for group in groups} == {"https"}  # up --tls
    assert list(tmp_path.iterdir()) == [tmp_path / TARGETS_FILE_NAME]  # replaced whole, nothing left over
