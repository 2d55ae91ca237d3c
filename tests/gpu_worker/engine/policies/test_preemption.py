"""Preemption policies: which running request gives its KV back when the pool runs dry."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.policies.batch_policy import RunningRequest
from services.gpu_worker.engine.policies.preemption import FewestComputed, Newest, make_preemption_policy

RUNNING = (
    RunningRequest("old-long", None, 0.0, context_tokens=90),
    RunningRequest("short", "a", 1.0, context_tokens=10),
    RunningRequest("new-long", None, 2.0, context_tokens=50),
)


def test_newest_preempts_the_last_started_request():
    assert Newest().victim(RUNNING).request_id == "new-long"


def test_fewest_computed_preempts_the_cheapest_recompute_the_newest_among_equals():
    assert FewestComputed().victim(RUNNING).request_id == "short"
    tied = (*RUNNING, RunningRequest("short-too", None, 3.0, context_tokens=10))
    assert FewestComputed().victim(tied).request_id == "short-too"


def test_policies_are_chosen_by_name_and_the_config_checks_it():
    assert isinstance(make_preemption_policy("fewest_computed"), FewestComputed)
    with pytest.raises(ValueError, match="known: fewest_computed, newest"):
        make_preemption_policy("oldest")
    assert EngineConfig().preemption_policy == "newest"
    with pytest.raises(ValueError, match="preemption_policy must be one of fewest_computed, newest"):
        EngineConfig(preemption_policy="oldest")
