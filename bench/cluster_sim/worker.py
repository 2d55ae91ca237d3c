"""One simulated gpu_worker: a continuous-batching server in virtual time.

It mirrors the engine's behaviour at the level the scheduler can see: requests queue FIFO; a
request is admitted to the running batch once its adapter is resident, a slot is free
(``max_running``) and its whole context (prompt + output) fits in the unified pool; each step
prefills the admitted prompts (the prefill emits the first token) and decodes one token for every
running request; its duration is the cost model's. Adapters share the pool with the KV (S-LoRA's
unified paging) and are evicted LRU when no queued or running request uses them. A request that
arrives for a non-resident adapter starts its load at once (the worker's prefetch on enqueue).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from bench.cluster_sim.cost_model import StepCostModel, StepShape, shape_of


@dataclass(frozen=True)
class WorkerSpec:
    """Capacity of every simulated worker."""

    max_running: int = 32
    """Requests in the running batch at most (the worker's ``--max-running``)."""
    memory_tokens: int = 32768
    """Unified pool size in KV tokens (adapters take their share of it)."""
    adapter_tokens_per_rank: int = 10
    """Pool footprint of an adapter per unit of rank, in KV tokens (SmolLM2 q/k/v/o: ≈ 10)."""
    max_prefill_tokens: int = 2048
    """Prompt tokens admitted in one step at most (one longer prompt is admitted alone)."""
    adapter_load_ms: float = 50.0
    """Time to fetch an adapter and page it in."""
    rate_window_s: float = 2.0
    """Window of the reported tokens_per_s."""


@dataclass
class SimRequest:
    """A request's life in the simulation."""

    request_id: str
    adapter: str
    rank: int
    input_len: int
    output_len: int
    arrival_s: float
    generated: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    worker: str = ""
    migrations: int = 0
    enqueued_s: float = 0.0
    """When it joined its current worker's queue."""

    @property
    def context_tokens(self) -> int:
        """KV it holds once prefilled: prompt and tokens so far (a migration recomputes them)."""
        return self.input_len + self.generated

    @property
    def reserved_tokens(self) -> int:
        """Pool tokens it occupies while running: its whole context up to its last token."""
        return self.input_len + self.output_len


@dataclass
class Step:
    """A step in flight: when it ends and which requests it prefills and decodes."""

    end_s: float
    prefill: list[SimRequest]
    decode: list[SimRequest]
    shape: StepShape


@dataclass
class SimWorker:
    worker_id: str
    spec: WorkerSpec
    cost: StepCostModel
    queue: list[SimRequest] = field(default_factory=list)
    running: list[SimRequest] = field(default_factory=list)
    resident: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Ready adapters -> their pool tokens, least recently used first."""
    loading: dict[str, int] = field(default_factory=dict)
    """Adapters being loaded -> their pool tokens (reserved from the start of the load)."""
    step: Step | None = None
    tokens_log: deque[tuple[float, int]] = field(default_factory=deque)
    """(step end, tokens generated) within the rate window."""

    # -- adapters ------------------------------------------------------------------------------

    def adapter_tokens(self, rank: int) -> int:
        return rank * self.spec.adapter_tokens_per_rank

    def has_adapter(self, adapter: str) -> bool:
        """Resident or on its way."""
        return not adapter or adapter in self.resident or adapter in self.loading

    def ensure_adapter(self, adapter: str, rank: int, now: float) -> float | None:
        """Start loading ``adapter`` unless it is here or coming; returns when it will be ready
        (None: nothing to do)."""
        if self.has_adapter(adapter):
            return None
        self._make_room(self.adapter_tokens(rank))
        ready = now + self.spec.adapter_load_ms / 1000.0
        self.loading[adapter] = self.adapter_tokens(rank)
        return ready

    def adapter_ready(self, adapter: str) -> None:
        if adapter in self.loading:
            self.resident[adapter] = self.loading.pop(adapter)

    def _in_use(self) -> set[str]:
        return {r.adapter for r in self.queue} | {r.adapter for r in self.running}

    def _make_room(self, tokens: int) -> None:
        """Evict LRU adapters no request here uses until ``tokens`` fit (or none is left)."""
        in_use = self._in_use()
        for adapter in list(self.resident):
            if self.free_tokens() >= tokens:
                return
            if adapter not in in_use:
                del self.resident[adapter]

    # -- memory and load -----------------------------------------------------------------------

    def used_tokens(self) -> int:
        return (
            sum(r.reserved_tokens for r in self.running)
            + sum(self.resident.values())
            + sum(self.loading.values())
        )

    def free_tokens(self) -> int:
        return max(0, self.spec.memory_tokens - self.used_tokens())

    def tokens_per_s(self, now: float) -> float:
        window = self.spec.rate_window_s
        while self.tokens_log and self.tokens_log[0][0] < now - window:
            self.tokens_log.popleft()
        return sum(n for _, n in self.tokens_log) / window

    def report(self, now: float) -> dict:
        """A load report in the gpu_worker's format (pages = 16 tokens)."""
        return {
            "queue": len(self.queue),
            "running": len(self.running),
            "free_pages": self.free_tokens() // 16,
            "total_pages": self.spec.memory_tokens // 16,
            "resident_adapters": sorted(self.resident),
            "tokens_per_s": self.tokens_per_s(now),
            "ts": now,
        }

    # -- requests ------------------------------------------------------------------------------

    def enqueue(self, request: SimRequest, now: float) -> float | None:
        """Queue a request; returns when its adapter will be ready if a load started."""
        request.worker = self.worker_id
        request.enqueued_s = now
        self.queue.append(request)
        return self.ensure_adapter(request.adapter, request.rank, now)

    def remove(self, request_id: str) -> SimRequest | None:
        """Take a queued or running request off this worker (its KV, if any, is dropped)."""
        for pool in (self.queue, self.running):
            for i, request in enumerate(pool):
                if request.request_id == request_id:
                    return pool.pop(i)
        return None

    def start_step(self, now: float) -> Step | None:
        """Admit what fits and start the next step; None when there is nothing to run."""
        if self.step is not None:
            return None
        admitted: list[SimRequest] = []
        prefill_tokens = 0
        free = self.free_tokens()
        for request in self.queue:
            if len(self.running) + len(admitted) >= self.spec.max_running:
                break
            if request.adapter and request.adapter not in self.resident:
                continue  # its adapter is loading: later requests may go first
            if request.reserved_tokens > free and (self.running or admitted):
                continue
            if admitted and prefill_tokens + request.context_tokens > self.spec.max_prefill_tokens:
                break
            admitted.append(request)
            prefill_tokens += request.context_tokens
            free -= request.reserved_tokens
        if not admitted and not self.running:
            return None
        for request in admitted:
            self.queue.remove(request)
        decode = list(self.running)
        self.running.extend(admitted)
        for request in self.running:
            if request.adapter:
                self.resident.move_to_end(request.adapter)
        parts = [(r.context_tokens, 0, r.rank, r.adapter) for r in admitted]
        parts += [(1, r.context_tokens, r.rank, r.adapter) for r in decode]
        shape = shape_of(parts)
        self.step = Step(now + self.cost.step_ms(shape) / 1000.0, admitted, decode, shape)
        return self.step

    def finish_step(self) -> list[SimRequest]:
        """End the step in flight: one token for each of its requests still here; returns the
        requests that finished."""
        step, self.step = self.step, None
        assert step is not None
        here = {id(r) for r in self.running}
        finished: list[SimRequest] = []
        produced = 0
        for request in step.prefill + step.decode:
            if id(request) not in here:
                continue  # migrated away mid-step: its token is recomputed at the target
            request.generated += 1
            produced += 1
            if request.first_token_s is None:
                request.first_token_s = step.end_s
            if request.generated >= request.output_len:
                request.finish_s = step.end_s
                finished.append(request)
        for request in finished:
            self.running.remove(request)
        self.tokens_log.append((step.end_s, produced))
        return finished
