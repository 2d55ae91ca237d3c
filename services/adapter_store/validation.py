"""Validate an uploaded PEFT LoRA adapter against the base model before it is registered.

An adapter is the two files PEFT's ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors``. The store commits nothing it could not serve, so a bad adapter is
refused at registration, with a message that names the field or tensor at fault, instead of
failing later inside a worker in the middle of a batch. The checks run cheapest first:

1. **Size**: both files together within ``ValidationLimits.max_adapter_bytes``
   (``ResourceExhausted``), before anything is parsed.
2. **Config**, parsed once into a :class:`~services.model_files.peft_format.PeftConfig`: a LoRA
   (``peft_type`` "LORA") for a causal LM whose targets are only the seven
   Llama projections (q/k/v/o/gate/up/down), with ``r`` and every ``rank_pattern`` rank within
   ``ValidationLimits.max_rank``. Features the worker's kernels do not implement (embedding or
   ``lm_head`` LoRA, ``modules_to_save``, DoRA, LoRA bias, ``fan_in_fan_out``...) are refused by
   field name. ``target_modules``, ``layers_to_transform``, ``exclude_modules``, ``rank_pattern``
   and ``alpha_pattern`` follow PEFT's matching rules exactly, so we serve what PEFT would load.
   An activated LoRA (aLoRA: ``alora_invocation_tokens``) names its invocation with token ids
   of the base model's vocabulary.
3. **Safetensors container**: the header is parsed here (no library, no copy of the data) and
   the tensors' ``data_offsets`` must tile the data section exactly: a truncated, padded or
   overlapping file is refused before any byte of it is interpreted.
4. **Dtype**: F16, BF16 or F32, one dtype for the whole adapter.
5. **Names**: exactly PEFT's saved names,
   ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``, for modules
   the config targets, each with both A and B.
6. **Shapes**: ``lora_A`` is ``(r, in_features)`` and ``lora_B`` ``(out_features, r)`` of the base
   model's projection, ``r`` being that module's rank.
7. **Values**: no NaN or Inf anywhere, tested on the raw bits of the whole data section at once
   (an IEEE value is NaN or Inf exactly when its exponent bits are all ones), so a 10 MB adapter
   is checked in a few milliseconds without converting anything.

Checks 2 to 6 depend only on the config's targeting fields and the safetensors header, which
adapters trained by one recipe share byte for byte, so their outcome is kept per distinct header
and config (a few dozen): validating an adapter of a known shape is one pass over its bytes (7).

This is pure domain code: it raises :mod:`services.runtime.errors` exceptions and needs only the
standard library and numpy.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from services.adapter_store.regex_cost import UnboundedRegex, count_repeats
from services.model_files.base_model import BaseModelSpec
from services.model_files.peft_format import (
    LORA_TARGETS,
    ModuleTargeting,
    PeftConfig,
    module_path,
    parse_tensor_name,
    tensor_name,
)
from services.runtime.errors import InvalidArgument, ResourceExhausted

#: Largest safetensors header we parse; real adapter headers are a few tens of KiB.
MAX_HEADER_BYTES = 100 * 2**20

#: Most repetitions (``.*``, ``\d+``...) one user-supplied regex may contain. Module names are
#: matched by backtracking, so each repetition multiplies the worst-case cost by a path's length.
MAX_REGEX_REPEATS = 3

#: Bytes per element of every safetensors dtype, so sizes can be checked before dtypes.
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip

#: Dtypes we serve: safetensors name -> (name reported in the catalog, raw-bits view, exponent mask).
_SERVED_DTYPES = {
    "F16": ("float16", "<u2", 0x7C00),
    "BF16": ("bfloat16", "<u2", 0x7F80),
    "F32": ("float32", "<u4", 0x7F800000),
}


@dataclass(frozen=True)
class ValidationLimits:
    """What the deployment is willing to store and serve."""

    max_rank: int = 64
    """Largest LoRA rank of any module (``r`` and every ``rank_pattern`` value)."""
    max_adapter_bytes: int = 256 * 2**20
    """Largest adapter, config and safetensors file together, in bytes."""


@dataclass(frozen=True)
class ValidatedAdapter:
    """What validation learnt about an adapter: the catalog's facts, read once."""

    config: PeftConfig
    """The parsed ``adapter_config.json`` (its rank, alpha, rsLoRA and patterns)."""
    max_rank: int
    """Largest rank among the modules the adapter carries (what a worker must make room for)."""
    target_modules: tuple[str, ...]
    """Projections that carry LoRA weights in at least one layer, a sorted subset of LORA_TARGETS."""
    dtype: str
    """``"float16"``, ``"bfloat16"`` or ``"float32"``: one dtype for every tensor."""
    num_tensors: int
    """Number of tensors in the safetensors file (two per adapted module)."""
    layers: tuple[int, ...]
    """Sorted indices of the layers that carry LoRA weights."""


@dataclass(frozen=True)
class _TensorEntry:
    """One tensor of a safetensors header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Offset of its first byte in the data section."""
    end: int
    """Offset one past its last byte in the data section."""


T = TypeVar("T")


def _cached_unless_large(
    maxsize: int, cost: Callable[..., int], max_cost: int
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``functools.lru_cache(maxsize)`` for the calls whose arguments ``cost`` at most
    ``max_cost`` (roughly, characters); a larger call runs uncached, so what the cache holds on
    to stays bounded."""

    def decorate(function: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=maxsize)(function)

        @functools.wraps(function)
        def call(*args: Any) -> T:
            return cached(*args) if cost(*args) <= max_cost else function(*args)

        return call

    return decorate


def validate_adapter(
    config_bytes: bytes, safetensors_bytes: bytes, spec: BaseModelSpec, limits: ValidationLimits
) -> ValidatedAdapter:
    """Check a PEFT LoRA adapter against ``spec`` and ``limits``; raise on the first problem.

    Raises ``ResourceExhausted`` when the adapter is too large and ``InvalidArgument`` for
    anything else, with a message naming the field or tensor and what was expected.
    """
    size = len(config_bytes) + len(safetensors_bytes)
    if size > limits.max_adapter_bytes:
        raise ResourceExhausted(
            f"adapter is {size} bytes, over the limit max_adapter_bytes={limits.max_adapter_bytes}"
        )
    config = PeftConfig.from_json(config_bytes)
    _check_limits(config, spec, limits)
    targeting = config.targeting
    targets = _targeted_modules(targeting, spec)
    ranks = {path: config.module_rank(path) for path in targets}
    data_start, header = _header(safetensors_bytes)
    tensors = _checked_tensors(
        header, len(safetensors_bytes) - data_start, targeting, tuple(ranks.items()), spec
    )
    entries, dtype = tensors.entries, tensors.dtype
    _check_finite(safetensors_bytes, data_start, entries, dtype)
    return ValidatedAdapter(
        config=config,
        max_rank=max(ranks.values()),
        target_modules=tuple(sorted({module for _, module in targets.values()})),
        dtype=_SERVED_DTYPES[dtype][0],
        num_tensors=len(entries),
        layers=tuple(sorted({layer for layer, _ in targets.values()})),
    )


# --- adapter_config.json ---------------------------------------------------------------------


def _check_limits(config: PeftConfig, spec: BaseModelSpec, limits: ValidationLimits) -> None:
    """Ranks within ``limits``, and patterns with at most one key per projection of the base model
    and cheap regexes (more keys could only be redundant, and every key is matched against every
    module)."""
    _check_rank("r", config.rank, limits)
    _check_invocation(config, spec)
    modules = spec.num_layers * len(LORA_TARGETS)
    for field, pattern in (("rank_pattern", config.rank_pattern), ("alpha_pattern", config.alpha_pattern)):
        if len(pattern) > modules:
            raise InvalidArgument(
                f"adapter_config.json {field} has {len(pattern)} keys, more than the {modules} projections "
                f"of {spec.name}"
            )
        for key in pattern:
            _check_regex(f"{field} key", key)
    for key, rank in config.rank_pattern.items():
        _check_rank(f"rank_pattern[{key!r}]", rank, limits)


def _check_invocation(config: PeftConfig, spec: BaseModelSpec) -> None:
    """An aLoRA's invocation tokens are ids of the base model's vocabulary (a prompt could never
    hold another, so the adapter would never activate)."""
    outside = [t for t in config.invocation_tokens or () if t >= spec.vocab_size]
    if outside:
        raise InvalidArgument(
            f"adapter_config.json alora_invocation_tokens holds token id {outside[0]}, outside the "
            f"vocabulary of {spec.name} ({spec.vocab_size} tokens)"
        )


def _check_rank(field: str, value: int, limits: ValidationLimits) -> None:
    if value > limits.max_rank:
        raise InvalidArgument(
            f"adapter_config.json {field}={value} exceeds the maximum rank {limits.max_rank}"
        )


def _check_regex(field: str, pattern: str) -> None:
    """A valid regex whose matching stays cheap (``regex_cost.py``)."""
    try:
        repeats = count_repeats(pattern)
    except re.error as exc:
        raise InvalidArgument(
            f"adapter_config.json {field} {pattern!r} is not a valid regex: {exc}"
        ) from None
    except UnboundedRegex as exc:
        raise InvalidArgument(f"adapter_config.json {field} {pattern!r} {exc}") from None
    if repeats > MAX_REGEX_REPEATS:
        raise InvalidArgument(
            f"adapter_config.json {field} {pattern!r} has {repeats} repetitions; at most "
            f"{MAX_REGEX_REPEATS} (like .* or \\d+) are accepted, to keep matching fast"
        )


def _model_modules(spec: BaseModelSpec) -> list[str]:
    """Every module path of a LlamaForCausalLM, as ``named_modules()`` lists them (root left out)."""
    paths = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}"
        paths += [prefix, f"{prefix}.self_attn", f"{prefix}.mlp", f"{prefix}.mlp.act_fn"]
        paths += [f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"]
        paths += [module_path(layer, module) for module in LORA_TARGETS]
    return paths


def _layer_filter(targeting: ModuleTargeting, spec: BaseModelSpec) -> set[int] | None:
    """The layers ``layers_to_transform`` keeps (None: all), checked against the base model."""
    layers = targeting.layers_to_transform
    if layers is None:
        return None
    if not all(0 <= i < spec.num_layers for i in layers):
        raise InvalidArgument(
            f"adapter_config.json layers_to_transform must be null or a list of layer indices in "
            f"[0, {spec.num_layers}), got {list(layers)!r}"
        )
    # PEFT finds a module's layer index with ``layers_pattern`` (a name before the index); our only
    # indexed container is ``model.layers``, so a pattern other than "layers" matches no module.
    if targeting.layers_pattern and "layers" not in targeting.layers_pattern:
        return set()
    return set(layers)


def _matches(names_or_regex: tuple[str, ...] | str, path: str) -> bool:
    """PEFT's module matching: a regex must match the whole path, a name its last components."""
    if isinstance(names_or_regex, str):
        return re.fullmatch(names_or_regex, path) is not None
    return any(path == name or path.endswith(f".{name}") for name in names_or_regex)


def _size(targeting: ModuleTargeting) -> int:
    """Characters of ``targeting`` written out: what keeping it in a cache costs, roughly."""
    return len(repr(targeting))


#: Largest :func:`_size` of a targeting whose resolution is cached: bounds the cache's memory.
_MAX_CACHED_TARGETING = 16 << 10


@_cached_unless_large(256, lambda targeting, spec: _size(targeting), _MAX_CACHED_TARGETING)
def _targeted_modules(targeting: ModuleTargeting, spec: BaseModelSpec) -> Mapping[str, tuple[int, str]]:
    """Resolve ``target_modules`` as PEFT does: module path -> (layer, projection) it adapts.

    Refuses a target that reaches any module other than the seven projections (PEFT would
    wrap it, or fail), and a list entry that names no module of the base model at all.
    Resolved once per distinct ``targeting``: adapters registered by the thousand mostly share
    it, and matching every module path was most of validation's time. Read-only: the one
    result is shared by every caller.
    """
    targets, exclude = targeting.target_modules, targeting.exclude_modules
    for field, value in (("target_modules", targets), ("exclude_modules", exclude)):
        if isinstance(value, str):
            _check_regex(field, value)
    paths = _model_modules(spec)
    if isinstance(targets, str):
        matched = [p for p in paths if _matches(targets, p)]
        layers = None  # PEFT applies layers_to_transform only to a list of names
    else:
        for name in targets:
            if not any(_matches((name,), p) for p in paths):
                raise InvalidArgument(
                    f"adapter_config.json target_modules entry {name!r} is not a module of the base "
                    f"model; LoRA may target {', '.join(LORA_TARGETS)}"
                )
        matched = [p for p in paths if _matches(targets, p)]
        layers = _layer_filter(targeting, spec)
    resolved = {}
    for path in matched:
        if _matches(exclude, path):
            continue
        parts = path.split(".")
        if len(parts) != 5 or parts[-1] not in LORA_TARGETS:
            raise InvalidArgument(
                f"adapter_config.json target_modules targets {path!r}: LoRA on {parts[-1]} is not "
                f"supported; LoRA may target {', '.join(LORA_TARGETS)}"
            )
        layer = int(parts[2])
        if layers is None or layer in layers:
            resolved[path] = (layer, parts[-1])
    if not resolved:
        raise InvalidArgument(
            f"adapter_config.json target_modules {targets!r} (after "
            "layers_to_transform / exclude_modules) selects no module of the base model"
        )
    return MappingProxyType(resolved)


# --- safetensors -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensors:
    """A safetensors header's tensors, checked."""

    entries: tuple[_TensorEntry, ...]
    dtype: str
    """Their one safetensors dtype."""


#: Longest header (with its targeting key) whose checked tensors are cached: bounds the cache.
_MAX_CACHED_HEADER = 256 << 10


@_cached_unless_large(
    64, lambda header, _data_len, targeting, *_: len(header) + _size(targeting), _MAX_CACHED_HEADER
)
def _checked_tensors(
    header: bytes,
    data_len: int,
    targeting: ModuleTargeting,
    ranks: tuple[tuple[str, int], ...],
    spec: BaseModelSpec,
) -> _Tensors:
    """The header's tensors checked for layout, dtype, names and shapes against the targeted
    modules and their ranks. Adapters of one recipe have the same header byte for byte (only
    their data differs), so the result is kept per header and config: checking hundreds of
    tensors in Python once, not once per adapter."""
    entries = _parse_header(header, data_len)
    dtype = _check_dtype(entries)
    factors = _check_names(entries, _targeted_modules(targeting, spec), spec)
    _check_shapes(factors, dict(ranks), spec)
    return _Tensors(tuple(entries), dtype)


def _header(data: bytes) -> tuple[int, bytes]:
    """Where the data section starts, and the header's bytes (bounds checked)."""
    if len(data) < 8:
        raise InvalidArgument(
            f"adapter_model.safetensors is truncated: {len(data)} bytes, shorter than the 8-byte header length"
        )
    (header_len,) = struct.unpack_from("<Q", data)
    if header_len == 0 or header_len > MAX_HEADER_BYTES:
        raise InvalidArgument(
            f"adapter_model.safetensors header length {header_len} must be in [1, {MAX_HEADER_BYTES}]"
        )
    if 8 + header_len > len(data):
        raise InvalidArgument(
            f"adapter_model.safetensors is truncated: header length {header_len} larger than the file "
            f"({len(data)} bytes)"
        )
    return 8 + header_len, bytes(data[8 : 8 + header_len])


def _parse_header(header_bytes: bytes, data_len: int) -> list[_TensorEntry]:
    """Parse the JSON header and check that its tensors tile the ``data_len``-byte data section."""
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidArgument(f"adapter_model.safetensors header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidArgument("adapter_model.safetensors header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise InvalidArgument("adapter_model.safetensors __metadata__ must map strings to strings")
    entries = [_parse_entry(name, info) for name, info in header.items()]
    _check_layout(entries, data_len)
    return entries


def _is_index(value: Any) -> bool:
    """A non-negative JSON integer (``bool`` is not one)."""
    return type(value) is int and value >= 0


def _parse_entry(name: str, info: Any) -> _TensorEntry:
    """One header entry, with a consistent dtype, shape and byte size (called once per tensor:
    the valid path does no more than it must)."""
    if not isinstance(info, dict):
        raise InvalidArgument(f"{_where(name)}: header entry must be an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise InvalidArgument(f"{_where(name)} has unknown dtype {dtype!r}; supported: F16, BF16, F32")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidArgument(f"{_where(name)}: shape must be a list of non-negative integers, got {shape!r}")
    if not (type(offsets) is list and len(offsets) == 2 and _is_index(offsets[0]) and _is_index(offsets[1])):
        raise InvalidArgument(f"{_where(name)}: data_offsets must be [begin, end], got {offsets!r}")
    begin, end = offsets
    if end < begin:
        raise InvalidArgument(f"{_where(name)}: data_offsets [{begin}, {end}] end before begin")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if end - begin != expected:
        raise InvalidArgument(
            f"{_where(name)}: data_offsets [{begin}, {end}] span {end - begin} bytes but shape {shape} "
            f"of {dtype} needs {expected}"
        )
    return _TensorEntry(name, dtype, tuple(shape), begin, end)


def _where(name: str) -> str:
    return f"adapter_model.safetensors tensor {name!r}"


def _check_layout(entries: list[_TensorEntry], data_len: int) -> None:
    """The tensors must lie inside the data section and tile it: no overlap, gap or trailing bytes."""
    for entry in entries:
        if entry.end > data_len:
            raise InvalidArgument(
                f"adapter_model.safetensors is truncated: tensor {entry.name!r} data_offsets "
                f"[{entry.begin}, {entry.end}] out of bounds of the {data_len}-byte data section"
            )
    position, previous = 0, None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < position:
            raise InvalidArgument(
                f"adapter_model.safetensors tensors {previous!r} and {entry.name!r} overlap: "
                f"{entry.name!r} begins at {entry.begin}, before {previous!r} ends at {position}"
            )
        if entry.begin > position:
            raise InvalidArgument(
                f"adapter_model.safetensors data_offsets leave a gap of {entry.begin - position} bytes "
                f"before tensor {entry.name!r} (at {position})"
            )
        position, previous = entry.end, entry.name
    if position != data_len:
        raise InvalidArgument(
            f"adapter_model.safetensors has {data_len - position} trailing bytes after the last tensor "
            f"(data section {data_len} bytes, tensors cover {position})"
        )


def _check_dtype(entries: list[_TensorEntry]) -> str:
    """All tensors one served floating-point dtype; returns its safetensors name."""
    for entry in entries:
        if entry.dtype not in _SERVED_DTYPES:
            raise InvalidArgument(
                f"adapter_model.safetensors tensor {entry.name!r} has dtype {entry.dtype}; "
                "supported: F16, BF16, F32"
            )
    dtypes = sorted({entry.dtype for entry in entries})
    if not dtypes:
        raise InvalidArgument("adapter_model.safetensors holds no tensors")
    if len(dtypes) > 1:
        raise InvalidArgument(
            f"adapter_model.safetensors mixes dtypes {', '.join(dtypes)}; all tensors must have one dtype"
        )
    return dtypes[0]


# --- tensors against the config and the base model ------------------------------------------


def _unsupported_name(name: str) -> str | None:
    """Why a tensor that is not a plain projection LoRA factor cannot be served, if we recognise it."""
    if "lora_embedding_" in name or "embed_tokens" in name:
        return "LoRA on embed_tokens is not supported"
    if "lm_head" in name:
        return "LoRA on lm_head is not supported"
    if "lora_magnitude_vector" in name:
        return "it is a DoRA magnitude vector; DoRA is not supported"
    return None


def _check_names(
    entries: list[_TensorEntry], targets: Mapping[str, tuple[int, str]], spec: BaseModelSpec
) -> list[tuple[_TensorEntry, str, str, str]]:
    """Each tensor is a LoRA factor of a targeted module; each targeted module has A and B.
    Returns each tensor with its module's path, its projection and its factor (A or B)."""
    factors: dict[str, set[str]] = {}
    parsed_entries = []
    for entry in entries:
        reason = _unsupported_name(entry.name)
        if reason:
            raise InvalidArgument(f"adapter_model.safetensors tensor {entry.name!r}: {reason}")
        parsed = parse_tensor_name(entry.name)
        if parsed is None:
            raise InvalidArgument(
                f"adapter_model.safetensors has an unknown tensor {entry.name!r}; expected PEFT names "
                "like base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"
            )
        layer, module, factor = parsed
        if layer >= spec.num_layers:
            raise InvalidArgument(
                f"adapter_model.safetensors tensor {entry.name!r} is for layer {layer}, but the base "
                f"model has {spec.num_layers} layers"
            )
        path = module_path(layer, module)
        if path not in targets:
            raise InvalidArgument(
                f"adapter_model.safetensors tensor {entry.name!r} is for {path}, which the config's "
                "target_modules (with layers_to_transform / exclude_modules) does not target"
            )
        factors.setdefault(path, set()).add(factor)
        parsed_entries.append((entry, path, module, factor))
    for path, (layer, module) in targets.items():
        for factor in ("A", "B"):
            if factor not in factors.get(path, ()):
                raise InvalidArgument(
                    f"adapter_model.safetensors is missing tensor {tensor_name(layer, module, factor)!r} "
                    f"for targeted module {path}"
                )
    return parsed_entries


def _check_shapes(
    factors: list[tuple[_TensorEntry, str, str, str]], ranks: dict[str, int], spec: BaseModelSpec
) -> None:
    """``lora_A`` is ``(r, in_features)`` and ``lora_B`` ``(out_features, r)`` of the projection."""
    shapes = {module: spec.projection_shape(module) for module in LORA_TARGETS}
    for entry, path, module, factor in factors:
        in_features, out_features = shapes[module]
        rank = ranks[path]
        expected = (rank, in_features) if factor == "A" else (out_features, rank)
        if entry.shape != expected:
            raise InvalidArgument(
                f"adapter_model.safetensors tensor {entry.name!r} has shape {list(entry.shape)}, expected "
                f"{list(expected)} ({module} of {spec.name}: in_features {in_features}, "
                f"out_features {out_features}; rank {rank})"
            )


def _check_finite(data: bytes, data_start: int, entries: Sequence[_TensorEntry], dtype: str) -> None:
    """No NaN or Inf in any tensor: exponent bits all ones, tested on the raw data section.

    With the sign bit cleared, a value is NaN or Inf exactly when its bits are at least the
    exponent mask. The section is tested a slice at a time through one small buffer: no temporary
    as large as the adapter (whose fresh pages cost more than the test itself)."""
    _, view, mask = _SERVED_DTYPES[dtype]
    itemsize = np.dtype(view).itemsize
    count = (len(data) - data_start) // itemsize
    bits = np.frombuffer(data, dtype=view, count=count, offset=data_start)
    magnitude = np.array((1 << (8 * itemsize - 1)) - 1, dtype=view)
    buffer = np.empty(min(count, _FINITE_SLICE), dtype=view)
    for start in range(0, count, _FINITE_SLICE):
        part = buffer[: min(_FINITE_SLICE, count - start)]
        np.bitwise_and(bits[start : start + len(part)], magnitude, out=part)
        if part.max() >= mask:
            _refuse_non_finite(start + int((part >= mask).argmax()), itemsize, entries)


#: Elements :func:`_check_finite` tests at a time (256 KiB of float16: stays in cache).
_FINITE_SLICE = 1 << 17


def _refuse_non_finite(element: int, itemsize: int, entries: Sequence[_TensorEntry]) -> None:
    first = element * itemsize
    ordered = sorted(entries, key=lambda e: (e.begin, e.end))
    entry = ordered[bisect.bisect_right([e.begin for e in ordered], first) - 1]
    raise InvalidArgument(
        f"adapter_model.safetensors tensor {entry.name!r} contains NaN or Inf "
        f"(first at element {(first - entry.begin) // itemsize})"
    )
