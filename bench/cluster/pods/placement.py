"""Which pods a workload makes, what they are called and on which node each runs.

A Deployment's pods are named as its ReplicaSet names them (``<name>-<template hash>-<5
chars>``), a StatefulSet's ``<name>-<ordinal>`` with the hostname and subdomain that make
``<name>-0.<service>`` resolve. Pods are dealt onto the nodes in turn across all workloads, so
the replicas of one workload land on different nodes while there are nodes enough: what the
manifests' preferred pod anti-affinity asks for. Resource requests are not scheduled against:
every node takes every pod.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field

SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
"""The characters Kubernetes draws generated name suffixes from."""


@dataclass
class PodPlan:
    """One pod to run."""

    name: str
    namespace: str
    labels: dict[str, str]
    spec: dict
    """The pod template's spec, as rendered."""
    owner: str
    """``Deployment/<name>`` or ``StatefulSet/<name>``."""
    node: int
    """Index of the node it runs on."""
    hostname: str = ""
    """Set for a StatefulSet's pod: its own name."""
    subdomain: str = ""
    """Set for a StatefulSet's pod: the governing Service."""
    claims: dict[str, str] = field(default_factory=dict)
    """volumeClaimTemplates name -> the claim this pod gets (``<template>-<pod>``)."""
    ip: str = ""
    """Filled in when its network is made."""

    def container_ports(self) -> dict[str, tuple[int, str]]:
        """Named container ports of every container: name -> (port, protocol)."""
        ports = {}
        for container in self.spec.get("containers", []):
            for port in container.get("ports", []):
                if "name" in port:
                    ports[port["name"]] = (int(port["containerPort"]), port.get("protocol", "TCP"))
        return ports


def _template_hash(template: dict) -> str:
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    return "".join(SUFFIX_ALPHABET[b % len(SUFFIX_ALPHABET)] for b in digest[:10])


def _suffix() -> str:
    return "".join(secrets.choice(SUFFIX_ALPHABET) for _ in range(5))


def plan_pods(workloads: list[dict], nodes: int) -> list[PodPlan]:
    """Every replica of every workload, placed round-robin over ``nodes`` nodes."""
    if nodes < 1:
        raise ValueError(f"a run needs at least one node, got {nodes}")
    pods: list[PodPlan] = []
    for workload in workloads:
        kind, meta, spec = workload["kind"], workload["metadata"], workload["spec"]
        template = spec["template"]
        replicas = int(spec.get("replicas", 1))
        for ordinal in range(replicas):
            common = {
                "namespace": meta.get("namespace", "default"),
                "labels": dict(template.get("metadata", {}).get("labels", {})),
                "spec": template["spec"],
                "owner": f"{kind}/{meta['name']}",
                "node": len(pods) % nodes,
            }
            if kind == "StatefulSet":
                name = f"{meta['name']}-{ordinal}"
                claims = {t["metadata"]["name"]: f"{t['metadata']['name']}-{name}"
                          for t in spec.get("volumeClaimTemplates", [])}  # fmt: skip
                pods.append(PodPlan(name, hostname=name, subdomain=spec.get("serviceName", ""),
                                    claims=claims, **common))  # fmt: skip
            else:
                pods.append(PodPlan(f"{meta['name']}-{_template_hash(template)}-{_suffix()}", **common))
    return pods
