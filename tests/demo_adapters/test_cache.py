"""The demo adapters' cache: a key that follows what the weights depend on, reuse without
training, and nothing that looks finished after a failed run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from demo_adapters import cache
from demo_adapters.cache import REPORT_FILE, cache_key, ensure_adapters
from demo_adapters.data import BEHAVIOURS
from demo_adapters.training import DEMO_CONFIGS, TrainingConfig

IDENTITY = "SmolLM2-135M-Instruct.Q4_1.gguf:98362432"


def _with(behaviour: str, **changes) -> dict[str, TrainingConfig]:
    return {**DEMO_CONFIGS, behaviour: dataclasses.replace(DEMO_CONFIGS[behaviour], **changes)}


def test_the_key_is_stable_and_follows_configs_and_base_model():
    key = cache_key(DEMO_CONFIGS, IDENTITY)
    assert key == cache_key(dict(DEMO_CONFIGS), IDENTITY)
    assert len(key) == 16 and int(key, 16) >= 0
    assert cache_key(_with("pirate", steps=DEMO_CONFIGS["pirate"].steps + 1), IDENTITY) != key
    assert cache_key(_with("sql", seed=1), IDENTITY) != key
    assert cache_key(_with("french", learning_rate=1e-3), IDENTITY) != key
    assert cache_key(DEMO_CONFIGS, IDENTITY.replace("98362432", "98362433")) != key


def test_the_key_follows_the_training_data(monkeypatch):
    key = cache_key(DEMO_CONFIGS, IDENTITY)
    monkeypatch.setattr(cache, "examples", lambda name: [])
    assert cache_key(DEMO_CONFIGS, IDENTITY) != key


@pytest.fixture
def no_training(monkeypatch):
    """The base model file's identity fixed, and any attempt to train a failure."""
    monkeypatch.setattr(cache, "base_model_identity", lambda: IDENTITY)

    def refuse(*args, **kwargs):
        raise AssertionError("trained although the adapters were cached")

    monkeypatch.setattr(cache, "_train_all", refuse)


def test_a_finished_folder_is_reused_without_training(tmp_path, no_training):
    folder = tmp_path / cache_key(DEMO_CONFIGS, IDENTITY)
    folder.mkdir()
    (folder / REPORT_FILE).write_text(json.dumps({"total_s": 1.0}))
    logged = []
    adapters = ensure_adapters(root=tmp_path, log=logged.append)
    assert adapters == {name: folder / name for name in BEHAVIOURS}
    assert logged == [f"reusing the demo adapters cached in {folder}"]


def test_a_failed_training_leaves_nothing_that_looks_finished(tmp_path, no_training):
    with pytest.raises(AssertionError, match="trained although"):
        ensure_adapters(root=tmp_path, log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_the_root_follows_the_cache_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAMESH_CACHE_DIR", str(tmp_path))
    assert cache.cache_root() == tmp_path / "demo-adapters"
    monkeypatch.delenv("LORAMESH_CACHE_DIR")
    assert cache.cache_root().parts[-3:] == (".cache", "loramesh", "demo-adapters")
