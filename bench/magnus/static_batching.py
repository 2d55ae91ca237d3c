"""Static batching as Magnus studies it (SEED-SPECS §3), as pure schedulers over one instance.

A static batch runs to the end of its longest request: every request in it keeps its KV slot for
``L(B) + G(B)`` tokens and returns when the batch ends. Two schedulers pick the next batch when
the instance is idle:

- :class:`FcfsStatic` (Magnus' VS baseline): the oldest ``batch_size`` requests, a size fixed so
  the worst case (longest prompt and output cap) fits the memory Θ;
- :class:`MagnusStatic`: each arriving request joins the queued batch whose WMA (wasted memory
  access, from the *predicted* lengths G′) stays lowest and under Φ, if its memory
  ``size·(L(B)+G(B))`` stays under Θ, else opens a new batch; the idle instance takes the batch
  with the highest response ratio ``(T_w + T_p) / T_p`` (T_p from the batch-time model, ``batch_time.py``).

A batch whose real lengths overflow Θ (an under-prediction) fails at the step its KV no longer
fits: :func:`overflow_step` finds it, and :func:`split` halves the batch for a requeue (Magnus'
OOM recovery). Memory is counted in KV token slots (Θ = bytes ÷ per-token KV bytes Δ).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from bench.magnus.batch_time import BatchShape, MeasuredBatch
from services.gpu_worker.engine.policies.linear_cost import OnlineFit


@dataclass(frozen=True)
class StaticRequest:
    """One request of a static-batching trace."""

    request_id: str
    arrival_s: float
    prompt_ids: tuple[int, ...]
    output_tokens: int
    """Tokens it really generates (G), known to the harness only."""
    predicted_tokens: int
    """Tokens the length predictor expects (G′)."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass
class StaticBatch:
    """Requests that start and end together."""

    requests: list[StaticRequest] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        """L(B): the longest prompt."""
        return max(r.prompt_tokens for r in self.requests)

    @property
    def output_tokens(self) -> int:
        """G(B) as it will really be: the longest real output."""
        return max(r.output_tokens for r in self.requests)

    @property
    def predicted_tokens(self) -> int:
        """G(B) as predicted: the longest predicted output."""
        return max(r.predicted_tokens for r in self.requests)

    @property
    def oldest_arrival_s(self) -> float:
        return min(r.arrival_s for r in self.requests)

    def shape(self, output_tokens: int) -> BatchShape:
        return BatchShape(len(self.requests), self.prompt_tokens, output_tokens)


def memory_tokens(requests: list[StaticRequest], output_tokens: int) -> int:
    """MEM(B) ÷ Δ: KV slots the batch holds by its end, every row padded to L(B) + G(B)."""
    return len(requests) * (max(r.prompt_tokens for r in requests) + output_tokens)


def wma(requests: list[StaticRequest]) -> float:
    """Magnus' WMA(B) over the predicted lengths: for each request, the padding it carries during
    generation, ``G(p)·(L(B) − L(p))``, plus the slot it holds idle after it ends,
    ``Σ_{g=G(p)}^{G(B)} (g + L(B))``; the batch's WMA is the worst request's."""
    longest_prompt = max(r.prompt_tokens for r in requests)
    longest_output = max(r.predicted_tokens for r in requests)
    worst = 0.0
    for r in requests:
        idle_steps = longest_output - r.predicted_tokens + 1
        idle = idle_steps * longest_prompt + (r.predicted_tokens + longest_output) * idle_steps / 2
        worst = max(worst, r.predicted_tokens * (longest_prompt - r.prompt_tokens) + idle)
    return worst


def overflow_step(batch: StaticBatch, memory_limit: int) -> int | None:
    """The decode step at which the batch's real KV exceeds Θ (it fails there), or None."""
    if memory_tokens(batch.requests, batch.output_tokens) <= memory_limit:
        return None
    return max(0, memory_limit // len(batch.requests) - batch.prompt_tokens)


def split(batch: StaticBatch) -> tuple[StaticBatch, StaticBatch]:
    """Magnus' OOM recovery: two halves of a failed batch (of at least two requests)."""
    if len(batch.requests) < 2:
        raise ValueError("a batch of one request cannot be split")
    half = len(batch.requests) // 2
    return StaticBatch(batch.requests[:half]), StaticBatch(batch.requests[half:])


class StaticScheduler(Protocol):
    """Forms static batches and picks the next one for the idle instance."""

    name: str

    def add(self, request: StaticRequest) -> None: ...

    def next_batch(self, now_s: float) -> StaticBatch | None: ...

    def requeue(self, batches: tuple[StaticBatch, ...]) -> None:
        """Batches that failed (split after an overflow) go back, ahead of the others."""
        ...

    def observe(self, shape: BatchShape, seconds: float) -> None: ...


class FcfsStatic:
    """Magnus' VS: FCFS batches of a fixed size."""

    name = "static FCFS (VS)"

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self._queue: deque[StaticRequest] = deque()
        self._failed: deque[StaticBatch] = deque()

    def add(self, request: StaticRequest) -> None:
        self._queue.append(request)

    def next_batch(self, now_s: float) -> StaticBatch | None:
        if self._failed:
            return self._failed.popleft()
        if not self._queue:
            return None
        return StaticBatch([self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))])

    def requeue(self, batches: tuple[StaticBatch, ...]) -> None:
        self._failed.extendleft(reversed(batches))

    def observe(self, shape: BatchShape, seconds: float) -> None:
        """VS learns nothing."""


@dataclass(frozen=True)
class MagnusStaticConfig:
    """Magnus' batch assembly knobs."""

    max_batch: int
    """Requests in one batch at most."""
    memory_limit: int
    """Θ in KV token slots: a batch whose predicted MEM(B) exceeds it is never formed."""
    wma_limit: float
    """Φ: a request joins a queued batch only if the batch's WMA stays under it."""


class MagnusStatic:
    """WMA batch assembly over predicted lengths, HRRN batch selection, split on overflow."""

    name = "static Magnus (WMA + HRRN + predictor)"

    def __init__(self, config: MagnusStaticConfig, estimator: OnlineFit[MeasuredBatch]):
        self.config = config
        self.estimator = estimator
        self._batches: list[StaticBatch] = []
        self._failed: deque[StaticBatch] = deque()

    def add(self, request: StaticRequest) -> None:
        best: tuple[float, StaticBatch] | None = None
        for batch in self._batches:
            joined = [*batch.requests, request]
            if len(joined) > self.config.max_batch:
                continue
            if memory_tokens(joined, max(r.predicted_tokens for r in joined)) > self.config.memory_limit:
                continue
            waste = wma(joined)
            if waste < self.config.wma_limit and (best is None or waste < best[0]):
                best = (waste, batch)
        if best is None:
            self._batches.append(StaticBatch([request]))
        else:
            best[1].requests.append(request)

    def next_batch(self, now_s: float) -> StaticBatch | None:
        if self._failed:
            return self._failed.popleft()
        if not self._batches:
            return None
        chosen = max(self._batches, key=lambda b: self.response_ratio(b, now_s))
        self._batches.remove(chosen)
        return chosen

    def response_ratio(self, batch: StaticBatch, now_s: float) -> float:
        if not self.estimator.fitted:
            return now_s - batch.oldest_arrival_s
        service = max(1e-6, self.estimator.cost.predict(batch.shape(batch.predicted_tokens).row()))
        return (max(0.0, now_s - batch.oldest_arrival_s) + service) / service

    def requeue(self, batches: tuple[StaticBatch, ...]) -> None:
        self._failed.extendleft(reversed(batches))

    def observe(self, shape: BatchShape, seconds: float) -> None:
        self.estimator.observe((shape, seconds))
