"""Settings of the adapter store (flags ``--name``, env ``LORAMESH_NAME``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.config import ServiceConfig, require_at_least

MAX_KEEP_VERSIONS = 16
"""Most versions a name may keep by count (each holds its blob on disk)."""


@dataclass
class AdapterStoreConfig(ServiceConfig):
    """loramesh adapter store: catalog in etcd, blobs in a directory or a bucket, hot set in RAM.
    Run several replicas for availability: they share the catalog and the blob tier."""

    data_dir: str = ".loramesh/adapter_store"
    """Local directory of this replica: the blobs when ``blob_store`` is empty, the disk cache
    in front of a bucket otherwise (an emptyDir is enough in Kubernetes then). A catalog of the
    single-replica store found here (``catalog.sqlite3``) is migrated into etcd once."""
    blob_store: str = ""
    """Where blobs live: "" for ``data_dir`` itself, a directory path (replicas on one host may
    share it), or ``s3://bucket/prefix`` (AWS S3, GCS's S3 API, MinIO, Ceph RGW; credentials
    from the standard AWS environment, docs/deploy.md)."""
    blob_cache_mib: int = 4096
    """Bytes of blobs kept on local disk in front of an ``s3://`` blob store, in MiB."""
    collect_interval_s: float = 600.0
    """How often this replica removes blobs no adapter references (deleted adapters, replaced
    versions, uploads interrupted by a crash)."""
    collect_grace_s: float = 3600.0
    """Unreferenced blobs and staged writes younger than this are left alone: a registration
    may have written its blob and not yet committed its row."""
    keep_versions: int = 4
    """Versions of each adapter name kept, the serving one counted (1 to 16): older ones can
    still be named (``name@N``, ``name@sha256:…``), fetched by the workers serving requests
    admitted on them, and published again at once (a rollback). Past it, a version's row and
    then its blobs are removed. 4 covers a training loop's in-flight policy lag (the version
    serving, the one before it that rollouts in flight were admitted on, one more for a slow
    worker) plus a last good version to roll back to; each kept version costs its blob's disk."""
    keep_versions_s: float = 10.0
    """Seconds a replaced version is kept at least, beyond the last ``keep_versions``: a request
    admitted on a version just before a publish fetches it on its worker only when it gets
    there, and at ten publishes a second the last 4 versions are 0.3 s. Raise it for failovers
    and migrations of long streams onto workers without the version; 0: the count alone."""
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
    cpu_nice: int = 0
    """Niceness of the store's threads and, when it leads its session (as ``loramesh up`` starts
    it), of the session's autogroup: 0 to 19. Above 0 the store's work for a publish (the
    upload's hashing, validation and durable write, the sends to the workers) takes the CPU
    only after the workers' decoding where they share cores, and after every other session's:
    it trades the publish rate for decoding (at 19 on 2 shared cores, publishes fell from
    10-20 to under 1 a second; docs/benchmarks.md, "Adapter versions at a training loop's
    pace"). No effect in a container with a CPU share of its own."""
    blocking_threads: int = 32
    """Threads running the store's blocking work (registrations, reads, deletes). A registration
    holds its thread while its row commits through etcd's Raft and disk flush: with the default
    executor's few threads (cores + 4) that wait, not the CPU, bounds registrations per second."""
    import_policy_file: str = ""
    """JSON file of which tenant may import adapters from which s3://, hf:// and file:// source
    prefixes (docs/operations.md); "": no imports at all."""
    tenants_file: str = ""
    """The tenants file the gateways read (their ``--api-keys-file``): its ``"tenants"`` bound what
    each tenant stores (``max_adapters``, ``max_stored_bytes``) and uploads at once
    (``max_concurrent_uploads``), every replica together; its keys are not read. "": no limits
    (docs/operations.md, "Tenants and quotas")."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(self, 1, "max_rank", "max_adapter_mib", "blocking_threads")
        require_at_least(self, 0, "ram_budget_mib")
        if not 1 <= self.keep_versions <= MAX_KEEP_VERSIONS:
            raise ValueError(f"--keep-versions must be 1 to {MAX_KEEP_VERSIONS}, got {self.keep_versions}")
        if self.keep_versions_s < 0:
            raise ValueError(f"--keep-versions-s must be >= 0, got {self.keep_versions_s:g}")
        if self.collect_interval_s <= 0:
            raise ValueError(f"--collect-interval-s must be > 0, got {self.collect_interval_s:g}")
        if self.collect_grace_s < 0:
            raise ValueError(f"--collect-grace-s must be >= 0, got {self.collect_grace_s:g}")
        if not 0 <= self.cpu_nice <= 19:
            raise ValueError(f"--cpu-nice must be 0 to 19, got {self.cpu_nice}")
        if self.blob_cache_mib < 0:
            raise ValueError(f"--blob-cache-mib must be >= 0, got {self.blob_cache_mib}")
