"""The suite's request traces, deterministic from the seed.

- :func:`skewed_trace`: dLoRA's skew sweep — Poisson arrivals, each request's adapter drawn with
  probability ``top_share`` for adapter 0 and the rest spread evenly over the others.
- :func:`zipf_gamma_trace`: S-LoRA's synthetic workload (power-law popularity, gamma arrivals
  with a coefficient of variation), from :mod:`bench.workload`.
- :func:`prefill_queue`: PetS's setting — every prompt queued at time 0, lengths ~ N(mean, σ)
  rounded and clipped to at least one token, tasks (adapters) round-robin, one output token each.
"""

from __future__ import annotations

import numpy as np

from bench.workload import TraceRequest, WorkloadSpec, generate

RANK = 8
"""Rank of every adapter of the suite."""


def skewed_trace(
    adapters: int,
    top_share: float,
    rate: float,
    duration_s: float,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` for ``duration_s``; adapter 0 takes ``top_share`` of them."""
    if not 1 / adapters <= top_share <= 1:
        raise ValueError(f"top_share must be in [1/{adapters}, 1], got {top_share}")
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate}, {duration_s}")
    rng = np.random.default_rng(seed)
    times: list[float] = []
    t = rng.exponential(1 / rate)
    while t < duration_s:
        times.append(t)
        t += rng.exponential(1 / rate)
    probabilities = np.full(adapters, (1 - top_share) / max(1, adapters - 1))
    probabilities[0] = top_share
    chosen = rng.choice(adapters, size=len(times), p=probabilities / probabilities.sum())
    inputs = rng.integers(input_range[0], input_range[1] + 1, size=len(times))
    outputs = rng.integers(output_range[0], output_range[1] + 1, size=len(times))
    return [
        TraceRequest(round(time, 6), int(chosen[i]), RANK, int(inputs[i]), int(outputs[i]), f"req-{i:06d}")
        for i, time in enumerate(times)
    ]


def zipf_gamma_trace(
    adapters: int,
    alpha: float,
    rate: float,
    cv: float,
    duration_s: float,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> list[TraceRequest]:
    """S-LoRA's trace with every adapter of rank :data:`RANK`."""
    spec = WorkloadSpec(
        adapters=adapters, alpha=alpha, rate=rate, cv=cv, input_range=input_range,
        output_range=output_range, ranks=(RANK,), duration_s=duration_s, seed=seed,
    )  # fmt: skip
    return generate(spec)


def prefill_queue(tasks: int, prompts: int, mean_len: int, sigma: float, seed: int) -> list[TraceRequest]:
    """``prompts`` requests at time 0, task ``i % tasks``, lengths ~ N(mean_len, sigma)."""
    if tasks < 1 or prompts < 1 or mean_len < 1 or sigma < 0:
        raise ValueError(
            f"need tasks, prompts, mean_len >= 1 and sigma >= 0: {tasks}, {prompts}, {mean_len}, {sigma}"
        )
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, np.rint(rng.normal(mean_len, sigma, size=prompts))).astype(int)
    return [
        TraceRequest(0.0, i % tasks, RANK, int(length), 1, f"req-{i:06d}") for i, length in enumerate(lengths)
    ]


def backlog_trace(
    adapters: int, requests: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> list[TraceRequest]:
    """``requests`` requests queued at time 0, adapters round-robin (a closed backlog)."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(input_range[0], input_range[1] + 1, size=requests)
    outputs = rng.integers(output_range[0], output_range[1] + 1, size=requests)
    return [
        TraceRequest(0.0, i % adapters, RANK, int(inputs[i]), int(outputs[i]), f"req-{i:06d}")
        for i in range(requests)
    ]
