"""Real material for the Secrets the manifests expect (templates in k8s/secrets/) and each pod's
own certificate (what cert-manager's csi-driver would write into its ``tls`` volume).

Everything is issued by the mesh's own code, as ``loramesh certs`` / ``loramesh up --tls`` do
(services.runtime.security.certificates): one CA for the run, ``etcd`` and ``admin``
certificates for loramesh-tls-etcd and loramesh-tls-admin, and per pod ``<kind>/<pod name>``.
A pod's csi attributes are checked against what that code issues (common name, URI SAN, DNS
names): a manifest asking for a name the mesh's certificates would not carry is a defect the
run reports rather than papers over.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from services.runtime.security.certificates import (
    CA_KEY_FILE,
    CertificateDirectory,
    create_mesh_certificates,
    dns_names,
)
from services.runtime.security.identity import MeshIdentity

TENANT = "pods"
"""The tenant the run's API key is for."""
CSI_DRIVER = "csi.cert-manager.io"


class ManifestMismatch(ValueError):
    """The manifests ask for something the mesh's own code does not do."""


@dataclass
class MeshSecrets:
    """The run's Secrets and the CA behind them."""

    certs: CertificateDirectory
    api_key: str
    data: dict[str, dict[str, bytes]]
    """Secret name -> key -> bytes."""

    def admin_files(self) -> tuple[Path, Path, Path]:
        """(CA, certificate, key) of the operator's ``admin`` identity."""
        return self.certs.ca_file, self.certs.cert_file("admin"), self.certs.key_file("admin")


def make_secrets(directory: Path, templates: list[dict], namespace: str) -> MeshSecrets:
    """A CA, the ``etcd`` and ``admin`` certificates and an API key, as the Secrets the
    templates define; a template key this run does not fill is an error."""
    certs = create_mesh_certificates(directory, ("etcd", "admin"), namespace=namespace)
    ca = certs.ca_file.read_bytes()

    def pair(identity: str) -> dict[str, bytes]:
        return {"ca.crt": ca, "tls.crt": certs.cert_file(identity).read_bytes(),
                "tls.key": certs.key_file(identity).read_bytes()}  # fmt: skip

    api_key = "pods-" + secrets.token_urlsafe(24)
    data = {
        "loramesh-mesh-ca": {"tls.crt": ca, "tls.key": (certs.path / CA_KEY_FILE).read_bytes()},
        "loramesh-tls-etcd": pair("etcd"),
        "loramesh-tls-admin": pair("admin"),
        "loramesh-api-keys": {"keys.json": json.dumps({api_key: TENANT}).encode()},
    }
    for template in templates:
        if template.get("kind") != "Secret":
            continue
        name = template["metadata"]["name"]
        keys = set(template.get("stringData", {})) | set(template.get("data", {}))
        if name not in data or keys != set(data[name]):
            raise ManifestMismatch(
                f"Secret template {name} (k8s/secrets) holds keys {sorted(keys)}; the run fills "
                f"{sorted(data.get(name, {}))}"
            )
    return MeshSecrets(certs, api_key, data)


def pod_certificate(mesh: MeshSecrets, attributes: dict, pod: str, namespace: str) -> dict[str, bytes]:
    """The files cert-manager's csi-driver writes for ``pod`` (ca.crt, tls.crt, tls.key)."""

    def expand(text: str) -> str:
        return text.replace("${POD_NAME}", pod).replace("${POD_NAMESPACE}", namespace)

    prefix = CSI_DRIVER + "/"
    wanted = {k.removeprefix(prefix): expand(v) for k, v in attributes.items() if k.startswith(prefix)}
    identity = MeshIdentity.parse(wanted["common-name"])
    issued_dns = dns_names(identity.kind, namespace)
    asked_dns = [n.strip() for n in wanted.get("dns-names", "").split(",") if n.strip()]
    if asked_dns != issued_dns:
        raise ManifestMismatch(
            f"pod {pod}: csi dns-names {asked_dns} differ from the mesh certificate's {issued_dns}"
        )
    if wanted.get("uri-sans", "") != identity.spiffe_id:
        raise ManifestMismatch(
            f"pod {pod}: csi uri-sans {wanted.get('uri-sans')!r}, not {identity.spiffe_id}"
        )
    create_mesh_certificates(mesh.certs.path, (identity,), namespace=namespace)
    return {
        "ca.crt": mesh.certs.ca_file.read_bytes(),
        "tls.crt": mesh.certs.cert_file(identity).read_bytes(),
        "tls.key": mesh.certs.key_file(identity).read_bytes(),
    }
