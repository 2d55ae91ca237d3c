"""Failover by continuation with speculation: a gateway resumes a request on another worker by
sending its prompt and the tokens streamed so far (``resumed_output_tokens``); the continuation,
drafting (``ngram``) or not, gives the tokens the unbroken stream would have had, greedy and
seeded (tiny Llama, fp32)."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from tests.support.draft_cost import pin_draft_cost

PROMPT = tuple((5 + j % 7) * 3 for j in range(20))  # a period of 7: drafts are accepted
STREAMED = 9
"""Tokens the first worker streamed before it died."""


def generate(tiny_llama, speculative: str, request: GenerationRequest) -> tuple[list[int], int]:
    """The request's tokens on a fresh engine, and the draft tokens it accepted."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=4, speculative=speculative))
    pin_draft_cost(engine)
    tokens: list[int] = []
    engine.submit(request, lambda e: e.token_id is None or tokens.append(e.token_id))
    while engine.has_work():
        engine.step()
    accepted = 0 if engine.speculator is None else sum(engine.speculator.counts.accepted.values())
    return tokens, accepted


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.2, seed=41, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_continuation_gives_the_unbroken_streams_tokens(tiny_llama, sampling):
    unbroken, _ = generate(tiny_llama, "off", GenerationRequest("r", PROMPT, sampling))
    resumed = GenerationRequest(
        "r",
        PROMPT + tuple(unbroken[:STREAMED]),
        SamplingParams(**{**vars(sampling), "max_tokens": sampling.max_tokens - STREAMED}),
        resumed_output_tokens=STREAMED,
    )
    drafted_unbroken, accepted = generate(tiny_llama, "ngram", GenerationRequest("r", PROMPT, sampling))
    continued, accepted_after = generate(tiny_llama, "ngram", resumed)
    assert drafted_unbroken == unbroken
    assert continued == unbroken[STREAMED:]
    assert accepted > 0 and accepted_after > 0
