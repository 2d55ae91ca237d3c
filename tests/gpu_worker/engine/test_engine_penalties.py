"""Penalties in the engine: a request with a frequency penalty, batched with plain greedy requests,
leaves their tokens as they are, and picks at every step the argmax of its own raw logits less
the penalty over its output so far (not its prompt)."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest, TokenEvent
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.sampling.request_validation import InvalidField

MAX_TOKENS = 16
PLAIN = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
PENALISED = SamplingParams(
    max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=2.0, presence_penalty=0.5
)
PROMPTS = {"a": (5, 6, 7, 8), "b": (40, 41, 40, 41, 40), "p": (9, 9, 9, 3, 100)}


def run(tiny_llama, penalised: SamplingParams) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Tokens and raw logits of ``a`` and ``b`` (plain greedy) and ``p`` (``penalised``), batched."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    rows: dict[str, list[torch.Tensor]] = {}
    engine = local_engine(
        model,
        EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=8),
        on_logits=lambda rid, row: rows.setdefault(rid, []).append(row.float().clone()),
    )
    tokens: dict[str, list[int]] = {}

    def sink(event: TokenEvent) -> None:
        if event.token_id is not None:
            tokens.setdefault(event.request_id, []).append(event.token_id)

    for rid, prompt in PROMPTS.items():
        engine.submit(GenerationRequest(rid, prompt, penalised if rid == "p" else PLAIN), sink)
    while engine.has_work():
        engine.step()
    return tokens, rows


def test_a_penalised_request_does_not_change_its_plain_neighbours(tiny_llama):
    plain, _ = run(tiny_llama, PLAIN)
    mixed, rows = run(tiny_llama, PENALISED)
    assert mixed["a"] == plain["a"] and mixed["b"] == plain["b"]
    assert mixed["p"] != plain["p"], "the penalty changes the penalised request's own tokens"
    assert len(set(plain["p"])) < MAX_TOKENS, "unpenalised, the tiny model repeats itself"

    for step, (row, token) in enumerate(zip(rows["p"], mixed["p"], strict=True)):
        expected = row.clone()
        so_far = mixed["p"][:step]  # its output so far; its prompt's repeats are not counted
        for t in set(so_far):
            expected[t] -= 2.0 * so_far.count(t) + 0.5
        assert token == int(expected.argmax()), f"step {step}"


def test_a_logit_bias_outside_the_vocabulary_is_refused_by_name_one_inside_forces_its_token(tiny_llama):
    engine = local_engine(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), EngineConfig(pool_mib=4)
    )
    vocab = tiny_llama.config.vocab_size
    outside = GenerationRequest("r", (1, 2), SamplingParams(logit_bias=((vocab, 1.0),)))
    with pytest.raises(InvalidField, match=rf"logit_bias token ids must be within \[0, {vocab}\)") as caught:
        engine.submit(outside, lambda event: None)
    assert caught.value.field == "logit_bias" and not engine.has_work()

    events: list[TokenEvent] = []
    forced = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=((vocab - 1, 100.0),))
    engine.submit(GenerationRequest("forced", (1, 2), forced), events.append)
    while engine.has_work():
        engine.step()
    assert [e.token_id for e in events if e.token_id is not None] == [vocab - 1] * 3
