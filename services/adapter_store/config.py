"""Settings of the adapter store (flags ``--name``, env ``LORAMESH_NAME``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.config import ServiceConfig


@dataclass
class AdapterStoreConfig(ServiceConfig):
    """loramesh adapter store: durable catalog, blobs on disk, hot set in RAM."""

    data_dir: str = ".loramesh/adapter_store"
    """Directory for the SQLite catalog and the blob files (a PVC in Kubernetes)."""
    model: str = ""
    """Base model the adapters must fit: GGUF file or HF directory (default: SmolLM2-135M)."""
    max_rank: int = 64
    """Largest LoRA rank accepted at registration."""
    max_adapter_mib: int = 256
    """Largest upload accepted, config plus weights, in MiB."""
    ram_budget_mib: int = 1024
    """Bytes of adapter weights kept hot in RAM, pinned adapters included; the rest is read from
    disk on demand."""
    eviction_policy: str = "lru"
    """Which adapters leave the RAM tier first when it is full: lru (least recently used), lfu
    (least frequently used, ties least recent) or fifo; pinned adapters never
    (docs/operations.md, "Eviction and pinning")."""
    verify_on_start: str = "size"
    """How blobs are checked when the catalog is reopened: ``size`` (a stat each; every blob's
    sha256 is checked when it is first read, before it is served) or ``sha256`` (every blob read
    and hashed before the store serves: minutes with thousands of adapters)."""
    retain_freed_memory: bool = True
    """On here (off in the other services): every upload passes through megabyte-sized buffers."""
    import_policy_file: str = ""
    """JSON file of which tenant may import adapters from which s3://, hf:// and file:// source
    prefixes (docs/operations.md); "": no imports at all."""
