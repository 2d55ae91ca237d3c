"""``loramesh certs``: a CA and one certificate per service identity, for mutual TLS."""

from __future__ import annotations

from pathlib import Path

from loramesh_cli.errors import CommandError
from services.runtime.certificates import DEFAULT_VALIDITY_DAYS, IDENTITIES, create_mesh_certificates


def add_parsers(sub) -> None:
    certs = sub.add_parser(
        "certs",
        help="create a mesh CA and a certificate per service identity (mutual TLS)",
        description="Writes ca.pem, ca-key.pem and <identity>.pem + <identity>-key.pem (keys 0600). "
        "An existing CA in the directory is reused, so running it again re-issues certificates "
        "that every running peer still trusts.",
    )
    certs.add_argument("--out", default="", help="directory (default: <state dir>/certs)")
    certs.add_argument("--identity", action="append", default=None, choices=IDENTITIES,
                       help="issue only these identities (repeatable; default: all)")  # fmt: skip
    certs.add_argument("--namespace", default="loramesh",
                       help="Kubernetes namespace of the Service names in the certificates")  # fmt: skip
    certs.add_argument("--days", type=int, default=DEFAULT_VALIDITY_DAYS, help="validity")
    certs.set_defaults(func=cmd_certs)


def cmd_certs(args) -> int:
    if args.days < 1:
        raise CommandError(f"--days must be at least 1, got {args.days}")
    out = Path(args.out) if args.out else Path(args.state_dir) / "certs"
    identities = tuple(args.identity or IDENTITIES)
    directory = create_mesh_certificates(out, identities, namespace=args.namespace, days=args.days)
    print(f"{'CA':<14} {directory.ca_file}")
    for identity in identities:
        print(f"{identity:<14} {directory.cert_file(identity)}  key {directory.key_file(identity)}")
    return 0
