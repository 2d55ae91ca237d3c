"""The base model spec read from the real GGUF file, and its cache file; from a HF directory."""

from __future__ import annotations

import json

import pytest

from services.model_files import base_model
from services.model_files.base_model import (
    BaseModelSpec,
    default_model_path,
    load_base_model_spec,
    spec_cache_path,
)
from services.model_files.cache_dir import CACHE_ENV


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache root, and no spec remembered in this process."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    base_model._load_spec.cache_clear()
    yield tmp_path / "cache"
    base_model._load_spec.cache_clear()


def test_the_gguf_spec_is_cached_on_disk_and_read_back(fresh, base_spec):
    cache = spec_cache_path(default_model_path())
    assert cache.parent == fresh / "converted" and not cache.exists()
    assert load_base_model_spec() == base_spec  # parsed from the header
    assert json.loads(cache.read_text())["hidden_size"] == base_spec.hidden_size

    # What the cache says is what a later start gets, without parsing the file again.
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "name": "from-the-cache"}))
    base_model._load_spec.cache_clear()
    assert load_base_model_spec().name == "from-the-cache"


def test_a_bad_cache_file_is_read_again_from_the_model(fresh, base_spec):
    cache = spec_cache_path(default_model_path())
    cache.parent.mkdir(parents=True)
    for bad in ("not json", json.dumps({"hidden_size": 1})):
        cache.write_text(bad)
        base_model._load_spec.cache_clear()
        assert load_base_model_spec() == base_spec
        assert json.loads(cache.read_text())["vocab_size"] == base_spec.vocab_size


def test_a_hf_directory_gives_its_model_config_s_dimensions(tmp_path):
    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = BaseModelSpec(
        tmp_path.name, 64, 128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256
    )
    assert load_base_model_spec(tmp_path) == load_base_model_spec(tmp_path / "config.json") == spec
