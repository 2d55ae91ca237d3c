"""Service names and Service addresses, without a DNS server or kube-proxy.

Names: each pod gets its own hosts file (``/etc/netns/<pod netns>/hosts``, bound over the pod's
``/etc/hosts``) with every Service as ``<svc>`` (same namespace only, as the search path makes
it), ``<svc>.<ns>``, ``<svc>.<ns>.svc`` and ``<svc>.<ns>.svc.cluster.local``, a StatefulSet pod's
own names (``etcd-0.etcd`` and longer) and ``kubernetes.default.svc`` for the API server. A
hosts file gives one address per name, so a headless Service with several endpoints resolves,
in each pod, to one of them: pods take the endpoints in turn (pod ``i`` gets endpoint ``i mod
n``), which spreads callers as DNS round-robin would on average, but a given pod always gets the
same one. A ClusterIP Service resolves to its virtual IP, which each pod's nftables translate to
one of its endpoints per connection (``numgen inc``: round-robin, as kube-proxy's nftables mode
does at random). Endpoints are every pod the selector matches, ready or not: the run waits for
readiness itself, nothing is taken out of a Service while it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bench.cluster.pods.netpolicy import selects
from bench.cluster.pods.placement import PodPlan

DOMAIN = "cluster.local"
NAT_TABLE = "lmservices"


@dataclass
class ServicePlan:
    """One Service of the overlay and the pods behind it."""

    name: str
    namespace: str
    vip: str
    """Its ClusterIP; empty for a headless Service."""
    ports: list[dict]
    endpoints: list[PodPlan]

    def names(self, from_namespace: str) -> list[str]:
        qualified = f"{self.name}.{self.namespace}"
        short = [self.name] if from_namespace == self.namespace else []
        return [*short, qualified, f"{qualified}.svc", f"{qualified}.svc.{DOMAIN}"]


def plan_services(services: Iterable[Mapping], pods: list[PodPlan], vip_for) -> list[ServicePlan]:
    """``vip_for(k)``: the k-th virtual IP (network.AddressPlan.service_ip)."""
    plans, next_vip = [], 0
    for service in services:
        meta, spec = service["metadata"], service["spec"]
        namespace = meta.get("namespace", "default")
        endpoints = [
            p for p in pods if p.namespace == namespace and spec.get("selector") and selects(
                {"matchLabels": spec["selector"]}, p.labels
            )
        ]  # fmt: skip
        vip = ""
        if spec.get("clusterIP") != "None":
            vip, next_vip = vip_for(next_vip), next_vip + 1
        plans.append(ServicePlan(meta["name"], namespace, vip, list(spec.get("ports", [])), endpoints))
    return plans


def _pod_names(pod: PodPlan, viewer_namespace: str) -> list[str]:
    """A StatefulSet pod's DNS names (hostname.subdomain...), as seen from a namespace."""
    if not (pod.hostname and pod.subdomain):
        return []
    base = f"{pod.hostname}.{pod.subdomain}.{pod.namespace}"
    short = [f"{pod.hostname}.{pod.subdomain}"] if viewer_namespace == pod.namespace else []
    return [*short, base, f"{base}.svc", f"{base}.svc.{DOMAIN}"]


def hosts_file(
    viewer: PodPlan, index: int, services: list[ServicePlan], pods: list[PodPlan], api_server: str
) -> str:
    """The hosts file of pod ``viewer`` (the ``index``-th pod of the run)."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    own = [viewer.hostname or viewer.name]
    if viewer.hostname and viewer.subdomain:
        own.insert(0, f"{viewer.hostname}.{viewer.subdomain}.{viewer.namespace}.svc.{DOMAIN}")
    lines.append(f"{viewer.ip}\t{' '.join(own)}")
    for service in services:
        if service.vip:
            address = service.vip
        elif service.endpoints:
            address = service.endpoints[index % len(service.endpoints)].ip
        else:
            continue
        lines.append(f"{address}\t{' '.join(service.names(viewer.namespace))}")
    for pod in pods:
        if names := _pod_names(pod, viewer.namespace):
            lines.append(f"{pod.ip}\t{' '.join(names)}")
    api = ["kubernetes"] if viewer.namespace == "default" else []
    lines.append(f"{api_server}\t{' '.join([*api, 'kubernetes.default', 'kubernetes.default.svc'])} "
                 f"kubernetes.default.svc.{DOMAIN}")  # fmt: skip
    return "\n".join(lines) + "\n"


def _target_port(port: Mapping, pod: PodPlan) -> int | None:
    target = port.get("targetPort", port["port"])
    if isinstance(target, str) and not target.isdigit():
        named = pod.container_ports().get(target)
        return named[0] if named else None
    return int(target)


def nat_ruleset(services: list[ServicePlan]) -> str:
    """Every pod's translation of ClusterIP:port to an endpoint, new connection by new
    connection, in turn."""
    rules = []
    for service in services:
        if not service.vip or not service.endpoints:
            continue
        for port in service.ports:
            targets = [(p.ip, t) for p in service.endpoints if (t := _target_port(port, p)) is not None]
            if not targets:
                continue
            protocol = port.get("protocol", "TCP").lower()
            mapping = ", ".join(f"{i} : {ip} . {t}" for i, (ip, t) in enumerate(targets))
            rules.append(
                f"    ip daddr {service.vip} {protocol} dport {port['port']} "
                f"dnat ip to numgen inc mod {len(targets)} map {{ {mapping} }}"
            )
    return (
        f"table ip {NAT_TABLE} {{\n  chain output {{\n    type nat hook output priority -100; policy accept;\n"
        + "".join(r + "\n" for r in rules)
        + "  }\n}\n"
    )
