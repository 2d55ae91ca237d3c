"""Which file system a process sees, as a string two processes can compare.

Two processes with the same boot and the same mount namespace resolve every path to the same
file: a worker beside the adapter store (``loramesh up`` on one machine) can read a blob the
store wrote instead of having it streamed over gRPC. Containers have mount namespaces of their
own, so pods (even on one node) never match and keep the stream.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def file_system_identity() -> str:
    """``<boot id>:<mount namespace inode>``; empty where either cannot be read (not Linux):
    an empty identity matches nothing."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return ""
    return f"{boot}:{namespace}"
