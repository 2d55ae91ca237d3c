"""A HF model directory (``config.json`` + safetensors, single file or sharded) as config and weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.model_files.model_config import ModelConfig, read_hf_config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the model: from the shard index when there is one."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = json.loads(index.read_text())["weight_map"].values()
        return [path / name for name in sorted(set(shards))]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    return files


def load_hf_dir(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named weights (cast to ``dtype``) of the model in directory ``path``."""
    path = Path(path)
    config = read_hf_config(path)
    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        weights |= {name: w.to(dtype) for name, w in load_file(str(file)).items()}
    # Old checkpoints carry rotary buffers; tied ones sometimes a copy of the embedding as lm_head.
    for name in [n for n in weights if n.endswith("rotary_emb.inv_freq")]:
        del weights[name]
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    config.check_weights(weights)
    return config, weights
