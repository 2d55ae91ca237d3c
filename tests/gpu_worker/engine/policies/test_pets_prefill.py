"""PetS coordinated batching: both DPs find the cheapest contiguous split (checked against brute
force), every prompt lands in exactly one step, and the policy admits the first step only."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    BatchView,
    QueuedRequest,
    RunningRequest,
)
from services.gpu_worker.engine.policies.linear_cost import FitConfig, LinearCost
from services.gpu_worker.engine.policies.pets_prefill import PetsPrefill, coordinated_batches, split_by_cost
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS, step_cost_model


def padded(fixed: float, per_token: float):
    return lambda prompts, length: fixed + per_token * prompts * length


def brute_force(lengths, sizes, cost) -> float:
    n = len(lengths)
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *(i + 1 for i, c in enumerate(cuts) if c), n]
        best = min(best, sum(cost(sum(sizes[a:b]), lengths[b - 1]) for a, b in itertools.pairwise(bounds)))
    return best


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 64), st.integers(1, 3)), min_size=1, max_size=8),
    st.floats(0.0, 2.0),
    st.floats(0.001, 0.1),
)
def test_the_dp_finds_the_cheapest_contiguous_split(items, fixed, per_token):
    items.sort()
    lengths, sizes = [length for length, _ in items], [size for _, size in items]
    cost = padded(fixed, per_token)
    groups = split_by_cost(lengths, cost, sizes)
    assert [g[0] for g in groups] == [0, *(g[1] for g in groups[:-1])] and groups[-1][1] == len(items)
    got = sum(cost(sum(sizes[a:b]), lengths[b - 1]) for a, b in groups)
    assert abs(got - brute_force(lengths, sizes, cost)) < 1e-9


def queue(lengths_by_adapter: dict[str, list[int]]) -> list[QueuedRequest]:
    requests, t = [], 0.0
    for adapter, lengths in lengths_by_adapter.items():
        for length in lengths:
            requests.append(QueuedRequest(f"{adapter}-{length}-{t}", adapter, t, length))
            t += 1
    return requests


def test_a_high_step_cost_puts_everything_in_one_step():
    steps = coordinated_batches(
        queue({"a": [8, 30, 31], "b": [9, 32]}), padded(100.0, 0.001), lambda n, l: 0.0
    )
    assert len(steps) == 1 and sum(len(m.requests) for m in steps[0]) == 5


def test_padding_cost_separates_short_prompts_from_long_ones():
    steps = coordinated_batches(
        queue({"a": [8, 9, 500], "b": [10, 501]}), padded(0.01, 0.001), padded(0.0, 0.0004)
    )
    lengths = [sorted(r.prefill_tokens for m in step for r in m.requests) for step in steps]
    assert lengths == [[8, 9, 10], [500, 501]]


def test_each_adapter_s_prompts_form_its_own_mini_batches():
    steps = coordinated_batches(queue({"a": [8, 9], "b": [8, 9]}), padded(10.0, 0.0), lambda n, l: 1.0)
    (step,) = steps
    assert sorted((m.adapter_id, len(m.requests)) for m in step) == [("a", 2), ("b", 2)]


def test_the_policy_admits_the_first_step_after_the_running_and_preempted_requests():
    cost = step_cost_model(FitConfig(min_rows=10**9), LinearCost(STEP_TERMS, (0.01, 0.001, 0.0, 0.0)))
    waiting = (
        QueuedRequest("pre", "a", 0.0, 700, started=True),
        QueuedRequest("long", "a", 1.0, 600),
        QueuedRequest("short", "b", 2.0, 12),
    )
    plan = PetsPrefill(cost=cost).plan(BatchView(5.0, waiting, (RunningRequest("r", "a", 0.0),), 8, UNMERGED))
    assert plan.run == ("r", "pre", "short")
