"""The engine's limits and policies: declared here once, they are the gpu_worker's settings too
(``WorkerConfig`` takes each as its flag and env var: ``--pool-mib``, ``LORAMESH_POOL_MIB``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gpu_worker.distkv import (
    DEFAULT_LEND_COMPUTE_SHARE,
    DEFAULT_LEND_COMPUTE_WINDOW_S,
    DistKvSettings,
)
from services.gpu_worker.engine.policies import BATCH_POLICIES
from services.gpu_worker.engine.policies.preemption import PREEMPTION_POLICIES
from services.runtime.config import setting
from services.runtime.eviction import EVICTION_POLICIES

KV_OVERFLOW_POLICIES = ("preempt", "borrow")
SPECULATIVE_MODES = ("off", "ngram", "suffix")
CUDA_GRAPH_MODES = ("off", "on")


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and policies; each field but those marked ``setting(None)`` is a gpu_worker
    setting of the same name (or the one ``setting`` gives), its docstring the flag's help."""

    pool_mib: float = 1024
    """Unified pool for KV cache and adapter weights (KV pages + adapter pages), allocated once
    at start."""
    kv_block_tokens: int = 16
    """Tokens per KV page (per layer)."""
    max_running: int = 64
    """Requests decoding together at most."""
    max_prefill_tokens: int = 2048
    """Prompt tokens admitted in one step at most (one longer prompt is admitted alone)."""
    lora_backend: str = "auto"
    """Kernel backend for LoRA deltas: auto (triton on CUDA, else cpu_native, else torch), cpu_native,
    torch, padded_bmm or triton."""
    # The ablation is the benchmarks' alone; the worker derives its id and pool kind.
    adapter_region_share: float | None = field(default=None, metadata=setting(None))
    """None: one unified pool (KV and adapter pages from one free list). A share in (0, 1): a
    fixed region of the pool for adapter weights and the rest for KV, for the S-LoRA
    "no unified memory" ablation only."""
    worker_id: str = field(default="local", metadata=setting(None))
    """This worker's instance id: the debtor name its borrowed blocks are lent under."""
    max_lent_blocks: int = field(default=-1, metadata=setting("lend_cap_blocks"))
    """KV blocks (one page per layer each) other workers may borrow from this pool at most, all
    together (DistKV-LLM's lending cap); 0 lends nothing; −1 (default): ``distkv.settings.AUTO_LEND_SHARE``, three
    quarters, of the pool's KV blocks. A lender lends only free pages and keeps the rest of the
    pool for its own requests; see docs/operations.md, "KV overflow and lending"."""
    shared_pool: bool = field(default=False, metadata=setting(None))
    """The pool lives in shared memory (a memfd; CPU only), so that debtors on this host can map
    it and attend over the blocks they borrowed from it in place (``--lending-lane
    shared-memory``). Otherwise a private buffer."""
    lend_compute_share: float = DEFAULT_LEND_COMPUTE_SHARE
    """DistKV-LLM's compute cap (its SLA threshold): the share of wall time, over a sliding window
    of ``lend_compute_window_s``, this worker may spend computing attention for debtors while it
    has requests of its own; beyond it AttendRemote is refused (RESOURCE_EXHAUSTED) and the
    debtor recomputes. 0.5 keeps its own steps within about 2x; 1: no cap; 0: none while busy;
    an idle worker is not capped. See distkv/lend_compute_cap.py."""
    lend_compute_window_s: float = DEFAULT_LEND_COMPUTE_WINDOW_S
    """The sliding window of ``lend_compute_share``, seconds."""
    kv_overflow: str = "preempt"
    """When the pool cannot hold a request's next KV block: ``preempt`` (free a running
    request's pages and recompute it later) or ``borrow`` (DistKV-LLM: borrow blocks from other
    workers, suggested by the kv_manager, and preempt only when none lends)."""
    loan_wait_s: float = 30.0
    """With ``kv_overflow=borrow``: how long a queued request that only borrowed KV blocks could
    start (nothing runs nor is lent out on this worker) may go without a lender, by the engine's
    clock from the first admission round that found none, before it is refused with
    RESOURCE_EXHAUSTED naming why; the requests queued behind it start meanwhile. Time, not
    rounds, so the bound is the same on a fast machine as on a slow one. The default outlasts a
    kv_manager leader's failover (its lease TTL, 15 s in the Kubernetes overlay, plus a round of
    TTL/3), during which no creditor is suggested. 0: ``loan_wait_rounds`` alone bounds it."""
    loan_wait_rounds: int = 20
    """...and the fewest admission rounds (an idle worker looks every 0.5 s) that request is let
    ask for a lender before that refusal, whatever the time: a floor for a loaded worker, whose
    rounds come slowly. At least 1."""

    batch_policy: str = "fcfs"
    """Which requests run each step and in which LoRA mode: fcfs, lcfs, early_abort (S-LoRA),
    adapter_clustering (S-LoRA), dlora (merged/unmerged switching), pets (coordinated prefill
    batching) or hrrn (Magnus); docs/batch-policies.md."""
    early_abort_slo_s: float = 6.0
    """First-token SLO of the early_abort batch policy, in seconds from a request's arrival: a
    queued request whose first token can no longer come within it is aborted (DEADLINE_EXCEEDED)
    while newer ones can still make theirs (S-LoRA's evaluation uses 6 s). Only read with
    ``batch_policy="early_abort"``."""
    deterministic: bool = False
    """Batch-invariant numerics: a request's logits do not depend on what else is in its batch,
    nor on whether its KV came from prefill or decode, so greedy output is the same alone or
    batched, and a request re-prefilled elsewhere (a failover) continues identically. CPU workers
    with the native kernels; not with the dlora policy (a merged adapter changes its requests'
    base matmuls). docs/operations.md, "Deterministic serving"."""

    preemption_policy: str = "newest"
    """Which running request gives its KV back when the pool runs dry: newest (the last started)
    or fewest_computed (the shortest context: the cheapest recompute); see
    services/gpu_worker/engine/policies/preemption.py."""

    prefix_cache: bool = True
    """Share the KV of whole prompt blocks between requests with the same prompt prefix and the
    same adapter version (on|off): a hit skips that part of the prefill.
    Cached blocks nobody uses are evicted first when the pool needs pages; a request that
    borrows KV keeps reading its cached blocks; see services/gpu_worker/memory/prefix_cache.py."""

    eviction_policy: str = "lru"
    """Which idle adapters leave the pool when it needs pages, and the worker's host cache when
    full, first: lru (least recently used), lfu (least frequently used, ties least recent) or
    fifo; pinned adapters never (docs/operations.md, "Eviction and pinning")."""

    speculative: str = "ngram"
    """Speculative decoding: ``ngram`` drafts each decoding request's next tokens from its own
    prompt and output (prompt lookup, no draft model) and verifies them in the batched step,
    whatever its adapter; ``suffix`` drafts from the recent outputs of the request's adapter
    (per tenant namespace) too. Lossless: the same tokens as ``off``, greedy or seeded. Pays on
    output that repeats its prompt, itself or its adapter's earlier outputs. ``ngram`` by
    default: served on 2 cores it decoded one request at a time 1.64x (repetitive) and 1.41x
    (the quick trace) faster than ``off``, and at 8 concurrent measured as far from ``off`` as
    two ``off`` meshes measure from each other (docs/operations.md, "Speculative decoding")."""

    cuda_graphs: str = "off"
    """``on``: decode steps on a CUDA device replay a CUDA graph captured per batch-size bucket
    (LoRA included; prefill and mixed steps stay eager); ignored on other devices. Off until
    measured on a GPU (docs/operations.md, "CUDA graphs")."""

    def distkv_settings(self) -> DistKvSettings:
        """This engine's DistKV settings, as the DistKV wing takes them."""
        return DistKvSettings(
            worker_id=self.worker_id,
            max_lent_blocks=self.max_lent_blocks,
            lend_compute_share=self.lend_compute_share,
            lend_compute_window_s=self.lend_compute_window_s,
            borrow=self.kv_overflow == "borrow",
            deterministic=self.deterministic,
        )

    def adapter_region_pages(self, num_pages: int) -> int | None:
        """The fixed adapter-only region of a pool of ``num_pages`` (None: unified)."""
        share = self.adapter_region_share
        return None if share is None else max(1, round(num_pages * share))

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
        if self.loan_wait_rounds < 1:
            raise ValueError(f"loan_wait_rounds must be at least 1, got {self.loan_wait_rounds}")
        if not self.loan_wait_s >= 0:
            raise ValueError(f"loan_wait_s must be at least 0, got {self.loan_wait_s}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, got {self.speculative!r}")
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}, got {self.cuda_graphs!r}")
        if self.kv_overflow not in KV_OVERFLOW_POLICIES:
            raise ValueError(f"kv_overflow must be one of {KV_OVERFLOW_POLICIES}, got {self.kv_overflow!r}")
