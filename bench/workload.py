"""Synthetic request traces as S-LoRA builds them (§7), and replay of recorded traces.

For ``n`` adapters the requests of adapter ``i`` (1-based) form a Gamma arrival process with mean
rate ``λ_i`` and coefficient of variation ``cv``; the rates follow a power law with exponent
``α`` and add up to the total rate ``R``::

    λ_i = R · i^(-α) / Σ_j j^(-α)
    inter-arrival times of adapter i ~ Gamma(shape = 1/cv², scale = cv² / λ_i)

(mean 1/λ_i, standard deviation cv/λ_i; cv = 1 is Poisson, larger is burstier). Each process
starts ``WARMUP_GAPS`` mean gaps before the trace, so the trace sees it in its steady state: started
at 0, a bursty (cv > 1) process would put a burst of every adapter's first arrivals at the very
start (with cv = 4, a 15 s trace at R = 2 got 442 requests instead of ≈30). Input and output
lengths are drawn from U[Il, Iu] and U[Ol, Ou], ranks are given to adapters round-robin from a
list, and the trace lasts ``duration_s``. The same spec and seed always give the same trace.

    python -m bench.workload --adapters 100 --alpha 1 --rate 2 --cv 1 --duration 300 --out trace.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

WARMUP_GAPS = 20
"""Mean inter-arrival gaps each adapter's process runs before the trace starts."""


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of a synthetic trace (S-LoRA Table 2 names them n, α, R, cv, I, O)."""

    adapters: int = 100
    """n: number of adapters."""
    alpha: float = 1.0
    """α: power-law exponent of the adapters' request rates (larger: more skewed)."""
    rate: float = 2.0
    """R: total requests per second over all adapters."""
    cv: float = 1.0
    """Coefficient of variation of each adapter's inter-arrival times."""
    input_range: tuple[int, int] = (8, 256)
    """[Il, Iu]: prompt lengths in tokens, inclusive."""
    output_range: tuple[int, int] = (8, 128)
    """[Ol, Ou]: output lengths in tokens, inclusive."""
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    """Ranks given to adapters round-robin."""
    duration_s: float = 300.0
    """Length of the trace."""
    seed: int = 0


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    time_s: float
    """Arrival time since the start of the trace."""
    adapter: int
    """Adapter index, 0-based; index 0 is the most popular."""
    rank: int
    input_len: int
    output_len: int
    request_id: str = field(default="")


def adapter_rates(spec: WorkloadSpec) -> np.ndarray:
    """``λ_i`` for every adapter, most popular first; they add up to ``spec.rate``."""
    weights = np.arange(1, spec.adapters + 1, dtype=np.float64) ** -spec.alpha
    return spec.rate * weights / weights.sum()


def generate(spec: WorkloadSpec) -> list[TraceRequest]:
    """The trace, sorted by arrival time."""
    if spec.adapters < 1 or spec.rate <= 0 or spec.cv <= 0 or spec.duration_s <= 0:
        raise ValueError(f"adapters, rate, cv and duration must be positive: {spec}")
    rng = np.random.default_rng(spec.seed)
    shape = 1.0 / spec.cv**2
    arrivals: list[tuple[float, int]] = []
    for adapter, rate in enumerate(adapter_rates(spec)):
        scale = spec.cv**2 / rate
        warmup = WARMUP_GAPS / rate
        expected = rate * (warmup + spec.duration_s)
        # Draw in chunks until the process passes the end of the trace.
        t, times = -warmup, []
        while t < spec.duration_s:
            gaps = rng.gamma(shape, scale, size=max(16, int(expected * 1.5) + 16))
            stamps = t + np.cumsum(gaps)
            times.extend(stamps[(stamps >= 0) & (stamps < spec.duration_s)].tolist())
            t = float(stamps[-1])
        arrivals.extend((time, adapter) for time in times)
    arrivals.sort()
    inputs = rng.integers(spec.input_range[0], spec.input_range[1] + 1, size=len(arrivals))
    outputs = rng.integers(spec.output_range[0], spec.output_range[1] + 1, size=len(arrivals))
    return [
        TraceRequest(
            time_s=round(time, 6),
            adapter=adapter,
            rank=spec.ranks[adapter % len(spec.ranks)],
            input_len=int(inputs[i]),
            output_len=int(outputs[i]),
            request_id=f"req-{i:06d}",
        )
        for i, (time, adapter) in enumerate(arrivals)
    ]


def generate_shared_arrivals(spec: WorkloadSpec) -> list[TraceRequest]:
    """A trace whose arrivals and lengths do not depend on ``n`` or ``α``: one process for all
    adapters, each request's adapter drawn on its own from the power law.

    :func:`generate` gives each adapter its own process, so two specs that differ only in ``n``
    offer different requests (the quick profile's n-sweep offered 71 requests at n = 10 and 84
    at n = 2,000 over the same 20 s): a throughput ratio between them mixes the load with the
    adapters. Here the arrival times come from one Gamma process of rate ``R`` and coefficient of
    variation ``cv`` (started ``WARMUP_GAPS`` gaps early, like each of :func:`generate`'s), the
    lengths from U[Il, Iu] and U[Ol, Ou], all from one random stream seeded by ``seed`` alone;
    request ``k``'s adapter is the power law's inverse CDF at the ``k``-th uniform of a second
    stream, also seeded by ``seed`` alone. Two specs that differ only in ``adapters`` or ``alpha``
    therefore offer exactly the same requests (times, lengths, ids) and differ only in which
    adapter each one names; ``alpha = 0`` spreads them uniformly.

    With cv = 1 this is S-LoRA's workload in distribution: a Poisson process whose requests are
    marked independently with probabilities ``λ_i / R`` splits into independent Poisson processes
    of rates ``λ_i``. With cv ≠ 1 the burstiness is the total's, not each adapter's.
    """
    if spec.adapters < 1 or spec.rate <= 0 or spec.cv <= 0 or spec.duration_s <= 0:
        raise ValueError(f"adapters, rate, cv and duration must be positive: {spec}")
    rng = np.random.default_rng([spec.seed, 0])
    shape, scale = 1.0 / spec.cv**2, spec.cv**2 / spec.rate
    warmup = WARMUP_GAPS / spec.rate
    t, times = -warmup, []
    while t < spec.duration_s:
        size = max(16, int(spec.rate * (warmup + spec.duration_s)) + 16)
        stamps = t + np.cumsum(rng.gamma(shape, scale, size=size))
        times.extend(stamps[(stamps >= 0) & (stamps < spec.duration_s)].tolist())
        t = float(stamps[-1])
    inputs = rng.integers(spec.input_range[0], spec.input_range[1] + 1, size=len(times))
    outputs = rng.integers(spec.output_range[0], spec.output_range[1] + 1, size=len(times))
    weights = np.arange(1, spec.adapters + 1, dtype=np.float64) ** -spec.alpha
    cdf = np.cumsum(weights) / weights.sum()
    uniforms = np.random.default_rng([spec.seed, 1]).random(len(times))
    adapters = np.minimum(np.searchsorted(cdf, uniforms, side="right"), spec.adapters - 1)
    return [
        TraceRequest(
            time_s=round(time, 6),
            adapter=int(adapters[i]),
            rank=spec.ranks[int(adapters[i]) % len(spec.ranks)],
            input_len=int(inputs[i]),
            output_len=int(outputs[i]),
            request_id=f"req-{i:06d}",
        )
        for i, time in enumerate(times)
    ]


def write_jsonl(requests: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(asdict(request)) + "\n" for request in requests)


def read_jsonl(path: str | Path) -> list[TraceRequest]:
    """A recorded or generated trace, for replay with its own timestamps (sorted by time)."""
    requests = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                requests.append(
                    TraceRequest(
                        time_s=float(raw["time_s"]),
                        adapter=int(raw["adapter"]),
                        rank=int(raw.get("rank", 8)),
                        input_len=int(raw["input_len"]),
                        output_len=int(raw["output_len"]),
                        request_id=str(raw.get("request_id") or f"req-{line_number:06d}"),
                    )
                )
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}:{line_number}: not a trace request ({error})") from None
    return sorted(requests, key=lambda r: r.time_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--cv", type=float, default=1.0)
    parser.add_argument("--input-range", type=int, nargs=2, default=(8, 256))
    parser.add_argument("--output-range", type=int, nargs=2, default=(8, 128))
    parser.add_argument("--ranks", type=int, nargs="+", default=(8, 16, 32, 64))
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = WorkloadSpec(
        adapters=args.adapters, alpha=args.alpha, rate=args.rate, cv=args.cv,
        input_range=tuple(args.input_range), output_range=tuple(args.output_range),
        ranks=tuple(args.ranks), duration_s=args.duration, seed=args.seed,
    )  # fmt: skip
    requests = generate(spec)
    write_jsonl(requests, args.out)
    print(f"{len(requests)} requests over {spec.duration_s:.0f} s for {spec.adapters} adapters -> {args.out}")


if __name__ == "__main__":
    main()
