"""ModelConfig from HF ``config.json`` dicts: transformers' own configs round-trip through it."""

from __future__ import annotations

import pytest

from services.model_files.model_config import ModelConfig

transformers = pytest.importorskip("transformers")


def _tiny_llama_config(**overrides) -> dict:
    defaults = {
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 10000.0,
    }  # fmt: skip
    return transformers.LlamaConfig(**(defaults | overrides)).to_dict()


def test_model_config_hf_round_trip():
    for overrides in (
        {},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "tie_word_embeddings": True},
        {
            "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "max_position_embeddings": 131072, "attention_bias": True, "eos_token_id": [5, 6],
        },
    ):  # fmt: skip
        config = ModelConfig.from_hf_config(_tiny_llama_config(**overrides), default_name="tiny")
        assert ModelConfig.from_hf_config(config.to_hf_config()) == config
        rebuilt = transformers.AutoConfig.for_model(**config.to_hf_config())
        assert ModelConfig.from_hf_config(rebuilt.to_dict()) == config
    qwen = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config = ModelConfig.from_hf_config(qwen.to_dict())
    assert config.attention_bias and config.architecture == "qwen2"
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config
    qwen_v4 = {k: v for k, v in qwen.to_dict().items() if k != "rope_parameters"}  # a hub-style config.json
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config({**qwen_v4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf_config({**qwen.to_dict(), "model_type": "gpt2"})
