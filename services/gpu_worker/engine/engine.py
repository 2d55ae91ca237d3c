"""The engine: continuous batching of many adapters over one unified pool.

Every :meth:`Engine.step` (one model iteration) it
1. applies cancellations and new requests handed over by other threads;
2. makes room for the running requests' next token: new KV pages, evicting idle adapters LRU
   and, when the pool runs dry, preempting the newest request (its pages are freed and it is
   recomputed later from prompt + output so far);
3. asks its batch policy (``services/gpu_worker/engine/policies``) which requests run this step
   and in which LoRA mode, aborts the requests the policy gives up on, and merges or unmerges an
   adapter when the mode changes;
4. admits waiting requests in the policy's order while their adapter can be paged in and their
   prompt fits, and runs prefills and decodes of the chosen requests in one forward pass (a
   running request the policy leaves out pauses, its KV kept);
5. samples, emits a :class:`TokenEvent` per request, retires finished requests, and tells the
   policy what the step cost.

The engine is single-threaded by design: only :meth:`submit`, :meth:`cancel`, :meth:`preload`,
:meth:`add_adapter`, :meth:`remove_adapter` and :meth:`between_steps` (DGFM's recalls) may be
called from other threads; they hand work over under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from services.gpu_worker.engine.block_recall import BlockRecalls
from services.gpu_worker.engine.borrower import Borrower, CreditorDirectory, TransportFactory
from services.gpu_worker.engine.policies import BATCH_POLICIES, make_batch_policy
from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    Abort,
    BatchPolicy,
    BatchView,
    LoraMode,
    Merged,
    QueuedRequest,
    RunningRequest,
    StepOutcome,
)
from services.gpu_worker.engine.request import (
    EngineRequest,
    FinishReason,
    GenerationRequest,
    RequestState,
    RequestSummary,
    TokenEvent,
)
from services.gpu_worker.engine.sampling import sample_batch, token_logprobs
from services.gpu_worker.engine.step_builder import StepBuilder
from services.gpu_worker.kernels.dispatch import resolve_backend
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.lora.merged_weights import MergedWeights
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.block_lender import LendingConfig
from services.gpu_worker.memory.block_table import BlockTable
from services.gpu_worker.memory.distkv_meter import DistKvMeter, MeteredLender, metered_connect
from services.gpu_worker.memory.kv_cache import KvTable
from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.remote_block_allocator import CreditorUnavailable
from services.gpu_worker.memory.rmanager import RManager
from services.gpu_worker.memory.unified_pool import PoolLayout, UnifiedPool
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import AlreadyExists, NotFound, ResourceExhausted
from services.runtime.request_validation import check_request

log = logging.getLogger("loramesh.engine")

EventSink = Callable[[TokenEvent], None]
T = TypeVar("T")
KV_OVERFLOW_POLICIES = ("preempt", "borrow")


@dataclass(frozen=True)
class PoolTokens:
    """The unified pool in KV-token units."""

    total: int
    free: int
    adapter_tokens: dict[str, int]
    """Footprint of each adapter with a host copy here, were it paged in."""


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
    max_lent_blocks: int = 0
    """KV blocks other workers may borrow from this pool at most, all together (0: none)."""
    kv_overflow: str = "preempt"
    """When the pool cannot hold a request's next KV block: ``preempt`` (free the newest
    request's pages and recompute it later) or ``borrow`` (DistKV-LLM: borrow blocks from other
    workers, and preempt only when none lends)."""

    batch_policy: str = "fcfs"
    """Which requests run each step and in which LoRA mode (``--batch-policy``): fcfs, lcfs,
    early_abort (S-LoRA), adapter_clustering (S-LoRA), dlora (merged/unmerged switching), pets
    (coordinated prefill batching) or hrrn (Magnus); see services/gpu_worker/engine/policies."""
    deterministic: bool = False
    """Batch-invariant numerics (``--deterministic``): a request's logits do not depend on what
    else is in its batch, nor on whether its KV came from prefill or decode, so greedy output is
    the same alone or batched, and a request re-prefilled elsewhere continues identically. CPU
    workers with the native kernels; not with the dlora policy (a merged adapter changes its
    requests' base matmuls). Costs: docs/benchmarks.md, "Deterministic serving"."""

    def __post_init__(self) -> None:
        if self.batch_policy not in BATCH_POLICIES:
            known = ", ".join(sorted(BATCH_POLICIES))
            raise ValueError(f"batch_policy must be one of {known}, got {self.batch_policy!r}")
        if self.kv_overflow not in KV_OVERFLOW_POLICIES:
            raise ValueError(f"kv_overflow must be one of {KV_OVERFLOW_POLICIES}, got {self.kv_overflow!r}")


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig = EngineConfig(),
        eos_token_ids: tuple[int, ...] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        on_logits: Callable[[str, torch.Tensor], None] | None = None,
        creditors: CreditorDirectory | None = None,
        connect: TransportFactory | None = None,
        batch_policy: BatchPolicy | None = None,
    ):
        """``creditors`` and ``connect``: where to borrow KV blocks and how to reach a creditor;
        required with ``kv_overflow="borrow"``. ``batch_policy``: a configured policy instead of
        ``config.batch_policy`` with its defaults (benchmarks and tests tune its knobs)."""
        self.model = model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.on_logits = on_logits
        """Observer of each request's float32 logits before sampling (tests compare them to HF)."""
        cfg = model.config
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        layout = PoolLayout(
            num_pages=PoolLayout.pages_for_bytes(
                int(config.pool_mib * 2**20), config.kv_block_tokens, kv_dim, model.dtype
            ),
            kv_block_tokens=config.kv_block_tokens,
            kv_dim=kv_dim,
            num_layers=cfg.num_layers,
        )
        adapter_region = (
            None
            if config.adapter_region_share is None
            else max(1, round(layout.num_pages * config.adapter_region_share))
        )
        self.pool = UnifiedPool(layout, model.dtype, model.device, adapter_region)
        if config.deterministic:  # refuse at start what would fail every step
            model.check_batch_invariant()
            resolve_backend(config.lora_backend, self.pool.buffer, batch_invariant=True)
        self.residency = AdapterResidency(self.pool)
        self.rm = RManager(
            config.worker_id, self.pool, LendingConfig(config.max_lent_blocks), config.deterministic
        )
        self.distkv = DistKvMeter()
        """This worker's lending traffic, as debtor and as creditor (heartbeat and metrics)."""
        self.lending = MeteredLender(self.rm.lender, layout, self.distkv)
        """The lender as the lending RPCs reach it, from their own threads."""
        self.borrower: Borrower | None = None
        if config.kv_overflow == "borrow":
            if creditors is None or connect is None:
                raise ValueError("kv_overflow='borrow' needs a creditor directory and a transport factory")
            self.borrower = Borrower(self.rm, creditors, metered_connect(connect, self.distkv))
        self.recalls = BlockRecalls(
            self.rm,
            self.borrower,
            lambda: [r.table for r in self.running if r.table is not None],
            self._recompute_table,
        )
        """DGFM recalls of this worker's blocks, applied through :meth:`between_steps`."""
        self._between_steps: list[tuple[Callable[[], object], Future]] = []
        self.builder = StepBuilder(model, self.pool, config.lora_backend, self.rm, config.deterministic)
        self.policy = batch_policy or make_batch_policy(config.batch_policy)
        if config.deterministic and self.policy.name == "dlora":
            raise ValueError(
                "deterministic serving cannot use the dlora batch policy: merging an adapter into the "
                "base weights changes its requests' numerics (run it with deterministic off)"
            )
        self.merged = MergedWeights(model)
        """The adapter folded into the base weights in merged mode (dLoRA), if any."""
        self.mode_switches = 0
        self.aborted = 0
        self.host_adapters: dict[str, HostAdapter] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._sinks: dict[str, EventSink] = {}
        self._inbox: list[tuple[EngineRequest, EventSink]] = []
        self._cancels: set[str] = set()
        self._preloads: list[str] = []
        self._gone_workers: list[str] = []
        self._active: set[str] = set()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._snapshot: dict = {}
        self.tokens_generated = 0
        self._rate_mark = (time.monotonic(), 0)
        self._tokens_per_s = 0.0
        self.steps = 0
        self.preemptions = 0
        self.tokens_by_adapter: dict[str, int] = {}
        """Tokens generated per adapter id since start (engine thread; read via :meth:`stats`)."""
        self.on_adapter_paged_in: Callable[[float], None] | None = None
        """Told the seconds each adapter took to be paged into the pool (engine thread)."""
        self._publish_stats()

    # -- called from any thread --------------------------------------------------------------

    def add_adapter(self, adapter: HostAdapter) -> None:
        """Make an adapter available (host copy); it is paged into the pool when first used."""
        with self._lock:
            self.host_adapters[adapter.adapter_id] = adapter

    def remove_adapter(self, adapter_id: str) -> None:
        """Drop the host copy of an adapter no queued or running request uses (the caller
        counts its requests); its pages, if resident, are left to LRU eviction."""
        with self._lock:
            self.host_adapters.pop(adapter_id, None)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self.host_adapters

    def host_adapter_ids(self) -> list[str]:
        """Adapters with a host copy on this worker (any thread)."""
        with self._lock:
            return list(self.host_adapters)

    def handed_over_adapters(self) -> list[str | None]:
        """The adapter of each request submitted and not yet taken up by the engine thread
        (None: the base model): queued too, but in no snapshot yet."""
        with self._lock:
            return [request.spec.adapter_id for request, _ in self._inbox]

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue a request; ``sink`` receives its events on the engine thread."""
        config = self.model.config
        check_request(request.prompt_ids, request.sampling, config.vocab_size, config.max_position_embeddings)
        if request.adapter_id is not None and request.adapter_id not in self.host_adapters:
            raise NotFound(f"adapter {request.adapter_id!r} is not loaded on this worker")
        kv = KvTable(self.pool)
        if (
            self.borrower is None
            and kv.pages_needed(len(request.prompt_ids) + 1) > self.pool.layout.num_pages
        ):
            raise ResourceExhausted(
                f"prompt of {len(request.prompt_ids)} tokens needs more KV pages than the whole pool has"
            )
        with self._lock:
            if request.request_id in self._active:
                raise AlreadyExists(f"request id {request.request_id!r} is already running on this worker")
            self._active.add(request.request_id)
            self._inbox.append((EngineRequest(spec=request, kv=kv), sink))
        self._wakeup.set()

    def preload(self, adapter_id: str) -> None:
        """Page a registered adapter into the pool at the next step, if there is room."""
        with self._lock:
            self._preloads.append(adapter_id)
        self._wakeup.set()

    def worker_gone(self, worker_id: str) -> None:
        """Another worker left the mesh (its etcd lease expired): if this worker borrowed from it,
        the requests with blocks there are recomputed, before the next step."""
        with self._lock:
            self._gone_workers.append(worker_id)
        self._wakeup.set()

    def between_steps(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread before the next step, so that no request's KV changes
        while it runs (DGFM's freeze); the future gets its result or its error."""
        future: Future[T] = Future()
        with self._lock:
            self._between_steps.append((fn, future))
        self._wakeup.set()
        return future

    def cancel(self, request_id: str) -> None:
        """Stop a request; its pages are freed before the next step."""
        with self._lock:
            self._cancels.add(request_id)
        self._wakeup.set()

    def hand_off(self, request_id: str) -> int:
        """Engine thread (through :meth:`between_steps`): end a request here with ``MIGRATED``,
        after the tokens it has emitted, and free its pages; returns how many it generated.
        NotFound when it is not queued or running (finished, cancelled, never here)."""
        for request in [*self.running, *self.waiting]:
            if request.request_id == request_id:
                if request in self.waiting:
                    self.waiting.remove(request)
                generated = len(request.output_ids)
                self._finish(request, FinishReason.MIGRATED, None)
                return generated
        raise NotFound(f"request {request_id!r} is not queued or running on this worker")

    def list_requests(self) -> list[RequestSummary]:
        """Engine thread (through :meth:`between_steps`): every request queued or running."""
        now = time.monotonic()
        return [
            RequestSummary(
                request_id=r.request_id,
                adapter_id=r.spec.adapter_id,
                context_tokens=r.total_len,
                remaining_tokens=max(0, r.spec.sampling.max_tokens - len(r.output_ids)),
                running=r.state is RequestState.RUNNING,
                waited_s=now - r.timings.arrived,
            )
            for r in [*self.running, *self.waiting]
        ]

    def memory_tokens(self) -> PoolTokens:
        """The pool in KV-token units, as the scheduler's migration and prefetch policies count
        it (any thread): one token of KV is ``num_layers / kv_block_tokens`` pages."""
        layout = self.pool.layout
        usage = self.pool.usage()

        def tokens(pages: int) -> int:
            return pages * layout.kv_block_tokens // layout.num_layers

        with self._lock:
            adapters = list(self.host_adapters.values())
        return PoolTokens(
            total=tokens(usage.total_pages),
            free=tokens(usage.free_pages),
            adapter_tokens={a.adapter_id: tokens(self.residency.pages_needed(a)) for a in adapters},
        )

    def start(self) -> None:
        """Run steps on a dedicated thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="loramesh-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stopping:
            if not self.has_work():
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            try:
                self.step()
                if self.recalls.frozen or not self.running and self.waiting and self.borrower is not None:
                    # Frozen by DGFM until its stage closes, or nothing runs and the head of the
                    # queue found no lender: look again after a pause (or at the next hand-over),
                    # not in a tight loop.
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
            except Exception:  # a bug must not kill the thread silently: fail the batch, go on
                log.exception("engine step failed; failing the running requests")
                for request in list(self.running):
                    self._finish(request, FinishReason.ERROR, None, "engine step failed")

    # -- engine thread -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(
            self.running
            or self.waiting
            or self._inbox
            or self._cancels
            or self._preloads
            or self._gone_workers
            or self._between_steps
            or self.recalls.frozen
        )

    def step(self) -> int:
        """One iteration; returns the number of tokens generated."""
        self._take_inbox()
        if self._apply_between_steps():
            self._publish_stats()
            return 0
        plan = self.policy.plan(self._batch_view())
        self._abort(plan.aborts)
        switch_s = self._switch_mode(plan.mode)
        self._make_room_for_running()
        self._admit(plan.run)
        self._publish_stats()  # who runs and waits, seen by scrapes during a long forward pass
        chosen = set(plan.run)
        batch_requests = [r for r in self.running if r.request_id in chosen and self._runs_in_mode(r)]
        if not batch_requests and self.running:
            # The plan left nothing runnable (e.g. the merged adapter's requests found no room
            # beside paused ones): unmerge and step the running batch rather than stall.
            switch_s += self._switch_mode(UNMERGED)
            batch_requests = list(self.running)
        if not batch_requests:
            return 0
        started = time.monotonic()
        prefill_tokens = sum(r.new_tokens for r in batch_requests if r.new_tokens > 1)
        decode_tokens = sum(1 for r in batch_requests if r.new_tokens == 1)
        batch = self.builder.build(batch_requests, self.residency, self._merged_adapter())
        try:
            logits = self.model.forward(batch, self.pool)
        except CreditorUnavailable as gone:
            # Nothing of this step is kept (no token emitted, nothing counted as computed): the
            # requests that had blocks there are recomputed, the others redo the step.
            log.warning("creditor %s is unreachable: %s", gone.creditor, gone.message)
            self._creditor_lost(gone.creditor)
            self._publish_stats()
            return 0
        now = time.monotonic()
        if self.on_logits is not None:
            for request, row in zip(batch_requests, logits):
                self.on_logits(request.request_id, row)
        tokens = sample_batch(
            logits,
            [r.spec.sampling for r in batch_requests],
            lambda i: torch.tensor(sorted(set(batch_requests[i].all_ids)), dtype=torch.int64),
            [r.next_draw_generator() for r in batch_requests],
        )
        for request, token, row in zip(batch_requests, tokens, logits):
            request.num_computed = request.total_len
            top = request.spec.sampling.top_logprobs
            request.last_logprobs = None if top is None else token_logprobs(row, token, top)
            self._emit_next_token(request, token, now)
        self.steps += 1
        self.distkv.end_step()
        merged = self._merged_adapter()
        self.policy.observe(  # what the step cost: dLoRA tunes its thresholds, the cost model fits
            StepOutcome(
                mode=self.mode,
                requests=len(batch_requests),
                prefill_tokens=prefill_tokens,
                decode_tokens=decode_tokens,
                adapters=len({r.spec.adapter_id for r in batch_requests} - {None, merged}),
                seconds=now - started,
                switch_seconds=switch_s,
            )
        )
        self._publish_stats()
        return len(batch_requests)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            preloads, self._preloads = self._preloads, []
            gone, self._gone_workers = self._gone_workers, []
        for worker_id in gone:
            self._creditor_lost(worker_id)
        for adapter_id in preloads:
            adapter = self.host_adapters.get(adapter_id)
            if adapter is None:  # removed from the host since the preload was asked for
                continue
            try:
                self._page_in(adapter)
            except PoolExhausted:
                log.info("no room to preload adapter %s now; it will be paged in when used", adapter_id)
        for request, sink in inbox:
            self._sinks[request.request_id] = sink
            self.waiting.append(request)
        if not cancels:
            return
        for request in [r for r in self.running if r.request_id in cancels]:
            self._finish(request, FinishReason.CANCELLED, None)
        for request in [r for r in self.waiting if r.request_id in cancels]:
            self.waiting.remove(request)
            self._finish(request, FinishReason.CANCELLED, None)

    def _apply_between_steps(self) -> bool:
        """Run the calls handed to :meth:`between_steps`; True while DGFM holds KV out of every
        pool (a stage is open), when no request may step."""
        with self._lock:
            calls, self._between_steps = self._between_steps, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as error:  # noqa: BLE001 - the caller gets it; the engine goes on
                future.set_exception(error)
        self.recalls.close_expired()
        return self.recalls.frozen

    def _recompute_table(self, table: BlockTable) -> None:
        """Recompute the running request whose KV blocks are ``table`` (DGFM found them no home)."""
        for request in self.running:
            if request.table is table:
                self._preempt(request)
                return

    def _reserve(self, request: EngineRequest, tokens: int) -> None:
        """Make ``request``'s KV hold ``tokens`` tokens (``PoolExhausted``: it could not)."""
        if request.table is not None:
            self._grow_borrowing(request, tokens)
            return
        needed = request.kv.pages_needed(tokens)
        if not needed:
            return
        try:
            self.residency.make_room(needed, PageUse.KV)
            request.kv.reserve(tokens)
        except PoolExhausted:
            if self.borrower is None:
                raise
            # From now on its blocks are in a block table, local ones where they were.
            request.table = self.rm.new_table()
            request.table.append(self.rm.local.adopt(request.kv.hand_over()))
            self._grow_borrowing(request, tokens)

    def _grow_borrowing(self, request: EngineRequest, tokens: int) -> None:
        """Grow a borrowing request's table: local blocks while the pool has them, then borrowed."""
        table = request.table
        missing = table.blocks_needed(tokens)
        if not missing:
            return
        local = min(missing, self.rm.local.free_blocks)
        if local:
            try:
                self.rm.reserve_local(table, table.capacity + local * table.block_tokens)
            except PoolExhausted:  # a lending call took the pages meanwhile
                local = 0
        try:
            table.append(self.borrower.borrow(missing - local))
        except ResourceExhausted as no_lender:
            raise PoolExhausted(missing - local, 0) from no_lender

    def _release_kv(self, request: EngineRequest) -> None:
        request.kv.release()
        if request.table is None:
            return
        table, request.table = request.table, None
        for creditor in self.rm.release(table):
            self._creditor_lost(creditor)

    def _creditor_lost(self, creditor: str) -> None:
        """``creditor`` is gone with the blocks it held: recompute the requests that had some."""
        borrowing = [r for r in self.running if r.table is not None]
        lost = self.rm.creditor_died(creditor, [r.table for r in borrowing])
        for index in lost:
            log.info("recomputing %s: its KV blocks on %s are lost", borrowing[index].request_id, creditor)
            self._preempt(borrowing[index])

    def _make_room_for_running(self) -> None:
        for request in list(self.running):
            if request.state is not RequestState.RUNNING:
                continue
            while True:
                try:
                    self._reserve(request, request.total_len)
                    break
                except PoolExhausted:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is request:
                        break

    def _preempt(self, request: EngineRequest) -> None:
        """Free a running request's pages; it goes back to the front of the queue (recompute)."""
        self.running.remove(request)
        self._release_kv(request)
        self._release_adapter(request)
        request.num_computed = 0
        request.state = RequestState.WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        log.debug("preempted %s (%d tokens)", request.request_id, request.total_len)

    def _admit(self, order: tuple[str, ...]) -> None:
        """Admit waiting requests in the policy's ``order`` (ids of running requests are skipped)
        until one does not fit: a later one never overtakes it."""
        budget = self.config.max_prefill_tokens
        waiting = {r.request_id: r for r in self.waiting}
        for request_id in order:
            if len(self.running) >= self.config.max_running:
                break
            request = waiting.get(request_id)
            if request is None:
                continue
            adapter_id = request.spec.adapter_id
            if adapter_id is not None and adapter_id not in self.host_adapters:
                # Only a request being cancelled loses its adapter's host copy (its caller
                # released it); finish it rather than fail the batch.
                self.waiting.remove(request)
                self._finish(request, FinishReason.CANCELLED, None)
                continue
            if not self._runs_in_mode(request):
                continue
            if request.total_len > budget and budget < self.config.max_prefill_tokens:
                break
            if not self._try_start(request):
                if self._pool_can_never_hold_it():
                    self.waiting.remove(request)
                    self._finish_unservable(request)
                    continue
                break
            self.waiting.remove(request)
            budget -= request.total_len

    def _pool_can_never_hold_it(self) -> bool:
        """A request that does not fit now never will: nothing runs, nothing is lent out (idle
        adapters were evicted to make room) and no other worker lends to this one."""
        return not self.running and self.borrower is None and not self.rm.lender.lent_blocks

    def _finish_unservable(self, request: EngineRequest) -> None:
        """Its prompt and output outgrew the whole pool: the pool is its context limit, so it ends
        like one whose context is full; one that never started gets an error saying why."""
        if request.output_ids:
            log.info(
                "%s ends at %d tokens: the pool holds no more of its KV",
                request.request_id,
                request.total_len,
            )
            self._finish(request, FinishReason.LENGTH, None)
        else:
            self._finish(
                request,
                FinishReason.ERROR,
                None,
                f"its {request.total_len} prompt tokens and adapter do not fit in this worker's pool",
            )

    # -- batch policy ------------------------------------------------------------------------

    def _batch_view(self) -> BatchView:
        return BatchView(
            now_s=time.monotonic(),
            waiting=tuple(
                QueuedRequest(
                    r.request_id,
                    r.spec.adapter_id,
                    r.timings.arrived,
                    r.total_len,
                    started=r.timings.first_token is not None,
                    predicted_output_tokens=r.spec.predicted_output_tokens,
                    max_new_tokens=self._tokens_left(r),
                )
                for r in self.waiting
            ),
            running=tuple(
                RunningRequest(
                    r.request_id,
                    r.spec.adapter_id,
                    r.timings.arrived,
                    remaining_tokens=self._tokens_left(r),
                    context_tokens=r.total_len,
                )
                for r in self.running
            ),
            max_running=self.config.max_running,
            mode=self.mode,
            max_prefill_tokens=self.config.max_prefill_tokens,
            kv_room_tokens=self.rm.local.free_blocks * self.config.kv_block_tokens,
        )

    def _tokens_left(self, request: EngineRequest) -> int:
        """Tokens ``request`` may still generate (``max_tokens`` or the context ends it first)."""
        by_max_tokens = request.spec.sampling.max_tokens - len(request.output_ids)
        by_context = self.model.config.max_position_embeddings - request.total_len
        return max(1, min(by_max_tokens, by_context))

    @property
    def mode(self) -> LoraMode:
        """The LoRA mode the base weights are in."""
        merged = self._merged_adapter()
        return UNMERGED if merged is None else Merged(merged)

    def _merged_adapter(self) -> str | None:
        return None if self.merged.merged is None else self.merged.merged.adapter_id

    def _runs_in_mode(self, request: EngineRequest) -> bool:
        """In merged mode only the merged adapter's requests can run (the base is changed)."""
        merged = self._merged_adapter()
        return merged is None or request.spec.adapter_id == merged

    def _switch_mode(self, mode: LoraMode) -> float:
        """Merge or unmerge so the base weights are in ``mode``; the seconds it took."""
        if mode == self.mode:
            return 0.0
        if isinstance(mode, Merged) and mode.adapter_id not in self.host_adapters:
            mode = UNMERGED  # removed from the host meanwhile: nothing to merge
            if mode == self.mode:
                return 0.0
        started = time.monotonic()
        self.merged.unmerge()
        if isinstance(mode, Merged):
            self.merged.merge(self.host_adapters[mode.adapter_id])
        self.mode_switches += 1
        log.debug("LoRA mode -> %s", mode)
        return time.monotonic() - started

    def _abort(self, aborts: tuple[Abort, ...]) -> None:
        waiting = {r.request_id: r for r in self.waiting}
        for abort in aborts:
            request = waiting.get(abort.request_id)
            if request is None:
                continue
            self.waiting.remove(request)
            self.aborted += 1
            self._finish(request, FinishReason.ABORTED, None, abort.reason)

    def _try_start(self, request: EngineRequest) -> bool:
        adapter_id = request.spec.adapter_id
        if adapter_id is not None:
            try:
                self._page_in(self.host_adapters[adapter_id])
            except PoolExhausted:
                return False
            self.residency.acquire(adapter_id)
            request.holds_adapter = True
        try:
            self._reserve(request, request.total_len)
        except PoolExhausted:
            self._release_kv(request)  # what a partly grown block table holds
            self._release_adapter(request)
            return False
        request.state = RequestState.RUNNING
        if request.timings.scheduled is None:
            request.timings.scheduled = time.monotonic()
        self.running.append(request)
        return True

    def _page_in(self, adapter: HostAdapter) -> None:
        """Page ``adapter`` into the pool (a no-op when resident), timing a real page-in."""
        if adapter.adapter_id in self.residency:
            self.residency.load(adapter)  # marks it recently used
            return
        started = time.perf_counter()
        self.residency.load(adapter)
        if self.on_adapter_paged_in is not None:
            self.on_adapter_paged_in(time.perf_counter() - started)

    def _release_adapter(self, request: EngineRequest) -> None:
        if request.holds_adapter:
            self.residency.release(request.spec.adapter_id)
            request.holds_adapter = False

    def _emit_next_token(self, request: EngineRequest, token: int, now: float) -> None:
        request.output_ids.append(token)
        self.tokens_generated += 1
        adapter_id = request.spec.adapter_id
        if adapter_id is not None:
            self.tokens_by_adapter[adapter_id] = self.tokens_by_adapter.get(adapter_id, 0) + 1
        if request.timings.first_token is None:
            request.timings.first_token = now
        reason = self._finish_reason(request, token)
        if reason is None:
            self._sinks[request.request_id](
                TokenEvent(
                    request.request_id,
                    token,
                    None,
                    request.timings,
                    len(request.output_ids),
                    logprobs=request.last_logprobs,
                )
            )
        else:
            self._finish(request, reason, token)

    def _finish_reason(self, request: EngineRequest, token: int) -> FinishReason | None:
        params = request.spec.sampling
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return FinishReason.STOP
        if params.stop_strings and self.detokenize is not None:
            text = self.detokenize(request.output_ids)
            if any(stop in text for stop in params.stop_strings):
                return FinishReason.STOP
        if len(request.output_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if request.total_len >= self.model.config.max_position_embeddings:
            return FinishReason.LENGTH
        return None

    def _finish(
        self, request: EngineRequest, reason: FinishReason, token: int | None, error: str = ""
    ) -> None:
        if request in self.running:
            self.running.remove(request)
        self._release_kv(request)
        self._release_adapter(request)
        request.state = RequestState.FINISHED
        request.timings.finished = time.monotonic()
        with self._lock:
            self._active.discard(request.request_id)
        sink = self._sinks.pop(request.request_id, None)
        if sink is not None:
            sink(
                TokenEvent(
                    request.request_id,
                    token,
                    reason,
                    request.timings,
                    len(request.output_ids),
                    error,
                    logprobs=request.last_logprobs if token is not None else None,
                )
            )

    def tokens_per_s(self) -> float:
        """Generation rate since the previous reading at least a second ago."""
        now, tokens = time.monotonic(), self.tokens_generated
        since, before = self._rate_mark
        if now - since >= 1.0:
            self._tokens_per_s = (tokens - before) / (now - since)
            self._rate_mark = (now, tokens)
        return self._tokens_per_s

    def fragmentation(self) -> float:
        """Share of allocated pool elements holding no data: KV blocks not yet filled, and page
        ends adapters could not use. Paging makes external fragmentation zero by construction."""
        layout = self.pool.layout
        kv_waste = sum(
            (r.kv.capacity - r.num_computed) * 2 * layout.kv_dim * layout.num_layers
            for r in self.running
            if r.table is None
        )
        adapter_waste = 0
        for adapter_id in self.residency.ids():
            resident = self.residency.get(adapter_id)
            used = resident.nbytes // self.pool.buffer.element_size()
            adapter_waste += len(resident.pages) * layout.page_elems - used
        usage = self.pool.usage()
        allocated = (usage.kv_pages + usage.adapter_pages) * layout.page_elems
        return (kv_waste + adapter_waste) / allocated if allocated else 0.0

    def stats(self) -> dict:
        """The latest snapshot (taken by the engine thread after each step; safe from any thread),
        with the pool's pages as they are now: blocks lent to other workers change between steps."""
        return {**self._snapshot, **self._pool_now(), "tokens_per_s": round(self.tokens_per_s(), 1)}

    def _pool_now(self) -> dict:
        usage = self.pool.usage()
        return {
            "free_pages": usage.free_pages,
            "total_pages": usage.total_pages,
            "kv_pages": usage.kv_pages,
            "adapter_pages": usage.adapter_pages,
            "free_blocks": self.rm.local.free_blocks,
            "total_blocks": self.pool.layout.num_pages // self.pool.layout.num_layers,
        }

    def _publish_stats(self) -> None:
        self._snapshot = {
            "fragmentation": round(self.fragmentation(), 4),
            "queue": len(self.waiting) + len(self._inbox),
            "running": len(self.running),
            **self._pool_now(),
            "resident_adapters": self.residency.ids(),
            "preemptions": self.preemptions,
            "borrowed_blocks": self.rm.borrowed(),
            **self._adapter_stats(),
            **self._policy_stats(),
        }

    def _adapter_stats(self) -> dict:
        """Per-adapter state for ``/metrics`` (adapter id None: the base model)."""
        return {
            "running_adapters": [r.spec.adapter_id for r in self.running],
            "waiting_adapters": [r.spec.adapter_id for r in self.waiting],
            "idle_adapter_pages": self.residency.idle_pages(),
            "tokens_by_adapter": dict(self.tokens_by_adapter),
            "decode_steps": self.steps,
        }

    def _policy_stats(self) -> dict:
        """The batch policy's decisions, as ``batch_policy_<name>`` numbers beside the engine's."""
        return {
            "lora_mode_merged": int(self._merged_adapter() is not None),
            "lora_mode_switches": self.mode_switches,
            "aborted_requests": self.aborted,
            **{f"batch_policy_{k}": v for k, v in self.policy.decisions().items()},
        }
