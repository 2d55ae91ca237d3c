"""A container's environment and command line, resolved as the kubelet resolves them.

Order: the image's ENV, the Service links (``KUBERNETES_SERVICE_HOST`` and, per ClusterIP
Service of the pod's namespace, ``<SVC>_SERVICE_HOST``/``_PORT``), ``envFrom`` in order
(``prefix``, ``optional``), then ``env`` in order (``value`` with ``$(VAR)`` references to
variables defined before it, ``fieldRef``, ``configMapKeyRef``, ``secretKeyRef``). ``$(VAR)`` in
``command`` and ``args`` is replaced from the result, ``$$`` is a literal ``$``, and a
reference to an undefined variable is left as written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from bench.cluster.pods.placement import PodPlan
from bench.cluster.pods.volumes import MissingObject

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(one, text)


def _field(pod: PodPlan, path: str, node_ip: str) -> str:
    values = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "status.podIP": pod.ip,
        "status.podIPs": pod.ip,
        "spec.nodeName": f"node-{pod.node}",
        "status.hostIP": node_ip,
        "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
    }
    if path.startswith("metadata.labels['"):
        return pod.labels.get(path[len("metadata.labels['") : -2], "")
    if path not in values:
        raise MissingObject(f"pod {pod.name}: fieldRef {path} is not one the run fills in")
    return values[path]


def _key_ref(kind: str, ref: Mapping, table: Mapping[str, Mapping]) -> str | None:
    data = table.get(ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise MissingObject(f"{kind} {ref['name']} (key {ref['key']}) is not in the run")
    value = data[ref["key"]]
    return value.decode() if isinstance(value, bytes) else value


def container_env(
    pod: PodPlan,
    container: Mapping,
    image_env: Mapping[str, str],
    service_links: Mapping[str, str],
    config_maps: Mapping[str, Mapping[str, str]],
    secrets: Mapping[str, Mapping[str, bytes]],
    node_ip: str,
) -> dict[str, str]:
    """The container's environment, every source applied in the kubelet's order."""
    env = {**image_env, **service_links}
    for source in container.get("envFrom", []):
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        ref = source.get("configMapRef") or source["secretRef"]
        data = (config_maps if kind == "ConfigMap" else secrets).get(ref["name"])
        if data is None:
            if ref.get("optional"):
                continue
            raise MissingObject(f"pod {pod.name}: envFrom names {kind} {ref['name']}, which the run lacks")
        for key, value in data.items():
            env[source.get("prefix", "") + key] = value.decode() if isinstance(value, bytes) else value
    for var in container.get("env", []):
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"], node_ip)
        elif "configMapKeyRef" in source:
            value = _key_ref("ConfigMap", source["configMapKeyRef"], config_maps)
        elif "secretKeyRef" in source:
            value = _key_ref("Secret", source["secretKeyRef"], secrets)
        else:
            raise MissingObject(
                f"pod {pod.name}: env {name} comes from {sorted(source)}, which the run lacks"
            )
        if value is not None:
            env[name] = value
    return env


def command_line(container: Mapping, image_entrypoint: list[str], env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args`` (the image's entrypoint when ``command`` is absent), expanded."""
    argv = list(container.get("command") or image_entrypoint) + list(container.get("args") or [])
    if not argv:
        raise MissingObject(f"container {container['name']} has no command and its image no entrypoint")
    return [expand(a, env) for a in argv]


def service_links(namespace: str, services, api_server: str) -> dict[str, str]:
    """What ``enableServiceLinks`` puts in every container: the API server's address and each
    ClusterIP Service of the namespace's host and ports."""
    links = {"KUBERNETES_SERVICE_HOST": api_server, "KUBERNETES_SERVICE_PORT": "443",
             "KUBERNETES_SERVICE_PORT_HTTPS": "443"}  # fmt: skip
    for service in services:
        if service.namespace != namespace or not service.vip or not service.ports:
            continue
        prefix = service.name.upper().replace("-", "_")
        first = service.ports[0]
        links[f"{prefix}_SERVICE_HOST"] = service.vip
        links[f"{prefix}_SERVICE_PORT"] = str(first["port"])
        links[f"{prefix}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{service.vip}:{first['port']}"
        for port in service.ports:
            protocol = port.get("protocol", "TCP")
            base = f"{prefix}_PORT_{port['port']}_{protocol}"
            links[base] = f"{protocol.lower()}://{service.vip}:{port['port']}"
            links[f"{base}_PROTO"] = protocol.lower()
            links[f"{base}_PORT"] = str(port["port"])
            links[f"{base}_ADDR"] = service.vip
            if "name" in port:
                links[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
    return links
