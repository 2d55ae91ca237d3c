"""Settings of a gpu_worker (flags ``--name``, env ``LORAMESH_NAME``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.capped_labels import DEFAULT_CAP
from services.runtime.config import ServiceConfig


@dataclass
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
    --dtype), or auto (q4_1 on a CPU worker, none on a GPU or with --tp > 1). The quantized
    kernels are native CPU code, AVX-512 where the CPU has it, else AVX2 (docs/operations.md)."""
    pool_mib: int = 1024
    """Unified pool for KV cache and adapter weights, allocated once at start."""
    kv_block_tokens: int = 16
    """Tokens per KV page."""
    max_running: int = 64
    """Requests decoding together at most."""
    max_prefill_tokens: int = 2048
    """Prompt tokens admitted per step at most."""
    lora_backend: str = "auto"
    """LoRA kernels: auto (Triton on CUDA, else the native CPU kernel), cpu_native, torch, padded_bmm, triton."""
    adapter_store: str = ""
    """Adapter store address; empty: discovered in etcd, or standalone with --adapter-dir."""
    adapter_dir: str = ""
    """Standalone mode: serve adapters from this directory (one PEFT directory per adapter id)."""
    host_cache_mib: int = 4096
    """Host RAM for adapter copies; beyond it, adapters no request uses are dropped in
    --eviction-policy order and fetched again when asked for; pinned ones stay (0: unbounded)."""
    eviction_policy: str = "lru"
    """Which idle adapters leave the host cache and the pool first: lru (least recently used), lfu
    (least frequently used, ties least recent) or fifo; pinned adapters never (docs/operations.md,
    "Eviction and pinning")."""
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
    lend_cap_blocks: int = -1
    """KV blocks (one page per layer each) other workers may borrow from this pool at most, all
    together (DistKV-LLM's lending cap); 0 lends nothing; −1 (default): three quarters of the
    pool's KV blocks. Only free pages are lent: see docs/operations.md, "KV overflow and lending"."""
    lending_lane: str = "shared-memory"
    """How a borrowing step reaches a creditor on the same host. shared-memory (default): the
    creditor's pool is mapped and the borrowed blocks are written and attended over in place, no
    call per layer (CPU pools; with --tls the socket instead, since a mapped pool is readable
    whole); socket: the per-layer attention and KV writes over the creditor's Unix-socket lane
    (~25 µs a round trip instead of 1–2 ms over gRPC); off: every lending call over gRPC. Lanes
    are opened with the mTLS-checked OpenLendingLane RPC; see services/gpu_worker/lending_lane.py."""
    lend_compute_share: float = 0.5
    """DistKV-LLM's compute cap (its SLA threshold): the share of wall time, over a sliding window
    of --lend-compute-window-s, this worker may spend computing attention over lent blocks for
    other workers while it has requests of its own; beyond it their AttendRemote is refused with
    RESOURCE_EXHAUSTED and they recompute. 0.5 keeps its own steps within about 2x; 1: no cap;
    0: no lent compute while busy. An idle worker is not capped."""
    lend_compute_window_s: float = 1.0
    """The sliding window of --lend-compute-share, in seconds."""
    topology: str = ""
    """Locality label (node, rack, zone): the kv_manager suggests creditors with the same label first."""
    kv_overflow: str = "preempt"
    """When the pool cannot hold a request's next KV block: preempt (recompute it later) or
    borrow (DistKV-LLM: borrow blocks from other workers, suggested by the kv_manager)."""
    kv_manager: str = ""
    """kv_manager address for --kv-overflow borrow; empty: its replicas are discovered in etcd."""
    batch_policy: str = "fcfs"
    """Which requests run each step and in which LoRA mode: fcfs, lcfs, early_abort,
    adapter_clustering, dlora or pets (docs/batch-policies.md)."""
    early_abort_slo_s: float = 6.0
    """First-token SLO of --batch-policy early_abort, in seconds from a request's arrival: a queued
    request that can no longer get its first token within it is aborted (DEADLINE_EXCEEDED) while
    newer ones can still make theirs (S-LoRA's 6 s by default; docs/batch-policies.md)."""
    preemption_policy: str = "newest"
    """Which running request gives its KV back when the pool runs dry: newest (the last started)
    or fewest_computed (the shortest context, cheapest to recompute)."""
    deterministic: bool = False
    """Batch-invariant numerics: a request's logits (hence its greedy output) do not depend on the
    rest of its batch, nor on prefill vs decode, so a failover resumes identically (CPU workers;
    not with dlora; docs/operations.md, "Deterministic serving")."""
    prefix_cache: bool = True
    """Prefix cache (on|off): requests with the same prompt prefix and the same adapter version
    share the KV of its whole blocks, and prefill only the rest (docs/operations.md, "Prefix
    cache")."""
    metric_adapter_labels: int = DEFAULT_CAP
    """Adapters named in each per-adapter metric series: the top N by requests, the rest summed
    under the label ``other``, so a worker's series stay bounded at 10,000 adapters (at least 1;
    docs/metrics.md, "Per-adapter label cap")."""
