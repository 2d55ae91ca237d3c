"""Sampling: each parameter does what a vLLM user expects, and seeds reproduce (that a draw is
keyed by the seed and the token's position: test_seeded_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.engine.sampling import (
    NO_HISTORY,
    SamplingParams,
    apply_repetition_penalty,
    draw_generator,
    sample_token,
    token_logprobs,
)
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import InvalidArgument
from services.runtime.sampling.stop_window import StopStringTail


def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(100) * 3


def draws(params: SamplingParams, n: int = 200) -> list[int]:
    """``n`` tokens drawn from the same logits, as positions 0..n-1 of one request."""
    return [sample_token(logits(), params, NO_HISTORY, draw_generator(params.seed, i)) for i in range(n)]


def test_greedy_picks_the_argmax():
    assert sample_token(logits(), SamplingParams(), NO_HISTORY, None) == int(logits().argmax())


def test_top_k_1_and_tiny_top_p_are_greedy():
    best = int(logits().argmax())
    assert set(draws(SamplingParams(temperature=1.0, top_k=1, seed=1))) == {best}
    assert set(draws(SamplingParams(temperature=1.0, top_p=1e-6, seed=1))) == {best}


def test_top_k_keeps_only_the_k_best():
    top5 = set(logits().topk(5).indices.tolist())
    picked = set(draws(SamplingParams(temperature=5.0, top_k=5, seed=2), 400))
    assert picked <= top5 and len(picked) > 1


def test_top_p_keeps_the_nucleus():
    probs = torch.softmax(logits(), -1)
    ordered, order = probs.sort(descending=True)
    nucleus = set(order[: int((ordered.cumsum(0) < 0.5).sum()) + 1].tolist())
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5, seed=3), 400)) <= nucleus


def test_same_seed_same_tokens_other_seed_other_tokens():
    params = SamplingParams(temperature=1.0, seed=42)
    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, seed=43))


def test_repetition_penalty_follows_hf():
    values = torch.tensor([2.0, -2.0, 1.0])
    penalised = apply_repetition_penalty(values, torch.tensor([0, 1]), 2.0)
    assert penalised.tolist() == [1.0, -4.0, 1.0]


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-3.0), "frequency_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias"),
    ],
)
def test_out_of_range_values_are_refused_by_name(params, field):
    with pytest.raises(InvalidArgument, match=field):
        params.validate()


def run(engine: Engine, params: SamplingParams, prompt=(5, 6, 7)):
    events = []
    engine.submit(GenerationRequest("r", prompt, params), events.append)
    while engine.has_work():
        engine.step()
    return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason


def test_stop_tokens_eos_and_stop_strings_end_generation(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    free_run, reason = run(
        local_engine(model, EngineConfig(pool_mib=4)), SamplingParams(max_tokens=6, ignore_eos=True)
    )
    assert reason is FinishReason.LENGTH and len(free_run) == 6
    stop_at = free_run[2]
    first = free_run.index(stop_at)

    tokens, reason = run(
        local_engine(model, EngineConfig(pool_mib=4)), SamplingParams(max_tokens=6, stop_token_ids=(stop_at,))
    )
    assert reason is FinishReason.STOP and tokens == free_run[: first + 1]

    eos_engine = local_engine(model, EngineConfig(pool_mib=4), eos_token_ids=(stop_at,))
    assert run(eos_engine, SamplingParams(max_tokens=6))[1] is FinishReason.STOP
    assert run(eos_engine, SamplingParams(max_tokens=6, ignore_eos=True))[1] is FinishReason.LENGTH

    text = {t: f"<{t}>" for t in range(256)}
    string_engine = local_engine(
        model, EngineConfig(pool_mib=4), detokenize=lambda ids: "".join(text[i] for i in ids)
    )
    tokens, reason = run(string_engine, SamplingParams(max_tokens=6, stop_strings=(f"<{stop_at}>",)))
    assert reason is FinishReason.STOP and tokens == free_run[: first + 1]


def test_stop_string_across_tokens_found_in_the_bounded_tail_as_in_the_whole_text(tiny_llama):
    """The worker's stop check reads only the output's tail (StopStringTail): a stop string that
    starts inside one token and ends inside a later one stops at the token a whole decode does."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    free_run, _ = run(
        local_engine(model, EngineConfig(pool_mib=4)), SamplingParams(max_tokens=40, ignore_eos=True)
    )
    piece = {t: f"<{t}>".encode() for t in range(256)}
    whole = b"".join(piece[t] for t in free_run).decode()
    stop = f"{free_run[30]}><{free_run[31]}"  # from inside token 30 to inside token 31
    expected = next(n for n in range(1, 41) if stop in b"".join(piece[t] for t in free_run[:n]).decode())
    assert stop in whole and expected <= 32
    tail_engine = local_engine(model, EngineConfig(pool_mib=4), detokenize=StopStringTail(piece.__getitem__))
    tokens, reason = run(tail_engine, SamplingParams(max_tokens=40, ignore_eos=True, stop_strings=(stop,)))
    assert reason is FinishReason.STOP and tokens == free_run[:expected]


def test_logprobs_are_the_log_softmax_of_the_raw_logits_with_the_most_likely_first():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    expected = torch.log_softmax(logits, dim=-1)
    result = token_logprobs(logits, token=2, top=3)
    assert result.logprob == pytest.approx(float(expected[2]))
    assert [t for t, _ in result.top] == [1, 2, 0]
    assert [v for _, v in result.top] == pytest.approx([float(expected[i]) for i in (1, 2, 0)])
    assert token_logprobs(logits, token=0, top=0).top == ()


def test_a_request_asking_for_logprobs_gets_them_with_every_token(tiny_llama):
    engine = local_engine(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), EngineConfig(pool_mib=4)
    )
    events, rows = [], []
    engine.on_logits = lambda _, row: rows.append(row.float().clone())
    params = SamplingParams(max_tokens=4, ignore_eos=True, top_logprobs=2)
    engine.submit(GenerationRequest("r", (3, 4, 5), params), events.append)
    while engine.has_work():
        engine.step()
    steps = [e for e in events if e.token_id is not None]
    assert len(steps) == 4 and all(len(e.logprobs.top) == 2 for e in steps)
    for event, row in zip(steps, rows, strict=True):
        assert event.logprobs.top[0][0] == event.token_id  # greedy: the chosen one is the likeliest
        assert event.logprobs.logprob == pytest.approx(float(torch.log_softmax(row, -1)[event.token_id]))
