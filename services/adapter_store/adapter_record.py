"""One registered adapter as the store knows it, and the catalog's few domain errors."""

from __future__ import annotations

from dataclasses import dataclass

PRIVATE = 1
PUBLIC = 2


@dataclass(frozen=True)
class AdapterRecord:
    """One registered adapter, as the catalog holds it."""

    id: str
    """Stable id of this registration (a new version of a name gets a new one)."""
    name: str
    """Unique per owner."""
    owner: str
    """Owner tenant."""
    visibility: int
    """``PRIVATE`` (1) or ``PUBLIC`` (2), the proto enum's values."""
    base_model: str
    """Base model tag the adapter was validated against."""
    pet_type: str
    """Kind of fine-tune; ``lora``."""
    rank: int
    """The config's ``r``."""
    max_rank: int
    """Largest rank over ``rank_pattern``."""
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    dtype: str
    size_bytes: int
    """Bytes of the safetensors blob."""
    sha256: str
    """Hex digest of the safetensors blob: the weights' blob name."""
    version: int
    """1 for the first registration of ``(owner, name)``; +1 each time it is registered again."""
    created_ms: int
    config_json: str
    """``adapter_config.json`` as uploaded."""
    chat_template: str = ""
    """Its own chat template, uploaded with it; "": the base model's."""
    tool_use_chat_template: str = ""
    """Its own chat template for requests that offer tools; "": :attr:`chat_template`."""
    pinned: bool = False
    """Never evicted from the store's RAM tier, the workers' host caches or their pools
    (``SetAdapterPinned``); a new version of the name keeps it."""


class DuplicateName(Exception):
    """``(owner, name)`` is already registered: ``serving_id`` names the adapter it serves ("":
    not known)."""

    def __init__(self, what: str, serving_id: str = ""):
        super().__init__(what)
        self.serving_id = serving_id
