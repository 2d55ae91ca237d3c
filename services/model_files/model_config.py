"""The decoder's hyperparameters, read from a HF ``config.json`` or a GGUF header.

The one reader of a model's configuration: the base model spec (``base_model.py`` loads and
caches it) is the part of the config adapters are checked against, and the config extends it.
(A tokenizer reads only its own fields: a vocabulary-only GGUF has no model to configure.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.runtime.field_copy import dataclass_of

#: Architectures the worker's Llama-family model runs, as HF ``model_type`` / GGUF
#: ``general.architecture`` spell them.
ARCHITECTURES = ("llama", "mistral", "qwen2")

_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Llama 3.1/3.2 GGUFs carry their rope scaling as a per-frequency factor tensor, not as
# parameters; every Meta release so far used these, so they are tried and then checked.
_LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class BaseModelSpec:
    """Dimensions of a Llama-family decoder, enough to know every projection's shape."""

    name: str
    """Short tag adapters are registered against (PetS's base model tag)."""
    hidden_size: int
    """Width of the residual stream (``embedding_length`` in GGUF)."""
    intermediate_size: int
    """Width of the SwiGLU MLP (``feed_forward_length`` in GGUF)."""
    num_layers: int
    """Number of decoder blocks."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA when fewer than ``num_heads``)."""
    head_dim: int
    """Per-head width; not always ``hidden_size // num_heads`` (e.g. Mistral Nemo)."""
    vocab_size: int
    """Rows of the token embedding (may exceed the tokenizer's vocabulary, e.g. Qwen2 padding)."""

    @classmethod
    def of(cls, config: ModelConfig) -> BaseModelSpec:
        """The spec of the model ``config`` describes (its spec fields alone)."""
        return dataclass_of(cls, config)

    def projection_shape(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one projection in every layer."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        return shapes[module]


@dataclass(frozen=True)
class ModelConfig(BaseModelSpec):
    """Everything needed to build the Llama-family decoder and check its weights' shapes: the
    spec's dimensions and the rest of the hyperparameters."""

    architecture: str
    """``"llama"``, ``"mistral"`` or ``"qwen2"``."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """Rotary base frequency."""
    rope_scaling: dict[str, Any] | None
    """``None`` for plain rotary; else ``{"rope_type": "linear", "factor": f}`` or
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``. Kept as data: the model applies it."""
    max_position_embeddings: int
    """Longest context the model was trained for."""
    tie_word_embeddings: bool
    """The LM head reuses ``model.embed_tokens.weight`` (no ``lm_head.weight`` in the weights)."""
    attention_bias: bool
    """q/k/v projections have biases (always for Qwen2)."""
    bos_token_id: int | None
    """Beginning-of-sequence token, if the model has one."""
    eos_token_ids: tuple[int, ...]
    """Every token that ends generation (Llama 3 instruct has several)."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported (supported: {ARCHITECTURES})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], default_name: str = "") -> ModelConfig:
        """From a parsed HF ``config.json`` (transformers 4.x or 5.x layout).

        ``default_name`` is used when the config has no ``_name_or_path`` (pass the directory
        name, as :func:`services.model_files.base_model.load_base_model_spec` does).
        """
        arch = str(cfg.get("model_type", ""))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 folds rope_theta and rope_scaling into one rope_parameters dict.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=_normalize_rope_scaling(rope),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
            name=str(cfg.get("_name_or_path") or default_name),
        )

    @classmethod
    def from_gguf(cls, reader, name: str | None = None) -> ModelConfig:
        """From an open ``gguf.GGUFReader``.

        ``name`` defaults to the file stem without its quantization suffix
        (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``), as the adapter store
        names the base model.
        """

        def value(key: str, default: Any = None) -> Any:
            field = reader.get_field(key)
            return default if field is None else field.contents()

        arch = value("general.architecture", "llama")
        heads = int(value(f"{arch}.attention.head_count"))
        hidden = int(value(f"{arch}.embedding_length"))
        head_dim = int(value(f"{arch}.attention.key_length") or hidden // heads)
        tensors = {t.name: t for t in reader.tensors}
        tokens = reader.get_field("tokenizer.ggml.tokens")
        vocab = value(f"{arch}.vocab_size") or (
            len(tokens.data) if tokens else tensors["token_embd.weight"].shape[1]
        )
        eos = [value(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
        theta = _f32(value(f"{arch}.rope.freq_base", 10000.0))
        if "rope_freqs.weight" in tensors:
            rope_scaling = _llama3_rope_from_factors(
                np.asarray(tensors["rope_freqs.weight"].data), head_dim, theta
            )
        else:
            rope_scaling = _gguf_rope_scaling(
                value(f"{arch}.rope.scaling.type"), value(f"{arch}.rope.scaling.factor")
            )
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(value(f"{arch}.feed_forward_length")),
            num_layers=int(value(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(value(f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=_f32(value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(value(f"{arch}.context_length", 2048)),
            # llama.cpp drops output.weight when the head is tied to the embedding.
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=value("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_tuple([e for e in eos if e is not None]),
            name=name or Path(reader.data.filename).name.split(".")[0],
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json``-style dict for ``transformers.AutoConfig.for_model(**d)`` (tests, references).

        Written in the hub's layout (``rope_theta`` + ``rope_scaling``), which transformers 4.x
        reads as is and 5.x converts. Sliding windows are off: the worker's model has none.
        """
        cfg: dict[str, Any] = {
            "model_type": self.architecture,
            "architectures": [_HF_CLASSES[self.architecture]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
            "_name_or_path": self.name,
        }
        if self.architecture == "qwen2":
            cfg["use_sliding_window"] = False  # Qwen2 always has qkv bias; it has no attention_bias key
        else:
            cfg["attention_bias"] = self.attention_bias
        if self.architecture == "mistral":
            cfg["sliding_window"] = None
        return cfg

    def check_weights(self, weights: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``weights`` holds exactly the tensors and shapes this config implies."""
        expected = self.weight_shapes()
        missing, unexpected = (
            sorted(expected.keys() - weights.keys()),
            sorted(weights.keys() - expected.keys()),
        )
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(weights[name].shape)}, the config implies {shape}")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor the model needs; loaders check against this."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
            if self.attention_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
        return shapes


def read_hf_config(path: Path) -> ModelConfig:
    """``config.json``, with the stop tokens of ``generation_config.json`` added when present
    (Llama 3 instruct stops at ``<|eot_id|>``, which only the generation config lists)."""
    cfg = json.loads((path / "config.json").read_text())
    generation = path / "generation_config.json"
    if generation.exists():
        extra = json.loads(generation.read_text()).get("eos_token_id")
        ids = [cfg.get("eos_token_id"), extra]
        flat = [i for x in ids if x is not None for i in (x if isinstance(x, list) else [x])]
        cfg = {**cfg, "eos_token_id": list(dict.fromkeys(flat)) or None}
    return ModelConfig.from_hf_config(cfg, default_name=path.name)


def _f32(value: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.99999974e-06. Take the shortest decimal that
    # round-trips in float32, the number the model's authors wrote.
    return float(str(np.float32(value)))


def _as_id_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(dict.fromkeys(int(i) for i in (ids if isinstance(ids, list | tuple) else [ids])))


def _normalize_rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    # Older configs say "type", newer "rope_type"; transformers 5 writes "default" for none.
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(rope["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"rope_type": "llama3", **{k: float(rope[k]) for k in keys[:3]}, keys[3]: int(rope[keys[3]])}
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, llama3)")


def _gguf_rope_scaling(kind: str | None, factor: float | None) -> dict[str, Any] | None:
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear)")


def _llama3_rope_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover Llama 3 rope parameters from llama.cpp's ``rope_freqs.weight`` (freq divisors)."""
    params = {"rope_type": "llama3", "factor": float(factors.max()), **_LLAMA3_ROPE_DEFAULTS}
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = params["original_max_position_embeddings"] / params["low_freq_factor"]
    high_wavelen = params["original_max_position_embeddings"] / params["high_freq_factor"]
    smooth = (params["original_max_position_embeddings"] / wavelen - params["low_freq_factor"]) / (
        params["high_freq_factor"] - params["low_freq_factor"]
    )
    expected = np.where(
        wavelen < high_wavelen,
        1.0,
        np.where(wavelen > low_wavelen, params["factor"], 1.0 / ((1 - smooth) / params["factor"] + smooth)),
    )
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3):
        raise ValueError("rope_freqs.weight does not match Llama 3 rope scaling with its usual parameters")
    return params
