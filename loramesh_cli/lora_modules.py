"""``loramesh up --lora-modules NAME=DIR|URI ...``: adapters registered as the mesh starts, as
vLLM's flag of that name does, in either of its forms: ``NAME=PATH``, or a JSON object
``{"name": NAME, "path": PATH, "base_model_name": BASE}`` (``base_model_name`` optional; a mesh
serves one base model, which the adapter store checks every adapter against, so it is only
checked to be a string).

Each directory is checked before anything starts; once every service is ready, ``up`` uploads
each one through the gateway, the way ``loramesh adapters upload`` does. A URI (``s3://``,
``hf://``, ``file://``) is imported by the adapter store instead, as ``loramesh adapters import``
does: ``up`` grants its owner that source in the store's import policy. ``NAME`` registers for the
``admin`` tenant (mesh.json's key); ``OWNER/NAME`` for tenant ``OWNER``, whose plain key must be in
``--api-keys-file``. The adapter store keeps adapters across restarts of the same state
directory, so an adapter already registered under the name is kept when its files are the same
and replaced when they differ: after ``up``, the name serves what its directory holds now.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loramesh.client import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, Client, check_adapter_dir
from loramesh.errors import AlreadyExists, LoraMeshError
from loramesh.tls import ClientTLS
from loramesh_cli.errors import CommandError
from mesh_api.adapter_transfer import is_import_uri, read_adapter_dir

JSON_KEYS = frozenset({"name", "path", "base_model_name"})
"""The keys of vLLM's JSON form of an entry."""
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
    source: str
    """A directory (absolute: resolved against the working directory of ``up``), or a URI the
    store imports from."""

    @property
    def is_uri(self) -> bool:
        return is_import_uri(self.source)


def parse_lora_modules(
    specs: Sequence[str], admin_tenant: str, tenant_keys: dict[str, str]
) -> list[LoraModule]:
    """The entries of ``--lora-modules``, each directory checked; a :class:`CommandError` naming
    the entry that is malformed, repeated, for a tenant without a key in ``tenant_keys``
    (tenant → plain API key), or whose directory is not an adapter directory."""
    modules: list[LoraModule] = []
    for spec in specs:
        reference, path = _reference_and_path(spec)
        owner, slash, name = reference.rpartition("/")
        owner = owner if slash else admin_tenant
        if not name or not owner or not path:
            raise CommandError(f"--lora-modules {spec!r}: expected NAME=DIR|URI or OWNER/NAME=DIR|URI")
        if owner != admin_tenant and owner not in tenant_keys:
            raise CommandError(
                f"--lora-modules {spec}: registering for tenant {owner!r} needs its plain API key in "
                f"--api-keys-file (a plain NAME registers for the {admin_tenant!r} tenant)"
            )
        source = path if is_import_uri(path) else _checked_directory(spec, path)
        if any((m.owner, m.name) == (owner, name) for m in modules):
            raise CommandError(f"--lora-modules names {owner}/{name} twice")
        modules.append(LoraModule(spec, owner, name, source))
    return modules


def _reference_and_path(spec: str) -> tuple[str, str]:
    """``[OWNER/]NAME`` and the directory or URI of one entry, in either form; empty strings
    where the ``NAME=PATH`` form lacks one (the caller refuses them)."""
    if not spec.lstrip().startswith("{"):
        reference, sep, path = spec.partition("=")
        return (reference, path) if sep else ("", "")
    try:
        entry = json.loads(spec)
    except json.JSONDecodeError as error:
        raise CommandError(f"--lora-modules {spec!r}: not JSON ({error.msg} at {error.pos})") from None
    if not isinstance(entry, dict) or set(entry) - JSON_KEYS:
        raise CommandError(
            f"--lora-modules {spec!r}: expected a JSON object of {', '.join(sorted(JSON_KEYS))}"
        )
    if not all(isinstance(entry.get(key, ""), str) for key in JSON_KEYS):
        raise CommandError(
            f"--lora-modules {spec!r}: each of {', '.join(sorted(JSON_KEYS))} must be a string"
        )
    return entry.get("name", ""), entry.get("path", "")


def _checked_directory(spec: str, path: str) -> str:
    try:
        return str(check_adapter_dir(Path(path).expanduser().resolve()))
    except OSError as error:
        raise CommandError(f"--lora-modules {spec}: {error}") from None


def import_grants(modules: Sequence[LoraModule]) -> dict[str, list[str]]:
    """Tenant → the URIs of its modules: what the store's import policy must allow for ``up``
    to import them."""
    grants: dict[str, list[str]] = {}
    for module in (m for m in modules if m.is_uri):
        grants.setdefault(module.owner, []).append(module.source)
    return grants


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
        log(f"{outcome} {module.owner}/{module.name} from {module.source}")


def _register(client: Client, module: LoraModule) -> str:
    """Registers one module; says whether it was new, kept or replaced."""
    if module.is_uri:
        imported = client.adapters.import_uri(module.source, module.name, timeout=REGISTER_TIMEOUT_S)
        return "imported" if imported.changed else "kept (already imported, same content)"
    try:
        client.adapters.upload(module.source, module.name, timeout=REGISTER_TIMEOUT_S)
        return "registered"
    except AlreadyExists:
        registered = client.adapters.get(module.name)
    files = read_adapter_dir(Path(module.source))
    weights_sha256 = hashlib.sha256(files[ADAPTER_WEIGHTS_FILE]).hexdigest()
    config_json = files[ADAPTER_CONFIG_FILE].decode("utf-8")
    if (registered.sha256, registered.config_json) == (weights_sha256, config_json):
        return "kept (already registered, same files)"
    client.adapters.delete(module.name)
    client.adapters.upload(module.source, module.name, timeout=REGISTER_TIMEOUT_S)
    return "replaced (its files changed)"
