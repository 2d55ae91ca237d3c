"""dLoRA dynamic batching over a small simulated engine: Algorithm 1 switches modes at α and β,
a merged step runs only the merged adapter's requests, credits bound a rare adapter's wait
under a skewed load, and Algorithm 2 moves the thresholds towards the mode that paid."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    BatchPlan,
    BatchView,
    Merged,
    QueuedRequest,
    RunningRequest,
    StepOutcome,
    Unmerged,
)
from services.gpu_worker.engine.policies.dlora import DloraConfig, DynamicBatching
from services.gpu_worker.engine.policies.linear_cost import FitConfig, LinearCost, OnlineFit
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS, step_cost_model

MERGED_S, PER_ADAPTER_S = 0.01, 0.005


def fixed_cost() -> OnlineFit[StepOutcome]:
    return step_cost_model(
        FitConfig(min_rows=10**9), LinearCost(STEP_TERMS, (0.0, 0.0, MERGED_S, PER_ADAPTER_S))
    )


@dataclass
class SimRequest:
    request_id: str
    adapter_id: str | None
    arrived: float
    tokens_left: int
    started: bool = False


@dataclass
class SimEngine:
    """Runs what the policy plans: each served request makes one token per step."""

    policy: DynamicBatching
    max_running: int = 8
    now: float = 0.0
    requests: dict[str, SimRequest] = field(default_factory=dict)
    served_at: dict[str, float] = field(default_factory=dict)
    plans: list[BatchPlan] = field(default_factory=list)

    def add(self, request_id: str, adapter_id: str | None, tokens: int = 4) -> None:
        self.requests[request_id] = SimRequest(request_id, adapter_id, self.now, tokens)

    def step(self) -> BatchPlan:
        running = tuple(
            RunningRequest(r.request_id, r.adapter_id, r.arrived, remaining_tokens=r.tokens_left)
            for r in self.requests.values()
            if r.started
        )
        waiting = tuple(
            QueuedRequest(r.request_id, r.adapter_id, r.arrived, 16, max_new_tokens=r.tokens_left)
            for r in self.requests.values()
            if not r.started
        )
        previous = self.policy.mode
        plan = self.policy.plan(BatchView(self.now, waiting, running, self.max_running, previous))
        self.plans.append(plan)
        served = [self.requests[i] for i in plan.run[: self.max_running]]
        assert all(isinstance(plan.mode, Unmerged) or r.adapter_id == plan.mode.adapter_id for r in served)
        for r in served:
            r.started = True
            self.served_at.setdefault(r.request_id, self.now)
            r.tokens_left -= 1
            if not r.tokens_left:
                del self.requests[r.request_id]
        adapters = len({r.adapter_id for r in served if r.adapter_id is not None})
        merged = isinstance(plan.mode, Merged)
        seconds = MERGED_S * len(served) + (0 if merged else PER_ADAPTER_S * adapters)
        self.policy.observe(
            StepOutcome(
                plan.mode,
                len(served),
                0,
                len(served),
                adapters,
                seconds,
                0.02 if plan.mode != previous else 0.0,
            )
        )
        self.now += 1.0
        return plan


def algorithm_1(**knobs) -> DloraConfig:
    """dLoRA's Algorithm 1 as published: the share alone decides (no cost gate)."""
    return DloraConfig(merge_must_pay=False, **knobs)


def test_a_dominant_adapter_is_merged_and_unmerged_once_its_share_falls():
    engine = SimEngine(DynamicBatching(algorithm_1(alpha=0.8, beta=0.5), fixed_cost()))
    for i in range(7):
        engine.add(f"hot{i}", "hot", tokens=3)
    engine.add("cold", "cold", tokens=3)
    assert engine.step().mode == Merged("hot")  # 7 of the 8 FCFS requests: 0.875 > α
    assert "cold" not in engine.plans[-1].run
    while "hot0" in engine.requests:
        engine.step()
    for i in range(3):
        engine.add(f"other{i}", f"a{i}", tokens=3)
    # Hot requests done; the merged adapter has no requests left: below β, back to unmerged.
    assert engine.step().mode == UNMERGED
    assert engine.policy.switches == 2


def test_alpha_at_one_stops_merging_even_under_a_backlog():
    # 20 queued requests of one adapter against a batch of 8: its share counts the 8 a merged
    # step could run, so it is 1 and never exceeds α = 1 (Algorithm 2's ceiling turns merging off).
    engine = SimEngine(DynamicBatching(algorithm_1(alpha=1.0, beta=0.5), fixed_cost()))
    for i in range(20):
        engine.add(f"hot{i}", "hot")
    assert all(engine.step().mode == UNMERGED for _ in range(5))
    merging = SimEngine(DynamicBatching(algorithm_1(alpha=0.95, beta=0.5), fixed_cost()))
    for i in range(20):
        merging.add(f"hot{i}", "hot")
    assert merging.step().mode == Merged("hot")


def test_a_merge_waits_until_the_cost_model_says_it_pays_for_its_switches():
    # Fixed cost: 0.01 s a decode, 0.005 s an adapter unmerged, a switch assumed 0.05 s. Eight
    # requests of one adapter unmerged: 8 / 0.085 s = 94 requests/s. Merged over 50 tokens each:
    # 400 / (50 · 0.08 + 2 · 0.05) = 98/s, so it merges; over 3 tokens: 24 / 0.34 = 71/s, it does not.
    long_run = SimEngine(DynamicBatching(DloraConfig(), fixed_cost()))
    short_run = SimEngine(DynamicBatching(DloraConfig(), fixed_cost()))
    for i in range(8):
        long_run.add(f"hot{i}", "hot", tokens=50)
        short_run.add(f"hot{i}", "hot", tokens=3)
    assert long_run.step().mode == Merged("hot")
    assert short_run.step().mode == UNMERGED


def test_where_a_merged_step_is_no_faster_it_never_merges():
    free_lora = step_cost_model(FitConfig(min_rows=10**9), LinearCost(STEP_TERMS, (0.0, 0.0, MERGED_S, 0.0)))
    engine = SimEngine(DynamicBatching(DloraConfig(), free_lora))
    for i in range(16):
        engine.add(f"hot{i}", "hot", tokens=10**6)
    assert all(engine.step().mode == UNMERGED for _ in range(20))
    assert engine.policy.switches == 0


def test_a_merged_step_pauses_the_running_requests_of_other_adapters():
    policy = DynamicBatching(algorithm_1(alpha=0.5, beta=0.3), fixed_cost())
    view = BatchView(
        5.0,
        tuple(QueuedRequest(f"w{i}", "hot", 1.0 + i, 16) for i in range(4)),
        (RunningRequest("r0", "cold", 0.0),),
        8,
        UNMERGED,
    )
    plan = policy.plan(view)
    assert plan.mode == Merged("hot") and plan.run == ("w0", "w1", "w2", "w3")


def test_credits_bound_the_wait_of_a_rare_adapter_under_a_skewed_load():
    threshold = 20
    engine = SimEngine(DynamicBatching(DloraConfig(credit_threshold=threshold), fixed_cost()))
    for i in range(16):
        engine.add(f"hot{i}", "hot", tokens=10**6)  # the hot adapter always fills the batch
    engine.step()
    engine.add("rare", "rare")
    arrived = engine.now
    for _ in range(threshold + 5):
        engine.step()
    assert "rare" in engine.served_at
    # Left out once per step, it is first once its credits reach the threshold.
    assert engine.served_at["rare"] - arrived <= threshold


def test_without_credits_the_rare_adapter_would_starve():
    engine = SimEngine(DynamicBatching(DloraConfig(credit_threshold=10**9), fixed_cost()))
    for i in range(16):
        engine.add(f"hot{i}", "hot", tokens=10**6)
    engine.add("rare", "rare")
    for _ in range(200):
        engine.step()
    assert "rare" not in engine.served_at


def test_alpha_falls_when_merging_paid_and_rises_when_it_did_not():
    config = DloraConfig(alpha=0.8, beta=0.5, period_steps=4)
    cheap_merge = DynamicBatching(
        config, step_cost_model(FitConfig(min_rows=10**9), LinearCost(STEP_TERMS, (0, 0, 0.01, 0.05)))
    )
    view = BatchView(
        0.0,
        tuple(QueuedRequest(f"w{i}", "hot" if i < 5 else f"x{i}", i, 16) for i in range(8)),
        (),
        8,
        UNMERGED,
    )
    for _ in range(4):  # unmerged steps that cost far more than merging the hot adapter would
        plan = cheap_merge.plan(view)
        assert plan.mode == UNMERGED  # 5/8 < 0.8
        cheap_merge.observe(StepOutcome(UNMERGED, 8, 0, 8, 4, 1.0))
    assert cheap_merge.alpha == config.alpha - config.gamma_dec

    costly_merge = DynamicBatching(
        config, step_cost_model(FitConfig(min_rows=10**9), LinearCost(STEP_TERMS, (5.0, 0, 0, 0)))
    )
    for _ in range(4):
        costly_merge.plan(view)
        costly_merge.observe(StepOutcome(UNMERGED, 8, 0, 8, 4, 0.01))
    assert costly_merge.alpha == min(1.0, config.alpha * config.gamma_mul)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.floats(0.001, 1.0), st.integers(1, 8)), min_size=1, max_size=200)
)
def test_thresholds_stay_ordered_and_in_range(steps):
    policy = DynamicBatching(DloraConfig(period_steps=5), fixed_cost())
    for hot, seconds, batch in steps:
        waiting = tuple(QueuedRequest(f"w{i}", "hot" if i <= hot else f"a{i}", i, 8) for i in range(batch))
        plan = policy.plan(BatchView(0.0, waiting, (), 8, policy.mode))
        policy.observe(StepOutcome(plan.mode, batch, 8 * batch, 0, 1, seconds))
        assert 0 < policy.config.min_threshold <= policy.beta <= policy.alpha <= 1
