"""A fixed mix of short and long requests, and their prompt token ids.

The same arguments always give the same requests: which ones are long is drawn once with the
seed, lengths are uniform in their ranges, and request ``i`` goes to worker ``i mod workers``
(no scheduler in the loop: the borrowing, not placement, is what is measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOKEN_ID_RANGE = (1000, 40000)
"""Prompt token ids are drawn from here: ordinary vocabulary, clear of special tokens."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    request_id: str
    """Unique within the run."""
    worker: int
    """Index of the worker it is sent to."""
    prompt_tokens: int
    """Prompt length."""
    new_tokens: int
    """Tokens to generate (EOS ignored)."""
    long: bool
    """Longer than one worker's pool."""


def long_count(long_fraction: float, count: int) -> int:
    """Long requests in a mix of ``count``: the fraction rounded, but at least one when the
    fraction is positive (a 1% mix of 60 requests still has its long request)."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be within [0, 1], got {long_fraction}")
    if long_fraction == 0.0:
        return 0
    return min(count, max(1, round(long_fraction * count)))


def make_mix(
    long_fraction: float,
    count: int,
    workers: int,
    short_range: tuple[int, int],
    long_range: tuple[int, int],
    new_tokens: int,
    seed: int,
) -> list[BenchRequest]:
    """``count`` requests, ``long_count(long_fraction, count)`` of them long, spread over
    ``workers`` round-robin."""
    if count < 1 or workers < 1:
        raise ValueError(f"need at least one request and one worker, got {count} and {workers}")
    for low, high in (short_range, long_range):
        if not 0 < low <= high:
            raise ValueError(f"a length range must satisfy 0 < low <= high, got {(low, high)}")
    rng = np.random.default_rng(seed)
    longs = set(rng.choice(count, size=long_count(long_fraction, count), replace=False).tolist())
    requests = []
    for index in range(count):
        low, high = long_range if index in longs else short_range
        requests.append(
            BenchRequest(
                request_id=f"r{index:04d}",
                worker=index % workers,
                prompt_tokens=int(rng.integers(low, high + 1)),
                new_tokens=new_tokens,
                long=index in longs,
            )
        )
    return requests


def prompt_ids(length: int, seed: int, salt: str) -> list[int]:
    """``length`` token ids, the same for the same ``(seed, salt)``: random ids cost the model
    what text costs, and no request shares a prefix with another."""
    rng = np.random.default_rng([seed, *salt.encode()])
    return rng.integers(*TOKEN_ID_RANGE, size=length).tolist()
