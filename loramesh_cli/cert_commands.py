"""``loramesh certs``: a CA and one certificate per identity, for mutual TLS."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from loramesh_cli.errors import CommandError
from services.runtime.security.certificates import DEFAULT_VALIDITY_DAYS, create_mesh_certificates
from services.runtime.security.identity import KINDS, MeshIdentity


def add_parsers(sub) -> None:
    certs = sub.add_parser(
        "certs",
        help="create a mesh CA and a certificate per identity (mutual TLS)",
        description="Writes ca.pem, ca-key.pem and, per identity, <kind>.pem + <kind>-key.pem, or "
        "<kind>/<instance>.pem + <kind>/<instance>-key.pem for one bound to an instance (keys 0600). "
        "An existing CA in the directory is reused, so running it again re-issues certificates "
        "that every running peer still trusts; running services pick the new files up without a "
        'restart (docs/operations.md, "Rotating certificates").',
    )
    certs.add_argument("--out", default="", help="directory (default: <state dir>/certs)")
    certs.add_argument("--identity", action="append", default=None, type=identity_argument,
                       help=f"issue only this identity (repeatable; default: every kind): one of "
                            f"{', '.join(KINDS)}, or KIND/INSTANCE for one instance, e.g. "
                            "gpu_worker/gpu_worker-0 (its --instance-id)")  # fmt: skip
    certs.add_argument("--namespace", default="loramesh",
                       help="Kubernetes namespace of the Service names in the certificates")  # fmt: skip
    certs.add_argument("--days", type=int, default=DEFAULT_VALIDITY_DAYS,
                       help="validity of a new CA and, without --hours, of the certificates")  # fmt: skip
    certs.add_argument("--hours", type=float, default=0,
                       help="issue short-lived certificates, valid this many hours (the CA keeps "
                            "--days); re-issue them before they expire")  # fmt: skip
    certs.set_defaults(func=cmd_certs)


def identity_argument(text: str) -> MeshIdentity:
    """``--identity``: a kind the mesh knows, optionally with ``/<instance>``."""
    try:
        identity = MeshIdentity.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if identity.kind not in KINDS:
        raise argparse.ArgumentTypeError(f"unknown kind {identity.kind!r}: one of {', '.join(KINDS)}")
    return identity


def cmd_certs(args) -> int:
    if args.days < 1:
        raise CommandError(f"--days must be at least 1, got {args.days}")
    if args.hours < 0:
        raise CommandError(f"--hours must be positive, got {args.hours:g}")
    validity = datetime.timedelta(hours=args.hours) if args.hours else None
    out = Path(args.out) if args.out else Path(args.state_dir) / "certs"
    identities = tuple(args.identity or map(MeshIdentity, KINDS))
    directory = create_mesh_certificates(
        out, identities, namespace=args.namespace, days=args.days, validity=validity
    )
    print(f"{'CA':<14} {directory.ca_file}")
    for identity in identities:
        print(f"{identity!s:<14} {directory.cert_file(identity)}  key {directory.key_file(identity)}")
    return 0
