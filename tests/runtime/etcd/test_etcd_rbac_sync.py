"""The controller that keeps etcd's per-pod users in step with a Kubernetes mesh's pods
(``services/runtime/etcd/etcd_rbac_sync.py``), against a real etcd with client-certificate auth. The
Kubernetes API server cannot run here: the pod list is a function the test controls, and
:class:`KubernetesPods` is checked against a local HTTP server speaking the API's pod list."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlparse

import pytest

from loramesh_cli.main import main as loramesh
from services.runtime.errors import Unavailable
from services.runtime.etcd.etcd_rbac import ETCD_ROOT
from services.runtime.etcd.etcd_rbac_sync import (
    EtcdRbacSync,
    KubernetesPods,
    identities_of_pods,
    instance_users,
)
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.identity import MeshIdentity

pytestmark = pytest.mark.integration

WORKER_A = MeshIdentity("gpu_worker", "gpu-worker-7d9f-abcde")
WORKER_B = MeshIdentity("gpu_worker", "gpu-worker-7d9f-fghij")
GATEWAY = MeshIdentity("gateway", "gateway-5c4b-klmno")


def pod(name: str, app: str, phase: str = "Running") -> dict:
    return {"metadata": {"name": name, "labels": {"app.kubernetes.io/name": app}}, "status": {"phase": phase}}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertificateDirectory:
    return create_mesh_certificates(
        tmp_path_factory.mktemp("certs"), [WORKER_A, WORKER_B, GATEWAY, "etcd", ETCD_ROOT]
    )


@pytest.fixture
def etcd(tmp_path, certs):
    server = EtcdServer(tmp_path / "etcd", tls=certs.tls_for("etcd")).start()
    try:
        yield server
    finally:
        server.stop()


async def registers(etcd: EtcdServer, certs: CertificateDirectory, identity: MeshIdentity) -> bool:
    """Whether ``identity``'s certificate may register as itself."""
    config = MembershipConfig(etcd_endpoints=etcd.endpoint, tls=certs.tls_for(identity), register_timeout_s=0)
    info = MemberInfo(identity.kind, identity.instance, "127.0.0.1:1", "127.0.0.1:2", "0", time.time())
    try:
        registration = await MemberRegistration(config, info).start()
    except Unavailable:
        return False
    await registration.stop()
    return True


def test_the_identities_are_the_live_pods_of_mesh_kinds():
    pods = {"items": [
        pod(WORKER_A.instance, "gpu-worker"), pod(GATEWAY.instance, "gateway", phase="Pending"),
        pod("etcd-0", "etcd"), pod("done-1", "gpu-worker", phase="Succeeded"),
        pod("crashed-1", "kv-manager", phase="Failed"), {"metadata": {"name": "unlabelled"}},
    ]}  # fmt: skip
    assert identities_of_pods(pods) == {WORKER_A, GATEWAY}


async def test_each_pod_gets_its_user_and_loses_it_when_the_pod_is_gone(etcd, certs):
    pods = {"items": [pod(WORKER_A.instance, "gpu-worker"), pod(GATEWAY.instance, "gateway")]}

    async def list_pods() -> dict:
        return pods

    root = certs.tls_for(ETCD_ROOT)
    sync = EtcdRbacSync([etcd.endpoint], root, list_pods)
    first = await sync.sync_once()
    assert first.added == {WORKER_A, GATEWAY} and not first.removed
    assert await registers(etcd, certs, WORKER_A) and await registers(etcd, certs, GATEWAY)
    assert not await registers(etcd, certs, WORKER_B)  # no pod yet: no user, auth is on

    pods = {"items": [pod(WORKER_B.instance, "gpu-worker"), pod(GATEWAY.instance, "gateway")]}
    second = await sync.sync_once()
    assert second.added == {WORKER_B} and second.removed == {WORKER_A}
    assert await instance_users(etcd.endpoint, root) == {WORKER_B, GATEWAY}
    assert await registers(etcd, certs, WORKER_B)
    assert not await registers(etcd, certs, WORKER_A)  # its pod is gone: its certificate is refused
    assert (await sync.sync_once()).added == frozenset()  # nothing changed: nothing to do

    # A restarted controller starts from what etcd has.
    again = EtcdRbacSync([etcd.endpoint], root, list_pods)
    await again.sync_once()
    pods = {"items": []}
    assert (await again.sync_once()).removed == {WORKER_B, GATEWAY}


class _ApiServer(BaseHTTPRequestHandler):
    """The one API call the controller makes: the namespace's pods, by label."""

    seen: ClassVar[list[tuple[str, dict, str]]] = []

    def do_GET(self) -> None:
        url = urlparse(self.path)
        self.seen.append((url.path, parse_qs(url.query), self.headers.get("Authorization", "")))
        body = json.dumps({"kind": "PodList", "items": [pod(WORKER_A.instance, "gpu-worker")]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


async def test_the_pods_come_from_the_api_server_as_the_service_account(tmp_path):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "namespace").write_text("loramesh\n")
    (account / "token").write_text("token-1\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pods = KubernetesPods(f"http://127.0.0.1:{server.server_port}", account_dir=account)
        assert identities_of_pods(await pods()) == {WORKER_A}
        (account / "token").write_text("token-2\n")  # rotated by the kubelet: read per call
        await pods()
    finally:
        server.shutdown()
        server.server_close()
    selector = {"labelSelector": ["app.kubernetes.io/part-of=loramesh"]}
    assert _ApiServer.seen == [
        ("/api/v1/namespaces/loramesh/pods", selector, "Bearer token-1"),
        ("/api/v1/namespaces/loramesh/pods", selector, "Bearer token-2"),
    ]


def test_the_command_refuses_without_etcd_or_the_admin_certificate(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LORAMESH_ETCD_ENDPOINTS", raising=False)
    state = ["--state-dir", str(tmp_path)]
    assert loramesh([*state, "etcd-rbac-sync", "--once"]) == 1
    assert "--etcd-endpoints" in capsys.readouterr().err
    assert loramesh([*state, "etcd-rbac-sync", "--once", "--etcd-endpoints", "127.0.0.1:1"]) == 1
    assert "admin certificate" in capsys.readouterr().err
