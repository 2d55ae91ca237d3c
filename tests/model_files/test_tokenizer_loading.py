"""The tokenizer alone, from a HF directory or a GGUF file, never reading a weight.

The HF directories here have no usable weights at all (none, or a file of garbage in place of
``model.safetensors``): the full loader fails on them, the tokenizer loader does not. The GGUF
is vocabulary-only (no tensors), as llama.cpp's ``ggml-vocab-*.gguf`` files are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from services.gpu_worker.model.loading import load_model
from services.model_files.tokenizer_loading import load_tokenizer

TEXTS = ["Hello, world!", "naïve café 🎉", "<|im_start|>user\nhi<|im_end|>", "12345 and 3.14"]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def smollm2():
    """The default model's tokenizer bundle (from the GGUF or its cached tokenizer)."""
    return load_tokenizer()


def _hf_dir(root: Path, smollm2, weights: str) -> Path:
    """SmolLM2's tokenizer as a HF directory whose config names 4096 positions and whose
    generation config adds a second stop id; ``weights``: ``"none"`` or ``"garbage"``."""
    root.mkdir()
    tokenizer = smollm2.tokenizer
    tokenizer.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer.special_tokens, "chat_template": tokenizer.chat_template})
    )
    config = {
        "model_type": "llama",
        "_name_or_path": "tiny-text-only",
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        "eos_token_id": 2,
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    if weights == "garbage":
        (root / "model.safetensors").write_bytes(b"\xff" * 4096)
    return root


@pytest.mark.parametrize("weights", ["none", "garbage"])
def test_hf_dir_gives_its_tokenizer_and_limits_without_weights(tmp_path, smollm2, weights):
    path = _hf_dir(tmp_path / "model", smollm2, weights)
    with pytest.raises(Exception):  # noqa: B017 - absent or unreadable weights: the full loader fails
        load_model(path)
    text = load_tokenizer(path)
    assert (text.model_name, text.context_length, text.source) == ("tiny-text-only", 4096, str(path))
    assert text.tokenizer.eos_token_ids == (2, 1)  # tokenizer_config's eos, then generation_config's
    for sample in TEXTS:
        assert text.tokenizer.encode(sample) == smollm2.tokenizer.encode(sample)
    assert text.tokenizer.apply_chat_template(CONVERSATION) == smollm2.tokenizer.apply_chat_template(
        CONVERSATION
    )
    assert text.tokenizer.vocab_size == smollm2.tokenizer.vocab_size


def _vocab_only_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(1024)
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ"]
    tokens = ["<|end|>", *alphabet, "Ġt", "he", "Ġthe"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_eos_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_vocabulary_only_gguf_loads_and_is_cached(tmp_path):
    path = _vocab_only_gguf(tmp_path / "Vocab-Only.Q8_0.gguf")
    cache = tmp_path / "cache"
    cold = load_tokenizer(path, cache)
    assert (cold.model_name, cold.context_length, cold.source) == ("Vocab-Only", 1024, str(path))
    assert cold.tokenizer.eos_token_ids == (0,)
    assert cold.tokenizer.encode(" the") == [cold.tokenizer.backend.token_to_id("Ġthe")]  # merged
    ids = cold.tokenizer.encode("the hat")
    assert cold.tokenizer.decode(ids) == "the hat"
    assert cold.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi<|end|>"

    warm = load_tokenizer(path, cache)
    assert warm.source.endswith(".tokenizer.json") and Path(warm.source).parent == cache
    assert (warm.model_name, warm.context_length, warm.tokenizer.eos_token_ids) == ("Vocab-Only", 1024, (0,))
    assert warm.tokenizer.encode("the hat") == ids

    Path(warm.source).write_text("{not json")  # a damaged cache is ignored and rewritten
    again = load_tokenizer(path, cache)
    assert again.source == str(path) and again.tokenizer.encode("the hat") == ids
    assert load_tokenizer(path, cache).source == warm.source


def test_missing_or_foreign_model_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_tokenizer(tmp_path / "absent.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a .gguf file nor a HF model directory"):
        load_tokenizer(tmp_path / "weights.bin")


def test_the_gateway_never_imports_torch():
    """No module the gateway process imports can hold a tensor: it cannot be holding the weights."""
    probe = (
        "import sys, services.gateway.__main__, services.gateway.service; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    )
    assert result.stdout.strip() == "[]", result.stdout
