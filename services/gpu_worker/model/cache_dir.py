"""Where loramesh keeps what it derives from a base model file (converted weights, tokenizers),
so a restart reads the result instead of converting again. No torch here: the gateway uses it."""

from __future__ import annotations

from pathlib import Path

from services.runtime.base_model import CACHE_ENV, cache_root

__all__ = ["CACHE_ENV", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$LORAMESH_CACHE_DIR/converted``, else ``~/.cache/loramesh/converted`` (read at call time)."""
    return cache_root() / "converted"
