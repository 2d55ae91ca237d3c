"""Who waits and who runs on this worker: admission, KV growth with preemption, the batch
policy's aborts, and the end of requests (their KV and adapter released).

The batch policy decides over a :class:`BatchView` of these queues; the preemption policy names
the victim when the pool runs dry; :func:`admission.admit` holds the admission rules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from services.gpu_worker.distkv import BlockTable, RemoteBlock
from services.gpu_worker.engine.adapter_pager import AdapterPager
from services.gpu_worker.engine.adapter_room import AdapterRoom
from services.gpu_worker.engine.admission import Start, admit
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.kv_reservation import KvReservation
from services.gpu_worker.engine.policies.batch_policy import Abort, BatchView
from services.gpu_worker.engine.policies.preemption import PreemptionPolicy
from services.gpu_worker.engine.request import EngineRequest, FinishReason, RequestState, RequestSummary
from services.gpu_worker.engine.request_lifecycle import EventSink, RequestEvents
from services.gpu_worker.engine.request_views import queued_view, running_view, tokens_left
from services.gpu_worker.engine.sampling import token_logprobs
from services.gpu_worker.engine.waiting_queue import WaitingQueue
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.page_allocator import PoolExhausted
from services.runtime.errors import NotFound
from services.runtime.prefix_keys import BlockKey, request_block_keys

log = logging.getLogger("loramesh.engine")


class RequestScheduler:
    """The queue and the running batch, and the moves between them (engine thread only)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KvReservation,
        adapters: AdapterPager,
        events: RequestEvents,
        preemption: PreemptionPolicy,
        host_adapters: dict[str, HostAdapter],
        on_end: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        """``host_adapters``: the engine's host copies (what can be paged in); ``on_end``: told
        each request id that ended here, before its last event is sent; ``clock``: what the wait
        for a lender is measured by (seconds)."""
        self.config = config
        self.clock = clock
        self.kv = kv
        self.adapters = adapters
        self.events = events
        self.preemption = preemption
        self.host_adapters = host_adapters
        self.on_end = on_end
        self.waiting = WaitingQueue(lambda r: queued_view(r, events.max_positions))
        self.running: list[EngineRequest] = []
        self.preemptions = 0
        self.aborted = 0
        self._block_on_copies = False
        """This admission round waits for adapters' copies (nothing was running)."""
        self._copying = 0
        """Requests this admission round passed over while their adapter's rows are copied in."""
        self.room = AdapterRoom(adapters, lambda r: tokens_left(r, events.max_positions))
        """Room for a waiting request's adapter when every resident one is held (the slot cliff)."""

    # -- the batch policy's view ---------------------------------------------------------------

    def view(self) -> BatchView:
        return BatchView(
            now_s=time.monotonic(),
            waiting=self.waiting.view(),
            waiting_ids=self.waiting.ids(),
            running=tuple(running_view(r, self.events.max_positions) for r in self.running),
            max_running=self.config.max_running,
            mode=self.adapters.mode,
            max_prefill_tokens=self.config.max_prefill_tokens,
            kv_room_tokens=self.kv.room_blocks() * self.config.kv_block_tokens,
        )

    # -- running -------------------------------------------------------------------------------

    def make_room_for_running(self) -> None:
        """Reserve each running request's next token's KV, preempting victims while the pool
        (and, when borrowing, every lender) is dry."""
        block = self.kv.rm.block_tokens
        for request in list(self.running):
            if request.state is not RequestState.RUNNING:
                continue
            if request.table is None and len(request.kv.blocks) * block >= request.total_len:
                continue  # its blocks hold its next token (fifteen steps in sixteen)
            while True:
                try:
                    self.kv.reserve(request, request.total_len)
                    break
                except PoolExhausted:
                    victim = self._victim()
                    self.preempt(victim)
                    if victim is request:
                        break

    def _victim(self) -> EngineRequest:
        chosen = self.preemption.victim([running_view(r, self.events.max_positions) for r in self.running])
        return next(r for r in self.running if r.request_id == chosen.request_id)

    def preempt(self, request: EngineRequest) -> None:
        """Free a running request's pages; it goes back to the front of the queue (recompute)."""
        self.running.remove(request)
        self._release(request)
        request.num_computed = 0
        request.state = RequestState.WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        log.debug("preempted %s (%d tokens)", request.request_id, request.total_len)

    def creditor_lost(self, creditor: str) -> None:
        """``creditor`` is gone with the blocks it held: recompute the requests that had some."""
        for request in self.kv.lost_with(creditor, self.running):
            log.info("recomputing %s: its KV blocks on %s are lost", request.request_id, creditor)
            self.preempt(request)

    def creditor_refused(self, creditor: str) -> None:
        """``creditor`` refused to compute attention over its cap: the running requests with
        blocks there give all their KV back (the creditor's too: it lives) and are recomputed,
        borrowing elsewhere or waiting for room here."""
        for request in list(self.running):
            table = request.table
            if table is not None and any(
                isinstance(block, RemoteBlock) and block.creditor == creditor for block in table
            ):
                log.info(
                    "recomputing %s: %s refused its attention (compute cap)", request.request_id, creditor
                )
                self.preempt(request)

    def recompute_table(self, table: BlockTable) -> None:
        """Recompute the running request whose KV blocks are ``table`` (DGFM found them no home)."""
        for request in self.running:
            if request.table is table:
                self.preempt(request)
                return

    # -- admission -----------------------------------------------------------------------------

    def admit(self, order: tuple[str, ...]) -> None:
        """Admit waiting requests in the policy's ``order`` (ids of running requests are skipped)
        until one does not fit (its KV, the prefill budget, ``max_running``): a later one never
        overtakes it, except behind a request whose adapter finds no room (``adapter_room.py``).

        A request whose adapter's rows are still being copied in is passed over, its copy under
        way, and keeps its place among the batch's slots (it counts as running for
        ``max_running``): it starts at a step after its copy ends. Only when nothing runs does
        admission wait for the copies instead, as nobody but the requests admitted waits then."""
        waiting = self.waiting
        self._block_on_copies = not self.running
        self._copying = 0
        self.room.begin_round(self.running)
        admit(  # lazily: admission stops at the first request that does not fit
            (r for r in map(waiting.get, order) if r is not None),
            running=lambda: len(self.running) + self._copying,
            max_running=self.config.max_running,
            max_prefill_tokens=self.config.max_prefill_tokens,
            context_tokens=lambda r: r.total_len,
            skip=self._passed_over,
            start=self._start,
        )
        self.room.end_round()

    def _passed_over(self, request: EngineRequest) -> bool:
        adapter_id = request.spec.adapter_id
        if adapter_id is not None and adapter_id not in self.host_adapters:
            # Only a request being cancelled loses its adapter's host copy (its caller released
            # it); finish it rather than fail the batch.
            self.waiting.remove(request)
            self.finish(request, FinishReason.CANCELLED, None)
            return True
        return not self.adapters.runs_in_mode(request)

    def _start(self, request: EngineRequest) -> Start:
        if self.room.holds_back(request):
            return Start.NO_ADAPTER_ROOM
        outcome = self._try_start(request)
        if outcome is Start.SKIPPED:
            self._copying += 1
        elif outcome is Start.NO_ADAPTER_ROOM:
            if self.kv.pool_can_never_hold(self.running):
                self.waiting.remove(request)
                self._finish_unservable(request)
                return Start.SKIPPED
            if not self.room.refused(request, self.running):
                return Start.BLOCKED  # nothing drains for it (any more): it stops admission
        elif outcome is Start.BLOCKED and self.kv.pool_can_never_hold(self.running):
            self.waiting.remove(request)
            self._finish_unservable(request)
            return Start.SKIPPED
        elif outcome is Start.BLOCKED and self._waits_on_loans():
            return self._no_loan(request)
        elif outcome is Start.STARTED:
            self.waiting.remove(request)
        return outcome

    def _waits_on_loans(self) -> bool:
        """The request that just did not fit waits on lenders alone: its borrow found none, and
        nothing here will make room (nothing runs, nothing is lent out). While something does, it
        waits for that as any request too large for the room left does (no starvation of long
        requests): a wait its worker's own requests bound."""
        return self.kv.overflow.shortfall is not None and not (self.running or self.kv.rm.lender.lent_blocks)

    def _no_loan(self, request: EngineRequest) -> Start:
        """One more admission round in which only a loan could start ``request`` and none came:
        it keeps its place and the requests behind it may start (holding them would not bring a
        lender sooner); once ``loan_wait_s`` has passed since the first such round and there
        were ``loan_wait_rounds`` of them, it is refused, naming why (RESOURCE_EXHAUSTED)."""
        now = self.clock()
        if request.loan_wait_since is None:
            request.loan_wait_since = now
        request.loan_waits += 1
        waited_s = now - request.loan_wait_since
        if request.loan_waits < self.config.loan_wait_rounds or waited_s < self.config.loan_wait_s:
            return Start.SKIPPED
        self.waiting.remove(request)
        blocks = -(-request.total_len // self.kv.rm.block_tokens)
        why = (
            f"its {request.total_len} tokens need {blocks} KV blocks, more than this worker's "
            f"pool gives it, and no worker lent the rest in {waited_s:.1f} s ({request.loan_waits} "
            f"admission rounds; last: {self.kv.overflow.shortfall})"
        )
        log.info("refusing %s: %s", request.request_id, why)
        self.finish(request, FinishReason.NO_KV, None, why)
        return Start.SKIPPED

    def _try_start(self, request: EngineRequest) -> Start:
        """STARTED, NO_ADAPTER_ROOM, BLOCKED (no room for its KV) or SKIPPED (its adapter's rows
        are being copied in)."""
        adapter_id = request.spec.adapter_id
        if adapter_id is not None:
            try:
                held = self.adapters.acquire(request, self.host_adapters[adapter_id], self._block_on_copies)
            except PoolExhausted:
                return Start.NO_ADAPTER_ROOM
            if not held:
                return Start.SKIPPED
        self.kv.reuse_prefix(request, lambda: self._prefix_keys(request))
        try:
            self.kv.reserve(request, request.total_len)
        except PoolExhausted:
            self._release(request)  # what a partly grown block table holds, and its adapter
            request.num_computed = 0  # its cached prefix blocks went back with its KV
            return Start.BLOCKED
        request.state = RequestState.RUNNING
        if request.timings.scheduled is None:
            request.timings.scheduled = time.monotonic()
            request.cached_prompt_tokens = request.num_computed  # all from the cache, so far
        self.running.append(request)
        return Start.STARTED

    def _prefix_keys(self, request: EngineRequest) -> list[BlockKey] | None:
        """The prefix-cache keys of ``request``'s whole prompt blocks, in its namespace, as the
        gateway names them for placement (:func:`request_block_keys`); None when its adapter's
        content is unknown: it bypasses the cache."""
        spec = request.spec
        adapter = None if spec.adapter_id is None else self.host_adapters[spec.adapter_id].identity
        return request_block_keys(
            spec.prefix_cache_namespace,
            spec.prompt_ids,
            self.kv.rm.block_tokens,
            adapter,
            len(spec.original_prompt_ids),
        )

    def _finish_unservable(self, request: EngineRequest) -> None:
        """Its prompt and output outgrew the whole pool: the pool is its context limit, so it ends
        like one whose context is full; one that never started gets an error saying why."""
        if request.output_ids:
            log.info(
                "%s ends at %d tokens: the pool holds no more of its KV",
                request.request_id,
                request.total_len,
            )
            self.finish(request, FinishReason.LENGTH, None)
        else:
            why = f"its {request.total_len} prompt tokens and adapter do not fit in this worker's pool"
            if self.kv.overflow.refusal is not None:
                why += f", nor in what the other workers lend ({self.kv.overflow.refusal})"
            self.finish(request, FinishReason.ERROR, None, why)

    # -- queries and hand-offs ------------------------------------------------------------------

    def hand_off(self, request_id: str) -> int:
        """Engine thread (through :meth:`between_steps`): end a request here with ``MIGRATED``,
        after the tokens it has emitted, and free its pages; returns how many it generated.
        NotFound when it is not queued or running (finished, cancelled, never here)."""
        request = self.waiting.get(request_id) or next(
            (r for r in self.running if r.request_id == request_id), None
        )
        if request is not None:
            if request in self.waiting:
                self.waiting.remove(request)
            generated = len(request.output_ids)
            self.finish(request, FinishReason.MIGRATED, None)
            return generated
        raise NotFound(f"request {request_id!r} is not queued or running on this worker")

    def summaries(self) -> list[RequestSummary]:
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

    # -- ends ----------------------------------------------------------------------------------

    def emit(self, batch: list[EngineRequest], tokens: list[int], logits: torch.Tensor, now: float) -> None:
        """Each stepped request's sampled token (``logits``: the rows it was drawn from): now
        computed up to it, sent, or ending the request."""
        for request, token, row in zip(batch, tokens, logits):
            request.num_computed = request.total_len
            if request.prompt_block_keys:  # its prefill is done: its prompt blocks can be shared
                self.kv.cache_prompt(request)
            top = request.spec.sampling.top_logprobs
            request.last_logprobs = None if top is None else token_logprobs(row, token, top)
            reason = self.events.token(request, token, now)
            if reason is not None:
                self.finish(request, reason, token)

    def take_over(self, requests: list[tuple[EngineRequest, EventSink]], cancels: set[str]) -> None:
        """Queue the requests handed over (their events to their sinks), then apply cancels."""
        for request, sink in requests:
            self.events.arrived(request, sink)
            self.waiting.append(request)
        if cancels:
            self.cancel(cancels)

    def abort(self, aborts: tuple[Abort, ...]) -> None:
        for abort in aborts:
            request = self.waiting.get(abort.request_id)
            if request is None:
                continue
            self.waiting.remove(request)
            self.aborted += 1
            self.finish(request, FinishReason.ABORTED, None, abort.reason)

    def cancel(self, request_ids: set[str]) -> None:
        for request in [r for r in self.running if r.request_id in request_ids]:
            self.finish(request, FinishReason.CANCELLED, None)
        for request in [r for r in map(self.waiting.get, request_ids) if r is not None]:
            self.waiting.remove(request)
            self.finish(request, FinishReason.CANCELLED, None)

    def finish(
        self, request: EngineRequest, reason: FinishReason, token: int | None, error: str = ""
    ) -> None:
        """End ``request`` (running, or already off the queue): free its KV and adapter and send
        its last event."""
        if request in self.running:
            self.running.remove(request)
        try:
            self._release(request)
        finally:  # whatever its release met, its client hears that it ended
            self.on_end(request.request_id)
            self.events.finished(request, reason, token, error)

    def _release(self, request: EngineRequest) -> None:
        for creditor in self.kv.release(request):
            self.creditor_lost(creditor)
        self.adapters.release(request)
