"""``<state dir>/prometheus-targets.json``: where a local mesh's ``/metrics`` are, as a Prometheus
``file_sd`` target list, written by ``loramesh up`` with each mesh.json.

The shipped scrape config (``monitoring/prometheus-up.yml``) reads it, so a Prometheus started
next to ``loramesh up`` scrapes every process of the mesh, whatever free ports they were given,
and follows restarts and new ports as the file changes. Each target is labelled ``service`` with
the Kubernetes Service name of its kind (``gpu-worker``, ``adapter-store``...), as the Prometheus
Operator labels them, so the alert rules (``monitoring/loramesh-alerts.yml``) read both alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from loramesh_cli.mesh_file import MeshFile

TARGETS_FILE_NAME = "prometheus-targets.json"
SERVICE_LABELS = {
    "gateway": "gateway",
    "gpu_worker": "gpu-worker",
    "scheduler": "scheduler",
    "adapter_store": "adapter-store",
    "kv_manager": "kv-manager",
}
"""A process's kind (the start of its name in mesh.json) -> its ``service`` label."""


def service_label(name: str) -> str:
    """The ``service`` label of the process ``name`` (``gpu_worker-0``, ``gateway-1``...)."""
    for kind, label in SERVICE_LABELS.items():
        if name == kind or name.startswith(f"{kind}-"):
            return label
    return name


def prometheus_targets(mesh: MeshFile) -> list[dict]:
    """One target group per process with a ``/metrics`` port, and etcd's (on its client port)."""
    scheme = "https" if mesh.tls else "http"
    groups = [
        {
            "targets": [entry.http_address],
            "labels": {"service": service_label(name), "instance_name": name, "__scheme__": scheme},
        }
        for name, entry in sorted(mesh.services.items())
        if entry.http_address
    ]
    groups.append(
        {
            "targets": [mesh.etcd_endpoint],
            "labels": {"service": "etcd", "instance_name": "etcd", "__scheme__": scheme},
        }
    )
    return groups


def write_prometheus_targets(mesh: MeshFile, state_dir: Path) -> None:
    """Replace the file atomically (Prometheus reads it when it changes: never half written)."""
    path = Path(state_dir) / TARGETS_FILE_NAME
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(prometheus_targets(mesh), indent=2))
    partial.replace(path)
