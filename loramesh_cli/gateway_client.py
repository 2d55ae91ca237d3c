"""The SDK client every gateway-facing command uses (``generate``, ``chat``, ``adapters``).

Gateway: ``--gateway``, else the local mesh's gateways (mesh.json). Key: ``--api-key``, else
``$LORAMESH_API_KEY``, else mesh.json's admin key, which the SDK sends only to that mesh's own
gateways. TLS: the global ``--tls-*`` flags, else mesh.json's. Each retry of an unreachable
gateway is announced on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loramesh.client import Client, RetryNotice
from loramesh.errors import NoApiKey, NoGatewayAddress, ResourceExhausted
from loramesh_cli.errors import CommandError
from loramesh_cli.mesh_file import MeshFile, live_mesh
from loramesh_cli.tls_options import sdk_tls

API_KEY_ENV = "LORAMESH_API_KEY"

DEFAULT_RETRIES = 6
"""The SDK's default: with its backoff (0.2 s doubling, with jitter) about 6-11 s in all."""


def add_connection_flags(parser: argparse.ArgumentParser, *, override_only: bool = False) -> None:
    """``--gateway``, ``--api-key`` and ``--retries``. With ``override_only`` (a verb's copy of
    its command's flags, as ``adapters list``), a flag not given leaves the command's value."""
    defaults = {"gateway": "", "api_key": "", "retries": DEFAULT_RETRIES}
    if override_only:
        defaults = dict.fromkeys(defaults, argparse.SUPPRESS)
    parser.add_argument("--gateway", default=defaults["gateway"], metavar="ADDR",
                        help="gateway address, or several separated by commas to fail over between "
                             "(default: every gateway in mesh.json)")  # fmt: skip
    parser.add_argument("--api-key", default=defaults["api_key"], metavar="KEY",
                        help=f"the tenant's API key (default: ${API_KEY_ENV}, else mesh.json's admin key)")  # fmt: skip
    parser.add_argument("--retries", type=int, default=defaults["retries"], metavar="N",
                        help="times an unreachable gateway is retried, 0.2 s doubling to 5 s apart "
                             f"(default {DEFAULT_RETRIES}: about 6-11 s in all)")  # fmt: skip


def announce_retry(notice: RetryNotice) -> None:
    """One stderr line per retry, so an unreachable gateway or a quota wait is not silent."""
    if isinstance(notice.failure, ResourceExhausted):
        why = f"gateway {notice.failed_address} asked to wait ({notice.failure.details})"
    else:
        why = f"gateway {notice.failed_address} is unavailable"
    print(
        f"loramesh: {why}; retrying on {notice.next_address} "
        f"in {notice.delay_s:.1f} s (retry {notice.retry} of {notice.retries})",
        file=sys.stderr,
        flush=True,
    )


def gateway_client(args) -> Client:
    """A :class:`Client` for the command's flags; a :class:`CommandError` saying what to pass
    when there is no gateway or no key to use. Without ``--gateway``, a mesh file whose
    ``loramesh up`` is gone is refused at once, not retried."""
    state_dir = Path(args.state_dir)
    if args.retries < 0:
        raise CommandError(f"--retries must be at least 0, got {args.retries}")
    if not args.gateway:
        live_mesh(state_dir, "pass --gateway HOST:PORT")
    try:
        return Client(
            args.gateway or None,
            args.api_key or os.environ.get(API_KEY_ENV) or None,
            retries=args.retries,
            mesh_file=MeshFile.path(state_dir),
            tls=sdk_tls(args),
            on_retry=announce_retry,
        )
    except NoGatewayAddress as error:
        raise CommandError(
            f"{error.mesh_file.absolute()} names no gateway: pass --gateway HOST:PORT"
        ) from None
    except NoApiKey as error:
        path = MeshFile.path(state_dir).absolute()
        whose = (
            f"the admin key of {path} goes only to that mesh's own gateways"
            if path.exists()
            else f"no {path} to take a local mesh's admin key from"
        )
        raise CommandError(
            f"no API key for the gateway at {', '.join(error.addresses)}: pass --api-key KEY or set "
            f"${API_KEY_ENV} ({whose})"
        ) from None
