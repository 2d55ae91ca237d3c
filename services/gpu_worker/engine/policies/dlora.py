"""dLoRA's dynamic batching (seed 001, Algorithms 1 and 2 and starvation prevention; parameters
in SEED-SPECS §2 are our choice where the seed gives none).

Every step (Algorithm 1), with R every request in the engine and B_fcfs the batch FCFS would run:
- unmerged: when the adapter with the most requests in R has more than α·|B_fcfs| of them,
  merge it into the base weights and run only its requests (at base speed);
- merged: when the merged adapter's requests fall below β·|B_fcfs|, unmerge and run B_fcfs.
An adapter's requests are counted up to the batch size (what a merged step can run), so the
share is at most 1 and α = 1 turns merging off.
Every ``period_steps`` steps (Algorithm 2) it compares the throughput the period had with the
throughput the other mode would have had (the step cost model estimates the mode not taken;
switching time is charged to merged mode) and lowers the threshold of the mode it is in when
merging paid (α or β minus γ_dec), else raises it (times γ_mul), keeping 0 < β ≤ α ≤ 1.
Starvation prevention: an adapter gains a credit each step its requests are left out and loses
them when served; past ``credit_threshold`` the policy unmerges (if needed) and runs its requests
first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    BatchPlan,
    BatchView,
    LoraMode,
    Merged,
    QueuedRequest,
    RunningRequest,
    StepOutcome,
    fcfs_batch,
)
from services.gpu_worker.engine.policies.linear_cost import OnlineFit
from services.gpu_worker.engine.policies.step_cost_model import step_cost_model, step_row

Request = QueuedRequest | RunningRequest


@dataclass(frozen=True)
class DloraConfig:
    """Thresholds and their tuning (SEED-SPECS §2, "our choice")."""

    alpha: float = 0.8
    """Initial α_switch: merge when the top adapter's share of B_fcfs exceeds it."""
    beta: float = 0.5
    """Initial β_switch: unmerge when the merged adapter's share falls below it."""
    gamma_dec: float = 0.05
    """Subtracted from the threshold when merging paid over the last period."""
    gamma_mul: float = 1.1
    """Multiplies the threshold when it did not."""
    min_threshold: float = 0.05
    """Floor of α and β, so a mode is never entered or kept unconditionally."""
    period_steps: int = 16
    """N_I: steps between two tunings. A CPU step takes 0.2–1 s here (a GPU's tens of ms), so a
    period of 50 outlasted a whole benchmark run and Algorithm 2 never acted."""
    credit_threshold: int = 32
    """Credits (steps left out) after which an adapter's requests go first: 2·N_I."""
    switch_s_prior: float = 0.05
    """Seconds one merge or unmerge is assumed to take until one is measured."""
    merge_must_pay: bool = True
    """Merge only when the step cost model expects the merged batch, decoding its requests'
    remaining tokens with a merge and an unmerge charged, to out-run the FCFS batch unmerged:
    Algorithm 2's comparison made before a switch instead of N_I steps after it (our addition).
    Without it, where a merged step is no faster (this CPU) every merge costs t_M and holds the
    other adapters' requests back until Algorithm 2 catches up. False: Algorithm 1 as published."""

    def __post_init__(self) -> None:
        if not 0 < self.min_threshold <= self.beta <= self.alpha <= 1:
            raise ValueError(
                f"need 0 < min_threshold <= beta <= alpha <= 1, got "
                f"{self.min_threshold}, {self.beta}, {self.alpha}"
            )
        if self.gamma_dec <= 0 or self.gamma_mul <= 1:
            raise ValueError(f"need gamma_dec > 0 and gamma_mul > 1, got {self.gamma_dec}, {self.gamma_mul}")
        if self.period_steps < 1 or self.credit_threshold < 1:
            raise ValueError("period_steps and credit_threshold must be >= 1")


@dataclass
class _PeriodStep:
    """One observed step and what the other mode would have run instead."""

    requests: int
    seconds: float
    switch_seconds: float
    other_requests: int
    other_seconds: float


class DynamicBatching:
    """dLoRA's merged/unmerged switching with online thresholds and credits."""

    name = "dlora"

    def __init__(self, config: DloraConfig = DloraConfig(), cost: OnlineFit[StepOutcome] | None = None):
        self.config = config
        self.cost = cost or step_cost_model()
        self.alpha = config.alpha
        self.beta = config.beta
        self.mode: LoraMode = UNMERGED
        self.credits: Counter[str] = Counter()
        self.switch_s = config.switch_s_prior
        self.switches = 0
        """Mode changes so far (exported as a metric)."""
        self.merged_steps = 0
        self.steps = 0
        self._alternative: tuple[int, float] = (0, 0.0)
        self._period: list[_PeriodStep] = []

    def plan(self, view: BatchView) -> BatchPlan:
        self.mode = view.mode  # the engine's weights are the truth (it may have unmerged)
        requests: list[Request] = [*view.running, *view.waiting]
        fcfs = fcfs_batch(view)
        starving = self._starving(requests)
        mode = self._next_mode(view, requests, fcfs, starving)
        if isinstance(mode, Merged):
            run = [r for r in requests if r.adapter_id == mode.adapter_id][: view.max_running]
            self._alternative = (len(fcfs), self._unmerged_seconds(fcfs))
        else:
            first = [r for r in requests if r.adapter_id in starving]
            run = [*first, *(r for r in requests if r.adapter_id not in starving)]
            merged = self._merge_candidate(requests)
            alternative = [] if merged is None else [r for r in requests if r.adapter_id == merged]
            alternative = alternative[: view.max_running]
            self._alternative = (len(alternative), self._merged_seconds(alternative))
        if mode != self.mode:
            self.switches += 1
        self.mode = mode
        self._credit(requests, run[: view.max_running])
        return BatchPlan(run=tuple(r.request_id for r in run), mode=mode)

    def observe(self, outcome: StepOutcome) -> None:
        self.cost.observe(outcome)
        self.steps += 1
        if isinstance(outcome.mode, Merged):
            self.merged_steps += 1
        if outcome.switch_seconds:
            self.switch_s = 0.8 * self.switch_s + 0.2 * outcome.switch_seconds
        other_requests, other_seconds = self._alternative
        self._period.append(
            _PeriodStep(
                outcome.requests, outcome.seconds, outcome.switch_seconds, other_requests, other_seconds
            )
        )
        if len(self._period) >= self.config.period_steps:
            self._tune(merged_now=isinstance(outcome.mode, Merged))
            self._period = []

    def decisions(self) -> dict[str, float]:
        return {
            "mode_switches": self.switches,
            "merged_share": self.merged_steps / self.steps if self.steps else 0.0,
            "alpha": self.alpha,
            "beta": self.beta,
            "max_credits": max(self.credits.values(), default=0),
        }

    # -- Algorithm 1 ------------------------------------------------------------------------

    def _next_mode(
        self, view: BatchView, requests: list[Request], fcfs: list[Request], starving: set[str]
    ) -> LoraMode:
        if not fcfs:
            return self.mode
        if isinstance(self.mode, Merged):
            if starving - {self.mode.adapter_id}:
                return UNMERGED
            share = _batch_share(requests, self.mode.adapter_id, view.max_running, fcfs)
            return UNMERGED if share < self.beta else self.mode
        if starving:
            return UNMERGED
        candidate = self._merge_candidate(requests)
        if candidate is None:
            return UNMERGED
        if _batch_share(requests, candidate, view.max_running, fcfs) <= self.alpha:
            return UNMERGED
        if self.config.merge_must_pay and not self._merge_pays(requests, candidate, view.max_running, fcfs):
            return UNMERGED
        return Merged(candidate)

    @staticmethod
    def _merge_candidate(requests: list[Request]) -> str | None:
        """The adapter with the most requests (ties: the one whose oldest request came first)."""
        counts = Counter(r.adapter_id for r in requests if r.adapter_id is not None)
        if not counts:
            return None
        first_seen = {}
        for r in sorted(requests, key=lambda r: r.arrived_s):
            first_seen.setdefault(r.adapter_id, r.arrived_s)
        return min(counts, key=lambda a: (-counts[a], first_seen[a], a))

    def _merge_pays(
        self, requests: list[Request], candidate: str, max_running: int, fcfs: list[Request]
    ) -> bool:
        """Decode throughput, from the step cost model: the merged batch over the mean of its
        requests' remaining tokens with a merge and an unmerge, against the FCFS batch unmerged."""
        batch = [r for r in requests if r.adapter_id == candidate][:max_running]
        steps = sum(_tokens_left(r) for r in batch) / len(batch)
        cost = self.cost.cost
        merged = _rate(
            len(batch) * steps, steps * cost.predict(step_row(0, len(batch), 0)) + 2 * self.switch_s
        )
        adapters = len({r.adapter_id for r in fcfs} - {None})
        return merged > _rate(len(fcfs), cost.predict(step_row(0, len(fcfs), adapters)))

    # -- starvation prevention --------------------------------------------------------------

    def _starving(self, requests: list[Request]) -> set[str]:
        present = {r.adapter_id for r in requests if r.adapter_id is not None}
        return {a for a in present if self.credits[a] >= self.config.credit_threshold}

    def _credit(self, requests: list[Request], served: list[Request]) -> None:
        served_adapters = {r.adapter_id for r in served}
        for adapter in {r.adapter_id for r in requests if r.adapter_id is not None}:
            if adapter in served_adapters:
                self.credits.pop(adapter, None)
            else:
                self.credits[adapter] += 1

    # -- Algorithm 2 ------------------------------------------------------------------------

    def _unmerged_seconds(self, batch: list[Request]) -> float:
        prefill = sum(r.prefill_tokens for r in batch if isinstance(r, QueuedRequest))
        decode = sum(isinstance(r, RunningRequest) for r in batch)
        adapters = len({r.adapter_id for r in batch if r.adapter_id is not None})
        return self.cost.cost.predict(step_row(prefill, decode, adapters))

    def _merged_seconds(self, batch: list[Request]) -> float:
        if not batch:
            return 0.0
        prefill = sum(r.prefill_tokens for r in batch if isinstance(r, QueuedRequest))
        decode = sum(isinstance(r, RunningRequest) for r in batch)
        return self.cost.cost.predict(step_row(prefill, decode, 0))

    def _tune(self, merged_now: bool) -> None:
        """Compare merged and unmerged throughput over the period and move the threshold of
        the mode the engine is in: lower when merging paid, higher when it did not."""
        steps = self._period
        actual = sum(s.requests for s in steps), sum(s.seconds for s in steps)
        other = sum(s.other_requests for s in steps), sum(s.other_seconds for s in steps)
        if merged_now:
            merged_tokens, merged_s = actual
            merged_s += sum(s.switch_seconds for s in steps)
            unmerged_tokens, unmerged_s = other
        else:
            unmerged_tokens, unmerged_s = actual
            merged_tokens, merged_s = other
            merged_s += 2 * self.switch_s if merged_tokens else 0.0
        merge_paid = _rate(merged_tokens, merged_s) > _rate(unmerged_tokens, unmerged_s)
        floor = self.config.min_threshold
        if merged_now:
            beta = self.beta - self.config.gamma_dec if merge_paid else self.beta * self.config.gamma_mul
            self.beta = min(max(floor, beta), self.alpha)
        else:
            alpha = self.alpha - self.config.gamma_dec if merge_paid else self.alpha * self.config.gamma_mul
            self.alpha = min(max(self.beta, alpha), 1.0)


def _batch_share(requests: list[Request], adapter_id: str, max_running: int, fcfs: list[Request]) -> float:
    """|R_merge| / |B_fcfs|, with R_merge counted as the batch merged mode would run (at most
    ``max_running``). Counting the whole queue instead lets the share pass 1 under a backlog, and
    then no α ≤ 1 that Algorithm 2 tunes to could ever stop merging when it does not pay."""
    return min(sum(r.adapter_id == adapter_id for r in requests), max_running) / len(fcfs)


def _tokens_left(request: Request) -> int:
    return request.max_new_tokens if isinstance(request, QueuedRequest) else request.remaining_tokens


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
