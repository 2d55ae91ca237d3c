"""The per-request sampler (pure torch, no engine state) over :class:`SamplingParams`.

A sampled draw's randomness is keyed by the request's seed and the position of the token drawn
(its index in prompt + output), never by the draws before it or the batch it runs in: every
draw gets a generator of its own, seeded with a hash of both (:func:`draw_generator`). So,
given the same logits, a seeded request draws the same tokens alone or in any batch, after a
preemption (recomputed), and when a gateway continues it elsewhere as prompt + tokens so far,
the worker there knowing nothing of the tokens before. The draw itself runs on the CPU, so the random stream does not
depend on the device the logits are on.

A row's logits go through, in vLLM's order: ``logit_bias`` (added); the repetition penalty
(HF's, over prompt + output); the presence and frequency penalties (OpenAI's, over the output
only); then greedy ``argmax``, or temperature, min-p, top-k and top-p before the draw.
The output a penalty counts is what this worker generated: a request continued elsewhere as
prompt + tokens so far counts those tokens as prompt.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from services.runtime.sampling.sampling_params import SamplingParams

History: TypeAlias = tuple[Sequence[int], Sequence[int]]
"""A request's (prompt ids, output ids), as the penalties read them."""
NO_HISTORY: History = ((), ())


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the most likely tokens at its step."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    """(token id, log-probability), most likely first."""


def request_seed(params: SamplingParams) -> int | None:
    """What a request's draws are keyed by: its own seed, a random one when it samples without
    one (its output stays random), None when it is greedy (nothing is drawn)."""
    if params.greedy:
        return None
    return params.seed if params.seed is not None else secrets.randbits(64)


def draw_generator(seed: int, position: int) -> torch.Generator:
    """The random stream of one draw: the token at ``position`` (its index in prompt + output)
    of a request keyed by ``seed``. A hash of both seeds it, so neighbouring seeds or positions
    give unrelated streams."""
    key = seed.to_bytes(8, "little") + position.to_bytes(8, "little")
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF semantics: positive logits of seen tokens divided by the penalty, negative multiplied."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """OpenAI's ``logit_bias``: each (token id, bias) pair's bias added to that token's logit."""
    if not bias:
        return logits
    ids = torch.tensor([token for token, _ in bias], dtype=torch.int64, device=logits.device)
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(0, ids, values)


def apply_output_penalties(
    logits: torch.Tensor, output_ids: Sequence[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's (and vLLM's) penalties over the output tokens: a token generated ``c > 0`` times
    so far loses ``frequency * c + presence`` from its logit."""
    if (presence == 0.0 and frequency == 0.0) or not output_ids:
        return logits
    ids, counts = torch.unique(torch.tensor(output_ids, dtype=torch.int64), return_counts=True)
    penalty = (frequency * counts.to(logits.dtype) + presence).to(logits.device)
    return logits.index_add(0, ids.to(logits.device), penalty, alpha=-1)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """``logit_bias``, then the repetition penalty (prompt + output), then the presence and
    frequency penalties (output only): what :func:`sample_token` samples from."""
    prompt_ids, output_ids = history
    logits = apply_logit_bias(logits, params.logit_bias)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_ids, *output_ids}), dtype=torch.int64, device=logits.device)
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return apply_output_penalties(logits, output_ids, params.presence_penalty, params.frequency_penalty)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, history: History, generator: torch.Generator | None
) -> int:
    """Pick the next token from one request's float32 logits ``[vocab]``, ``history`` its
    (prompt ids, output ids) so far (read only when it has a penalty)."""
    logits = apply_penalties(logits, params, history)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = sampling_probs(logits, params).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a sampled (not greedy) row draws from, given its penalised logits: the softmax after
    temperature, min-p, top-k and top-p, in vLLM's (v1) order. min-p drops the tokens less likely
    than ``min_p`` times the likeliest; top-p then reads the mass of what is left."""
    logits = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) > params.top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    return torch.softmax(logits, dim=-1)


def reads_history(params: SamplingParams) -> bool:
    """Its penalties read its prompt or output ids."""
    return params.repetition_penalty != 1.0 or params.penalizes_output


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    history: Callable[[int], History],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """The next token of every row of ``logits`` ``[R, vocab]`` (float32), row ``i`` sampled with
    ``params[i]``, ``history(i)`` (its prompt and output ids, asked for only when it has a
    penalty: :func:`reads_history`) and ``generators[i]`` (its draw's :func:`draw_generator`;
    None when greedy). Plain greedy rows (no penalty, no bias) share one ``argmax`` call: the
    same result as :func:`sample_token` row by row, without a torch call per request."""
    plain = [i for i, p in enumerate(params) if p.greedy and not p.logit_bias and not reads_history(p)]
    if len(plain) == len(params):
        return logits.argmax(dim=-1).tolist()
    tokens = [0] * len(params)
    if plain:
        for i, token in zip(plain, logits[plain].argmax(dim=-1).tolist()):
            tokens[i] = token
    for i in sorted(set(range(len(params))) - set(plain)):
        so_far = history(i) if reads_history(params[i]) else NO_HISTORY
        tokens[i] = sample_token(logits[i], params[i], so_far, generators[i])
    return tokens


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits`` (one row, the model's raw output: before
    temperature, top-k/p and penalties, as OpenAI reports them) and the ``top`` most likely."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return TokenLogprobs(float(logprobs[token]), alternatives)
