"""Settings of a gpu_worker (flags ``--name``, env ``LORAMESH_NAME``): its own below, and the
engine's limits and policies, declared once in :class:`EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.distkv.transport.lane_modes import LANE_MODES
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.quantization_setting import QUANTIZATION_CHOICES
from services.runtime.capped_labels import DEFAULT_CAP
from services.runtime.config import (
    ServiceConfig,
    part_of,
    require_at_least,
    require_choice,
    require_positive,
    settings_of,
)

STORE_FETCH_MODES = ("auto", "stream")
"""``--store-fetch``: read a version's blob file where a store replica shares this worker's file
system (else streamed), or always stream it."""


@dataclass
@settings_of(EngineConfig)
class WorkerConfig(ServiceConfig):
    """loramesh gpu_worker: base model + unified paged pool + continuous batching over adapters."""

    model: str = ""
    """Base model: GGUF file or HF safetensors directory (default: SmolLM2-135M-Instruct GGUF)."""
    dtype: str = "auto"
    """Compute dtype: float32, bfloat16, float16, or auto (bfloat16 where fast, else float32)."""
    device: str = "auto"
    """cuda, cpu, or auto (cuda when available)."""
    quantization: str = "auto"
    """Base weights' format: q4_1 (projections as GGUF Q4_1 blocks, embedding Q8_0: over a Q4_1
    GGUF its own blocks, exact with respect to their dequantization), q8_0, none (dequantized to
    --dtype), or auto (a quantized GGUF's own format, q4_1 for the default model, on a CPU worker;
    none for any other model, on a GPU or with --tp > 1: auto never quantizes). The quantized
    kernels are native CPU code, AVX-512 where the CPU has it, else AVX2 (docs/operations.md)."""
    adapter_store: str = ""
    """Adapter store address; empty: discovered in etcd, or standalone with --adapter-dir."""
    store_fetch: str = "auto"
    """How adapter versions come from the store: auto (a replica on this worker's own file system,
    the same machine and mount namespace as under ``loramesh up``, names the version's blob file
    and the worker reads it and checks its sha256; any other replica, or a file that cannot be
    read, streams it over gRPC), or stream (always over gRPC)."""
    adapter_dir: str = ""
    """Standalone mode: serve adapters from this directory (one PEFT directory per adapter id)."""
    host_cache_mib: int = 4096
    """Host RAM for adapter copies; beyond it, adapters no request uses are dropped in
    --eviction-policy order and fetched again when asked for; pinned ones stay (0: unbounded)."""
    prefetch_versions_s: float = 60.0
    """A new version of an adapter name is pulled (and paged in where there is room) as soon as
    its publish reaches this worker's etcd watch, when a request used a version of that name here
    within this many seconds (0: off; a version is then pulled by its first request)."""
    pin_refresh_s: float = 5.0
    """How often the worker reads the adapter store's pinned adapters, so that a pin or unpin set
    after it loaded an adapter applies within this many seconds (a fetch brings its pin at once;
    0: only at fetch)."""
    threads: int = 0
    """torch CPU threads (0: torch's default); with --tp N, of the whole group, each rank taking
    threads // N."""
    tp: int = 1
    """Ranks of one tensor-parallel group: this worker is rank 0 (it serves and broadcasts the
    plans) and runs N−1 follower processes. Must divide the model's query heads, KV heads and
    hidden size (SmolLM2-135M: 1 or 3); a bad degree is refused at start with the sharding
    module's message. With N > 1: no dlora (fcfs), no KV borrowing (preempt), no lending."""
    lending_lane: str = "shared-memory"
    """The first lane a borrowing step tries to reach a creditor. shared-memory (default): the
    creditor's pool is mapped and the borrowed blocks are written and attended over in place, no
    call per layer (CPU pools; with --tls the socket instead, since a mapped pool is readable
    whole); socket: the per-layer attention and KV writes over the creditor's Unix-socket lane
    (~25 µs a round trip instead of 1–2 ms over gRPC); tcp: over its TCP lane, even on one host;
    off: every lending call over gRPC. A creditor that the first lane cannot reach (another
    host or pod) is reached over its TCP lane (mutual TLS with --tls), else gRPC. Lanes are
    opened with the mTLS-checked OpenLendingLane RPC; see services/gpu_worker/distkv/transport/lending_lane.py."""
    lending_lane_port: int = 0
    """TCP port of this worker's lending lane between hosts, on --host (0: any free port; a
    NetworkPolicy must let the other workers reach it, else they keep gRPC)."""
    topology: str = ""
    """Locality label (node, rack, zone): the kv_manager suggests creditors with the same label first."""
    kv_manager: str = ""
    """kv_manager address for --kv-overflow borrow; empty: its replicas are discovered in etcd."""
    metric_adapter_labels: int = DEFAULT_CAP
    """Adapters named in each per-adapter metric series: the top N by requests, the rest summed
    under the label ``other``, so a worker's series stay bounded at 10,000 adapters (at least 1;
    docs/metrics.md, "Per-adapter label cap")."""

    cluster_prefix_cache: str = "on"
    """The cluster prefix tier: announce this worker's cached prompt blocks to the kv_manager's
    index and fetch a prompt's leading blocks from the worker holding them when that is faster
    than computing them (on), or keep the prefix cache to this worker (off). Needs the prefix
    cache, one rank (--tp 1) and a kv_manager; docs/operations.md, "Cluster prefix cache"."""
    prefix_fetch_mb_s: float = 100.0
    """The cost model's speed of a prefix fetch from another worker, MB/s (68 measured on
    loopback on a loaded 2-vCPU host: docs/benchmarks.md, "Cluster prefix tier")."""
    prefill_gflops: float = 60.0
    """The cost model's prefill speed of this worker, GFLOP/s (SmolLM2 fp32 on 2 vCPUs: about
    70 quiet, 5 under a load of 20): a prefix is fetched when moving its blocks takes less time
    than computing them at this rate."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # --tp 0 once ran unsharded: a degree below 1 is refused here; whether the model divides
        # a degree above is known only once it is loaded (the sharding module's message).
        require_at_least(self, 1, "tp", "metric_adapter_labels")
        require_positive(self, "pool_mib")
        require_at_least(self, 1, "kv_block_tokens", "max_running", "max_prefill_tokens", "loan_wait_rounds")
        require_at_least(self, 0, "loan_wait_s")
        require_at_least(
            self, 0, "threads", "host_cache_mib", "pin_refresh_s", "prefetch_versions_s", "lending_lane_port"
        )
        require_at_least(self, -1, "lend_cap_blocks")
        require_choice(self, "quantization", QUANTIZATION_CHOICES)
        require_choice(self, "lending_lane", LANE_MODES)
        require_choice(self, "cluster_prefix_cache", ("on", "off"))
        require_choice(self, "store_fetch", STORE_FETCH_MODES)
        require_positive(self, "prefix_fetch_mb_s", "prefill_gflops")
        # The engine's own checks (its policies' names, its shares), now rather than at start.
        self.engine_config(shared_pool=False)

    def engine_config(self, *, shared_pool: bool) -> EngineConfig:
        """The engine's settings as given, lending and borrowing under this worker's instance id
        (resolved before), its pool in shared memory or not (from the lending lane)."""
        return part_of(self, EngineConfig, worker_id=self.instance_id, shared_pool=shared_pool)
