"""Where a client connects: the gateway addresses, API key and TLS files it is given, the
missing ones taken from the local mesh's file (``loramesh up`` writes it)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from loramesh.errors import NoApiKey, NoGatewayAddress
from loramesh.tls import ClientTLS

STATE_DIR_ENV = "LORAMESH_STATE_DIR"
"""The local mesh's state directory, where ``loramesh up`` writes ``mesh.json``: the default of the
CLI's ``--state-dir`` and of the clients' ``mesh_file``."""
DEFAULT_STATE_DIR = Path(".loramesh")
"""The state directory when ``$LORAMESH_STATE_DIR`` is unset (relative to the working directory)."""
MESH_FILE_NAME = "mesh.json"


def default_state_dir() -> Path:
    """``$LORAMESH_STATE_DIR``, else ``.loramesh``. Read at each call, never at import, so a
    variable set after ``import loramesh`` counts."""
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def resolve_targets(
    address: str | Sequence[str] | None,
    api_key: str | None,
    mesh_file: str | Path | None,
    tls: ClientTLS | None = None,
) -> tuple[tuple[str, ...], str, ClientTLS | None]:
    """The gateway addresses, API key and TLS files, the missing ones taken from a local mesh's
    file.

    The mesh file's ``admin_api_key`` and ``tls`` CA are only used when every address is one of the
    mesh file's gateways, so a key never goes to a server it was not issued by. The mesh file's
    client certificate (the operator's) is never taken: a client of the gateway presents none.

    Args:
        address: ``host:port`` of a gateway, several of them (a sequence, or one string with
            commas), or None for the mesh file's gateways.
        api_key: The caller's API key, or None for the mesh file's admin key.
        mesh_file: The file ``loramesh up`` writes (``{"gateway_addresses", "services":
            {"gateway": {"address"}}, "admin_api_key", "tls"}``); ignored when it does not exist.
            None: ``mesh.json`` in :func:`default_state_dir`.
        tls: The client's TLS files, or None for the mesh file's CA (if it has one).

    Returns:
        ``(addresses, api_key, tls)``; ``tls`` None: plaintext.

    Raises:
        NoGatewayAddress: No address is given and the mesh file has none (a ``ValueError``).
        NoApiKey: No key is given and the mesh file's does not apply (a ``ValueError``).
    """
    path = Path(mesh_file) if mesh_file is not None else default_state_dir() / MESH_FILE_NAME
    mesh = json.loads(path.read_text()) if path.is_file() else {}
    first = mesh.get("services", {}).get("gateway", {}).get("address")
    mesh_addresses = tuple(mesh.get("gateway_addresses") or ([first] if first else []))
    if isinstance(address, str):
        address = address.split(",")
    addresses = tuple(a.strip() for a in address or () if a.strip()) or mesh_addresses
    if not addresses:
        found = "names no gateway" if path.is_file() else "does not exist"
        raise NoGatewayAddress(
            f"no gateway address: pass address=, or start a mesh with `loramesh up` ({path.absolute()} "
            f"{found}; ${STATE_DIR_ENV} names the state directory of a mesh started elsewhere)",
            path,
        )
    own_mesh = set(addresses) <= set(mesh_addresses)
    if api_key is None and own_mesh:
        api_key = mesh.get("admin_api_key")
    if not api_key:
        whose = (
            f"the admin key of {path.absolute()} goes only to that mesh's own gateways"
            if path.is_file()
            else f"no {path.absolute()} to take a local mesh's admin key from"
        )
        raise NoApiKey(
            f"no API key for the gateway at {', '.join(addresses)}: pass api_key= ({whose})", addresses
        )
    if tls is None and own_mesh and mesh.get("tls"):
        # The CA alone: the file's certificate is the operator's, for the CLI's calls to the
        # internal ports; a gateway's public port reads none (the API key names the tenant).
        tls = ClientTLS(mesh["tls"]["ca_file"], server_name=mesh["tls"].get("server_name", ""))
    return addresses, api_key, tls
