"""PEFT's LoRA format for a ``LlamaForCausalLM``: what an adapter may target and what PEFT names it.

The adapter store validates uploads by these rules and the worker parses adapters by them, so
both read an adapter's names, ranks and alphas the same way:

- the projections LoRA may target (:data:`LORA_TARGETS`);
- a module's path (``model.layers.3.self_attn.q_proj``) and the name a LoRA factor of it is saved
  under (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``), both ways;
- the ``rank_pattern``/``alpha_pattern`` lookup that gives a module its own rank or alpha.
"""

from __future__ import annotations

import functools
import re
from typing import Any

#: Projections a LoRA adapter may target, as PEFT names them in Llama-family models.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS

_TENSOR_PREFIX = "base_model.model."
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")


def module_path(layer: int, module: str) -> str:
    """PEFT's name for a projection in a LlamaForCausalLM, e.g. ``model.layers.3.self_attn.q_proj``."""
    parent = "self_attn" if module in ATTENTION_PROJECTIONS else "mlp"
    return f"model.layers.{layer}.{parent}.{module}"


def tensor_name(layer: int, module: str, factor: str) -> str:
    """Name PEFT saves a LoRA factor under; ``factor`` is ``"A"`` or ``"B"``."""
    return f"{_TENSOR_PREFIX}{module_path(layer, module)}.lora_{factor}.weight"


def parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """``(layer, projection, factor)`` of a name :func:`tensor_name` writes; ``None`` for any other.

    Exactly PEFT's saved form: a projection of :data:`LORA_TARGETS` under its own parent
    (``self_attn`` or ``mlp``), the layer index without leading zeros.
    """
    match = _TENSOR_NAME.fullmatch(name)
    if match is None or match[2] not in LORA_TARGETS:
        return None
    layer, module, factor = int(match[1]), match[2], match[3]
    return (layer, module, factor) if tensor_name(layer, module, factor) == name else None


def pattern_value(pattern: dict | None, path: str, default: Any) -> Any:
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup for the module at ``path``.

    A key matches when ``path`` is the key or ends with ``.`` followed by it (keys are regexes);
    the first matching key in the dict's order wins, otherwise ``default`` applies.
    """
    for key, value in (pattern or {}).items():
        if _pattern_key_regex(key).fullmatch(path):
            return value
    return default


@functools.lru_cache(maxsize=4096)
def _pattern_key_regex(key: str) -> re.Pattern:
    """A pattern key compiled once (``re``'s own cache holds only 512 patterns)."""
    return re.compile(rf"(.*\.)?(?:{key})")
