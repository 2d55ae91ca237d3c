"""The pods runner's translations, without namespaces: NetworkPolicies to nftables rules,
Services to hosts files and ClusterIP translation, a container's env and command line."""

from __future__ import annotations

import pytest

from bench.cluster.pods import cluster_dns, netpolicy
from bench.cluster.pods.container import checkout_again
from bench.cluster.pods.environment import command_line, container_env, expand
from bench.cluster.pods.placement import PodPlan, plan_pods
from bench.cluster.pods.volumes import MissingObject, Mount

MESH = {"app.kubernetes.io/part-of": "loramesh"}


def pod(name: str, ip: str, labels: dict, namespace: str = "loramesh", ports=(("grpc", 50052),)) -> PodPlan:
    spec = {"containers": [{"name": "c", "ports": [{"name": n, "containerPort": p} for n, p in ports]}]}
    return PodPlan(name, namespace, labels, spec, "Deployment/x", 0, ip=ip)


def policy(name: str, spec: dict, namespace: str = "loramesh") -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"policyTypes": ["Ingress"], **spec}}


WORKER = pod("worker", "10.9.1.2", {**MESH, "app": "worker"})
GATEWAY = pod("gateway", "10.9.1.3", {**MESH, "app": "gateway"}, ports=(("grpc", 50050), ("http", 9100)))
OUTSIDER = pod("outsider", "10.9.2.2", {}, namespace="default")
PROMETHEUS = pod("prometheus", "10.9.2.3", {}, namespace="monitoring")
PEERS = [netpolicy.Peer(p.ip, p.namespace, p.labels) for p in (WORKER, GATEWAY, OUTSIDER, PROMETHEUS)]
NAMESPACES = {"loramesh": {"kubernetes.io/metadata.name": "loramesh"},
              "monitoring": {"kubernetes.io/metadata.name": "monitoring"}}  # fmt: skip
POLICIES = [
    policy("default-deny", {"podSelector": {}}),
    policy("public", {"podSelector": {"matchLabels": {"app": "gateway"}},
                      "ingress": [{"ports": [{"port": "grpc", "protocol": "TCP"}]}]}),
    policy("mesh", {"podSelector": {"matchLabels": MESH}, "ingress": [{"from": [{"podSelector": {"matchLabels": MESH}}]}]}),
    policy("metrics", {"podSelector": {"matchLabels": MESH}, "ingress": [
        {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
         "ports": [{"port": 9100, "protocol": "TCP"}]}]}),
]  # fmt: skip


def test_label_selectors_with_expressions():
    labels = {"app": "gateway", "tier": "edge"}
    assert netpolicy.selects({}, labels) and netpolicy.selects(None, {})
    assert netpolicy.selects(
        {"matchExpressions": [{"key": "app", "operator": "In", "values": ["gateway"]}]}, labels
    )
    assert not netpolicy.selects(
        {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["gateway"]}]}, labels
    )
    assert netpolicy.selects({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, labels)
    assert not netpolicy.selects({"matchLabels": {"app": "gateway"}, "matchExpressions": [
        {"key": "tier", "operator": "Exists"}, {"key": "x", "operator": "Exists"}]}, labels)  # fmt: skip


def test_ingress_rules_admit_the_mesh_the_public_port_and_prometheus_only():
    worker = netpolicy.ingress_rules(WORKER, POLICIES, PEERS, NAMESPACES)
    gateway = netpolicy.ingress_rules(GATEWAY, POLICIES, PEERS, NAMESPACES)
    assert worker == [
        'ip saddr { 10.9.1.2, 10.9.1.3 } accept comment "mesh ingress[0]"',
        'ip saddr { 10.9.2.3 } meta l4proto tcp th dport 9100 accept comment "metrics ingress[0]"',
    ]
    # The named port is the gateway's own grpc (50050), not the worker's.
    assert 'meta l4proto tcp th dport 50050 accept comment "public ingress[0]"' in gateway
    # Nothing selects a pod of another namespace: it is not isolated.
    assert netpolicy.ingress_rules(OUTSIDER, POLICIES, PEERS, NAMESPACES) is None
    table = netpolicy.ruleset(worker, ["10.9.1.1"])
    assert "ip saddr { 10.9.1.1 } accept" in table and table.rstrip().endswith("drop\n  }\n}")


def test_egress_policies_are_refused_not_ignored():
    with pytest.raises(netpolicy.UnsupportedPolicy, match="egress-lock"):
        netpolicy.ingress_rules(
            WORKER, [policy("egress-lock", {"podSelector": {}, "policyTypes": ["Egress"]})], [], {}
        )


def test_hosts_files_name_services_per_namespace_and_spread_headless_endpoints():
    etcd = [PodPlan(f"etcd-{i}", "loramesh", {"app": "etcd"}, {}, "StatefulSet/etcd", i, hostname=f"etcd-{i}",
                    subdomain="etcd", ip=f"10.9.{i + 1}.9") for i in range(3)]  # fmt: skip
    services = cluster_dns.plan_services(
        [{"metadata": {"name": "etcd", "namespace": "loramesh"}, "spec": {"clusterIP": "None", "selector": {"app": "etcd"}}},
         {"metadata": {"name": "gateway", "namespace": "loramesh"},
          "spec": {"selector": {"app": "gateway"}, "ports": [{"port": 50050, "targetPort": "grpc"}]}}],
        [*etcd, GATEWAY], lambda k: f"10.9.200.{k + 1}",
    )  # fmt: skip
    inside = [cluster_dns.hosts_file(p, i, services, etcd, "10.9.250.1") for i, p in enumerate(etcd)]
    assert "10.9.1.9\tetcd etcd.loramesh etcd.loramesh.svc etcd.loramesh.svc.cluster.local" in inside[0]
    assert "10.9.2.9\tetcd etcd.loramesh" in inside[1]  # the next pod, the next endpoint
    assert "10.9.3.9\tetcd-2.etcd etcd-2.etcd.loramesh" in inside[0]
    assert "10.9.200.1\tgateway gateway.loramesh" in inside[0]
    outside = cluster_dns.hosts_file(OUTSIDER, 3, services, etcd, "10.9.250.1")
    assert "10.9.200.1\tgateway.loramesh gateway.loramesh.svc" in outside and "\tgateway " not in outside
    assert "10.9.250.1\tkubernetes kubernetes.default" in outside
    nat = cluster_dns.nat_ruleset(services)
    assert (
        "ip daddr 10.9.200.1 tcp dport 50050 dnat ip to numgen inc mod 1 map { 0 : 10.9.1.3 . 50050 }" in nat
    )


def test_env_sources_in_the_kubelets_order_and_command_expansion():
    assert (
        expand("--name=$(POD_NAME) $$(KEPT) $(UNKNOWN)", {"POD_NAME": "etcd-0"})
        == "--name=etcd-0 $(KEPT) $(UNKNOWN)"
    )
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "common"}}, {"secretRef": {"name": "absent", "optional": True}},
                    {"configMapRef": {"name": "common"}, "prefix": "X_"}],
        "env": [{"name": "A", "value": "from env"}, {"name": "B", "value": "$(A) and $(PORT)"},
                {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "command": ["run", "--at=$(IP):$(PORT)"],
    }  # fmt: skip
    env = container_env(
        WORKER,
        container,
        {"PATH": "/bin", "A": "image"},
        {},
        {"common": {"A": "cm", "PORT": "1"}},
        {},
        "10.9.1.1",
    )
    assert env["A"] == "from env" and env["X_PORT"] == "1" and env["B"] == "from env and 1"
    assert (env["ME"], env["IP"], env["PATH"]) == ("worker", "10.9.1.2", "/bin")
    assert command_line(container, ["python", "-m"], env) == ["run", "--at=10.9.1.2:1"]
    with pytest.raises(MissingObject, match="ConfigMap missing"):
        container_env(
            WORKER, {"name": "c", "envFrom": [{"configMapRef": {"name": "missing"}}]}, {}, {}, {}, {}, ""
        )


def test_replicas_are_named_as_kubernetes_names_them_and_spread_over_the_nodes():
    template = {"metadata": {"labels": {"app": "a"}}, "spec": {"containers": []}}
    pods = plan_pods([
        {"kind": "Deployment", "metadata": {"name": "gateway"}, "spec": {"replicas": 2, "template": template}},
        {"kind": "StatefulSet", "metadata": {"name": "etcd"},
         "spec": {"replicas": 3, "serviceName": "etcd", "template": template,
                  "volumeClaimTemplates": [{"metadata": {"name": "data"}}]}},
    ], nodes=3)  # fmt: skip
    first, second = pods[0].name.split("-"), pods[1].name.split("-")
    assert first[0] == "gateway" and first[1] == second[1] and len(first[1]) == 10 and len(first[2]) == 5
    assert [(p.name, p.hostname, p.subdomain, p.node) for p in pods[2:]] == [
        ("etcd-0", "etcd-0", "etcd", 2), ("etcd-1", "etcd-1", "etcd", 0), ("etcd-2", "etcd-2", "etcd", 1)]  # fmt: skip
    assert pods[2].claims == {"data": "data-etcd-0"}


def test_a_checkout_a_volume_hides_is_bound_again_entry_by_entry(tmp_path):
    """A checkout under /tmp (``mktemp -d``, mode 0700) is hidden by the pods' /tmp emptyDir:
    its entries, .git aside, are bound again, read-only, into a folder made where it was; a
    checkout no volume hides gets nothing."""
    checkout = tmp_path / "clone"
    (checkout / ".venv").mkdir(parents=True)
    (checkout / ".git").mkdir()
    (checkout / "Makefile").write_text("")
    hiding = [Mount(tmp_path / "empty", str(tmp_path), False)]
    lines = checkout_again(hiding, "/scratch/root", checkout)
    assert lines[0] == f"mkdir -p /scratch/root{checkout}"
    assert f"mount --bind {checkout / '.venv'} /scratch/root{checkout}/.venv" in lines
    assert f"mount -o remount,bind,ro /scratch/root{checkout}/Makefile" in lines
    assert not any(".git" in line for line in lines)
    assert checkout_again([Mount(tmp_path / "empty", "/elsewhere", False)], "/scratch/root", checkout) == []
