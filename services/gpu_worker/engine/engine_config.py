"""The engine's limits and policies (the gpu_worker's flags of the same names)."""

from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.policies import BATCH_POLICIES
from services.gpu_worker.engine.policies.preemption import PREEMPTION_POLICIES
from services.gpu_worker.memory.lend_compute_cap import (
    DEFAULT_LEND_COMPUTE_SHARE,
    DEFAULT_LEND_COMPUTE_WINDOW_S,
)
from services.runtime.eviction import EVICTION_POLICIES

KV_OVERFLOW_POLICIES = ("preempt", "borrow")


AUTO_LEND_SHARE = 0.75
"""Share of its pool's KV blocks a worker lends at most by default: three idle workers with
1,090-token pools serve a 2,500-token prompt, and a quarter of each pool stays its own."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits."""

    pool_mib: float = 512
    """Size of the unified pool (KV pages + adapter pages), allocated once at start."""
    kv_block_tokens: int = 16
    """Tokens per KV page (per layer)."""
    max_running: int = 64
    """Requests decoding together at most."""
    max_prefill_tokens: int = 2048
    """Prompt tokens admitted in one step at most (one longer prompt is admitted alone)."""
    lora_backend: str = "auto"
    """Kernel backend for LoRA deltas: auto (triton on CUDA, else cpu_native, else torch), cpu_native,
    torch, padded_bmm or triton."""
    adapter_region_share: float | None = None
    """None: one unified pool (KV and adapter pages from one free list). A share in (0, 1): a
    fixed region of the pool for adapter weights and the rest for KV, for the S-LoRA
    "no unified memory" ablation only."""
    worker_id: str = "local"
    """This worker's instance id: the debtor name its borrowed blocks are lent under."""
    max_lent_blocks: int = -1
    """KV blocks other workers may borrow from this pool at most, all together (0: none; −1:
    ``AUTO_LEND_SHARE`` of the pool's KV blocks). A lender lends only free pages and keeps the
    rest of the pool for its own requests; see docs/operations.md, "KV overflow and lending"."""
    shared_pool: bool = False
    """The pool lives in shared memory (a memfd; CPU only), so that debtors on this host can map
    it and attend over the blocks they borrowed from it in place (``--lending-lane
    shared-memory``). Otherwise a private buffer."""
    lend_compute_share: float = DEFAULT_LEND_COMPUTE_SHARE
    """DistKV-LLM's compute cap (``--lend-compute-share``): the share of wall time, over a sliding
    window of ``lend_compute_window_s``, this worker may spend computing attention for debtors
    while it has requests of its own; beyond it AttendRemote is refused (RESOURCE_EXHAUSTED) and
    the debtor recomputes. 1: no cap; 0: none while busy. See memory/lend_compute_cap.py."""
    lend_compute_window_s: float = DEFAULT_LEND_COMPUTE_WINDOW_S
    """The sliding window of ``lend_compute_share``, seconds (``--lend-compute-window-s``)."""
    kv_overflow: str = "preempt"
    """When the pool cannot hold a request's next KV block: ``preempt`` (free the newest
    request's pages and recompute it later) or ``borrow`` (DistKV-LLM: borrow blocks from other
    workers, and preempt only when none lends)."""

    batch_policy: str = "fcfs"
    """Which requests run each step and in which LoRA mode (``--batch-policy``): fcfs, lcfs,
    early_abort (S-LoRA), adapter_clustering (S-LoRA), dlora (merged/unmerged switching), pets
    (coordinated prefill batching) or hrrn (Magnus); see services/gpu_worker/engine/policies."""
    early_abort_slo_s: float = 6.0
    """First-token SLO of the early_abort batch policy (``--early-abort-slo-s``), in seconds from
    a request's arrival: a queued request whose first token can no longer come within it is
    aborted while newer ones can still make theirs (S-LoRA's evaluation uses 6 s). Only read
    with ``batch_policy="early_abort"``."""
    deterministic: bool = False
    """Batch-invariant numerics (``--deterministic``): a request's logits do not depend on what
    else is in its batch, nor on whether its KV came from prefill or decode, so greedy output is
    the same alone or batched, and a request re-prefilled elsewhere continues identically. CPU
    workers with the native kernels; not with the dlora policy (a merged adapter changes its
    requests' base matmuls). Costs: docs/benchmarks.md, "Deterministic serving"."""

    preemption_policy: str = "newest"
    """Which running request gives its KV back when the pool runs dry (``--preemption-policy``):
    newest (the last started) or fewest_computed (the shortest context: the cheapest recompute);
    see services/gpu_worker/engine/policies/preemption.py."""

    prefix_cache: bool = True
    """Share the KV of whole prompt blocks between requests with the same prompt prefix and the
    same adapter version (``--prefix-cache on|off``): a hit skips that part of the prefill.
    Cached blocks nobody uses are evicted first when the pool needs pages; a request that
    borrows KV keeps reading its cached blocks; see services/gpu_worker/memory/prefix_cache.py."""

    eviction_policy: str = "lru"
    """The order idle adapters leave the pool in when it needs pages (``--eviction-policy``):
    lru, lfu or fifo; pinned adapters never leave (services/runtime/eviction.py)."""

    def __post_init__(self) -> None:
        if self.eviction_policy not in EVICTION_POLICIES:
            known = ", ".join(sorted(EVICTION_POLICIES))
            raise ValueError(f"eviction_policy must be one of {known}, got {self.eviction_policy!r}")
        if self.preemption_policy not in PREEMPTION_POLICIES:
            known = ", ".join(sorted(PREEMPTION_POLICIES))
            raise ValueError(f"preemption_policy must be one of {known}, got {self.preemption_policy!r}")
        if self.batch_policy not in BATCH_POLICIES:
            known = ", ".join(sorted(BATCH_POLICIES))
            raise ValueError(f"batch_policy must be one of {known}, got {self.batch_policy!r}")
        if not self.early_abort_slo_s > 0:
            raise ValueError(f"early_abort_slo_s must be > 0, got {self.early_abort_slo_s}")
        if not 0.0 <= self.lend_compute_share <= 1.0:
            raise ValueError(f"lend_compute_share must be in [0, 1], got {self.lend_compute_share}")
        if not self.lend_compute_window_s > 0:
            raise ValueError(f"lend_compute_window_s must be > 0, got {self.lend_compute_window_s}")
        if self.kv_overflow not in KV_OVERFLOW_POLICIES:
            raise ValueError(f"kv_overflow must be one of {KV_OVERFLOW_POLICIES}, got {self.kv_overflow!r}")
