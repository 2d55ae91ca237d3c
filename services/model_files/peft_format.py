"""PEFT's LoRA format for a ``LlamaForCausalLM``: what an adapter may target and what PEFT names it.

The adapter store validates uploads by these rules and the worker parses adapters by them, so
both read an adapter's names, ranks and alphas the same way:

- the projections LoRA may target (:data:`LORA_TARGETS`);
- a module's path (``model.layers.3.self_attn.q_proj``) and the name a LoRA factor of it is saved
  under (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``), both ways;
- ``adapter_config.json`` parsed into a :class:`PeftConfig`: its fields typed and checked once,
  each module's rank, alpha and scale (``rank_pattern``/``alpha_pattern``) from one method each.
"""

from __future__ import annotations

import functools
import json
import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from services.runtime.errors import InvalidArgument

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


def pattern_value(pattern: Mapping[str, Any] | None, path: str, default: Any) -> Any:
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


#: Config fields naming features the worker cannot serve: refused whenever set (truthy).
_UNSUPPORTED_FIELDS = {
    "modules_to_save": "full copies of extra modules are not served",
    "use_dora": "DoRA is not supported",
    "fan_in_fan_out": "transposed (Conv1D) weights are not supported",
    "lora_bias": "a bias on lora_B is not supported",
    "use_qalora": "QA-LoRA is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "trainable_token_indices": "trainable embedding tokens are not supported",
    "layer_replication": "layer replication is not supported",
    "target_parameters": "LoRA on parameters (rather than modules) is not supported",
    "arrow_config": "Arrow routing is not supported",
}


@dataclass(frozen=True)
class ModuleTargeting:
    """The config fields that decide which modules an adapter adapts, typed (PEFT resolves them
    against the model's module paths; the store does, in ``validation.py``). Hashable: adapters
    of one recipe share it, so what it resolves to is computed once per distinct value."""

    target_modules: tuple[str, ...] | str
    """Module names, each matching a path or its last components, or one regex matching whole
    paths; ``"all-linear"`` is read as :data:`LORA_TARGETS`."""
    exclude_modules: tuple[str, ...] | str
    """Modules left out, named as in ``target_modules``; empty: none."""
    layers_to_transform: tuple[int, ...] | None
    """The layers adapted when ``target_modules`` names modules (PEFT ignores it for a regex);
    None: all. Not checked against the base model's depth here."""
    layers_pattern: tuple[str, ...]
    """Names of the module list ``layers_to_transform`` indexes; empty: any."""


@dataclass(frozen=True)
class PeftConfig:
    """A LoRA ``adapter_config.json``, parsed and checked once: what the store validates
    adapters by and the worker scales them by (vLLM's ``PEFTHelper``)."""

    rank: int
    """``r``: the rank of every module ``rank_pattern`` does not override."""
    alpha: float
    """``lora_alpha``: the scaling numerator of every module ``alpha_pattern`` does not override."""
    use_rslora: bool
    """Scale by ``alpha / sqrt(rank)`` instead of ``alpha / rank``."""
    targeting: ModuleTargeting
    """Which modules it adapts."""
    rank_pattern: Mapping[str, int]
    """Regex key -> rank of the modules it matches (:func:`pattern_value`); read-only."""
    alpha_pattern: Mapping[str, float]
    """Regex key -> alpha of the modules it matches (:func:`pattern_value`); read-only."""
    base_model_name_or_path: str | None
    """The base model it was trained on, as PEFT recorded it (informational)."""
    invocation_tokens: tuple[int, ...] | None = None
    """``alora_invocation_tokens``: an activated LoRA (aLoRA), whose weights apply only from the
    start of the last occurrence of these tokens in a prompt on; None: a standard LoRA. Not
    checked against the vocabulary here (``validation.py`` does, knowing the base model)."""

    def module_rank(self, path: str) -> int:
        """The rank of the module at ``path`` (``model.layers.3.self_attn.q_proj``)."""
        return pattern_value(self.rank_pattern, path, self.rank)

    def module_alpha(self, path: str) -> float:
        """The alpha of the module at ``path``."""
        return pattern_value(self.alpha_pattern, path, self.alpha)

    def scale(self, path: str) -> float:
        """What the module at ``path`` multiplies its LoRA product by: alpha / rank, or
        alpha / sqrt(rank) with ``use_rslora``."""
        rank, alpha = self.module_rank(path), self.module_alpha(path)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @classmethod
    def from_json(cls, config_json: bytes | str) -> PeftConfig:
        """Parse ``adapter_config.json`` and check every field that decides what is served;
        ``InvalidArgument`` names the field at fault. Not checked here: limits of a deployment
        (ranks, pattern sizes, regex costs) and the base model (``validation.py``)."""
        try:
            text = config_json if isinstance(config_json, str) else bytes(config_json).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"adapter_config.json is not valid UTF-8: {exc}") from None
        try:
            config = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidArgument(f"adapter_config.json is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise InvalidArgument(f"adapter_config.json must be a JSON object, got {type(config).__name__}")
        if config.get("peft_type") != "LORA":
            raise InvalidArgument(
                f"adapter_config.json peft_type is {config.get('peft_type')!r}; only 'LORA' is supported"
            )
        if config.get("task_type") not in (None, "CAUSAL_LM"):
            raise InvalidArgument(
                f"adapter_config.json task_type is {config['task_type']!r}; expected 'CAUSAL_LM' or null"
            )
        for name in ("r", "lora_alpha", "target_modules"):
            if config.get(name) is None:
                raise InvalidArgument(f"adapter_config.json has no {name}")
        if not isinstance(config.get("use_rslora", False), bool):
            raise InvalidArgument(
                f"adapter_config.json use_rslora must be true or false, got {config['use_rslora']!r}"
            )
        if config.get("bias", "none") != "none":
            raise InvalidArgument(
                f"adapter_config.json bias is {config['bias']!r}; only 'none' is supported "
                "(trained biases of the base model are not served)"
            )
        for field, reason in _UNSUPPORTED_FIELDS.items():
            if config.get(field):
                raise InvalidArgument(
                    f"adapter_config.json {field} is {config[field]!r}: {reason}; it must be unset"
                )
        base_model = config.get("base_model_name_or_path")
        return cls(
            rank=_rank("r", config["r"]),
            alpha=_alpha("lora_alpha", config["lora_alpha"]),
            use_rslora=config.get("use_rslora", False),
            targeting=_targeting(config),
            rank_pattern=_pattern(config, "rank_pattern", _rank),
            alpha_pattern=_pattern(config, "alpha_pattern", _alpha),
            base_model_name_or_path=base_model if isinstance(base_model, str) else None,
            invocation_tokens=_invocation_tokens(config),
        )


def _invocation_tokens(config: dict) -> tuple[int, ...] | None:
    """``alora_invocation_tokens``: null, or a non-empty list of token ids. PEFT reads an empty
    list as a standard LoRA and serves an aLoRA only in a causal LM (any other model class runs
    it as the base model throughout): both are refused rather than served unlike their name."""
    tokens = config.get("alora_invocation_tokens")
    if tokens is None:
        return None
    if not (
        isinstance(tokens, list)
        and tokens
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
    ):
        raise InvalidArgument(
            f"adapter_config.json alora_invocation_tokens must be null or a non-empty list of token "
            f"ids, got {reprlib.repr(tokens)}"
        )
    if config.get("task_type") != "CAUSAL_LM":
        raise InvalidArgument(
            f"adapter_config.json task_type is {config.get('task_type')!r}; an aLoRA "
            "(alora_invocation_tokens) needs 'CAUSAL_LM', without which PEFT never activates it"
        )
    return tuple(tokens)


def _rank(field: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"adapter_config.json {field} must be a positive integer, got {value!r}")
    return value


def _alpha(field: str, value: Any) -> float:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidArgument(f"adapter_config.json {field} must be a positive number, got {value!r}")
    return float(value)


def _pattern(config: dict, field: str, check) -> Mapping[str, Any]:
    """A ``rank_pattern``/``alpha_pattern`` (null: empty), each value ``check``ed, in its order
    (the first matching key wins)."""
    pattern = config.get(field) or {}
    if not isinstance(pattern, dict):
        raise InvalidArgument(f"adapter_config.json {field} must be an object, got {pattern!r}")
    return MappingProxyType({key: check(f"{field}[{key!r}]", value) for key, value in pattern.items()})


def _targeting(config: dict) -> ModuleTargeting:
    targets = config["target_modules"]
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(LORA_TARGETS)
    layers = config.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (
        isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    ):
        raise InvalidArgument(
            f"adapter_config.json layers_to_transform must be null or a list of layer indices, got {layers!r}"
        )
    pattern = config.get("layers_pattern")
    patterns = [pattern] if isinstance(pattern, str) else pattern or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise InvalidArgument(
            f"adapter_config.json layers_pattern must be null, a string or a list of strings, got {pattern!r}"
        )
    return ModuleTargeting(
        target_modules=_names_or_regex("target_modules", targets),
        exclude_modules=_names_or_regex("exclude_modules", config.get("exclude_modules") or []),
        layers_to_transform=tuple(layers) if layers else None,
        layers_pattern=tuple(patterns),
    )


def _names_or_regex(field: str, value: Any) -> tuple[str, ...] | str:
    """``target_modules``/``exclude_modules``: a list of module names or one regex."""
    if isinstance(value, str):
        return value
    if not (isinstance(value, list) and all(isinstance(name, str) for name in value)):
        raise InvalidArgument(
            f"adapter_config.json {field} must be a list of module names or a regex, got {value!r}"
        )
    return tuple(value)
