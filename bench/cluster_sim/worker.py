"""One simulated gpu_worker: a continuous-batching server in virtual time.

It mirrors the engine (``services/gpu_worker/engine/engine.py``) and its adapter loader at the
level that shapes latency under load:

- A request whose adapter has no host copy waits for the fetch (``adapter_load_ms``: read,
  parse) before it joins the engine's queue, as the worker submits it only once its loader holds
  the adapter; host copies are kept LRU within ``host_cache_tokens`` (unbounded when 0), and one
  no request references may be dropped, so a later request fetches it again.
- The queue is FIFO and admission follows the engine's own rules, imported
  (``services/gpu_worker/engine/admission.py``): it stops at the first request that cannot start
  (a later one never overtakes it), after ``max_running`` requests, or when the step's prefill
  budget (``max_prefill_tokens``) is spent. Starting pages the adapter into the unified pool (evicting
  idle adapters LRU) and reserves the request's context (prompt + tokens so far), not its whole
  output.
- Every step each running request's KV grows by a token; when the pool runs dry, idle adapters
  are evicted and then the running request the worker's preemption policy names (the newest by
  default) is preempted (its KV freed, back to the front of the queue, its context recomputed
  when it starts again).
- A step prefills the admitted contexts (the prefill emits the first token) and decodes one
  token for every running request; its duration is the cost model's.
- With a prefix cache (``prefix_cache_tokens``), a starting request skips the prefill of the
  longest run of its prompt blocks (chain hashes, as the worker keys them) the cache holds, less
  the prompt's last token; its blocks are cached once its prefill step ends, least recently used
  going first past the budget. The cache is a budget of its own beside the pool (the engine's
  unused cached blocks live in free pool pages): a hit saves compute here, not memory.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from bench.cluster_sim.cost_model import StepShape, shape_of
from services.gpu_worker.engine.admission import Start, admit
from services.gpu_worker.engine.policies.batch_policy import RunningRequest
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.gpu_worker.engine.policies.preemption import make_preemption_policy


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
    """Context tokens admitted in one step at most (one longer context is admitted alone)."""
    adapter_load_ms: float = 50.0
    """Time to fetch an adapter's host copy (read and parse); paging it into the pool is free."""
    host_cache_tokens: int = 0
    """Host RAM for adapter copies, in the pool's token units (0: unbounded)."""
    rate_window_s: float = 2.0
    """Window of the reported tokens_per_s."""
    preemption_policy: str = "newest"
    """Which running request is preempted when the pool runs dry: the worker's
    ``--preemption-policy`` (``services/gpu_worker/engine/policies/preemption.py``)."""
    prefix_cache_tokens: int = 0
    """Prompt KV kept for reuse by later requests (the prefix cache), in tokens; 0: none."""
    prefix_block_tokens: int = 16
    """Tokens per cached block (the worker's ``--kv-block-tokens``)."""


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
    preemptions: int = 0
    enqueued_s: float = 0.0
    """When it reached its current worker."""
    keeps_place: bool = False
    """Joins a queue by its arrival time, not at the back (a migrated request, when the
    simulated resume path carries its arrival time)."""
    prefix_blocks: tuple[bytes, ...] = ()
    """Chain hashes of its prompt's whole blocks (what the prefix cache and the scheduler's
    prefix index key); (): none."""
    cached_tokens: int = 0
    """Prompt tokens its latest start found in the worker's prefix cache (their prefill skipped)."""
    first_cached_tokens: int | None = None
    """``cached_tokens`` of its first start (the hit rate's numerator)."""

    @property
    def context_tokens(self) -> int:
        """KV it holds once prefilled: prompt and tokens so far (a migration or a preemption
        recomputes them)."""
        return self.input_len + self.generated

    @property
    def reserved_tokens(self) -> int:
        """Pool tokens it will occupy by its last token: its whole context."""
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
    cost: LinearCost
    fetching: dict[str, list[SimRequest]] = field(default_factory=dict)
    """Adapters being fetched -> the requests waiting for them (not in the engine yet)."""
    queue: list[SimRequest] = field(default_factory=list)
    running: list[SimRequest] = field(default_factory=list)
    host: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Host copies of adapters -> their pool tokens, least recently used first."""
    resident: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Adapters paged into the pool -> their pool tokens, least recently used first."""
    prefetched: set[str] = field(default_factory=set)
    """Adapters being fetched to be paged in ahead of demand."""
    step: Step | None = None
    preemptions: int = 0
    tokens_log: deque[tuple[float, int]] = field(default_factory=deque)
    """(step end, tokens generated) within the rate window."""
    prefix: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    """Cached prompt blocks, least recently used first."""

    # -- adapters ------------------------------------------------------------------------------

    def adapter_tokens(self, rank: int) -> int:
        return rank * self.spec.adapter_tokens_per_rank

    def has_adapter(self, adapter: str) -> bool:
        """A host copy is here or on its way: a request for it needs no new fetch."""
        return not adapter or adapter in self.host or adapter in self.fetching

    def holds(self) -> set[str]:
        """Adapters in the pool, in host memory or being fetched."""
        return set(self.resident) | set(self.host) | set(self.fetching)

    def _fetch(self, adapter: str, now: float) -> float | None:
        """Start fetching ``adapter``'s host copy unless it is here or coming; when it lands."""
        if self.has_adapter(adapter):
            if adapter in self.host:
                self.host.move_to_end(adapter)
            return None
        self.fetching[adapter] = []
        return now + self.spec.adapter_load_ms / 1000.0

    def ensure_adapter(self, adapter: str, rank: int, now: float) -> float | None:
        """Prefetch: fetch ``adapter`` and page it into the pool when it lands (if idle adapters
        make room for it); returns when it will be ready (None: nothing to do)."""
        if adapter in self.resident:
            return None
        ready = self._fetch(adapter, now)
        if adapter in self.host:
            self._page_in(adapter, self.adapter_tokens(rank))
        else:
            self.prefetched.add(adapter)
        return ready

    def adapter_ready(self, adapter: str, rank: int) -> None:
        """The fetch of ``adapter`` landed: its waiting requests join the queue."""
        waiting = self.fetching.pop(adapter, None)
        if waiting is None:
            return
        self.host[adapter] = self.adapter_tokens(rank)
        for request in waiting:
            self._join_queue(request)
        if adapter in self.prefetched:
            self.prefetched.discard(adapter)
            self._page_in(adapter, self.adapter_tokens(rank))
        self._trim_host()

    def _in_use(self) -> set[str]:
        return {r.adapter for r in self.queue} | {r.adapter for r in self.running}

    def _trim_host(self) -> None:
        """Drop unreferenced host copies (and their idle pool pages) LRU beyond the budget."""
        budget = self.spec.host_cache_tokens
        if budget <= 0:
            return
        in_use = self._in_use()
        for adapter in list(self.host):
            if sum(self.host.values()) <= budget:
                return
            if adapter not in in_use:
                del self.host[adapter]
                self.resident.pop(adapter, None)

    def _make_room(self, tokens: int) -> bool:
        """Evict idle adapters LRU until ``tokens`` are free; False if they cannot be."""
        while self.free_tokens() < tokens:
            if not self._evict_one_idle():
                return False
        return True

    def _page_in(self, adapter: str, tokens: int) -> bool:
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            return True
        if not self._make_room(tokens):
            return False
        self.resident[adapter] = tokens
        return True

    # -- memory and load -----------------------------------------------------------------------

    def used_tokens(self) -> int:
        return sum(r.context_tokens for r in self.running) + sum(self.resident.values())

    def free_tokens(self) -> int:
        return max(0, self.spec.memory_tokens - self.used_tokens())

    def waiting(self) -> list[SimRequest]:
        """Requests here not running: queued, then those waiting for their adapter's fetch."""
        return self.queue + [r for rs in self.fetching.values() for r in rs]

    def tokens_per_s(self, now: float) -> float:
        window = self.spec.rate_window_s
        while self.tokens_log and self.tokens_log[0][0] < now - window:
            self.tokens_log.popleft()
        return sum(n for _, n in self.tokens_log) / window

    def report(self, now: float) -> dict:
        """A load report in the gpu_worker's format (pages = 16 tokens)."""
        return {
            "queue": len(self.queue) + sum(len(rs) for rs in self.fetching.values()),
            "running": len(self.running),
            "free_pages": self.free_tokens() // 16,
            "total_pages": self.spec.memory_tokens // 16,
            "resident_adapters": sorted(self.resident),
            "tokens_per_s": self.tokens_per_s(now),
            "ts": now,
        }

    # -- requests ------------------------------------------------------------------------------

    def enqueue(self, request: SimRequest, now: float) -> float | None:
        """Take a request; returns when its adapter's fetch lands if one started."""
        request.worker = self.worker_id
        request.enqueued_s = now
        ready = self._fetch(request.adapter, now)
        if request.adapter in self.fetching:
            self.fetching[request.adapter].append(request)
        else:
            self._join_queue(request)
        return ready

    def _join_queue(self, request: SimRequest) -> None:
        if not request.keeps_place:
            self.queue.append(request)
            return
        later = next(
            (i for i, r in enumerate(self.queue) if r.arrival_s > request.arrival_s), len(self.queue)
        )
        self.queue.insert(later, request)

    def remove(self, request_id: str) -> SimRequest | None:
        """Take a request off this worker (its KV, if any, is dropped)."""
        for pool in (self.queue, self.running, *self.fetching.values()):
            for i, request in enumerate(pool):
                if request.request_id == request_id:
                    return pool.pop(i)
        return None

    def _evict_one_idle(self) -> bool:
        """Evict the least recently used adapter no running request uses; False if none."""
        busy = {r.adapter for r in self.running}
        for adapter in self.resident:
            if adapter not in busy:
                del self.resident[adapter]
                return True
        return False

    def _preempt_until_it_fits(self) -> None:
        """Make room for the running requests' KV: idle adapters go first, then the newest
        requests the worker's preemption policy names (back to the front of the queue)."""
        policy = make_preemption_policy(self.spec.preemption_policy)
        while self.running and self.used_tokens() > self.spec.memory_tokens:
            if self._evict_one_idle():
                continue
            views = [
                RunningRequest(r.request_id, r.adapter or None, r.arrival_s, context_tokens=r.context_tokens)
                for r in self.running
            ]
            victim = self.running.pop(views.index(policy.victim(views)))
            victim.preemptions += 1
            self.preemptions += 1
            self.queue.insert(0, victim)

    def _admit(self) -> list[SimRequest]:
        """Start queued requests in order until one does not fit: the engine's rules
        (``services/gpu_worker/engine/admission.py``)."""
        return admit(
            list(self.queue),
            running=lambda: len(self.running),
            max_running=self.spec.max_running,
            max_prefill_tokens=self.spec.max_prefill_tokens,
            context_tokens=lambda r: r.context_tokens,
            start=self._start,
        )

    def _start(self, request: SimRequest) -> Start:
        """Page its adapter in and make room for its context (the engine's start)."""
        tokens = self.host.get(request.adapter) or self.adapter_tokens(request.rank)
        if request.adapter and not self._page_in(request.adapter, tokens):
            return Start.BLOCKED
        if not self._make_room(request.context_tokens):
            return Start.BLOCKED
        self.queue.remove(request)
        self.running.append(request)
        request.cached_tokens = self._cached_prefix(request)
        if request.first_cached_tokens is None:
            request.first_cached_tokens = request.cached_tokens
        return Start.STARTED

    def _cached_prefix(self, request: SimRequest) -> int:
        """Prompt tokens of ``request`` the prefix cache holds (its longest run of blocks from
        the first, marked used), less its last token, which is always computed."""
        if not self.spec.prefix_cache_tokens:
            return 0
        hits = 0
        for block in request.prefix_blocks:
            if block not in self.prefix:
                break
            self.prefix.move_to_end(block)
            hits += 1
        return max(0, min(hits * self.spec.prefix_block_tokens, request.context_tokens - 1))

    def _cache_prompt(self, request: SimRequest) -> None:
        """Its prefill is done: its prompt blocks are cached, the head marked used last (a chain
        is evicted from its tail), the least recently used past the budget going first."""
        if not self.spec.prefix_cache_tokens:
            return
        for block in reversed(request.prefix_blocks):
            self.prefix[block] = None
            self.prefix.move_to_end(block)
        for _ in range(len(self.prefix) - self.spec.prefix_cache_tokens // self.spec.prefix_block_tokens):
            self.prefix.popitem(last=False)

    def start_step(self, now: float) -> Step | None:
        """Admit what fits and start the next step; None when there is nothing to run."""
        if self.step is not None:
            return None
        self._preempt_until_it_fits()
        decode = list(self.running)
        admitted = self._admit()
        if not self.running:
            return None
        for request in self.running:
            if request.adapter in self.resident:
                self.resident.move_to_end(request.adapter)
            if request.adapter in self.host:
                self.host.move_to_end(request.adapter)
        parts = [(r.context_tokens - r.cached_tokens, r.cached_tokens, r.rank, r.adapter) for r in admitted]
        parts += [(1, r.context_tokens, r.rank, r.adapter) for r in decode]
        shape = shape_of(parts)
        self.step = Step(now + self.cost.predict(shape.row()) / 1000.0, admitted, decode, shape)
        return self.step

    def finish_step(self) -> list[SimRequest]:
        """End the step in flight: one token for each of its requests still running here;
        returns the requests that finished."""
        step, self.step = self.step, None
        assert step is not None
        here = {id(r) for r in self.running}
        prefilled = {id(r) for r in step.prefill}
        finished: list[SimRequest] = []
        produced = 0
        for request in step.prefill + step.decode:
            if id(request) not in here:
                continue  # migrated away mid-step: its token is recomputed at the target
            request.generated += 1
            produced += 1
            if id(request) in prefilled:
                self._cache_prompt(request)
            if request.first_token_s is None:
                request.first_token_s = step.end_s
            if request.generated >= request.output_len:
                request.finish_s = step.end_s
                finished.append(request)
        for request in finished:
            self.running.remove(request)
        self.tokens_log.append((step.end_s, produced))
        return finished
