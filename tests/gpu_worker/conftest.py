"""Fixtures for the worker: a tiny random Llama (fast, exact comparisons against HF) and its
PEFT adapters."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from services.model_files.base_model import BaseModelSpec
from services.model_files.model_config import ModelConfig


@dataclass
class TinyLlama:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    spec: BaseModelSpec
    hf_config: dict


@pytest.fixture(scope="session")
def tiny_llama() -> TinyLlama:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(hf_config)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = ModelConfig.from_hf_config(hf_config.to_dict(), default_name="tiny-llama")
    spec = BaseModelSpec(
        name="tiny-llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=256,
    )  # fmt: skip
    return TinyLlama(config, weights, spec, hf_config.to_dict())
