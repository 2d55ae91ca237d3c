"""Seeded sampling keyed by (seed, position): a seeded sampled request draws the same tokens alone,
in a batch with other requests (joining it at any step), and continued on another engine as
prompt + tokens so far, as a gateway continues a broken stream. Unseeded sampling stays random;
greedy draws nothing."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest, TokenEvent
from services.gpu_worker.engine.sampling import SamplingParams, draw_generator, request_seed
from services.gpu_worker.model.llama import LlamaModel

PROMPT = (5, 17, 3, 42, 8, 9)
MAX_TOKENS = 24
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
OTHERS = [
    GenerationRequest("greedy", (7, 7, 1, 30), SamplingParams(max_tokens=30, ignore_eos=True)),
    GenerationRequest(
        "other-seed", (99, 4), SamplingParams(max_tokens=30, temperature=0.7, seed=1, ignore_eos=True)
    ),
    GenerationRequest(
        "unseeded", (12, 13, 14), SamplingParams(max_tokens=30, temperature=1.3, top_k=50, ignore_eos=True)
    ),
]


def new_engine(tiny_llama) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    return local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=8))


def tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def run(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def alone(tiny_llama, prompt=PROMPT, params=SEEDED) -> list[int]:
    engine, events = new_engine(tiny_llama), []
    engine.submit(GenerationRequest("r", prompt, params), events.append)
    run(engine)
    return tokens(events)


def draw(seed: int, position: int) -> list[float]:
    return torch.rand(4, generator=draw_generator(seed, position)).tolist()


def test_a_draw_is_keyed_by_seed_and_position_only():
    assert draw(7, 100) == draw(7, 100)
    assert draw(7, 100) != draw(7, 101) and draw(7, 100) != draw(8, 100)
    assert draw(2**64 - 1, 2**20) == draw(2**64 - 1, 2**20)  # the whole uint64 seed range


def test_seeded_keeps_its_seed_unseeded_gets_a_random_one_greedy_none():
    assert request_seed(SEEDED) == 1234
    assert request_seed(SamplingParams()) is None
    unseeded = SamplingParams(temperature=0.8)
    assert request_seed(unseeded) != request_seed(unseeded)


def test_a_seeded_request_draws_the_same_alone_and_in_a_batch(tiny_llama):
    expected = alone(tiny_llama)
    assert len(expected) == MAX_TOKENS and len(set(expected)) > 1

    batched, events = new_engine(tiny_llama), []
    for other in OTHERS:
        batched.submit(other, lambda _: None)
    batched.submit(GenerationRequest("r", PROMPT, SEEDED), events.append)
    run(batched)
    assert tokens(events) == expected

    joining, events = new_engine(tiny_llama), []
    for other in OTHERS:
        joining.submit(other, lambda _: None)
    for _ in range(5):  # the others are decoding when it arrives: it prefills beside them
        joining.step()
    joining.submit(GenerationRequest("r", PROMPT, SEEDED), events.append)
    run(joining)
    assert tokens(events) == expected


@pytest.mark.parametrize("delivered", [1, 9, MAX_TOKENS - 1])
def test_a_seeded_request_continued_as_prompt_plus_tokens_draws_the_rest_unchanged(tiny_llama, delivered):
    """What a gateway does when a stream broke: the same request, its prompt extended by the
    tokens delivered, ``max_tokens`` reduced by them, on an engine that never saw it."""
    expected = alone(tiny_llama)
    rest_params = SamplingParams(
        max_tokens=MAX_TOKENS - delivered, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True
    )
    rest = alone(tiny_llama, PROMPT + tuple(expected[:delivered]), rest_params)
    assert expected[:delivered] + rest == expected


def test_another_seed_draws_other_tokens(tiny_llama):
    other = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=4321, ignore_eos=True)
    assert alone(tiny_llama, params=other) != alone(tiny_llama)
