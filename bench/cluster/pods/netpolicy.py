"""NetworkPolicies (networking.k8s.io/v1) as nftables rules in each pod's namespace.

Ingress as Kubernetes defines it: a pod no policy selects takes everything; a pod that one or
more Ingress policies select takes only what a rule of one of them admits (the union), matched
on the source pod's address (pods chosen by podSelector / namespaceSelector labels, or an
ipBlock) and the destination port (a number, or a name resolved against the destination pod's
container ports). Replies of admitted connections pass (conntrack), as does the pod's own
loopback and its node's address: the kubelet's probes come from the node, which CNI plugins
(Calico, Cilium) admit to the node's own pods whatever the policies say.

What is dropped for want of a rule is recorded in the pod's nftables set ``blocked`` (source
address . destination port), so a run can say which flow a policy blocked instead of timing out
on it. Egress policies are refused: these manifests have none, and a runner that ignored one
would pass what a cluster would block.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bench.cluster.pods.commands import in_netns
from bench.cluster.pods.placement import PodPlan

TABLE = "lmpolicy"


class UnsupportedPolicy(ValueError):
    pass


def selects(selector: Mapping | None, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels and matchExpressions) matches ``labels``; an empty
    selector matches everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


@dataclass(frozen=True)
class Peer:
    """A pod a rule may admit traffic from."""

    ip: str
    namespace: str
    labels: Mapping[str, str]


def _peer_match(peer_rule: Mapping, policy_ns: str, peers: Iterable[Peer], ns_labels) -> list[str]:
    """nft source matches for one ``from`` entry."""
    if "ipBlock" in peer_rule:
        block = peer_rule["ipBlock"]
        excepted = block.get("except") or []
        match = f"ip saddr {block['cidr']}"
        return [match + (f" ip saddr != {{ {', '.join(excepted)} }}" if excepted else "")]
    pod_sel, ns_sel = peer_rule.get("podSelector"), peer_rule.get("namespaceSelector")
    ips = sorted(
        p.ip
        for p in peers
        if (
            selects(ns_sel, ns_labels.get(p.namespace, {}))
            if ns_sel is not None
            else p.namespace == policy_ns
        )
        and selects(pod_sel, p.labels)
    )
    return [f"ip saddr {{ {', '.join(ips)} }}"] if ips else []


def _port_match(port_rule: Mapping, target: PodPlan) -> str | None:
    """nft destination match for one ``ports`` entry (None: a named port the pod lacks)."""
    protocol = port_rule.get("protocol", "TCP").lower()
    port = port_rule.get("port")
    if port is None:
        return f"meta l4proto {protocol}"
    if isinstance(port, str) and not port.isdigit():
        named = target.container_ports().get(port)
        if named is None:
            return None
        port = named[0]
    end = port_rule.get("endPort")
    return f"meta l4proto {protocol} th dport {port}" + (f"-{end}" if end else "")


def ingress_rules(
    target: PodPlan, policies: Iterable[Mapping], peers: list[Peer], ns_labels: Mapping[str, Mapping]
) -> list[str] | None:
    """The accept rules for ``target``; None when no Ingress policy selects it (not isolated)."""
    isolated, rules = False, []
    for policy in policies:
        meta, spec = policy["metadata"], policy["spec"]
        types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
        if "Egress" in types:
            raise UnsupportedPolicy(f"NetworkPolicy {meta['name']}: Egress policies are not translated")
        if meta.get("namespace", "default") != target.namespace or not selects(
            spec.get("podSelector"), target.labels
        ):
            continue
        isolated = True
        for i, rule in enumerate(spec.get("ingress") or []):
            sources = [""]
            if rule.get("from"):
                sources = [
                    m
                    for entry in rule["from"]
                    for m in _peer_match(entry, meta["namespace"], peers, ns_labels)
                ]
            ports = [""]
            if rule.get("ports"):
                ports = [m for p in rule["ports"] if (m := _port_match(p, target)) is not None]
            for source in sources:
                for port in ports:
                    match = " ".join(x for x in (source, port) if x)
                    rules.append(f'{match} accept comment "{meta["name"]} ingress[{i}]"'.strip())
    return rules if isolated else None


def ruleset(rules: list[str] | None, node_addresses: Iterable[str]) -> str:
    """A pod's table: admitted flows accepted, the rest recorded in ``blocked`` and dropped."""
    lines = [
        f"table inet {TABLE} {{",
        "  set blocked { type ipv4_addr . inet_service; flags dynamic; size 65535; }",
        "  chain ingress {",
        "    type filter hook input priority filter; policy accept;",
    ]
    if rules is not None:
        lines += [
            "    ct state established,related accept",
            "    iif lo accept",
            f'    ip saddr {{ {", ".join(node_addresses)} }} accept comment "kubelet probes from the nodes"',
            *(f"    {rule}" for rule in rules),
            "    meta l4proto { tcp, udp } add @blocked { ip saddr . th dport } drop",
            "    drop",
        ]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def apply(netns: str, text: str) -> None:
    in_netns(netns, "nft", "-f", "-", stdin=text)


def blocked_flows(netns: str) -> set[tuple[str, int]]:
    """(source address, destination port) of every connection attempt the pod's policy dropped."""
    listed = json.loads(
        in_netns(netns, "nft", "-j", "list", "set", "inet", TABLE, "blocked", check=False) or "{}"
    )
    flows = set()
    for item in listed.get("nftables", []):
        for element in (item.get("set") or {}).get("elem", []):
            source, port = element["concat"] if "concat" in element else element["elem"]["val"]["concat"]
            flows.add((source, int(port)))
    return flows
