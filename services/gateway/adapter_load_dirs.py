"""Which directory on the gateway's machine a ``lora_path`` (vLLM's ``/v1/load_lora_adapter``)
names, and whether the gateway may read it.

Only directories under ``--adapter-load-dirs`` may be read: a tenant must not make the gateway
read arbitrary files. A relative path is looked up under each of those directories in the order
given, and the first that has it wins; it never resolves against the gateway's working
directory, which is wherever ``loramesh up`` happened to run. A path that leads out of them
(``..``, a symbolic link pointing elsewhere) is refused however it is spelled: the directory is
resolved (``..`` and links followed) before it is compared with the resolved load dirs.

This confines the directory only; its files are read by the adapter store's ``file://`` importer
(:meth:`services.gateway.adapter_admin.AdapterAdmin.load_adapter_dir`), which checks the tenant's
import policy, refuses a file that is a link or not a regular file, and the size limit.
"""

from __future__ import annotations

from pathlib import Path

from services.runtime.errors import InvalidArgument, PermissionDenied


def load_roots(adapter_load_dirs: str) -> list[Path]:
    """The directories of the comma-separated ``--adapter-load-dirs``, resolved."""
    return [Path(d.strip()).resolve() for d in adapter_load_dirs.split(",") if d.strip()]


def resolve_adapter_dir(path: str, roots: list[Path]) -> Path:
    """The directory ``path`` names under ``roots``: PermissionDenied when loading by path is
    off or ``path`` leads out of every root, InvalidArgument when no root has it."""
    if not roots:
        raise PermissionDenied("loading adapters from a path is off (gateway flag --adapter-load-dirs)")
    given = Path(path)
    candidates = [given.resolve()] if given.is_absolute() else [(root / given).resolve() for root in roots]
    allowed = [c for c in candidates if any(c.is_relative_to(root) for root in roots)]
    if not allowed:
        raise PermissionDenied(f"{path!r} is not under a directory the gateway may load adapters from")
    for directory in allowed:
        if directory.is_dir():
            return directory
    where = "" if given.is_absolute() else f" under {', '.join(str(r) for r in roots)}"
    raise InvalidArgument(f"adapter directory {path!r} does not exist{where}")
