"""Penalties, ``logit_bias`` and ``min_p`` against a plain reference on logits (OpenAI's and
vLLM's semantics, written here with Python loops over numpy arrays, independently of the
sampler's torch code):

- ``logit_bias``: ``logits[t] += bias[t]``, first;
- repetition penalty (HF/vLLM): every token in prompt + output, ``l / p`` if ``l > 0`` else ``l * p``;
- presence and frequency penalties: every token generated ``c > 0`` times so far (the output,
  never the prompt) loses ``frequency * c + presence``;
- then temperature; min-p (tokens less likely than ``min_p`` times the likeliest are dropped);
  top-k; top-p over what is left (vLLM v1's order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.gpu_worker.engine.sampling import (
    SamplingParams,
    apply_penalties,
    draw_generator,
    sample_token,
    sampling_probs,
)

VOCAB = 64
PROMPT = (3, 3, 5, 9, 9, 9, 11)
OUTPUT = (5, 12, 12, 12, 20, 3, 12, 40)


def raw_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference_penalised(logits: np.ndarray, params: SamplingParams, prompt, output) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for token, bias in params.logit_bias:
        x[token] += bias
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            x[token] = (
                x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
            )
    counts: dict[int, int] = {}
    for token in output:
        counts[token] = counts.get(token, 0) + 1
    for token, count in counts.items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, min-p, top-k, top-p (a token is kept while the mass of the likelier ones is
    at most top_p); then the renormalised probabilities."""
    x = logits.astype(np.float64) / params.temperature
    keep = [True] * len(x)
    order = sorted(range(len(x)), key=lambda t: -x[t])
    if params.min_p > 0.0:
        total = sum(math.exp(v) for v in x)
        best = max(math.exp(v) for v in x) / total
        keep = [math.exp(v) / total >= params.min_p * best for v in x]
    if params.top_k > 0:
        for rank, token in enumerate(order):
            keep[token] = keep[token] and rank < params.top_k
    if params.top_p < 1.0:
        mass = [math.exp(x[t]) if keep[t] else 0.0 for t in range(len(x))]
        total, before = sum(mass), 0.0
        for token in order:
            if before / total > params.top_p:
                keep[token] = False
            before += mass[token]
    mass = [math.exp(x[t]) if keep[t] else 0.0 for t in range(len(x))]
    return np.array(mass) / sum(mass)


PENALTY_CASES = [
    SamplingParams(logit_bias=((0, 5.0), (7, -100.0), (63, 100.0), (12, -1.5))),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.2),
    SamplingParams(presence_penalty=-2.0),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(frequency_penalty=-1.1),
    SamplingParams(
        logit_bias=((12, 4.0), (3, -2.5), (9, 1.0)),
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=2.0,
    ),
]


@pytest.mark.parametrize("params", PENALTY_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_penalties_and_bias_match_the_reference(params, seed):
    logits = raw_logits(seed)
    got = apply_penalties(logits, params, (PROMPT, OUTPUT))
    expected = reference_penalised(logits.numpy(), params, PROMPT, OUTPUT)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-4)


def test_presence_and_frequency_read_the_output_only():
    logits = raw_logits()
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, params, (PROMPT, OUTPUT)) - logits
    assert got[9] == 0.0 and got[11] == 0.0, "prompt-only tokens are not penalised"
    assert got[12].item() == pytest.approx(-(0.25 * 4 + 0.5))  # 4 times in the output
    assert got[3].item() == pytest.approx(-(0.25 * 1 + 0.5))  # twice in the prompt, once in the output
    assert got[1] == 0.0, "a token never seen is untouched"
    unpenalised = apply_penalties(logits, params, (PROMPT, ()))
    assert torch.equal(unpenalised, logits), "no output yet: nothing to penalise"


def test_repetition_penalty_still_reads_prompt_and_output():
    logits = raw_logits()
    got = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), (PROMPT, OUTPUT))
    changed = {int(t) for t in torch.nonzero(got != logits)}
    assert changed == set(PROMPT) | set(OUTPUT)


def test_minus_100_bans_and_plus_100_forces_under_greedy():
    logits = raw_logits()
    best, worst = int(logits.argmax()), int(logits.argmin())
    history = (PROMPT, OUTPUT)
    banned = sample_token(logits, SamplingParams(logit_bias=((best, -100.0),)), history, None)
    assert banned != best and banned == int(logits.topk(2).indices[1])
    assert sample_token(logits, SamplingParams(logit_bias=((worst, 100.0),)), history, None) == worst


def test_minus_100_bans_and_plus_100_forces_when_sampling():
    logits, best, worst = raw_logits(), int(raw_logits().argmax()), int(raw_logits().argmin())
    hot = SamplingParams(temperature=1.0, seed=9)
    draws = [sample_token(logits, hot, ((), ()), draw_generator(9, i)) for i in range(300)]
    assert best in draws, "without a bias the likeliest token is drawn"
    banned = SamplingParams(temperature=1.0, seed=9, logit_bias=((best, -100.0),))
    assert best not in [sample_token(logits, banned, ((), ()), draw_generator(9, i)) for i in range(300)]
    forced = SamplingParams(temperature=1.0, seed=9, logit_bias=((worst, 100.0),))
    assert {sample_token(logits, forced, ((), ()), draw_generator(9, i)) for i in range(300)} == {worst}


def test_a_frequency_penalty_moves_greedy_off_a_repeated_token():
    logits = torch.zeros(VOCAB)
    logits[12], logits[13] = 2.0, 1.0
    history = ((), (12, 12))
    assert sample_token(logits, SamplingParams(frequency_penalty=0.4), history, None) == 12  # 2 - 0.8 > 1
    assert sample_token(logits, SamplingParams(frequency_penalty=0.6), history, None) == 13  # 2 - 1.2 < 1


SAMPLING_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, min_p=0.05),
    SamplingParams(temperature=1.5, min_p=0.3),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=2.0, top_k=10, min_p=0.2),
    SamplingParams(temperature=1.0, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("params", SAMPLING_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sampled_distribution_matches_the_reference(params, seed):
    logits = raw_logits(seed)
    got = sampling_probs(logits, params).numpy()
    expected = reference_probs(logits.numpy(), params)
    assert set(np.nonzero(got)[0]) == set(np.nonzero(expected)[0])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)


def test_min_p_draws_only_tokens_likely_enough():
    logits = raw_logits()
    params = SamplingParams(temperature=2.0, min_p=0.1, seed=4)
    probs = torch.softmax(logits / 2.0, -1)
    allowed = {int(t) for t in torch.nonzero(probs >= 0.1 * probs.max())}
    draws = {sample_token(logits, params, ((), ()), draw_generator(4, i)) for i in range(400)}
    assert draws <= allowed and len(draws) > 1
    assert len(allowed) < VOCAB // 2, "the cut drops most of the vocabulary here"


def test_min_p_cuts_before_top_p_reads_the_mass_as_vllm_does():
    """Probabilities .5, .3, .2: min_p .5 leaves .5 and .3 (.625 and .375 once renormalised), so
    top_p .6 keeps only the first (top-p first would keep two)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    probs = sampling_probs(logits, SamplingParams(temperature=1.0, min_p=0.5, top_p=0.6))
    assert probs.tolist() == [1.0, 0.0, 0.0]
    np.testing.assert_allclose(
        reference_probs(logits.numpy(), SamplingParams(temperature=1.0, min_p=0.5, top_p=0.6)),
        [1.0, 0.0, 0.0],
    )
    only_top_p = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))
    np.testing.assert_allclose(only_top_p.numpy(), [0.625, 0.375, 0.0], rtol=1e-6)
