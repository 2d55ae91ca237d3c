"""The engine's batch-policy interface: which requests run this step, in which LoRA mode.

The engine keeps the mechanics (pages, adapters, the forward pass); a policy decides over a
read-only :class:`BatchView` of the queue and the running batch and answers a :class:`BatchPlan`.
Policies never touch engine objects, so each is a pure object, unit-tested without a model.

After each step the engine reports a :class:`StepOutcome`, from which policies that learn online
(dLoRA's threshold tuning, the step cost model) update themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Unmerged:
    """Every adapter's delta computed beside the shared base GEMM (x·W + x·A·B per segment)."""


@dataclass(frozen=True)
class Merged:
    """``adapter_id``'s delta folded into the base weights: only its requests run, at base speed."""

    adapter_id: str


LoraMode = Unmerged | Merged
UNMERGED = Unmerged()


@dataclass(frozen=True)
class QueuedRequest:
    """A request that waits for its prefill (never started, or preempted and to be recomputed)."""

    request_id: str
    adapter_id: str | None
    """None: the base model."""
    arrived_s: float
    """When the engine received it (the view's clock)."""
    prefill_tokens: int
    """Tokens its prefill computes (prompt plus output so far after a preemption)."""
    started: bool = False
    """It produced a token before (a preempted request): its first-token deadline is behind it."""
    predicted_output_tokens: int | None = None
    """Tokens it is predicted to generate (Magnus' G′, set by whoever submitted it); None: no
    prediction."""
    max_new_tokens: int = 1
    """Tokens it may still generate (``max_tokens`` less its output so far): how long it will hold
    a running slot and how much KV it may grow to, for policies that look ahead."""
    first_token_deadline_s: float | None = None
    """Seconds from ``arrived_s`` to its first token that its caller asked for (``early_abort``
    holds it to them); None: the policy's own SLO."""


@dataclass(frozen=True)
class RunningRequest:
    """A request in the running batch: its KV is in the pool."""

    request_id: str
    adapter_id: str | None
    arrived_s: float
    remaining_tokens: int = 1
    """Tokens it may still generate: at most this many steps until its slot frees (fewer if it
    stops early)."""
    context_tokens: int = 0
    """Tokens whose KV it holds now (prompt plus output so far): pool room it frees when it ends."""


@dataclass(frozen=True)
class BatchView:
    """What a policy sees of the engine at the start of a step."""

    now_s: float
    """The engine's clock (monotonic seconds), the same clock as the requests' ``arrived_s``."""
    waiting: tuple[QueuedRequest, ...]
    """The queue in arrival order (preempted requests first: they arrived earliest)."""
    running: tuple[RunningRequest, ...]
    """The running batch, in admission order."""
    max_running: int
    """Requests that may run in one step at most."""
    mode: LoraMode
    """The LoRA mode the base weights are in now."""
    max_prefill_tokens: int = 2048
    """Prompt tokens one step prefills at most (the engine's admission budget)."""
    kv_room_tokens: int | None = None
    """Tokens of KV the pool can take now without evicting (None: not limited)."""
    waiting_ids: tuple[str, ...] | None = None
    """``waiting``'s request ids in order, when the engine keeps them (its queue caches the
    tuple between changes); None: read them off ``waiting``."""


@dataclass(frozen=True)
class Abort:
    """A waiting request the policy gives up on, and why (the caller sees the reason)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class BatchPlan:
    """A policy's decision for one step."""

    run: tuple[str, ...]
    """Request ids to run, in priority order: running requests keep their KV and step; waiting
    ones are admitted in this order while the pool and ``max_running`` allow. A running request
    left out pauses this step (its KV stays)."""
    mode: LoraMode = UNMERGED
    """The LoRA mode of this step; every request in ``run`` must be servable in it."""
    aborts: tuple[Abort, ...] = ()
    """Waiting requests to finish now without running."""


@dataclass(frozen=True)
class StepOutcome:
    """What one step did, as the engine measured it."""

    mode: LoraMode
    requests: int
    """Requests that ran."""
    prefill_tokens: int
    """Prompt tokens computed."""
    decode_tokens: int
    """Decode tokens computed (one per decoding request, and one per draft it verifies)."""
    adapters: int
    """Distinct adapters in the step (the base model counts as none)."""
    seconds: float
    """Forward pass and sampling time."""
    switch_seconds: float = 0.0
    """Time spent merging or unmerging before the step (0 when the mode did not change)."""


class BatchPolicy(Protocol):
    """One batch policy: ``plan`` each step, ``observe`` what it cost."""

    name: str
    """The name ``--batch-policy`` selects it by."""

    def plan(self, view: BatchView) -> BatchPlan: ...

    def observe(self, outcome: StepOutcome) -> None: ...

    def decisions(self) -> dict[str, float]:
        """The policy's counters and knobs as they are now, for metrics (name -> value)."""
        ...


def fcfs_ids(view: BatchView) -> tuple[str, ...]:
    """The running batch, then the queue in arrival order: what FCFS runs."""
    waiting = view.waiting_ids if view.waiting_ids is not None else tuple(r.request_id for r in view.waiting)
    return tuple(r.request_id for r in view.running) + waiting


def fcfs_batch(view: BatchView) -> list[QueuedRequest | RunningRequest]:
    """The requests FCFS would run this step (``B_fcfs`` in dLoRA): running first, then the
    oldest waiting ones, up to ``max_running`` (ignoring the pool, which the engine checks)."""
    batch: list[QueuedRequest | RunningRequest] = [*view.running, *view.waiting]
    return batch[: view.max_running]
