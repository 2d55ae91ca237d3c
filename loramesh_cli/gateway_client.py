"""The SDK client every gateway-facing command uses (``generate``, ``chat``, ``adapters``).

Gateway: ``--gateway``, else the local mesh's gateways (mesh.json). Key: ``--api-key``, else
``$LORAMESH_API_KEY``, else mesh.json's admin key, which the SDK sends only to that mesh's own
gateways. TLS: the global ``--tls-*`` flags, else mesh.json's.
"""

from __future__ import annotations

import os
from pathlib import Path

from loramesh.client import Client
from loramesh_cli.errors import CommandError
from loramesh_cli.mesh_file import MeshFile
from loramesh_cli.tls_options import sdk_tls

API_KEY_ENV = "LORAMESH_API_KEY"


def gateway_client(args) -> Client:
    """A :class:`Client` for the command's flags; a :class:`CommandError` saying what to pass
    when there is no gateway or no key to use."""
    state_dir = Path(args.state_dir)
    if not args.gateway and MeshFile.read(state_dir) is None:
        raise CommandError("no mesh is up; start one with `loramesh up` or pass --gateway HOST:PORT")
    try:
        return Client(
            args.gateway or None,
            args.api_key or os.environ.get(API_KEY_ENV) or None,
            mesh_file=str(MeshFile.path(state_dir)),
            tls=sdk_tls(args),
        )
    except ValueError as error:  # no key: the mesh file's goes only to that mesh's own gateways
        reason = str(error).partition(": pass")[0]
        fix = f"--api-key KEY or set ${API_KEY_ENV}" if "API key" in reason else "--gateway HOST:PORT"
        raise CommandError(f"{reason}: pass {fix}") from None
