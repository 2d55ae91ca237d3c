"""The per-request sampler (pure torch, no engine state) over :class:`SamplingParams`.

A sampled draw's randomness is keyed by the request's seed and the position of the token drawn
(its index in prompt + output), never by the draws before it or the batch it runs in: every
draw gets a generator of its own, seeded with a hash of both (:func:`draw_generator`). So,
given the same logits, a seeded request draws the same tokens alone or in any batch, after a
preemption (recomputed), and when a gateway continues it elsewhere as prompt + tokens so far,
the worker there knowing nothing of the tokens before. The draw itself runs on the CPU, so the random stream does not
depend on the device the logits are on.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.runtime.sampling_params import SamplingParams


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


def sample_token(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, generator: torch.Generator | None
) -> int:
    """Pick the next token from one request's float32 logits ``[vocab]``."""
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) > params.top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seen: Callable[[int], torch.Tensor],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """The next token of every row of ``logits`` ``[R, vocab]`` (float32), row ``i`` sampled with
    ``params[i]``, ``seen(i)`` (its prompt + output ids, asked for only when it has a repetition
    penalty) and ``generators[i]`` (its draw's :func:`draw_generator`; None when greedy). Plain
    greedy rows (no penalty) share one ``argmax`` call: the same result as :func:`sample_token`
    row by row, without a torch call per request."""
    plain = [i for i, p in enumerate(params) if p.greedy and p.repetition_penalty == 1.0]
    if len(plain) == len(params):
        return logits.argmax(dim=-1).tolist()
    tokens = [0] * len(params)
    if plain:
        for i, token in zip(plain, logits[plain].argmax(dim=-1).tolist()):
            tokens[i] = token
    no_history = torch.empty(0, dtype=torch.int64)
    for i in sorted(set(range(len(params))) - set(plain)):
        history = seen(i) if params[i].repetition_penalty != 1.0 else no_history
        tokens[i] = sample_token(logits[i], params[i], history, generators[i])
    return tokens


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits`` (one row, the model's raw output: before
    temperature, top-k/p and penalties, as OpenAI reports them) and the ``top`` most likely."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return TokenLogprobs(float(logprobs[token]), alternatives)
