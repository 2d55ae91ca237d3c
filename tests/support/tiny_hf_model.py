"""A tiny random Llama saved as a HF model directory, for the benchmark systems' tests.

Its vocabulary covers the benchmark's prompt token ids (``PROMPT_TOKEN_RANGE``), so traces run
on it unchanged; everything else is as small as a Llama gets, so a trace replays in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.systems.base import PROMPT_TOKEN_RANGE
from services.model_files.base_model import BaseModelSpec

SPEC = BaseModelSpec(
    name="tiny-bench-llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=PROMPT_TOKEN_RANGE[1] + 256,
)  # fmt: skip


def write_tiny_hf_model(directory: Path) -> Path:
    """``config.json``, ``model.safetensors`` (seeded random weights) and a word-level
    ``tokenizer.json`` in ``directory``; returns it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SPEC.vocab_size, hidden_size=SPEC.hidden_size, intermediate_size=SPEC.intermediate_size,
        num_hidden_layers=SPEC.num_layers, num_attention_heads=SPEC.num_heads,
        num_key_value_heads=SPEC.num_kv_heads, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(
        str(directory / "tokenizer.json")
    )
    return directory
