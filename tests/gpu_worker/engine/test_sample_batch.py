"""Batched sampling picks exactly what per-request sampling picks, in a batch mixing plain greedy
rows (one shared argmax) with penalised and sampled rows (each through ``sample_token``)."""

from __future__ import annotations

import torch

from services.gpu_worker.engine.sampling import SamplingParams, draw_generator, sample_batch, sample_token

PARAMS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(temperature=0.8, top_k=5, seed=3),
    SamplingParams(),
    SamplingParams(temperature=1.2, top_p=0.5, seed=4),
    SamplingParams(repetition_penalty=0.7),
]


def generator(params: SamplingParams) -> torch.Generator | None:
    """The generator of a draw at position 9 of a request with ``params`` (None: greedy)."""
    return None if params.greedy else draw_generator(params.seed, 9)


def test_sample_batch_equals_sample_token_row_by_row() -> None:
    logits = torch.randn(len(PARAMS), 97, generator=torch.Generator().manual_seed(0))
    seen = [torch.tensor([i, 2 * i + 1, 40]) for i in range(len(PARAMS))]
    asked: list[int] = []

    def history(i: int) -> torch.Tensor:
        asked.append(i)
        return seen[i]

    batched = sample_batch(logits, PARAMS, history, [generator(p) for p in PARAMS])
    one_by_one = [
        sample_token(row, p, seen[i] if p.repetition_penalty != 1.0 else torch.empty(0, dtype=torch.int64), g)
        for i, (row, p, g) in enumerate(zip(logits, PARAMS, [generator(p) for p in PARAMS]))
    ]
    assert batched == one_by_one
    assert sorted(asked) == [1, 5], "history is built only for rows with a repetition penalty"


def test_all_greedy_batch_is_one_argmax() -> None:
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(1))
    tokens = sample_batch(logits, [SamplingParams()] * 4, lambda i: torch.empty(0), [None] * 4)
    assert tokens == logits.argmax(dim=-1).tolist()
