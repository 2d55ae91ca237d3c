"""Sample adapters are real PEFT adapters: PEFT loads them exactly, and the store accepts them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.adapter_store.validation import ValidationLimits, validate_adapter
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS

pytestmark = pytest.mark.model

SAMPLE = SampleAdapterSpec(
    rank=8,
    lora_alpha=16.0,
    target_modules=LORA_TARGETS,
    dtype="float32",
    use_rslora=True,
    rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 12},
    alpha_pattern={"v_proj": 32.0},
    seed=7,
)


@pytest.fixture(scope="module")
def spec():
    """SmolLM2-135M's dimensions, cut to two layers so the random model is small."""
    return dataclasses.replace(load_base_model_spec(), num_layers=2)


def _llama(spec):
    """A LlamaForCausalLM with random weights and the spec's dimensions."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_peft_loads_the_sample_adapter_exactly(spec, tmp_path):
    peft = pytest.importorskip("peft")
    directory = write_peft_adapter(tmp_path / "a", spec, SAMPLE)
    written = load_file(directory / "adapter_model.safetensors")

    model = peft.PeftModel.from_pretrained(_llama(spec), str(directory))
    loaded = peft.get_peft_model_state_dict(model)
    assert sorted(loaded) == sorted(written)
    for name, value in written.items():
        np.testing.assert_array_equal(loaded[name].numpy(), value, err_msg=name)

    # A second load reports which adapter keys it missed or did not expect: none.
    result = model.load_adapter(str(directory), adapter_name="again")
    assert result.missing_keys == []
    assert result.unexpected_keys == []

    # PEFT resolved rank_pattern / alpha_pattern / use_rslora as the config says.
    layers = model.base_model.model.model.layers
    assert layers[0].self_attn.q_proj.r["default"] == 4
    assert layers[1].mlp.down_proj.r["default"] == 12
    assert layers[0].mlp.down_proj.r["default"] == 8
    assert layers[0].self_attn.v_proj.scaling["default"] == pytest.approx(32.0 / 8**0.5)
    assert layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(16.0 / 4**0.5)


def test_the_store_accepts_the_sample_adapter(spec, tmp_path):
    files = adapter_files(write_peft_adapter(tmp_path, spec, SAMPLE))
    result = validate_adapter(
        files["adapter_config.json"], files["adapter_model.safetensors"], spec, ValidationLimits()
    )
    assert result.max_rank == 12
    assert result.layers == (0, 1)
    assert result.target_modules == tuple(sorted(LORA_TARGETS))
    assert result.config.use_rslora


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_written_dtype_and_determinism(spec, tmp_path, dtype):
    sample = dataclasses.replace(SAMPLE, dtype=dtype)
    first = adapter_files(write_peft_adapter(tmp_path / "1", spec, sample, base_model_name_or_path="base"))
    assert (
        adapter_files(write_peft_adapter(tmp_path / "2", spec, sample, base_model_name_or_path="base"))
        == first
    )
    assert (
        adapter_files(write_peft_adapter(tmp_path / "3", spec, dataclasses.replace(sample, seed=8))) != first
    )
    header_len = int.from_bytes(first["adapter_model.safetensors"][:8], "little")
    header = json.loads(first["adapter_model.safetensors"][8 : 8 + header_len])
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {info["dtype"] for info in header.values()} == {
        {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}[dtype]
    }
    config = json.loads(first["adapter_config.json"])
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["rank_pattern"] == SAMPLE.rank_pattern
    assert config["base_model_name_or_path"] == "base"
