"""System (d), "merged-swap": one adapter merged into the base weights at a time.

dLoRA's merged-only mode and S-LoRA §7.5's "merge" ablation, on loramesh's own engine (same
kernels, same continuous batching, same paged KV cache), so that the only difference from system
(b) is how the adapters are applied:

* the current adapter is merged into the base weights, ``W += scale · B·A`` for each adapted
  (layer, projection), written into the rows of the fused ``qkv`` / ``o`` / ``gate_up`` /
  ``down`` matrices; no request carries an adapter, so the engine runs the plain base model;
* switching adapters restores the touched rows from a pristine copy (saved the first time a
  projection is touched; exact, where subtracting ``scale · B·A`` again would leave rounding
  residue) and merges the next adapter; the engine does nothing meanwhile;
* policy: when the engine is idle, the oldest waiting request's adapter goes next. While it is
  current, its requests (waiting or newly arriving) are admitted as slots free up (at most
  ``context.max_batch`` running), until some other adapter's request has waited longer than
  ``switch_after_s``; then admission stops, the running requests drain, and the next adapter is
  merged. A small ``switch_after_s`` switches often (less batching, more merges); a large one
  lets a popular adapter starve the others.

Adapters are read from disk (PEFT directories) when needed and kept in host RAM up to
``context.host_cache_mib``, least recently used dropped first, as the engine system does. The
loop is single-threaded: it calls ``engine.step()`` itself, so merges never race a forward pass.
After a run, :meth:`MergedSwapSystem.stats` gives the switch count and the seconds spent merging,
unmerging and reading adapters.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from bench.sample_adapters import read_peft_directory
from bench.systems.base import AdapterSet, RequestRecord, RunContext
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest, TokenEvent
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.lora.merged_weights import MergedWeights
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model

SAMPLE_PERIOD_S = 0.25
"""How often the pool occupancy is sampled."""


@dataclass(frozen=True)
class MergedSwapOptions:
    """The merged-swap system's label and switching threshold."""

    name: str = "merged-swap"
    """Label in tables and plots."""
    switch_after_s: float = 2.0
    """Stop admitting the current adapter's requests once another adapter's request has waited
    longer than this (seconds since its arrival)."""


class _HostCache:
    """Parsed adapters in host RAM within a byte budget, least recently used dropped first."""

    def __init__(self, adapters: AdapterSet, budget_bytes: int):
        self.adapters = adapters
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[int, HostAdapter] = OrderedDict()

    def get(self, index: int) -> tuple[HostAdapter, bool]:
        """The adapter, and whether it had to be read from disk."""
        adapter = self._lru.get(index)
        if adapter is not None:
            self._lru.move_to_end(index)
            return adapter, False
        adapter = read_peft_directory(
            self.adapters.name(index), self.adapters.directory(index), torch.float32
        )
        self._lru[index] = adapter
        # The one just read stays even when it alone exceeds the budget: it is about to be merged.
        while len(self._lru) > 1 and sum(a.nbytes for a in self._lru.values()) > self.budget_bytes:
            self._lru.popitem(last=False)
        return adapter, True


class MergedSwapSystem:
    """loramesh's engine serving one merged adapter at a time (see the module docstring)."""

    def __init__(self, options: MergedSwapOptions = MergedSwapOptions()):
        self.options = options
        self.name = options.name
        self.switches = 0
        """Adapters merged during the last run (the first merge included)."""
        self.switch_s = 0.0
        """Seconds the last run spent merging and unmerging, within the window."""
        self.load_s = 0.0
        """Seconds the last run spent reading adapters from disk, within the window."""
        self.outputs: dict[str, list[int]] = {}
        """Each request's generated token ids in the last run (tests compare them with the
        engine's LoRA path)."""
        self.model: LlamaModel | None = None
        """The model the last run served, its base weights restored after the run."""

    def stats(self) -> dict:
        """What the last run did besides serving, for the results file."""
        return {
            "switches": self.switches,
            "switch_s": round(self.switch_s, 3),
            "adapter_load_s": round(self.load_s, 3),
        }

    def run(self, context: RunContext) -> list[RequestRecord]:
        loaded = load_model(context.model_path)
        self.model = LlamaModel(loaded.config, loaded.weights, torch.float32)
        engine = local_engine(
            self.model, EngineConfig(pool_mib=context.pool_mib, max_running=context.max_batch)
        )
        self.switches, self.switch_s, self.load_s, self.outputs = 0, 0.0, 0.0, {}
        replay = _Replay(self, context, engine)
        try:
            replay.run()
        finally:
            replay.weights.unmerge()
        if replay.ended < len(context.trace):
            context.on_progress(len(context.trace) - replay.ended)
        return replay.records


class _Replay:
    """One run's state: the trace clock, the waiting requests, the merged adapter."""

    def __init__(self, system: MergedSwapSystem, context: RunContext, engine: Engine):
        self.system = system
        self.context = context
        self.clock = context.clock
        self.engine = engine
        self.weights = MergedWeights(engine.executor.model)
        self.cache = _HostCache(context.adapters, int(context.host_cache_mib * 2**20))
        self.records = [
            RequestRecord(r.request_id, r.adapter, r.time_s, r.input_len, r.output_len) for r in context.trace
        ]
        self.arrived = 0
        """Trace requests whose arrival time has passed."""
        self.waiting: list[int] = []
        """Trace positions of arrived requests not yet submitted, in arrival order."""
        self.current: int | None = None
        """The adapter merged now."""
        self.admitting = False
        """Whether the current adapter's requests may still be submitted."""
        self.in_engine = 0
        """Requests submitted and not ended."""
        self.ended = 0
        """Requests that completed or failed (the rest are reported at the end of the window)."""
        self.start = 0.0

    def run(self) -> None:
        context, engine, trace = self.context, self.engine, self.context.trace
        self.start = self.clock.now()
        next_sample = 0.0
        while (now := self.clock.now() - self.start) < context.window_s:
            if context.on_sample is not None and now >= next_sample:
                context.on_sample(now, engine.stats().as_dict())
                next_sample = now + SAMPLE_PERIOD_S
            while self.arrived < len(trace) and trace[self.arrived].time_s <= now:
                self.waiting.append(self.arrived)
                self.arrived += 1
            if self.admitting:
                if self._longest_other_wait(now) > self.system.options.switch_after_s:
                    self.admitting = False
                else:
                    self._submit_current()
            if engine.has_work():
                engine.step()
                continue
            if self.waiting:
                self._switch(trace[self.waiting[0]].adapter)
                continue
            if self.arrived == len(trace):
                return
            wake = min(trace[self.arrived].time_s, next_sample, context.window_s)
            self.clock.sleep(max(0.0, wake - now))

    def _longest_other_wait(self, now: float) -> float:
        """How long the oldest waiting request of another adapter has waited (0 if none)."""
        trace = self.context.trace
        for index in self.waiting:
            if trace[index].adapter != self.current:
                return now - trace[index].time_s
        return 0.0

    def _switch(self, adapter: int) -> None:
        """Make ``adapter`` current (merging it unless it already is) and admit its requests."""
        if adapter != self.current:
            loading = self.clock.now()
            host, fetched = self.cache.get(adapter)
            if fetched:
                self.system.load_s += self.clock.now() - loading
            switching = self.clock.now()
            self.weights.unmerge()
            self.weights.merge(host)
            self.system.switch_s += self.clock.now() - switching
            self.system.switches += 1
            self.current = adapter
        self.admitting = True
        # Admit now, before the next wait check: the oldest waiting request is this adapter's,
        # so the switch always makes progress even when others have waited long already.
        self._submit_current()

    def _submit_current(self) -> None:
        """Hand the current adapter's waiting requests to the engine while it has free slots."""
        trace, limit = self.context.trace, self.context.max_batch
        kept = []
        for index in self.waiting:
            if trace[index].adapter == self.current and self.in_engine < limit:
                self._submit(index)
            else:
                kept.append(index)
        self.waiting = kept

    def _submit(self, index: int) -> None:
        request, record = self.context.trace[index], self.records[index]
        tokens = self.system.outputs.setdefault(request.request_id, [])

        def on_event(event: TokenEvent) -> None:
            now = self.clock.now() - self.start
            if event.token_id is not None:
                tokens.append(event.token_id)
                record.output_tokens = len(tokens)
                if record.first_token_s is None:
                    record.first_token_s = now
            if event.finish_reason is None:
                return
            self.in_engine -= 1
            self.ended += 1
            if event.finish_reason is FinishReason.ERROR:
                record.error = event.error or "engine error"
            elif record.output_tokens == record.output_len:
                record.finish_s = now
            self.context.on_progress(1)

        self.in_engine += 1
        self.engine.submit(
            GenerationRequest(
                request.request_id,
                self.context.prompt(request),
                SamplingParams(max_tokens=request.output_len, ignore_eos=True),
            ),
            on_event,
        )
