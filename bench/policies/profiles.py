"""The sizes of one run of the batch-policy suite: ``quick`` (a smoke run) and ``full`` (the
figures of bench/HISTORY.md). Both are scaled down from the papers' settings (shorter outputs,
a few dozen requests per run) so the whole suite fits in a quarter of an hour on two shared CPU
cores. Traces are sized in requests, not seconds: the offered rate is a share of the capacity
measured at the start, so a run holds the same number of requests on a fast or a busy machine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyBenchProfile:
    """Every knob of the suite."""

    name: str
    seed: int = 0
    """Seed of every trace and prompt."""
    max_batch: int = 8
    """Requests running together at most (dLoRA's skew sweep uses 8)."""
    pool_mib: float = 256
    """The engine's unified pool, except in the clustering experiment."""
    input_range: tuple[int, int] = (16, 32)
    """Prompt lengths of the decode experiments, inclusive."""
    output_range: tuple[int, int] = (8, 12)
    """Output lengths of the decode experiments, inclusive (the papers use 64-128; scaled down)."""
    probe_rounds: int = 2
    """Paired rounds of the LoRA-cost and merge-time probes (medians are reported)."""
    calibration_requests: int = 12
    """Requests of the closed backlog that measures capacity (requests per second)."""
    skew_top_shares: tuple[float, ...] = (0.125, 0.5, 0.9)
    """dLoRA sweep: share of requests for the top adapter (0.125 = uniform over 8)."""
    skew_adapters: int = 8
    skew_load: float = 0.7
    """Offered load as a share of the measured capacity (scaled by the output lengths' ratio)."""
    skew_output_range: tuple[int, int] = (16, 24)
    """Output lengths of the skew sweep, longer than the others': a merged run must last long
    enough to pay for its switch, and Algorithm 2 needs whole periods within a run."""
    skew_requests: int = 10
    """Requests per run (expected: the trace lasts this many over the offered rate)."""
    abort_cvs: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    abort_adapters: int = 8
    abort_load: float = 1.5
    """Offered load of the abort experiment, above capacity (S-LoRA's setting)."""
    abort_requests: int = 32
    abort_slo_factor: float = 10.0
    """First-token SLO = this × the median first-token latency at low load."""
    low_load: float = 0.3
    """Offered load of the run that measures the low-load first-token latency."""
    low_load_requests: int = 5
    cluster_caps: tuple[int, ...] = (1, 2)
    """Adapter clustering caps C; FCFS is C = ∞."""
    cluster_adapters: int = 32
    cluster_alpha: float = 1.0
    """Zipf exponent of the 32 adapters' popularity."""
    cluster_load: float = 0.9
    cluster_requests: int = 12
    cluster_pool_mib: float = 48
    """A tight pool: about ten rank-8 adapters besides the running requests' KV."""
    cluster_max_batch: int = 16
    pets_sigmas: tuple[float, ...] = (1.0, 8.0)
    """Standard deviations of the prompt lengths ~ N(pets_mean_len, σ)."""
    pets_mean_len: int = 32
    pets_tasks: int = 32
    pets_prompts: int = 48
    """Prompts queued at once (each asks for one output token: prefill only)."""
    pets_max_batch: int = 32
    drain_s: float = 5.0
    """Seconds a run's window adds to the trace and to the time its requests would take as one
    backlog at the measured capacity (so a system that keeps up finishes every request)."""


PROFILES = {
    "quick": PolicyBenchProfile(
        name="quick",
        output_range=(8, 12),
        probe_rounds=1,
        calibration_requests=8,
        skew_top_shares=(0.125, 0.9),
        skew_requests=8,
        skew_output_range=(8, 12),
        abort_cvs=(4.0,),
        abort_requests=12,
        low_load_requests=4,
        cluster_caps=(1,),
        cluster_requests=10,
        pets_sigmas=(4.0,),
        pets_prompts=32,
    ),
    "full": PolicyBenchProfile(name="full"),
}
