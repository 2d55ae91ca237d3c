"""A PEFT LoRA adapter parsed into per-(layer, projection) factors, ready to page in.

The adapter arrives as the bytes the adapter store serves (validated there); here it becomes
``A`` (r × in) and ``Bᵀ`` (r × out) per targeted projection, with the scale its
:class:`~services.model_files.peft_format.PeftConfig` gives that module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from services.gpu_worker.lora.paired_rows import ModuleKey, paired_rows
from services.gpu_worker.lora.safetensors_views import SafetensorsBytes, tensor_views
from services.model_files.peft_format import PeftConfig, module_path, parse_tensor_name
from services.runtime.errors import InvalidArgument
from services.runtime.prefix_keys import AdapterIdentity, content_sha256


@dataclass(frozen=True)
class LoraFactors:
    """One projection's LoRA: ``delta(x) = scale * (x @ a.T) @ b_t``."""

    a: torch.Tensor
    """``(r, in_features)``."""
    b_t: torch.Tensor
    """``(r, out_features)``: PEFT's B transposed, so each rank is one contiguous row."""
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class HostAdapter:
    """An adapter in host memory."""

    adapter_id: str
    modules: dict[ModuleKey, LoraFactors]
    """``(layer, projection name) -> factors`` for every targeted projection."""
    content_sha256: str = ""
    """sha256 of the bytes it was parsed from (config and weights): names this version of the
    adapter in the prefix cache's keys. Empty: unknown (built in memory), and its requests
    bypass the prefix cache."""
    rows: torch.Tensor | None = None
    """Every module's A rows then Bᵀ rows, in ``modules``' order, back to back (1-D): the factors
    are views of it, so a placement that keeps that order is written in one copy. None: the
    factors are tensors of their own (built in memory)."""
    invocation_tokens: tuple[int, ...] | None = None
    """An activated LoRA's (aLoRA) invocation: its weights apply to a request's positions from
    the start of this sequence's last occurrence in its prompt on (``lora/activation.py``);
    None: a standard LoRA, applied everywhere."""

    @property
    def identity(self) -> AdapterIdentity:
        """What names its prefix blocks (:func:`services.runtime.prefix_keys.request_block_keys`)."""
        return AdapterIdentity(self.adapter_id, self.content_sha256, self.invocation_tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of its host copy (its factors may be narrower than the pool's dtype:
        ``paired_rows.host_dtype``)."""
        return sum(f.a.nbytes + f.b_t.nbytes for f in self.modules.values())

    @property
    def numel(self) -> int:
        """Elements of its factors: the pool elements its rows take."""
        return sum(f.a.numel() + f.b_t.numel() for f in self.modules.values())

    def __reduce__(self):
        # Pickled (to a tensor-parallel rank's process) as its rows once and each factor's shape:
        # pickling the factors themselves would send the whole of ``rows`` once per view.
        if self.rows is None:
            return (
                HostAdapter,
                (self.adapter_id, self.modules, self.content_sha256, None, self.invocation_tokens),
            )
        return (
            _from_rows,
            (self.adapter_id, self.content_sha256, self.rows, _layout(self.modules), self.invocation_tokens),
        )

    @property
    def max_rank(self) -> int:
        return max((f.rank for f in self.modules.values()), default=0)

    def pinned(self) -> HostAdapter:
        """This adapter with its rows in page-locked host memory, from where a GPU copies them
        asynchronously, without the driver staging them through a buffer of its own (which, on an
        H100, made a running batch's steps 1.5x slower while adapters paged in). Itself when its
        factors are not one buffer of rows. Needs CUDA."""
        if self.rows is None:
            return self
        return _from_rows(
            self.adapter_id,
            self.content_sha256,
            self.rows.pin_memory(),
            _layout(self.modules),
            self.invocation_tokens,
        )


def parse_peft_adapter(
    adapter_id: str,
    config_json: bytes | str,
    weights: SafetensorsBytes,
    dtype: torch.dtype,
    weights_sha256: str | None = None,
    narrow: bool = False,
) -> HostAdapter:
    """Build a :class:`HostAdapter` from ``adapter_config.json`` and safetensors bytes (whole, or
    the chunks they were fetched in), for a pool of ``dtype``. ``weights_sha256``: the weights' sha256 when the caller
    has verified it (a fetch checks it against the store's), so they are not hashed a second
    time here. ``narrow``: keep the factors in the file's dtype where the pool's conversion of it
    is exact (``paired_rows.host_dtype``; for a pool in host memory)."""
    config = PeftConfig.from_json(config_json)
    content = content_sha256(config_json, weights_sha256 or _sha256(weights))
    packed = paired_rows(weights, dtype, narrow)  # PEFT's own layout: converted whole, not per tensor
    if packed is not None:
        layout = [(key, a, b_t, config.scale(module_path(*key))) for key, a, b_t in packed.modules]
        return _from_rows(adapter_id, content, packed.rows, layout, config.invocation_tokens)
    tensors = tensor_views(weights)  # read in place: with_rows converts them, the one copy
    pairs: dict[ModuleKey, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise InvalidArgument(f"adapter {adapter_id}: unexpected tensor {name!r}")
        layer, module, factor = parsed
        pairs.setdefault((layer, module), {})[factor] = tensor
    modules = {}
    for (layer, module), factors in sorted(pairs.items()):
        scale = config.scale(module_path(layer, module))
        modules[(layer, module)] = LoraFactors(a=factors["A"], b_t=factors["B"].t(), scale=scale)
    adapter = HostAdapter(adapter_id, modules, content, invocation_tokens=config.invocation_tokens)
    return with_rows(adapter, dtype)


def _sha256(weights: SafetensorsBytes) -> str:
    digest = hashlib.sha256()
    for chunk in weights if isinstance(weights, list | tuple) else (weights,):
        digest.update(chunk)
    return digest.hexdigest()


FactorLayout = list[tuple[ModuleKey, torch.Size, torch.Size, float]]
"""Each module's key, A shape, Bᵀ shape and scale, in ``modules``' order."""


def _layout(modules: dict[ModuleKey, LoraFactors]) -> FactorLayout:
    return [(key, f.a.shape, f.b_t.shape, f.scale) for key, f in modules.items()]


def _views(rows: torch.Tensor, layout: FactorLayout) -> dict[ModuleKey, LoraFactors]:
    """The factors of ``layout`` as views of ``rows``, A then Bᵀ per module, back to back."""
    modules, offset = {}, rows.storage_offset()
    for key, a_shape, b_shape, scale in layout:
        # as_strided: one call a view (a slice then a view took three times as long, 1.8 ms for
        # an adapter's 420 factors)
        a = rows.as_strided(a_shape, (a_shape[1], 1), offset)
        offset += a_shape.numel()
        b_t = rows.as_strided(b_shape, (b_shape[1], 1), offset)
        offset += b_shape.numel()
        modules[key] = LoraFactors(a=a, b_t=b_t, scale=scale)
    return modules


def _from_rows(
    adapter_id: str,
    content_sha256: str,
    rows: torch.Tensor,
    layout: FactorLayout,
    invocation_tokens: tuple[int, ...] | None = None,
) -> HostAdapter:
    """What :meth:`HostAdapter.__reduce__` sends, as the adapter: its factors views of ``rows``."""
    return HostAdapter(adapter_id, _views(rows, layout), content_sha256, rows, invocation_tokens)


def with_rows(adapter: HostAdapter, dtype: torch.dtype) -> HostAdapter:
    """``adapter`` with its factors in ``dtype`` gathered into one buffer (:attr:`HostAdapter.rows`),
    each a view of it."""
    rows = torch.empty(sum(f.a.numel() + f.b_t.numel() for f in adapter.modules.values()), dtype=dtype)
    modules = _views(rows, _layout(adapter.modules))
    for key, factors in adapter.modules.items():
        modules[key].a.copy_(factors.a)
        modules[key].b_t.copy_(factors.b_t)
    return HostAdapter(adapter.adapter_id, modules, adapter.content_sha256, rows, adapter.invocation_tokens)
