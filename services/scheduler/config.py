"""Settings of the scheduler (flags ``--name``, env ``LORAMESH_NAME``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.config import ServiceConfig, require_at_least, require_positive


@dataclass
class SchedulerConfig(ServiceConfig):
    """loramesh scheduler: places each request on a gpu_worker (by default the one with the least
    estimated wait, counting the prompt prefix it likely holds cached)."""

    placement: str = "prefix-aware"
    """Placement policy: ``prefix-aware`` (least-estimated-wait plus the prompt prefix each worker
    likely holds in its prefix cache, against load imbalance: ``--prefix-*``; with no cached
    prefix anywhere the same choice as least-estimated-wait), ``least-estimated-wait`` (dLoRA
    proactive dispatch: queue + adapter load), ``least-loaded`` (fewest queued + running
    requests) or ``round-robin``."""
    migration: str = "none"
    """Migration policy: ``none``, ``co-migration`` (dLoRA's relaxed LP over the top-K replicas),
    ``pets`` (PetS greedy balancing, adaptive interval) or ``batch-balancing`` (running requests
    from the largest batches to the smallest when the step model says it pays). Each round lists the workers' requests and
    hands the planned ones off to their targets, adapter first (docs/architecture.md)."""
    prefetch: str = "none"
    """Prefetch policy: ``none`` or ``burst-tolerance`` (dLoRA: load the adapters whose holders
    absorb the least burst onto workers that lack them)."""
    length_predictor: str = "none"
    """Output-length predictor: ``none`` or ``magnus`` (prompt embedding + random forest, learning
    from completions; needs ``pip install 'loramesh[predictor]'``). Its predictions feed the wait
    estimate and the workers' ``hrrn`` batch policy."""
    predictor_bootstrap_completions: int = 32
    """With ``magnus``: completions collected before the first forest is fitted."""
    demand_window_s: float = 30.0
    """Window of the per-adapter request rates and per-worker invocations the policies see."""
    worker_call_deadline_s: float = 30.0
    """Deadline of each call migration and prefetch make to a worker (a listing or a hand-off
    waits for the worker's current step; a load for the adapter's fetch)."""

    per_request_step_ms: float = 10.0
    """How much each request already in a worker's batch delays a new one's first token."""
    adapter_load_ms: float = 50.0
    """Estimated time to load an adapter on a worker that does not hold it (fetch + copy)."""
    mean_output_tokens: float = 128.0
    """Average tokens per request, for the time between completions (tokens / worker tokens_per_s)."""
    default_service_ms: float = 1000.0
    """Time between request completions assumed for a worker that reports no throughput yet."""
    min_tokens_per_s: float = 1.0
    """Floor on a worker's reported tokens_per_s in the wait estimate."""
    max_running_hint: int = 64
    """Requests a worker runs together (its --max-running); beyond it a new request waits."""
    max_queue_per_worker: int = 64
    """Refuse (RESOURCE_EXHAUSTED) when every worker has this many requests queued."""
    default_deadline_ms: float = 0.0
    """First-token deadline for requests that carry none; 0: none."""
    start_timeout_s: float = 10.0
    """How long start-up waits for the first listing of workers from etcd before failing."""

    prefix_prefill_ms_per_token: float = 1.0
    """With ``prefix-aware``: what prefilling one prompt token costs a worker (ms), turning the
    tokens a cached prefix saves into time (docs/architecture.md, prefix-aware placement)."""
    prefix_imbalance_ms_per_request: float = 50.0
    """With ``prefix-aware``: the cost (ms) of each request a worker has above the least-loaded
    one, against piling a popular prefix's requests onto its holder."""
    prefix_index_blocks: int = 16384
    """With ``prefix-aware``: prompt blocks remembered per worker (least recently placed go first)."""
    prefix_index_ttl_s: float = 600.0
    """With ``prefix-aware``: a block not placed again on a worker for this long counts as evicted."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(
            self,
            1,
            "max_running_hint",
            "max_queue_per_worker",
            "predictor_bootstrap_completions",
            "prefix_index_blocks",
        )
        require_at_least(self, 0, "per_request_step_ms", "adapter_load_ms", "default_deadline_ms")
        require_at_least(self, 0, "prefix_prefill_ms_per_token", "prefix_imbalance_ms_per_request")
        # Windows, rates and deadlines: zero would divide by it, or give up before asking.
        require_positive(self, "demand_window_s", "worker_call_deadline_s", "mean_output_tokens")
        require_positive(
            self, "default_service_ms", "min_tokens_per_s", "start_timeout_s", "prefix_index_ttl_s"
        )
