"""Model loading: GGUF and HF directories -> config, HF-named fp32 weights, tokenizer.

The reference is transformers' own GGUF support (it dequantizes and un-permutes q/k itself) on
the real SmolLM2-135M-Instruct file; tiny GGUFs written here with ``gguf.GGUFWriter`` cover what
that file does not have (Qwen2 biases without permutation, Llama 3 rope factors, an untied head).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from services.gpu_worker.model import gguf_loader
from services.gpu_worker.model.hf_loader import load_hf_dir
from services.gpu_worker.model.loading import LoadedModel, load_model
from services.model_files.base_model import default_model_path
from services.model_files.model_config import ModelConfig

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello world",
    "12345",
    "3.14159 and 1,000,000",
    "def f(x):\n    return x**2  # square\n",
    "emoji 🤗🚀 done",
    "café naïve résumé Ærøskøbing",
    "日本語のテキスト 中文 한국어",
    "  leading and trailing  ",
    "\n\nnew\nlines\n\n",
    "I'm sure they'll say it's fine",
    "<|im_start|>user\nhi<|im_end|>",
    "\ttabs\tand  double  spaces",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("converted")


@pytest.fixture(scope="module")
def cold(gguf_path, cache_dir) -> LoadedModel:
    """The default model converted from the GGUF file (empty cache)."""
    return load_model(gguf_path, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def hf_reference(gguf_path):
    """transformers' own load of the same GGUF file, fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


# --- SmolLM2 GGUF against transformers ---------------------------------------------------------


@pytest.mark.model
def test_smollm2_config(cold, base_spec):
    cfg = cold.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "llama", 576, 30, 9, 3
    )  # fmt: skip
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 1536, 49152)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.rope_scaling is None
    # llama.rope.freq_base and the f32-stored epsilon, as the authors wrote them.
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    # The adapter store's view of the base model must agree.
    assert cfg.name == base_spec.name == "SmolLM2-135M-Instruct"
    for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        block = "self_attn" if module[0] in "qkvo" else "mlp"
        out_features, in_features = cold.weights[f"model.layers.0.{block}.{module}.weight"].shape
        assert base_spec.projection_shape(module) == (in_features, out_features)


@pytest.mark.model
def test_weights_and_config_equal_transformers_gguf_loading(cold, hf_reference):
    reference = hf_reference.state_dict()
    # Tied: transformers exposes lm_head as the embedding; we do not store it twice.
    assert set(reference) - {"lm_head.weight"} == set(cold.weights)
    for name, expected in reference.items():
        ours = cold.weights[name if name != "lm_head.weight" else "model.embed_tokens.weight"]
        assert ours.dtype == torch.float32 and ours.shape == expected.shape, name
        # Both dequantize the same blocks; torch.equal first because it is cheap on 135M values.
        assert torch.equal(ours, expected) or (ours - expected).abs().max() <= 1e-6, name
    # transformers' reading of the GGUF header agrees with ours. It keeps the name from
    # general.name and epsilon as float32 (9.99999975e-06); we take the file stem and 1e-05.
    theirs = ModelConfig.from_hf_config(hf_reference.config.to_dict())
    assert theirs.rms_norm_eps == pytest.approx(cold.config.rms_norm_eps, rel=1e-7)
    assert (
        dataclasses.replace(theirs, name=cold.config.name, rms_norm_eps=cold.config.rms_norm_eps)
        == cold.config
    )


@pytest.mark.model
def test_tokenizer_matches_transformers(cold, hf_tokenizer):
    tok = cold.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf_tokenizer.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert b"".join(tok.id_to_bytes(i) for i in ids).decode() == text
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert (tok.bos_token_id, tok.eos_token_ids) == (hf_tokenizer.bos_token_id, (hf_tokenizer.eos_token_id,))
    # Byte-level pieces: one emoji spans several tokens, each a fragment of its UTF-8 bytes.
    assert any(len(tok.id_to_bytes(i)) == 1 and tok.id_to_bytes(i)[0] >= 0x80 for i in tok.encode("🤗"))


@pytest.mark.model
def test_smollm_pretokenizer_isolates_digits(cold):
    """tokenizer.ggml.pre "smollm": llama.cpp splits every digit off before the GPT-2 regex (as
    SmolLM2's tokenizer.json does with Digits(individual_digits=True)). transformers' GGUF
    rebuild skips that step; it only shows when a run of spaces precedes a digit, where the
    spaces must stay one token ("ĠĠ", 256) instead of two (216, 216)."""
    assert cold.tokenizer.encode("a  12 x") == [81, 256, 33, 34, 1792]


@pytest.mark.model
def test_chat_template_matches_transformers(cold, hf_tokenizer):
    tok = cold.tokenizer
    for messages in (CONVERSATION, CONVERSATION[1:]):
        for generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    assert tok.apply_chat_template(CONVERSATION).endswith("<|im_end|>\n<|im_start|>assistant\n")


# --- converted cache ----------------------------------------------------------------------------


@pytest.mark.model
def test_second_load_reads_the_cache(cold, gguf_path, cache_dir):
    cached_file = gguf_loader.cache_path(gguf_path, cache_dir)
    assert cold.source == str(gguf_path) and cached_file.exists()
    warm = load_model(gguf_path, cache_dir=cache_dir)
    assert warm.source == str(cached_file)
    assert warm.config == cold.config
    assert warm.weights.keys() == cold.weights.keys()
    assert all(torch.equal(warm.weights[k], w) for k, w in cold.weights.items())
    for text in TEXTS:
        assert warm.tokenizer.encode(text) == cold.tokenizer.encode(text)
    assert warm.tokenizer.apply_chat_template(CONVERSATION) == cold.tokenizer.apply_chat_template(
        CONVERSATION
    )
    assert warm.tokenizer.eos_token_ids == cold.tokenizer.eos_token_ids


@pytest.mark.model
def test_changed_source_gets_a_new_key_and_stale_conversions_go(gguf_path, tmp_path, cold):
    copy = tmp_path / gguf_path.name
    shutil.copyfile(gguf_path, copy)
    key = gguf_loader.cache_path(copy, tmp_path / "cache")
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 1_000_000))
    new_key = gguf_loader.cache_path(copy, tmp_path / "cache")
    assert new_key != key and new_key.parent == key.parent

    # An entry that does not match its config is ignored, never served.
    gguf_loader.write_cached(key, cold.config, {"model.norm.weight": torch.ones(576)}, cold.tokenizer)
    assert key.exists() and gguf_loader.read_cached(key) is None
    # Writing the replaced file's conversion deletes the old one.
    other = key.parent / "Other.Q4_1-1-2.safetensors"
    gguf_loader.write_cached(other, cold.config, {"model.norm.weight": torch.ones(576)}, cold.tokenizer)
    gguf_loader.write_cached(new_key, cold.config, {"model.norm.weight": torch.ones(576)}, cold.tokenizer)
    assert sorted(p.name for p in key.parent.iterdir()) == sorted([new_key.name, other.name])


# --- HF directories -----------------------------------------------------------------------------


def _tiny_llama(**overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    defaults = {
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 10000.0,
    }  # fmt: skip
    config = transformers.LlamaConfig(**(defaults | overrides))
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(("tied", "shard"), [(False, None), (True, "40KB")])
def test_hf_dir_round_trip(tmp_path, tied, shard):
    model = _tiny_llama(tie_word_embeddings=tied)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)

    config, weights = load_hf_dir(tmp_path)
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    assert config == ModelConfig.from_hf_config(model.config.to_dict(), default_name=tmp_path.name)
    assert (config.num_layers, config.head_dim, config.tie_word_embeddings) == (2, 16, tied)

    _, half = load_hf_dir(tmp_path, dtype=torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in half.values())


@pytest.mark.model
def test_load_model_from_hf_dir(cold, hf_tokenizer, tmp_path):
    """The same model as a HF directory (transformers-written config.json, tokenizer.json,
    tokenizer_config.json, chat_template.jinja) loads to the same weights, config and template."""
    hf_cfg = cold.config.to_hf_config()
    transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg).save_pretrained(tmp_path)
    save_file(cold.weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf_tokenizer.save_pretrained(tmp_path)

    loaded = load_model(tmp_path)
    assert loaded.source == str(tmp_path)
    assert loaded.weights.keys() == cold.weights.keys()
    assert all(torch.equal(loaded.weights[k], w) for k, w in cold.weights.items())
    assert dataclasses.replace(loaded.config, name=cold.config.name) == cold.config
    assert loaded.tokenizer.apply_chat_template(CONVERSATION) == cold.tokenizer.apply_chat_template(
        CONVERSATION
    )
    assert loaded.tokenizer.encode(TEXTS[3]) == cold.tokenizer.encode(TEXTS[3])
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_ids) == (1, (2,))


# --- tiny GGUF files written here ---------------------------------------------------------------

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: HF halves -> interleaved rotary pairs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, model, arch: str, rope_freqs: np.ndarray | None = None) -> None:
    """``model`` as llama.cpp's converter would write it (F32), with a tiny byte-level vocabulary."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ"]
    tokens = ["<|end|>", *alphabet, "Ġt", "he", "Ġthe"]
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_eos_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    permute = arch != "qwen2"
    for name, tensor in model.state_dict().items():
        w = tensor.numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {
                "model.embed_tokens": "token_embd",
                "model.norm": "output_norm",
                "lm_head": "output",
            }[name.rsplit(".", 1)[0]] + ".weight"
        else:
            _, _, layer, *module, kind = name.split(".")
            gguf_name = f"blk.{layer}.{_GGUF_NAMES['.'.join(module)]}.{kind}"
            if permute and module[-1] in ("q_proj", "k_proj"):
                heads = cfg.num_attention_heads if module[-1] == "q_proj" else cfg.num_key_value_heads
                w = _llama_cpp_permute(w, heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n_head in (1, 2, 3):
        assert np.array_equal(gguf_loader.unpermute_rotary(_llama_cpp_permute(w, n_head), n_head), w)
        assert not np.array_equal(_llama_cpp_permute(w, n_head), w)
    bias = np.arange(12, dtype=np.float32)
    assert np.array_equal(gguf_loader.unpermute_rotary(_llama_cpp_permute(bias, 3), 3), bias)


def _assert_same_logits(loaded: LoadedModel, model) -> None:
    hf_cfg = loaded.config.to_hf_config()
    rebuilt = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg), dtype=torch.float32
    ).eval()
    rebuilt.load_state_dict(loaded.weights, strict=not loaded.config.tie_word_embeddings)
    rebuilt.tie_weights()
    ids = torch.tensor([[1, 5, 9, 42, 7, 100, 3]])
    with torch.no_grad():
        assert torch.allclose(rebuilt(ids).logits, model(ids).logits, atol=1e-5)


def test_tiny_llama3_gguf_with_rope_factors(tmp_path):
    rope = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    # head_dim 64: enough frequencies to land in all three llama3 bands.
    model = _tiny_llama(
        rope_scaling=dict(rope), max_position_embeddings=131072, rope_theta=500000.0, head_dim=64, hidden_size=128,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    scaled, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    _write_gguf(
        tmp_path / "tiny-llama3.F32.gguf", model, "llama", rope_freqs=inv_freq / scaled.double().numpy()
    )

    loaded = load_model(tmp_path / "tiny-llama3.F32.gguf", cache_dir=tmp_path / "cache")
    assert loaded.config.rope_scaling == rope and loaded.config.rope_theta == 500000.0
    assert loaded.config.name == "tiny-llama3" and not loaded.config.tie_word_embeddings
    assert all(torch.equal(loaded.weights[k], v) for k, v in model.state_dict().items())
    _assert_same_logits(loaded, model)
    tok = loaded.tokenizer
    assert tok.encode(" the<|end|>") == [tok.backend.token_to_id("Ġthe"), 0] and tok.eos_token_ids == (0,)
    assert tok.decode(tok.encode("x the<|end|>")) == "x the<|end|>"
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi<|end|>"


def test_tiny_qwen2_gguf_has_biases_and_no_permutation(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    _write_gguf(tmp_path / "tiny-qwen2.gguf", model, "qwen2")

    loaded = load_model(tmp_path / "tiny-qwen2.gguf", cache_dir=tmp_path / "cache")
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert loaded.weights.keys() == expected.keys()
    assert all(torch.equal(loaded.weights[k], v) for k, v in expected.items())
    _assert_same_logits(loaded, model)
