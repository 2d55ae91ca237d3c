"""What placement works with: the request, the decision, the wait model, the eligible workers.

:class:`WaitModel` is the estimate of how long a request waits on a worker — queueing time there
plus the time to load the request's adapter if the worker does not hold it (dLoRA's proactive
dispatch, DESIGN §7) — shared by the policies in ``policies/`` and by admission
(``admission.py``) so they reason about the same numbers.

No gRPC here; errors are domain errors from ``services.runtime.errors``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.runtime.errors import InvalidArgument, Unavailable
from services.scheduler.cluster_view import ClusterSnapshot, WorkerState

MAX_PREFIX_BLOCKS = 65536
"""Prompt blocks one placement may name (a million tokens of 16-token blocks): bounds the work
and memory one request may cost the prefix index."""
MAX_PREFIX_BLOCK_BYTES = 64
"""Longest block hash accepted (the gateway's are sha256 digests, 32 bytes)."""


@dataclass(frozen=True)
class PlacementRequest:
    """What the scheduler is asked to place (``loramesh.v1.PlaceRequest`` without the proto)."""

    request_id: str = ""
    """Caller's id of the request (logs only)."""
    adapter_id: str = ""
    """Adapter the request uses; empty: the base model (nothing to load)."""
    prompt_tokens: int = 0
    """Prompt length in tokens."""
    max_tokens: int = 0
    """Largest number of tokens the request may generate (0: unknown)."""
    first_token_deadline_ms: float = 0.0
    """The first token must come within this many ms of now; 0: no deadline."""
    exclude_workers: frozenset[str] = frozenset()
    """Worker ids not to place on (e.g. one that just failed this request)."""
    adapter_bytes: int = 0
    """Size of the adapter's weights when the caller knows it (0: unknown)."""
    prefer_worker: str = ""
    """A migration's target: placed there when it is eligible and open, whatever the policy."""
    prefix_blocks: tuple[bytes, ...] = ()
    """Chain hashes of the prompt's whole blocks as the workers' prefix caches name them (the
    gateway's; :mod:`services.scheduler.prefix_index`); (): none."""
    prefix_block_tokens: int = 0
    """Tokens in each of ``prefix_blocks``."""

    def __post_init__(self) -> None:
        if self.prefix_blocks and self.prefix_block_tokens < 1:
            raise InvalidArgument(
                f"prefix_block_tokens must be >= 1 with {len(self.prefix_blocks)} prefix_blocks, "
                f"got {self.prefix_block_tokens}"
            )
        if len(self.prefix_blocks) > MAX_PREFIX_BLOCKS:
            raise InvalidArgument(
                f"prefix_blocks holds {len(self.prefix_blocks)} blocks; the limit is {MAX_PREFIX_BLOCKS}"
            )
        if any(len(block) > MAX_PREFIX_BLOCK_BYTES for block in self.prefix_blocks):
            raise InvalidArgument(f"a prefix_blocks hash is over {MAX_PREFIX_BLOCK_BYTES} bytes")
        deadline = self.first_token_deadline_ms
        if not math.isfinite(deadline) or deadline < 0:
            raise InvalidArgument(f"first_token_deadline_ms must be >= 0 (0: none), got {deadline}")
        if self.adapter_bytes < 0:
            raise InvalidArgument(f"adapter_bytes must be >= 0, got {self.adapter_bytes}")


@dataclass(frozen=True)
class PlacementDecision:
    """The decision: where the request goes and what the policy expects there."""

    worker_id: str
    """Chosen worker's instance id."""
    address: str
    """Chosen worker's gRPC address."""
    estimated_wait_ms: float
    """Estimated time until the request can start there: ``queue_wait_ms + adapter_load_ms``."""
    adapter_resident: bool
    """The adapter is resident there (or on its way, placed since the report), or base model."""
    queue_wait_ms: float = 0.0
    """The queueing part of the estimate."""
    adapter_load_ms: float = 0.0
    """The adapter-loading part of the estimate (0 when resident)."""
    ahead: int = 0
    """Requests estimated to finish before this one gets a slot."""
    cached_prefix_tokens: int = 0
    """Prompt tokens the worker likely holds in its prefix cache (the scheduler's prefix index)."""


@dataclass(frozen=True)
class WaitModel:
    """How long a request would wait on a worker before it starts.

    The worker is modelled as a throughput-bound server: it completes requests at
    ``tokens_per_s / mean_output_tokens`` per second, so one request finishes every
    *service interval* ::

        interval = mean_output_tokens / max(tokens_per_s, min_tokens_per_s)   (tokens_per_s > 0)
                 = default_service_ms                                          (tokens_per_s == 0)

    Our request gets a slot once the requests ahead of it have finished::

        ahead = queue + placed_since_report + max(0, running + 1 - max_running_hint)

    ``queue`` and our own un-reported placements wait before us (FIFO); the running batch only
    delays us once it is full (``running`` at the hint: one more request must finish to free a
    slot for ours). Below that, a batch still slows us down: every step, hence our prefill and
    first token, takes longer the more requests share it. Then::

        queue_wait  = ahead * interval + (running + placed_since_report) * per_request_step_ms
        adapter_load = 0                                  adapter resident / placed there / base
                     = adapter_bytes / load_bandwidth     both known
                     = adapter_load_ms                    otherwise
        wait = queue_wait + adapter_load

    With a length predictor (``--length-predictor magnus``), ``mean_output_tokens`` of a worker is
    the mean predicted length of the requests placed there and not finished yet
    (``ClusterSnapshot.predicted_output_tokens``): a worker busy with long answers frees its
    slots more slowly than one busy with short ones.

    Loading overlaps nothing in this model (the worker fetches the adapter while the request
    queues, so this over-estimates loaded-while-queued adapters; dLoRA makes the same choice).
    """

    adapter_load_ms: float = 50.0
    """Time to bring a non-resident adapter into a worker's pool (fetch + copy)."""
    load_bandwidth_bytes_per_s: float = 0.0
    """When > 0 and the request carries its adapter's size, load time = bytes / bandwidth."""
    mean_output_tokens: float = 128.0
    """Average tokens a request generates (for the service interval)."""
    min_tokens_per_s: float = 1.0
    """Floor on a worker's reported throughput (a crawling worker is not infinitely slow)."""
    default_service_ms: float = 1000.0
    """Service interval of a worker that reports no throughput yet (tokens_per_s 0)."""
    max_running_hint: int = 64
    """Requests a worker runs together before a new one must wait for a slot (its --max-running)."""
    per_request_step_ms: float = 10.0
    """How much one more request in the running batch lengthens a step (so the first token).
    Without it, two workers with free slots tie whatever their batch sizes and adapter affinity
    alone would pile a burst onto one worker."""

    def __post_init__(self) -> None:
        for name in (
            "adapter_load_ms",
            "load_bandwidth_bytes_per_s",
            "min_tokens_per_s",
            "default_service_ms",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"WaitModel.{name} must be a finite number >= 0, got {value}")
        if not math.isfinite(self.mean_output_tokens) or self.mean_output_tokens <= 0:
            raise ValueError(f"WaitModel.mean_output_tokens must be > 0, got {self.mean_output_tokens}")
        if self.min_tokens_per_s <= 0:
            raise ValueError(f"WaitModel.min_tokens_per_s must be > 0, got {self.min_tokens_per_s}")
        if self.max_running_hint < 1:
            raise ValueError(f"WaitModel.max_running_hint must be >= 1, got {self.max_running_hint}")

    def service_interval_ms(self, worker: WorkerState, output_tokens: float | None = None) -> float:
        """Estimated ms between two request completions on ``worker`` whose requests generate
        ``output_tokens`` on average (None: ``mean_output_tokens``)."""
        if worker.tokens_per_s <= 0:
            return self.default_service_ms
        tokens = self.mean_output_tokens if output_tokens is None else output_tokens
        return 1000.0 * tokens / max(worker.tokens_per_s, self.min_tokens_per_s)

    def ahead(self, snapshot: ClusterSnapshot, worker: WorkerState) -> int:
        """Requests that finish before a new one gets a slot on ``worker``."""
        queued = worker.queue + snapshot.placed(worker.worker_id)
        return queued + max(0, worker.running + 1 - self.max_running_hint)

    def load_ms(self, request: PlacementRequest) -> float:
        """Time to load the request's adapter on a worker that does not hold it."""
        if not request.adapter_id:
            return 0.0
        if request.adapter_bytes and self.load_bandwidth_bytes_per_s > 0:
            return 1000.0 * request.adapter_bytes / self.load_bandwidth_bytes_per_s
        return self.adapter_load_ms

    def estimate(
        self, snapshot: ClusterSnapshot, worker: WorkerState, request: PlacementRequest
    ) -> PlacementDecision:
        """The wait on ``worker`` for ``request``, as the :class:`PlacementDecision` it would be."""
        resident = not request.adapter_id or snapshot.will_have(worker.worker_id, request.adapter_id)
        ahead = self.ahead(snapshot, worker)
        batch = worker.running + snapshot.placed(worker.worker_id)
        interval = self.service_interval_ms(worker, snapshot.predicted_output_tokens.get(worker.worker_id))
        queue_ms = ahead * interval + batch * self.per_request_step_ms
        load_ms = 0.0 if resident else self.load_ms(request)
        return PlacementDecision(
            worker_id=worker.worker_id,
            address=worker.address,
            estimated_wait_ms=queue_ms + load_ms,
            adapter_resident=resident,
            queue_wait_ms=queue_ms,
            adapter_load_ms=load_ms,
            ahead=ahead,
            cached_prefix_tokens=snapshot.hit_tokens(worker.worker_id),
        )


def eligible(snapshot: ClusterSnapshot, request: PlacementRequest) -> list[WorkerState]:
    """Live workers the request may go to (not excluded); Unavailable when there are none."""
    if not snapshot.workers:
        raise Unavailable("no gpu_worker is live: none is registered in etcd")
    workers = [w for w in snapshot.workers if w.worker_id not in request.exclude_workers]
    if not workers:
        ids = ", ".join(w.worker_id for w in snapshot.workers)
        raise Unavailable(
            f"every live gpu_worker is excluded by the request ({len(snapshot.workers)} live: {ids})"
        )
    return workers
