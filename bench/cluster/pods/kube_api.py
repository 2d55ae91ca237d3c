"""The one corner of the Kubernetes API the overlay uses: listing pods (etcd-rbac-sync does,
services.runtime.etcd.etcd_rbac_sync.KubernetesPods). A stand-in, as Kubernetes cannot run here.

It serves HTTPS at ``kubernetes.default.svc`` (the host's address on the run's network, port
443) with a certificate of a cluster CA of its own, which every pod's service-account folder
holds as ``ca.crt`` beside a token for its service account. A request is allowed as RBAC allows
it: the token's service account, the RoleBindings and ClusterRoleBindings naming it, and the
rules of the Roles they bind must grant ``list`` on ``pods`` in the namespace asked, or the
answer is 403, as an API server's. Pods are listed from the run, Running while their process
runs, with labelSelector (equality terms) applied.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import secrets
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")
ALL = "*"


def _write_server_certificate(directory: Path, address: str) -> tuple[Path, Path, Path]:
    """A cluster CA and the API server's certificate for :data:`NAMES` and ``address``;
    (ca, cert, key) files."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pods run cluster CA")])

    def builder(subject: x509.Name, public_key) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))  # fmt: skip

    ca = (
        builder(ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans = [x509.DNSName(n) for n in NAMES] + [x509.IPAddress(ipaddress.ip_address(address))]
    cert = builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]), key.public_key())
    cert = cert.add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(ca_key, hashes.SHA256())
    paths = directory / "ca.crt", directory / "apiserver.crt", directory / "apiserver.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    paths[2].chmod(0o600)
    return paths


def allowed(
    rbac: Iterable[Mapping], namespace: str, account: str, verb: str, resource: str, in_ns: str
) -> bool:
    """Whether service account ``namespace/account`` may ``verb`` ``resource`` (core group) in
    namespace ``in_ns``, by the overlay's Roles, ClusterRoles and their bindings."""
    objects = list(rbac)
    roles = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objects
             if o["kind"] in ("Role", "ClusterRole")}  # fmt: skip
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        bound_ns = binding["metadata"].get("namespace", "")
        if binding["kind"] == "RoleBinding" and bound_ns != in_ns:
            continue
        subject = any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                      and s.get("namespace", bound_ns) == namespace for s in binding.get("subjects", []))  # fmt: skip
        if not subject:
            continue
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], bound_ns if ref["kind"] == "Role" else "", ref["name"]))
        for rule in (role or {}).get("rules", []):
            if (set(rule.get("apiGroups", [])) & {"", ALL} and set(rule.get("resources", [])) & {resource, ALL}
                    and set(rule.get("verbs", [])) & {verb, ALL}):  # fmt: skip
                return True
    return False


class KubeApi:
    """The stand-in API server, in a thread of the run's process."""

    def __init__(
        self,
        directory: Path,
        address: str,
        rbac: list[dict],
        pods: Callable[[], list[dict]],
        log: Callable[[str], None],
    ):
        """``pods()``: the run's pods now, each {name, namespace, labels, ip, running};
        ``log``: told ``<account> GET <path> -> <status>`` of the first request answered and
        of every one refused."""
        self.address = address
        self.ca_file, cert, key = _write_server_certificate(directory, address)
        self._rbac, self._pods, self._log = rbac, pods, log
        self._tokens: dict[str, tuple[str, str]] = {}
        self._answered = False
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self._server = ThreadingHTTPServer((address, 443), self._handler())
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kube-api", daemon=True)

    def token(self, namespace: str, account: str) -> str:
        """The token of service account ``namespace/account`` (made on first ask)."""
        for token, who in self._tokens.items():
            if who == (namespace, account):
                return token
        token = secrets.token_urlsafe(32)
        self._tokens[token] = (namespace, account)
        return token

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _pod_list(self, namespace: str, selector: str) -> dict:
        terms = dict(t.split("=", 1) for t in selector.split(",") if "=" in t)
        items = [
            {"metadata": {"name": p["name"], "namespace": p["namespace"], "labels": p["labels"]},
             "status": {"phase": "Running" if p["running"] else "Pending", "podIP": p["ip"]}}
            for p in self._pods()
            if p["namespace"] == namespace and all(p["labels"].get(k) == v for k, v in terms.items())
        ]  # fmt: skip
        return {"kind": "PodList", "apiVersion": "v1", "items": items}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                who = api._tokens.get(self.headers.get("Authorization", "").removeprefix("Bearer "))
                parts = url.path.strip("/").split("/")
                status, body = 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
                if who is None:
                    status, body = (
                        401,
                        {"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401},
                    )
                elif parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 5 and parts[4] == "pods":
                    if allowed(api._rbac, *who, "list", "pods", parts[3]):
                        selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
                        status, body = 200, api._pod_list(parts[3], selector)
                    else:
                        status = 403
                        body = {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                                "message": f"system:serviceaccount:{who[0]}:{who[1]} cannot list pods in {parts[3]}"}  # fmt: skip
                if status != 200 or not api._answered:  # the first answer, then refusals only
                    account = f"system:serviceaccount:{who[0]}:{who[1]}" if who else "anonymous"
                    api._log(f"kube-api: {account} GET {url.path} -> {status}")
                    api._answered = api._answered or status == 200
                self._send(status, body)

            def log_message(self, *args) -> None:
                return  # every request goes to the run's log instead

        return Handler
