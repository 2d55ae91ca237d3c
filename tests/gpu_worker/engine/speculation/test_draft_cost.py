"""Drafting is cost-aware: a request drafts k tokens only while the k-th one's expected saving
(its chance of acceptance times what a token of the step costs) exceeds the row it adds, by the
step-cost model (a declined request probes with one token now and then); the model is shown the draft rows among each step's decode tokens (injected
cost models; tiny Llama, fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.policies.linear_cost import FitConfig, LinearCost, OnlineFit
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS, step_cost_model
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.engine.speculation.acceptance import AcceptanceRate, DraftChances, KeyedRates
from services.gpu_worker.engine.speculation.draft_budget import DraftSettings
from services.gpu_worker.engine.speculation.draft_cost import DraftPrices, draft_prices, fixed_cost
from services.gpu_worker.engine.speculation.request_drafter import RequestDrafter
from services.gpu_worker.engine.speculation.speculator import allot_rows
from services.gpu_worker.model.llama import LlamaModel
from tests.support.draft_cost import pin_draft_cost

MEMORY_BOUND = LinearCost.named(STEP_TERMS, fixed=0.010, per_decode_token=0.001)
"""A step that mostly reads weights: a row costs a tenth of a batch-1 step."""
COMPUTE_BOUND = LinearCost.named(STEP_TERMS, fixed=0.0, per_decode_token=0.010)
"""Every row costs what a token saves: no draft ever pays."""


def test_the_kth_draft_token_pays_while_its_chance_times_a_tokens_cost_exceeds_a_row():
    prices = DraftPrices(token_s=0.010, row_s=0.002)
    assert prices.worth(0.9, ceiling=5) == 5
    assert prices.worth(0.9, ceiling=3) == 3
    assert prices.worth(0.5, ceiling=8) == 2  # 0.5, 0.25 > 0.2 > 0.125
    assert prices.worth(0.2, ceiling=8) == 0
    assert DraftPrices(token_s=0.001, row_s=0.001).worth(0.99, ceiling=8) == 0


def test_a_drafts_saving_is_its_tokens_expected_savings_less_their_rows():
    prices = DraftPrices(token_s=0.010, row_s=0.002, step_s=0.005)
    assert prices.saving(0.5, 2) == pytest.approx(0.005 - 0.002 + 0.0025 - 0.002)
    assert draft_prices(MEMORY_BOUND, 8, 0, verify_step_share=0.25).step_s == pytest.approx(0.25 * 0.011)


def test_prices_come_from_a_plain_decode_step_of_the_batch():
    assert draft_prices(MEMORY_BOUND, 1, 0) == pytest.approx(DraftPrices(0.011, 0.001))
    wide = draft_prices(MEMORY_BOUND, 8, 3)
    assert wide.token_s == pytest.approx(0.018 / 8) and wide.row_s == 0.001
    # At batch 8 a 0.5 chance no longer pays for a row that batch 1 drafts 3 of.
    assert draft_prices(MEMORY_BOUND, 1, 0).worth(0.5, 8) == 3
    assert wide.worth(0.5, 8) == 1


def test_a_row_costs_at_least_its_floor_share_of_a_batch_one_step():
    free_rows = LinearCost.named(STEP_TERMS, fixed=0.010, per_decode_token=0.0)  # a loaded machine's fit
    assert draft_prices(free_rows, 8, 0).row_s == 0
    assert draft_prices(free_rows, 8, 0, min_row_share=0.05).row_s == pytest.approx(0.0005)
    assert draft_prices(MEMORY_BOUND, 8, 0, min_row_share=0.05).row_s == 0.001  # the fit's, above it


def test_acceptance_counts_tried_positions_and_decays():
    rate = AcceptanceRate(decay=0.5)
    assert rate.rate(prior=0.5, prior_weight=2) == 0.5
    rate.verified(drafted=4, accepted=4)  # 4 tried, 4 accepted
    assert rate.rate(0.5, 2) == pytest.approx(5 / 6)
    rate.verified(drafted=4, accepted=0)  # 1 tried, none accepted; the first halved
    assert (rate.accepted, rate.tried) == (2, 3)
    with pytest.raises(ValueError, match="decay"):
        AcceptanceRate(decay=0)


def test_keyed_rates_start_from_the_prior_and_are_bounded():
    rates = KeyedRates(decay=1.0, max_keys=2)
    assert rates.rate("sql", prior=0.5, prior_weight=2) == 0.5
    rates.verified("sql", drafted=4, accepted=4)
    rates.verified("chat", drafted=2, accepted=0)
    assert rates.rate("sql", 0.5, 2) == pytest.approx(5 / 6)
    assert rates.rate("chat", 0.5, 2) == pytest.approx(1 / 3)
    rates.verified("pirate", drafted=1, accepted=1)  # the least recently verified goes
    assert rates.keys() == ["chat", "pirate"]


def test_a_drafts_chance_is_its_adapters_at_its_match_length():
    chances = DraftChances(prior=0.5, prior_weight=2, decay=1.0, max_adapters=4)
    assert chances.match("sql", 3) == 0.5  # nothing verified: the prior
    chances.verified("sql", 3, drafted=4, accepted=4)
    chances.verified("sql", 1, drafted=2, accepted=0)
    # sql over all: 4 accepted of 5 tried, (4 + 1) / (5 + 2); each length starts from that.
    assert chances.adapter("sql") == pytest.approx(5 / 7)
    assert chances.match("sql", 3) == pytest.approx((4 + 2 * 5 / 7) / (4 + 2))
    assert chances.match("sql", 1) == pytest.approx((0 + 2 * 5 / 7) / (1 + 2))
    assert chances.match("sql", 2) == pytest.approx(5 / 7)
    assert chances.match("chat", 3) == 0.5  # another adapter's drafts say nothing of these


def test_a_drafter_prices_its_draft_at_its_match_lengths_chance():
    drafter = RequestDrafter(DraftSettings())
    sequence = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # the last 3 tokens occurred before: 4, 5, ... follow
    prices = DraftPrices(token_s=1.0, row_s=0.17)
    by_length = {3: 0.9, 2: 0.5, 1: 0.2}
    assert drafter.propose(sequence, 5, prices, by_length.get) == (4, 5, 6, 7, 8)  # 0.9^5 = 0.59
    assert (drafter.match_length, drafter.chance) == (3, 0.9)
    by_length[3] = 0.5
    assert drafter.propose(sequence, 5, prices, by_length.get) == (4, 5)  # 0.5, 0.25 > 0.17 > 0.125
    by_length[3] = 0.1
    assert drafter.propose(sequence, 5, prices, by_length.get) == ()  # declined, its probe not yet due


def engine_with(tiny_llama, cost: OnlineFit) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(
        model, EngineConfig(pool_mib=4, kv_block_tokens=4, speculative="ngram", max_running=8)
    )
    engine.speculator.cost = cost
    return engine


def run(engine: Engine, requests: int) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for i in range(requests):
        prompt = tuple((i + j % 5) * 7 % 250 + 1 for j in range(12))  # a period of 5: drafts accepted
        sink = tokens.setdefault(f"r{i}", [])
        request = GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
        engine.submit(request, lambda e, sink=sink: e.token_id is None or sink.append(e.token_id))
    while engine.has_work():
        engine.step()
    return tokens


def test_rows_that_cost_what_they_save_are_drafted_only_as_probes(tiny_llama):
    cheap, dear = (
        engine_with(tiny_llama, fixed_cost(MEMORY_BOUND)),
        engine_with(tiny_llama, fixed_cost(COMPUTE_BOUND)),
    )
    assert run(dear, 4) == run(cheap, 4)
    # One probe per request after 8 declined steps (the next would come after 16 more).
    assert sum(dear.speculator.counts.drafted.values()) <= 4
    assert sum(cheap.speculator.counts.accepted.values()) > 4


def test_the_step_cost_model_counts_draft_rows_as_decode_tokens(tiny_llama):
    seen = []
    features = step_cost_model().features
    # It records what it is shown, and never fits (the decisions stay the prior's, whatever the speed).
    recording = OnlineFit(
        STEP_TERMS,
        lambda outcome: seen.append(outcome) or features(outcome),
        FitConfig(min_rows=10**9),
        MEMORY_BOUND,
    )
    engine = engine_with(tiny_llama, recording)
    run(engine, 1)
    drafted = sum(engine.speculator.counts.drafted.values())
    assert drafted > 0
    decode_steps = [o for o in seen if o.prefill_tokens == 0]
    assert sum(o.decode_tokens for o in decode_steps) == len(decode_steps) + drafted


def test_drafts_share_the_steps_prefill_budget_after_admission(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    config = EngineConfig(pool_mib=4, kv_block_tokens=4, speculative="ngram", max_prefill_tokens=12)
    engine = pin_draft_cost(local_engine(model, config))
    shares: list[tuple[int, int]] = []
    draft = engine.speculator.draft

    def counted(batch):
        rows = draft(batch)
        shares.append((sum(r.new_tokens for r in batch if r.new_tokens > 1), rows))
        return rows

    engine.speculator.draft = counted
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    engine.submit(GenerationRequest("early", tuple(j % 5 + 1 for j in range(12)), sampling), lambda e: None)
    for _ in range(6):  # it decodes and drafts when the next one arrives
        engine.step()
    engine.submit(GenerationRequest("late", tuple(j % 3 + 9 for j in range(12)), sampling), lambda e: None)
    while engine.has_work():
        engine.step()
    late = shares[6]
    assert late == (12, 0)  # its 12 prompt tokens fill the step's budget: the early request drafts nothing
    assert shares[5][1] > 0 and shares[7][1] > 0  # it drafted in the steps before and after


def test_a_step_drafts_only_when_its_drafts_together_pay_for_verifying(tiny_llama):
    costly = engine_with(tiny_llama, fixed_cost(MEMORY_BOUND))
    costly.speculator.settings = dataclasses.replace(costly.speculator.settings, verify_step_share=100.0)
    cheap = engine_with(tiny_llama, fixed_cost(MEMORY_BOUND))
    assert run(costly, 4) == run(cheap, 4)
    # Only probes (one token after 8 declined steps) where a verifying step costs 100 plain ones.
    assert sum(costly.speculator.counts.drafted.values()) <= 4
    assert sum(cheap.speculator.counts.accepted.values()) > 4


def test_a_request_whose_drafts_never_pay_still_probes_alone_in_its_steps(tiny_llama):
    """At batch 1 a probe is the step's only draft, whose saving never pays for a verifying step:
    it is verified all the same (one token after 8 declined steps; each accepted here, so the
    wait stays 8), so a request, and its adapter's next ones, can draft again once its output
    turns repetitive."""
    dear = engine_with(tiny_llama, fixed_cost(COMPUTE_BOUND))
    prompt = tuple(j % 5 * 7 + 1 for j in range(12))
    dear.submit(
        GenerationRequest("r", prompt, SamplingParams(max_tokens=30, ignore_eos=True)), lambda e: None
    )
    while dear.has_work():
        dear.step()
    assert dear.speculator.counts.drafted == dear.speculator.counts.accepted == {"": 3}


def test_a_steps_draft_rows_go_to_the_tokens_likeliest_to_be_accepted():
    sure, likely, doubtful = (1, 2, 3, 4), (5, 6, 7), (8, 9)
    proposals = {"sure": (sure, 0.9), "likely": (likely, 0.8), "doubtful": (doubtful, 0.3)}
    # 0.9, 0.81, 0.8, 0.729 come first; 0.3 (the doubtful request's first) after 0.64 and 0.59.
    assert allot_rows(proposals, room=4) == {"sure": 3, "likely": 1}
    assert allot_rows(proposals, room=7) == {"sure": 4, "likely": 3}
    assert allot_rows(proposals, room=20) == {"sure": 4, "likely": 3, "doubtful": 2}
    assert allot_rows(proposals, room=0) == {}
    # At equal chances the rows spread: each request's first token before anyone's second.
    even = {f"r{i}": ((1, 2, 3, 4), 0.8) for i in range(8)}
    assert allot_rows(even, room=4) == {"r0": 1, "r1": 1, "r2": 1, "r3": 1}
