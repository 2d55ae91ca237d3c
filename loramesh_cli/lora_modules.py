"""``loramesh up --lora-modules NAME=DIR ...``: adapters registered as the mesh starts, as vLLM's
flag of that name does.

Each directory is checked before anything starts; once every service is ready, ``up`` uploads
each one through the gateway, the way ``loramesh adapters upload`` does. ``NAME`` registers for the
``admin`` tenant (mesh.json's key); ``OWNER/NAME`` for tenant ``OWNER``, whose plain key must be in
``--api-keys-file``. The adapter store keeps adapters across restarts of the same state
directory, so an adapter already registered under the name is kept when its files are the same
and replaced when they differ: after ``up``, the name serves what its directory holds now.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loramesh.client import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, Client, check_adapter_dir
from loramesh.errors import AlreadyExists, LoraMeshError
from loramesh.tls import ClientTLS
from loramesh_cli.errors import CommandError
from mesh_api.adapter_transfer import read_adapter_dir

REGISTER_TIMEOUT_S = 300.0
"""One adapter's upload (up to the store's size limit); a hang guard, not a timing claim."""


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry."""

    spec: str
    """As given on the command line (what refusals quote)."""
    owner: str
    """The tenant it is registered for."""
    name: str
    directory: Path
    """Absolute: resolved against the working directory of ``up``."""


def parse_lora_modules(
    specs: Sequence[str], admin_tenant: str, tenant_keys: dict[str, str]
) -> list[LoraModule]:
    """The entries of ``--lora-modules``, each directory checked; a :class:`CommandError` naming
    the entry that is malformed, repeated, for a tenant without a key in ``tenant_keys``
    (tenant → plain API key), or whose directory is not an adapter directory."""
    modules: list[LoraModule] = []
    for spec in specs:
        reference, sep, path = spec.partition("=")
        owner, slash, name = reference.rpartition("/")
        owner = owner if slash else admin_tenant
        if not sep or not name or not owner or not path:
            raise CommandError(f"--lora-modules {spec!r}: expected NAME=DIR or OWNER/NAME=DIR")
        if owner != admin_tenant and owner not in tenant_keys:
            raise CommandError(
                f"--lora-modules {spec}: registering for tenant {owner!r} needs its plain API key in "
                f"--api-keys-file (a plain NAME registers for the {admin_tenant!r} tenant)"
            )
        try:
            directory = check_adapter_dir(Path(path).expanduser().resolve())
        except OSError as error:
            raise CommandError(f"--lora-modules {spec}: {error}") from None
        if any((m.owner, m.name) == (owner, name) for m in modules):
            raise CommandError(f"--lora-modules names {owner}/{name} twice")
        modules.append(LoraModule(spec, owner, name, directory))
    return modules


def register_lora_modules(
    modules: Sequence[LoraModule],
    gateways: Sequence[str],
    tenant_keys: dict[str, str],
    tls: ClientTLS | None,
    mesh_file: Path,
    log: Callable[[str], None],
) -> None:
    """Uploads every module through ``gateways`` with its tenant's key (``tenant_keys``: tenant →
    plain API key); a :class:`CommandError` naming the entry the mesh refused."""
    for module in modules:
        with Client(gateways, tenant_keys[module.owner], tls=tls, mesh_file=mesh_file) as client:
            try:
                outcome = _register(client, module)
            except LoraMeshError as error:
                raise CommandError(f"--lora-modules {module.spec}: {error.code}: {error.details}") from None
        log(f"{outcome} {module.owner}/{module.name} from {module.directory}")


def _register(client: Client, module: LoraModule) -> str:
    """Registers one module; says whether it was new, kept or replaced."""
    try:
        client.adapters.upload(module.directory, module.name, timeout=REGISTER_TIMEOUT_S)
        return "registered"
    except AlreadyExists:
        registered = client.adapters.get(module.name)
    files = read_adapter_dir(module.directory)
    weights_sha256 = hashlib.sha256(files[ADAPTER_WEIGHTS_FILE]).hexdigest()
    config_json = files[ADAPTER_CONFIG_FILE].decode("utf-8")
    if (registered.sha256, registered.config_json) == (weights_sha256, config_json):
        return "kept (already registered, same files)"
    client.adapters.delete(module.name)
    client.adapters.upload(module.directory, module.name, timeout=REGISTER_TIMEOUT_S)
    return "replaced (its files changed)"
