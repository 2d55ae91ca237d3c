"""Batched sampling picks exactly what per-request sampling picks, in a batch mixing plain greedy
rows (one shared argmax) with penalised, biased and sampled rows (each through ``sample_token``)."""

from __future__ import annotations

import torch

from services.gpu_worker.engine.sampling import (
    NO_HISTORY,
    SamplingParams,
    draw_generator,
    reads_history,
    sample_batch,
    sample_token,
)

PARAMS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(temperature=0.8, top_k=5, seed=3),
    SamplingParams(),
    SamplingParams(temperature=1.2, top_p=0.5, seed=4),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(frequency_penalty=1.5),
    SamplingParams(presence_penalty=-0.5, temperature=0.9, min_p=0.1, seed=5),
    SamplingParams(logit_bias=((2, 100.0),)),
    SamplingParams(temperature=1.0, min_p=0.2, logit_bias=((7, -100.0), (8, 3.0)), seed=6),
]
PENALISED = [1, 5, 6, 7]
"""Rows whose penalties read their history (logit_bias alone does not)."""


def generator(params: SamplingParams) -> torch.Generator | None:
    """The generator of a draw at position 9 of a request with ``params`` (None: greedy)."""
    return None if params.greedy else draw_generator(params.seed, 9)


def test_sample_batch_equals_sample_token_row_by_row() -> None:
    logits = torch.randn(len(PARAMS), 97, generator=torch.Generator().manual_seed(0))
    histories = [((i, 40, 40), (2 * i + 1, 40, 3, 3, 3)) for i in range(len(PARAMS))]
    asked: list[int] = []

    def history(i: int):
        asked.append(i)
        return histories[i]

    batched = sample_batch(logits, PARAMS, history, [generator(p) for p in PARAMS])
    one_by_one = [
        sample_token(row, p, histories[i] if reads_history(p) else NO_HISTORY, g)
        for i, (row, p, g) in enumerate(zip(logits, PARAMS, [generator(p) for p in PARAMS]))
    ]
    assert batched == one_by_one
    assert batched[8] == 2, "a +100 bias forces a greedy row's token"
    assert sorted(asked) == PENALISED, "history is built only for rows with a penalty"


def test_all_greedy_batch_is_one_argmax() -> None:
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(1))
    tokens = sample_batch(logits, [SamplingParams()] * 4, lambda i: NO_HISTORY, [None] * 4)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_sampling_leaves_the_batch_logits_as_they_were() -> None:
    """Penalties and biases work on copies: the logits the engine reports (logprobs) are raw."""
    logits = torch.randn(len(PARAMS), 97, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    sample_batch(logits, PARAMS, lambda i: ((1, 2), (3, 3, 4)), [generator(p) for p in PARAMS])
    assert torch.equal(logits, before)
