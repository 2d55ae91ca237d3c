"""The mesh's certificate authority and one certificate per identity (``loramesh certs``).

A directory made by :func:`create_mesh_certificates` holds ``ca.pem`` (the CA certificate every
peer trusts), ``ca-key.pem`` (kept to issue more; never mounted into a service) and, per
identity (services.runtime.security.identity), ``<kind>.pem`` + ``<kind>-key.pem`` for one a whole kind
shares, ``<kind>/<instance>.pem`` + ``<kind>/<instance>-key.pem`` for one bound to an instance
(what ``loramesh up --tls`` issues for each process it starts). Each certificate names its
identity twice: ``CN=<kind>[/<instance>]`` (etcd's user, services.runtime.etcd.etcd_rbac) and the URI
SAN ``spiffe://loramesh/<kind>[/<instance>]`` (what services.runtime.security.tls.peer_identity reads
from a verified peer), and carries DNS/IP SANs for loopback and the kind's Kubernetes Service
names, so a client can verify the server it dialled. Keys are EC P-256, written ``0600`` in
``0700`` directories.

Validity: the CA and, by default, the certificates are valid :data:`DEFAULT_VALIDITY_DAYS`;
``validity`` issues short-lived certificates instead (``loramesh certs --hours``), which the
services reload when the files are replaced (services.runtime.security.certificate_reload). The TLS
handshake refuses an expired certificate: short lifetimes are the mesh's revocation
(docs/security.md, "Rotation and expiry").
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.runtime.security.identity import KINDS, MeshIdentity
from services.runtime.security.private_files import private_dir, write_private_text
from services.runtime.security.tls import MESH_SERVER_NAME, TLSConfig

Identity = MeshIdentity | str
"""An identity, or its text (``gpu_worker``, ``gpu_worker/gpu_worker-0``)."""

CA_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"
DEFAULT_VALIDITY_DAYS = 365

#: Kubernetes Service names per identity (k8s/base), short and namespace-qualified forms.
K8S_SERVICE_NAMES = {
    "gateway": ("gateway", "gateway-internal"),
    "scheduler": ("scheduler",),
    "adapter_store": ("adapter-store",),
    "gpu_worker": ("gpu-worker",),
    "kv_manager": ("kv-manager",),
    "etcd": ("etcd", "etcd-client", "*.etcd"),
    "admin": (),
    "operator": (),
}


def _identity(identity: Identity) -> MeshIdentity:
    return identity if isinstance(identity, MeshIdentity) else MeshIdentity.parse(identity)


def dns_names(kind: str, namespace: str) -> list[str]:
    """DNS SANs of a certificate of ``kind``: loopback, the mesh-wide name peers dialled by IP
    are checked against (:data:`MESH_SERVER_NAME`), and the kind's Services in ``namespace``."""
    names = ["localhost", MESH_SERVER_NAME]
    for service in K8S_SERVICE_NAMES.get(kind, ()):
        names += [service, f"{service}.{namespace}", f"{service}.{namespace}.svc"]
    return names


@dataclass(frozen=True)
class CertificateDirectory:
    """Where a mesh's certificates are (the layout :func:`create_mesh_certificates` writes)."""

    path: Path
    """The directory."""

    @property
    def ca_file(self) -> Path:
        return self.path / CA_FILE

    def cert_file(self, identity: Identity) -> Path:
        return self._file(identity, ".pem")

    def key_file(self, identity: Identity) -> Path:
        return self._file(identity, "-key.pem")

    def _file(self, identity: Identity, suffix: str) -> Path:
        """``<kind><suffix>``, or ``<kind>/<instance><suffix>`` for an instance's identity."""
        who = _identity(identity)
        if who.instance:
            return self.path / who.kind / f"{who.instance}{suffix}"
        return self.path / f"{who.kind}{suffix}"

    def tls_for(self, identity: Identity) -> TLSConfig:
        """The TLS settings a process of ``identity`` runs with."""
        return TLSConfig(
            ca_file=str(self.ca_file),
            cert_file=str(self.cert_file(identity)),
            key_file=str(self.key_file(identity)),
        )

    def complete(self, identities: Iterable[Identity] = KINDS) -> bool:
        """Whether the CA and every identity's certificate and key are there."""
        files = [self.ca_file, *(f(i) for i in identities for f in (self.cert_file, self.key_file))]
        return all(f.is_file() for f in files)


_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private_text(path, pem.decode())


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_text(cert.public_bytes(serialization.Encoding.PEM).decode())


def _new_ca(common_name: str, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _issue(
    identity: MeshIdentity,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    namespace: str,
    validity: datetime.timedelta,
    not_before: datetime.datetime | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    start = not_before or _now() - datetime.timedelta(minutes=5)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.spiffe_id)]
    sans += [x509.DNSName(n) for n in dns_names(identity.kind, namespace)]
    sans += [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity))]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # Every service is a server to its callers and a client of etcd and of other services.
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _load_ca(directory: CertificateDirectory) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(directory.ca_file.read_bytes())
    key = serialization.load_pem_private_key((directory.path / CA_KEY_FILE).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{directory.path / CA_KEY_FILE} is not an EC key (not made by `loramesh certs`)")
    return cert, key


def create_mesh_certificates(
    path: Path | str,
    identities: Iterable[Identity] = KINDS,
    namespace: str = "loramesh",
    days: int = DEFAULT_VALIDITY_DAYS,
    ca_name: str = "loramesh mesh CA",
    validity: datetime.timedelta | None = None,
    not_before: datetime.datetime | None = None,
) -> CertificateDirectory:
    """Write a CA (unless ``path`` already has one: it is reused, so more identities can be
    issued later) and a certificate and key for each of ``identities``. Returns the directory.

    A new CA is valid ``days``; the certificates ``validity`` (default: ``days`` too) from
    ``not_before`` (default: 5 minutes ago, for clocks a little behind). A ``not_before`` more
    than ``validity`` ago issues an expired certificate (a test's)."""
    if validity is None:
        validity = datetime.timedelta(days=days)
    if validity <= datetime.timedelta(0):
        raise ValueError(f"a certificate's validity must be positive, got {validity}")
    directory = CertificateDirectory(private_dir(path))
    if directory.ca_file.is_file() and (directory.path / CA_KEY_FILE).is_file():
        ca_cert, ca_key = _load_ca(directory)
    else:
        ca_cert, ca_key = _new_ca(ca_name, days)
        _write_key(directory.path / CA_KEY_FILE, ca_key)
        _write_cert(directory.ca_file, ca_cert)
    for identity in map(_identity, identities):
        cert, key = _issue(identity, ca_cert, ca_key, namespace, validity, not_before)
        if identity.instance:
            private_dir(directory.path / identity.kind)
        _write_key(directory.key_file(identity), key)
        _write_cert(directory.cert_file(identity), cert)
    return directory
