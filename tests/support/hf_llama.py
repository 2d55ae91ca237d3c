"""The reference model of the exactness tests: transformers' Llama holding the loaded weights."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights


def hf_llama(loaded) -> LlamaForCausalLM:
    """``loaded``'s model as a transformers ``LlamaForCausalLM`` (its tied head included), in
    eval mode. Built without transformers' random initialisation (2 s for SmolLM2 on 2 cores,
    a third of a reference's cost): every weight is then loaded, which is checked."""
    with no_init_weights():
        model = LlamaForCausalLM(LlamaConfig(**loaded.config.to_hf_config()))
    loaded_keys = model.load_state_dict(loaded.weights, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(loaded_keys.missing_keys) <= tied, f"weights not loaded: {loaded_keys.missing_keys}"
    assert not loaded_keys.unexpected_keys, f"weights HF has no place for: {loaded_keys.unexpected_keys}"
    model.tie_weights()
    return model.eval()
