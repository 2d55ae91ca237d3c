"""``--tls-ca/--tls-cert/--tls-key`` (and ``--tls-server-name``): the TLS files the CLI presents to a
mesh that runs with TLS. The gateway commands (``generate``, ``adapters``...) need the CA alone: a
gateway's public port reads no certificate, the API key names the tenant. The operator's commands
(``status``, ``etcd-rbac-sync``...) call internal ports and etcd, which take mutual TLS: the CA, a
certificate and its key. Without flags, the local mesh's files from mesh.json (``loramesh up
--tls`` writes the CA and the ``operator`` identity's there); without those, plaintext."""

from __future__ import annotations

from pathlib import Path

from loramesh.tls import ClientTLS
from loramesh_cli.errors import CommandError
from loramesh_cli.mesh_file import MeshFile
from services.runtime.security.tls import NO_TLS, TLSConfig


def add_tls_flags(parser) -> None:
    parser.add_argument("--tls-ca", default="", help="mesh CA certificate (default: from mesh.json)")
    parser.add_argument("--tls-cert", default="",
                        help="client certificate, e.g. certs/operator.pem (the gateway commands need none)")  # fmt: skip
    parser.add_argument("--tls-key", default="", help="its private key, e.g. certs/operator-key.pem")
    parser.add_argument(
        "--tls-server-name",
        default="",
        help="name the servers' certificates are checked against instead of the host dialled "
        "(mesh.loramesh in a cluster, whose etcd members are dialled as etcd-0.etcd)",
    )


def cli_tls(args) -> TLSConfig:
    """The TLS settings of this command: the flags, else mesh.json's, else none (plaintext)."""
    try:
        if args.tls_ca or args.tls_cert or args.tls_key:
            return TLSConfig(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    except ValueError as error:
        raise CommandError(f"--tls-ca, --tls-cert and --tls-key go together: {error}") from None
    mesh = MeshFile.read(Path(args.state_dir))
    return mesh.tls_config() if mesh is not None else NO_TLS


def sdk_tls(args) -> ClientTLS | None:
    """The flags as the SDK's TLS option (``--tls-ca`` alone will do); None leaves the SDK to read
    mesh.json's CA itself."""
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    try:
        return ClientTLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    except ValueError as error:
        raise CommandError(f"--tls-ca, with --tls-cert and --tls-key together or neither: {error}") from None
