"""A GGUF file's weights as HF-named float32 tensors, and a converted cache for fast restarts.

llama.cpp stores the weights quantized (SmolLM2: Q8_0 token embedding, Q4_1 projections, F32
norms), under its own names, and with q/k rows permuted for its interleaved rotary layout.
:func:`convert_weights` undoes all three. Shapes need no transposing: the reader's numpy arrays
are already ``(out_features, in_features)``; GGUF's reversed ``ne`` order is only in ``.shape``.

Parsing the GGUF header alone takes ~2.9 s (49k vocabulary strings) and dequantizing ~2 s, so the
first load writes one safetensors file holding the fp32 weights plus the model config and
tokenizer as metadata; later loads read only that file (memory-mapped, copy-on-write). Measured
for SmolLM2-135M-Instruct.Q4_1 on the 2-core dev VM, busy with other jobs: cold load 8.2 s wall /
5.4 s CPU (parse 2.9 + dequantize 2.0 + tokenizer 0.2 + cache write 1.5), cached load 0.2 s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from services.gpu_worker.model.quantized_weight import GGML_TYPES, QuantizedWeight
from services.model_files.cache_dir import default_cache_dir
from services.model_files.model_config import ModelConfig
from services.model_files.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the conversion changes, so caches written by older code are not trusted.
_CACHE_FORMAT = "1"

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Consumed by ModelConfig.from_gguf (Llama 3 rope scaling), not a model weight.
_METADATA_TENSORS = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (and the global tensors)."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family decoder")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate_half halves).

    Within each head llama.cpp orders rows ``0, d/2, 1, d/2+1, ...``; HF wants ``0..d/2-1`` then
    ``d/2..d-1``. Works for weights ``(rows, K)`` and biases ``(rows,)``.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_weights(reader: GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 under its HF name, q/k un-permuted for llama/mistral.

    Qwen2 files are not permuted: llama.cpp runs Qwen2 with the NEOX rotary, HF's own layout.
    """
    permuted = config.architecture in ("llama", "mistral")
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}

    weights = {}
    for tensor in reader.tensors:
        if tensor.name in _METADATA_TENSORS:
            continue
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if permuted and kind in heads:
            w = unpermute_rotary(w, heads[kind])
        # F32 tensors come back as read-only views of the file's memory map: copy those.
        weights[hf_name(tensor.name)] = torch.from_numpy(np.array(w, copy=not w.flags.writeable))
    config.check_weights(weights)
    return weights


def quantized_tensors(reader: GGUFReader, config: ModelConfig) -> dict[str, QuantizedWeight]:
    """The file's Q4_1 and Q8_0 tensors as their own blocks, under their HF names, q/k rows
    un-permuted (a row permutation moves whole rows of blocks, so the bytes are untouched)."""
    permuted = config.architecture in ("llama", "mistral")
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    formats = {ggml_type: fmt for fmt, ggml_type in GGML_TYPES.items()}
    found = {}
    for tensor in reader.tensors:
        fmt = formats.get(tensor.tensor_type)
        if fmt is None or tensor.name in _METADATA_TENSORS:
            continue
        rows = np.asarray(tensor.data)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if permuted and kind in heads:
            rows = unpermute_rotary(rows, heads[kind])
        found[hf_name(tensor.name)] = QuantizedWeight.from_gguf_rows(rows, fmt)
    return found


def blocks_cache_path(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the file's quantized tensors are kept as raw blocks (a folder of its own: the fp32
    conversion's clean-up deletes other conversions of the same stem)."""
    return (cache_dir or default_cache_dir()) / "blocks" / cache_path(gguf_path, cache_dir).name


def cached_quantized_tensors(
    gguf_path: Path, config: ModelConfig, cache_dir: Path | None = None
) -> dict[str, QuantizedWeight]:
    """:func:`quantized_tensors` of the file, read from its blocks cache when there is one
    (parsing the GGUF header alone takes ~3 s), else parsed and cached."""
    path = blocks_cache_path(gguf_path, cache_dir)
    try:
        with safe_open(str(path), framework="pt") as f:
            formats = json.loads((f.metadata() or {})["loramesh.formats"])
            return {
                name: QuantizedWeight(f.get_tensor(name), fmt, in_features)
                for name, (fmt, in_features) in formats.items()
            }
    except (OSError, SafetensorError, KeyError, TypeError, ValueError):
        pass
    found = quantized_tensors(GGUFReader(str(gguf_path)), config)
    formats = {name: (w.format, w.in_features) for name, w in found.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file(
                {name: w.blocks for name, w in found.items()},
                tmp,
                metadata={"loramesh.formats": json.dumps(formats)},
            )
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not write the blocks cache %s: %s", path, exc)
    return found


def cache_path(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the converted copy of ``gguf_path`` lives: keyed by stem, size and mtime, so a
    replaced file gets a new key."""
    stat = gguf_path.stat()
    return (
        cache_dir or default_cache_dir()
    ) / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}.safetensors"


def read_cached(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer] | None:
    """The converted model at ``path``, or ``None`` when there is none or it is unusable."""
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("loramesh.format") != _CACHE_FORMAT:
            return None
        fields = json.loads(meta["loramesh.config"])
        config = ModelConfig(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})
        weights = load_file(str(path))
        config.check_weights(weights)
        return config, weights, Tokenizer.from_json(meta["loramesh.tokenizer"])
    except (OSError, SafetensorError, KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring unusable converted cache %s: %s", path, exc)
        return None


def write_cached(
    path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> None:
    """Write the converted model (temp file, then rename: readers never see half a file) and
    delete older conversions of the same file. A failure only costs the next start a reconversion."""
    metadata = {
        "loramesh.format": _CACHE_FORMAT,
        "loramesh.config": json.dumps(dataclasses.asdict(config)),
        "loramesh.tokenizer": tokenizer.to_json(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        os.close(fd)
        try:
            save_file(weights, tmp, metadata=metadata)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        # Same source name, other size/mtime: a replaced file's conversion, never read again.
        stem = path.name.rsplit("-", 2)[0]
        for stale in path.parent.glob("*.safetensors"):
            if stale != path and stale.name.rsplit("-", 2)[0] == stem:
                stale.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not write converted cache %s: %s", path, exc)
