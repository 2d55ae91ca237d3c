"""What ``loramesh bench``'s command line tells the systems beyond the profile: where llama-server
is, and extra ``loramesh up`` flags for the loramesh-up system."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LLAMA_SERVER_ENV = "LORAMESH_LLAMA_SERVER"
"""Environment variable naming the llama-server binary when ``--llama-server`` is not given."""


@dataclass(frozen=True)
class SystemSettings:
    llama_server: Path | None = None
    """The llama-server binary; None: the llama.cpp systems cannot run."""
    up_args: tuple[str, ...] = ()
    """Flags added to loramesh-up's ``loramesh up`` (e.g. ``--dtype bfloat16``)."""


NO_SETTINGS = SystemSettings()
"""A command line that sets none of them: no llama-server, no extra ``up`` flags."""


def llama_server_path(option: str) -> Path | None:
    """The binary from ``--llama-server`` (``option``), else from ``$LORAMESH_LLAMA_SERVER``."""
    chosen = option or os.environ.get(LLAMA_SERVER_ENV, "")
    return Path(chosen) if chosen else None
