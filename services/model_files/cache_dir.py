"""Where loramesh keeps what it derives from a base model file (converted weights, tokenizers),
so a restart reads the result instead of converting again. No torch here: the gateway uses it."""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable naming loramesh's cache root (default ``~/.cache/loramesh``).
CACHE_ENV = "LORAMESH_CACHE_DIR"


def cache_root() -> Path:
    """``$LORAMESH_CACHE_DIR``, else ``~/.cache/loramesh``: read at call time, not import time."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "loramesh"


def default_cache_dir() -> Path:
    """``$LORAMESH_CACHE_DIR/converted``, else ``~/.cache/loramesh/converted`` (read at call time)."""
    return cache_root() / "converted"
