"""S-LoRA's early abort (§4.3; reconstruction in SEED-SPECS §5): when the queue is longer than
the first-token SLO allows, serve the newest requests that can still make it, in arrival order,
and abort the older ones at once instead of letting them occupy the batch after their SLO is lost.

With the not-yet-started queue q_1..q_n (oldest first), the policy keeps the smallest k such that
every q_i with i ≥ k gets its first token within the SLO when q_k..q_n are served in arrival order,
and aborts q_1..q_{k−1}. The first-token times come from replaying what the engine will do
(:func:`first_token_times`): each step admits queued prompts in order while a running slot is
free, the step's prefill-token budget allows and the pool has room for the prompt and its output;
the step's duration is the online step cost model's for its prefill tokens, decodes and adapters;
running requests free their slot and KV after their remaining tokens. So several prefills share
a step, and a full batch admits no one until a slot frees. Preempted requests (they had their
first token) are never aborted; they go first and their recompute counts.

The estimate is an upper bound on occupancy (a request is assumed to run to ``max_tokens``; one
that stops at EOS frees its slot sooner) and counts KV in tokens, not pages.

Each request is held to its own first-token deadline when its caller gave one
(``first_token_deadline_ms``, carried from the SDK or the OpenAI body through the gateway to the
worker: :attr:`QueuedRequest.first_token_deadline_s`), and to the worker's SLO
(``--early-abort-slo-s``) otherwise. With deadlines that differ, a newer request is no longer
sure to have more slack than an older one, so before the search every request that would miss
its deadline even if it were the first fresh request served is aborted on its own: one request
with an impossible deadline never takes the older requests down with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.policies.batch_policy import (
    Abort,
    BatchPlan,
    BatchView,
    QueuedRequest,
    StepOutcome,
)
from services.gpu_worker.engine.policies.linear_cost import LinearCost, OnlineFit
from services.gpu_worker.engine.policies.step_cost_model import step_cost_model, step_row


@dataclass(frozen=True)
class EarlyAbortConfig:
    """S-LoRA's first-token SLO."""

    first_token_slo_s: float = 6.0
    """Seconds from arrival to the first token (S-LoRA's evaluation uses 6 s)."""

    def __post_init__(self) -> None:
        if self.first_token_slo_s <= 0:
            raise ValueError(f"first_token_slo_s must be > 0, got {self.first_token_slo_s}")


@dataclass
class _Slot:
    """A request holding a running slot in the replay."""

    adapter_id: str | None
    steps_left: int
    frees_tokens: int
    """KV room it gives back when it ends (what it holds plus what it was granted to grow)."""


def first_token_times(
    view: BatchView, queue: list[QueuedRequest], cost: LinearCost, deadline_s: float | None = None
) -> list[float]:
    """When each request of ``queue`` (served in this order after the running batch) gets its
    first token, replaying the engine's steps from ``view``. With ``deadline_s`` the replay stops
    at the first not-yet-started request whose token would come after its deadline (``arrived_s``
    plus its own ``first_token_deadline_s``, or plus ``deadline_s`` when it has none) and returns
    the times found so far (shorter than ``queue``)."""
    now = view.now_s
    room = float("inf") if view.kv_room_tokens is None else float(view.kv_room_tokens)
    running = [
        _Slot(r.adapter_id, r.remaining_tokens, r.context_tokens + r.remaining_tokens) for r in view.running
    ]
    room -= sum(r.remaining_tokens for r in view.running)  # the running batch's growth comes first
    times: list[float] = []
    while len(times) < len(queue):
        budget = view.max_prefill_tokens
        admitted: list[QueuedRequest] = []
        for request in queue[len(times) :]:
            if len(running) + len(admitted) >= view.max_running:
                break
            if request.prefill_tokens > budget and budget < view.max_prefill_tokens:
                break
            needs = request.prefill_tokens + request.max_new_tokens
            if needs > room and (running or admitted):
                break  # it waits for a running request to end and free room
            room -= needs
            budget -= request.prefill_tokens
            admitted.append(request)
        adapters = {s.adapter_id for s in running} | {r.adapter_id for r in admitted}
        now += cost.predict(step_row(view.max_prefill_tokens - budget, len(running), len(adapters - {None})))
        for request in admitted:
            if (
                deadline_s is not None
                and not request.started
                and now - request.arrived_s > deadline_of(request, deadline_s)
            ):
                return times
            times.append(now)
        for slot in running:
            slot.steps_left -= 1
        running.extend(
            _Slot(r.adapter_id, r.max_new_tokens - 1, r.prefill_tokens + r.max_new_tokens) for r in admitted
        )
        room += sum(s.frees_tokens for s in running if s.steps_left <= 0)
        running = [s for s in running if s.steps_left > 0]
    return times


def deadline_of(request: QueuedRequest, default_s: float) -> float:
    """Seconds from its arrival to its first token that ``request`` is held to: its own
    deadline, or ``default_s`` (the worker's SLO) when it has none."""
    return request.first_token_deadline_s or default_s


class EarlyAbort:
    """FCFS over the requests that can still meet their first-token deadline (their own, or the
    worker's SLO); abort the rest."""

    name = "early_abort"

    def __init__(
        self, config: EarlyAbortConfig = EarlyAbortConfig(), cost: OnlineFit[StepOutcome] | None = None
    ):
        self.config = config
        self.cost = cost or step_cost_model()
        self.aborted = 0
        """Requests aborted so far (exported as a metric)."""

    def plan(self, view: BatchView) -> BatchPlan:
        started = [r for r in view.waiting if r.started]
        fresh = [r for r in view.waiting if not r.started]
        hopeless: set[str] = set()
        if any(r.first_token_deadline_s is not None for r in fresh):
            hopeless = {r.request_id for r in fresh if not self._all_meet(view, started, [r])}
            candidates = [r for r in fresh if r.request_id not in hopeless]
        else:  # one deadline for all: the newest have the most slack, as in S-LoRA
            candidates = fresh
        keep_from = self._oldest_servable(view, started, candidates)
        dropped = hopeless | {r.request_id for r in candidates[:keep_from]}
        aborts = tuple(
            Abort(r.request_id, self._reason(view.now_s, r, r.request_id in hopeless))
            for r in fresh
            if r.request_id in dropped
        )
        self.aborted += len(aborts)
        kept = [*started, *candidates[keep_from:]]
        return BatchPlan(
            run=tuple(r.request_id for r in view.running) + tuple(r.request_id for r in kept),
            aborts=aborts,
        )

    def observe(self, outcome: StepOutcome) -> None:
        self.cost.observe(outcome)

    def decisions(self) -> dict[str, float]:
        return {"aborted": self.aborted}

    def _oldest_servable(
        self, view: BatchView, started: list[QueuedRequest], fresh: list[QueuedRequest]
    ) -> int:
        """The smallest k such that fresh[k:], served in order after ``started``, all meet their
        deadlines.

        Dropping older requests only brings the newer ones' first tokens earlier, so "fresh[k:]
        all meet it" holds from some k on: a binary search over k, each probe a replay that stops
        at the first miss (so it never looks further ahead than one SLO)."""
        low, high = 0, len(fresh)  # fresh[high:] (nothing) always meets it
        while low < high:
            k = (low + high) // 2
            if self._all_meet(view, started, fresh[k:]):
                high = k
            else:
                low = k + 1
        return low

    def _all_meet(
        self, view: BatchView, started: list[QueuedRequest], candidates: list[QueuedRequest]
    ) -> bool:
        queue = [*started, *candidates]
        return len(first_token_times(view, queue, self.cost.cost, self.config.first_token_slo_s)) == len(
            queue
        )

    def _reason(self, now_s: float, request: QueuedRequest, hopeless: bool) -> str:
        if request.first_token_deadline_s is None:
            target = f"the {self.config.first_token_slo_s:g} s SLO"
        else:
            target = f"its first_token_deadline_ms of {request.first_token_deadline_s * 1000:g} ms"
        return (
            f"aborted early: its first token cannot come within {target} "
            f"(it waited {now_s - request.arrived_s:.2f} s and "
            + ("would miss it even if served next)" if hopeless else "newer requests can still make theirs)")
        )
