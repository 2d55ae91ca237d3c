"""The engine: continuous batching of many adapters over one unified pool.

The engine plans and its executor runs (``executor.py``). Every :meth:`Engine.step` it
1. applies what other threads handed over (``hand_over.py``);
2. asks its batch policy (``services/gpu_worker/engine/policies``) which requests run this step
   and in which LoRA mode, aborts the requests the policy gives up on, and merges or unmerges an
   adapter when the mode changes (``adapter_pager.py``);
3. makes room for the running requests' next token: new KV pages, evicting idle adapters and,
   when the pool runs dry, preempting the preemption policy's victim (``request_scheduler.py``,
   ``kv_reservation.py``);
4. admits waiting requests in the policy's order (``admission.py``); a request whose adapter is
   not in the pool gets its pages reserved and waits while the copier thread writes its rows
   (``adapter_copier.py``), the running batch stepping on meanwhile;
5. emits a :class:`StepPlan` of the chosen requests, which the executor runs into logits (a
   running request the policy leaves out pauses, its KV kept); with ``speculative`` on, a
   decoding request adds the tokens it drafts, verified in the same pass (``speculation/``);
6. samples (accepting the drafts that equal the draws), emits a :class:`TokenEvent` per request, retires finished requests, tells the
   policy what the step cost, and takes its :class:`EngineStats`.

Single-threaded by design: only the methods under "called from any thread" may be called from
other threads; they hand work over under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from operator import attrgetter, sub
from typing import TypeVar, cast

import torch

from services.gpu_worker.distkv import (
    CreditorDirectory,
    CreditorRefused,
    CreditorUnavailable,
    DistKv,
    TransportFactory,
)
from services.gpu_worker.engine.adapter_pager import AdapterPager, runnable_batch_policy
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.engine_loop import run_steps
from services.gpu_worker.engine.engine_stats import (
    AdapterUsage,
    EngineStats,
    PoolTokens,
    TokenRate,
    pool_tokens,
    take_stats,
    tokens_of_pages,
    with_pool_now,
)
from services.gpu_worker.engine.executor import Executor, LendingExecutor
from services.gpu_worker.engine.hand_over import HandOver
from services.gpu_worker.engine.kv_reservation import KvReservation
from services.gpu_worker.engine.policies import make_batch_policy
from services.gpu_worker.engine.policies.batch_policy import UNMERGED, BatchPolicy, StepOutcome
from services.gpu_worker.engine.policies.preemption import make_preemption_policy
from services.gpu_worker.engine.request import (
    EngineRequest,
    GenerationRequest,
    RequestSummary,
)
from services.gpu_worker.engine.request_intake import RequestIntake
from services.gpu_worker.engine.request_lifecycle import EventSink, RequestEvents
from services.gpu_worker.engine.request_scheduler import RequestScheduler
from services.gpu_worker.engine.speculation.speculator import Speculator
from services.gpu_worker.engine.speculation.verification import verify_and_emit
from services.gpu_worker.engine.steady_decode import SteadyDecode
from services.gpu_worker.engine.step_plan import StepPlan
from services.gpu_worker.engine.step_sampling import sample_and_emit
from services.gpu_worker.engine.structured_output import (
    GrammarCompiler,
    MaskPlanner,
)
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.prefix_cache import PrefixCache
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.eviction import make_eviction_policy

__all__ = ["Engine", "EngineConfig", "EventSink", "PoolTokens"]

log = logging.getLogger("loramesh.engine")

T = TypeVar("T")
_total_len = attrgetter("total_len")
_computed = attrgetter("num_computed")


class Engine:
    """Continuous batching of many adapters over one unified pool, planned here and run by its
    executor (the steps above); one engine per worker."""

    def __init__(
        self,
        executor: Executor,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: tuple[int, ...] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        on_logits: Callable[[str, torch.Tensor], None] | None = None,
        creditors: CreditorDirectory | None = None,
        connect: TransportFactory | None = None,
        batch_policy: BatchPolicy | None = None,
        grammars: GrammarCompiler | None = None,
    ):
        """``creditors`` and ``connect``: where to borrow KV blocks and how to reach a creditor;
        required with ``kv_overflow="borrow"``. ``batch_policy``: a configured policy instead of
        ``config.batch_policy`` with its defaults (benchmarks and tests tune its knobs).
        ``executor``: what runs the plans (``services/gpu_worker/build.py`` makes one).
        ``grammars``: the model's structured-output grammars (None: constrained requests are
        refused)."""
        config = config or EngineConfig()
        self.executor = executor
        self.pool = UnifiedPool(executor.view, config.adapter_region_pages(executor.view.layout.num_pages))
        """The pages of the executor's buffer and their allocator: all the engine's accounting."""
        self.config = config
        self.lora_backend = config.lora_backend
        """The LoRA kernel backend plans ask for (benchmarks switch it between runs)."""
        self.on_logits = on_logits
        """Observer of each request's float32 logits before sampling (tests compare them to HF)."""
        self.masks = MaskPlanner(self.executor.config.vocab_size) if grammars is not None else None
        self.policy, self.fallbacks = runnable_batch_policy(
            batch_policy or make_batch_policy(config.batch_policy, config.early_abort_slo_s),
            config,
            self.executor,
        )
        self._build_distkv(config, creditors, connect)
        self.hand_over = HandOver()
        self.prefix_cache = PrefixCache(self.pool) if config.prefix_cache else None
        """Shared prompt-prefix KV blocks (None: off)."""
        self.adapters = AdapterPager(
            self.executor,
            self.pool,
            self.prefix_cache,
            on_copied=self.hand_over.wakeup.set,
            eviction=make_eviction_policy(config.eviction_policy),
        )
        self.residency = self.adapters.residency
        self.intake = RequestIntake(
            executor.config, self.pool, self.prefix_cache, grammars, borrowing=self.borrower is not None
        )
        self.host_adapters: dict[str, HostAdapter] = {}
        self._adapter_tokens: dict[str, int] = {}
        """Each host adapter's footprint in the pool in KV tokens, were it paged in: computed once
        when it arrives (it walks the adapter's rows), not per :meth:`memory_tokens` call."""
        self.events = RequestEvents(
            frozenset(eos_token_ids), detokenize, executor.config.max_position_embeddings
        )
        self.kv = KvReservation(self.rm, self.residency, self.prefix_cache, overflow=self.wing.kv_overflow)
        self.scheduler = RequestScheduler(
            config,
            self.kv,
            self.adapters,
            self.events,
            make_preemption_policy(config.preemption_policy),
            self.host_adapters,
            on_end=self.hand_over.ended,
        )
        self.speculator = (
            None
            if config.speculative == "off"
            else Speculator(
                self.kv,
                executor.config.max_position_embeddings,
                adapter_known=self.has_adapter if config.speculative == "suffix" else None,
                max_prefill_tokens=config.max_prefill_tokens,
            )
        )
        """Drafts and verifies the decoding requests' next tokens (None: ``speculative`` off)."""
        self.steady = SteadyDecode()
        """Hands the executor the decode steps that only continue the last one as deltas."""
        self.running, self.waiting = self.scheduler.running, self.scheduler.waiting
        """The running batch and the queue (the scheduler's, as tests and benchmarks read them)."""
        self.recalls = self.wing.recalls(
            lambda: [r.table for r in self.running if r.table is not None], self.scheduler.recompute_table
        )
        """DGFM recalls of this worker's blocks, applied through :meth:`between_steps`."""
        self._thread: threading.Thread | None = None
        self.stopping = False
        """Set by :meth:`stop`: the engine thread ends after its current step."""
        self._snapshot = EngineStats()
        self._rate = TokenRate()
        self.steps = 0
        self._last_step_s = 0.0
        """The last step's forward pass (what page-ins' share of a step is measured against)."""
        self._publish_stats()

    def _build_distkv(
        self, config: EngineConfig, creditors: CreditorDirectory | None, connect: TransportFactory | None
    ) -> None:
        self.wing = DistKv(
            config.distkv_settings(),
            self.pool,
            self.executor.supports_lending,
            # The SLA it protects is its own requests': an idle worker lends all its compute.
            busy=lambda: bool(self.running or self.waiting),
            creditors=creditors,
            connect=connect,
        )
        """DistKV-LLM on this worker; ``rm``, ``distkv``, ``lending`` and ``borrower`` are its parts."""
        self.fallbacks = (*self.fallbacks, *self.wing.fallbacks)
        self.rm, self.distkv = self.wing.rm, self.wing.meter
        self.lending, self.borrower = self.wing.lending, self.wing.borrower
        if self.borrower is not None:
            cast(LendingExecutor, self.executor).lend_through(  # a borrowing request's table, by id
                self.rm, lambda request_id: next(r.table for r in self.running if r.request_id == request_id)
            )

    @property
    def preemptions(self) -> int:
        """Requests preempted since start (recomputed later)."""
        return self.scheduler.preemptions

    # -- called from any thread --------------------------------------------------------------

    def add_adapter(self, adapter: HostAdapter) -> None:
        """Make an adapter available (host copy); it is paged into the pool when first used.
        Its footprint, and on a GPU its page-locked copy, are made here, on the caller's thread."""
        if self.pool.device.type == "cuda":
            adapter = adapter.pinned()
        tokens = tokens_of_pages(self.pool.layout, self.adapters.pages_needed(adapter))
        with self.hand_over.lock:
            self.host_adapters[adapter.adapter_id] = adapter
            self._adapter_tokens[adapter.adapter_id] = tokens

    def remove_adapter(self, adapter_id: str) -> None:
        """Drop the host copy of an adapter no queued or running request uses (the caller
        counts its requests); its pages, if resident, are left to eviction."""
        with self.hand_over.lock:
            self.host_adapters.pop(adapter_id, None)
            self._adapter_tokens.pop(adapter_id, None)

    def set_pinned_adapters(self, adapter_ids: frozenset[str]) -> None:
        """Make ``adapter_ids`` the adapters the pool never evicts; applied between two steps."""
        self.between_steps(lambda: self.adapters.set_pinned(adapter_ids))

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self.host_adapters

    def host_adapter_ids(self) -> list[str]:
        """Adapters with a host copy on this worker (any thread)."""
        with self.hand_over.lock:
            return list(self.host_adapters)

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue a request; ``sink`` receives its events on the engine thread."""
        self.hand_over.request(self.intake.take(request, self.host_adapters), sink)

    def preload(self, adapter_id: str) -> None:
        """Page a registered adapter into the pool at the next step, if there is room."""
        self.hand_over.preload(adapter_id)

    def worker_gone(self, worker_id: str) -> None:
        """Another worker left the mesh (its etcd lease expired): if this worker borrowed from it,
        the requests with blocks there are recomputed, before the next step."""
        self.hand_over.worker_gone(worker_id)

    def between_steps(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread before the next step, so that no request's KV changes
        while it runs (DGFM's freeze); the future gets its result or its error."""
        return self.hand_over.call(fn)

    def cancel(self, request_id: str) -> None:
        """Stop a request; its pages are freed before the next step."""
        self.hand_over.cancel(request_id)

    def hand_off(self, request_id: str) -> int:
        """Engine thread (through :meth:`between_steps`): end a request here with ``MIGRATED``
        and free its pages; how many tokens it generated (NotFound: not queued or running)."""
        return self.scheduler.hand_off(request_id)

    def list_requests(self) -> list[RequestSummary]:
        """Engine thread (through :meth:`between_steps`): every request queued or running."""
        return self.scheduler.summaries()

    def memory_tokens(self) -> PoolTokens:
        """The pool in KV-token units, as the scheduler's migration and prefetch policies count
        it (any thread). No work per host adapter but one copy of their footprints, which the
        caller lists anyway."""
        with self.hand_over.lock:
            adapter_tokens = dict(self._adapter_tokens)
        return pool_tokens(self.pool, adapter_tokens)

    def adapter_usage(self) -> AdapterUsage:
        """Requests and tokens per adapter since start (any thread: copying a dict of str to int
        runs in C under the GIL, so the engine thread cannot change it half-way)."""
        return AdapterUsage(dict(self.events.requests_by_adapter), dict(self.events.tokens_by_adapter))

    def start(self) -> None:
        """Run steps on a dedicated thread until :meth:`stop`."""
        self._thread = threading.Thread(target=run_steps, args=(self,), name="loramesh-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.stopping = True
        self.hand_over.wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.adapters.close()
        self.executor.close()
        if self.masks is not None:
            self.masks.close()

    # -- engine thread -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(
            self.running
            or self.waiting
            or self.hand_over.pending()
            or self.recalls.frozen
            or self.adapters.has_work()
        )

    def step(self) -> int:
        """One iteration; returns the number of requests that stepped. Its stats are taken when
        it ends (and before its forward pass, for scrapes during a long one)."""
        try:
            return self._step()
        finally:
            self._publish_stats()

    def _step(self) -> int:
        self.adapters.begin_step(self._last_step_s if self.running else None)
        self._take_inbox()
        self.adapters.settle()
        if self._apply_between_steps():
            return 0
        scheduler, adapters = self.scheduler, self.adapters
        decision = self.policy.plan(scheduler.view())
        scheduler.abort(decision.aborts)
        switch_s = adapters.switch_mode(decision.mode, self.host_adapters)
        scheduler.make_room_for_running()
        scheduler.admit(decision.run)
        self._publish_stats()  # who runs and waits, seen by scrapes during a long forward pass
        chosen = set(decision.run)
        batch = [r for r in self.running if r.request_id in chosen]
        if adapters.merged is not None:
            batch = list(filter(adapters.runs_in_mode, batch))
        if not batch and self.running:
            # The plan left nothing runnable (e.g. the merged adapter's requests found no room
            # beside paused ones): unmerge and step the running batch rather than stall.
            switch_s += adapters.switch_mode(UNMERGED, self.host_adapters)
            batch = list(self.running)
        if not batch:
            return 0
        speculator = self.speculator
        draft_rows = speculator.draft(batch) if speculator is not None else 0
        new_tokens = list(map(sub, map(_total_len, batch), map(_computed, batch)))
        prefill_tokens = sum(n for n in new_tokens if n > 1)
        decode_tokens = new_tokens.count(1) + draft_rows
        started = time.monotonic()
        # The constrained rows' masks are computed while the forward pass runs.
        masks = self.masks.start([r.grammar for r in batch]) if self.masks is not None else None
        try:
            logits = self._run(batch, plain_decode=not (draft_rows or prefill_tokens))
        except (CreditorUnavailable, CreditorRefused) as failure:
            self.wing.step_failed(failure, lost=scheduler.creditor_lost, refused=scheduler.creditor_refused)
            return 0
        finally:
            if masks is not None:
                masks.wait()  # no grammar may advance while its mask is being computed
        now = time.monotonic()
        self._last_step_s = now - started
        if speculator is not None and draft_rows:
            verify_and_emit(batch, logits, masks, scheduler, speculator, now, self.on_logits)
        else:
            sample_and_emit(batch, logits, masks, scheduler, now, self.on_logits)
        self.steps += 1
        self.distkv.end_step()
        outcome = StepOutcome(
            mode=adapters.mode,
            requests=len(batch),
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
            adapters=len({r.spec.adapter_id for r in batch} - {None, adapters.merged}),
            seconds=now - started,
            switch_seconds=switch_s,
        )
        self.policy.observe(outcome)  # dLoRA tunes its thresholds, the policies' cost models fit
        if speculator is not None:
            speculator.observe(outcome)  # its cost model prices draft rows
        return len(batch)

    def _run(self, batch: list[EngineRequest], plain_decode: bool) -> torch.Tensor:
        """The step's logits (``plain_decode``: one new token each, no drafts): a step that only
        continues the last decode step goes to the executor as what changed
        (``steady_decode.py``), any other as its plan."""
        slots = list(map(self.adapters.slot, batch))
        invariant = self.config.deterministic
        plain_decode = plain_decode and all(r.table is None for r in batch)  # none borrowed
        if plain_decode:
            logits = self.steady.run(self.executor, batch, slots, self.lora_backend, invariant)
            if logits is not None:
                return logits
        else:
            self.steady.forget()
        plan = tuple(map(EngineRequest.planned, batch, slots))
        return self.executor.execute(StepPlan(plan, self.lora_backend, invariant))

    def _take_inbox(self) -> None:
        taken = self.hand_over.take()
        for worker_id in taken.gone_workers:
            self.scheduler.creditor_lost(worker_id)
        self.adapters.preload(taken.preloads, self.host_adapters)
        self.scheduler.take_over(taken.requests, taken.cancels)

    def _apply_between_steps(self) -> bool:
        """Run the calls handed to :meth:`between_steps`; True while DGFM holds KV out of every
        pool (a stage is open), when no request may step."""
        self.hand_over.run_calls()
        self.recalls.close_expired()
        return self.recalls.frozen

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the engine thread after each step; safe from any thread),
        with the pool's pages as they are now: blocks lent to other workers change between steps."""
        rate = self._rate.read(self.events.tokens_generated)
        return with_pool_now(self._snapshot, self.pool, self.rm, round(rate, 1))

    def _publish_stats(self) -> None:
        """Take this step's snapshot (the pool's pages are read when it is handed out)."""
        self._snapshot = take_stats(self)
