"""Files and directories only their owner may read: state that holds keys, tenants' adapters, etcd data.

``mkdir``'s mode is filtered by the umask and leaves an existing directory as it was, so the
mode is set explicitly after creation.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: Path | str) -> Path:
    """Create ``path`` (and missing parents) if needed and make it ``0700``; returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    os.chmod(path, PRIVATE_DIR_MODE)
    return path


def write_private_text(path: Path | str, text: str) -> None:
    """Atomically replace ``path`` with ``text``, mode ``0600`` from the first byte written (the
    temporary file is created with that mode, so the content is never readable by others)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # O_CREAT's mode is filtered by the umask too
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
