"""The cache folder follows $LORAMESH_CACHE_DIR, read at call time."""

from __future__ import annotations

from pathlib import Path

from services.model_files.cache_dir import CACHE_ENV, cache_root, default_cache_dir


def test_cache_dir_env_is_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert (cache_root(), default_cache_dir()) == (tmp_path, tmp_path / "converted")
    monkeypatch.delenv(CACHE_ENV)
    assert default_cache_dir() == Path.home() / ".cache" / "loramesh" / "converted"
