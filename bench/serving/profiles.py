"""The experiments of ``loramesh bench``: S-LoRA §7's, scaled to a CPU machine.

Every experiment is a (system, workload) pair. Three sweeps vary one workload parameter each
(number of adapters, total rate, coefficient of variation) around one default workload, as S-LoRA
Table 2 does; the comparisons with the baselines and the ablations run on the default workload
with ``comparison_adapters`` adapters. The comparison with llama.cpp's llama-server (both served
over HTTP by the same client) runs at ``peer_rate``, which saturates both, and only when its
systems are named (:data:`PEER_SYSTEMS`). Runs that are the same (system, workload) pair are done
once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.workload import WorkloadSpec

LORAMESH = "loramesh"
"""The engine in-process (b)."""
GATEWAY = "loramesh-gateway"
"""The whole mesh through the gateway (a)."""
PEFT = "peft"
"""HF transformers + peft, same-adapter batches, swap between batches (c)."""
MERGED = "merged-swap"
"""dLoRA's merged-only: merge one adapter, serve its queue, unmerge (d)."""
PADDED_BMM = "loramesh-bmm"
"""Padded bmm instead of the gather kernels (e)."""
NO_UNIFIED_POOL = "loramesh-no-unified-pool"
"""Fixed separate KV and adapter regions of the same total size (f)."""
LORAMESH_UP = "loramesh-up"
"""`loramesh up` as a user runs it, driven through the gateway's OpenAI HTTP API."""
LLAMACPP = "llamacpp"
"""llama.cpp's llama-server with every adapter loaded, each request applying its own."""
LLAMACPP_BASE = "llamacpp-base"
"""llama-server without adapters: the no-LoRA ceiling of the same server."""
PEER_SYSTEMS = (LORAMESH_UP, LLAMACPP, LLAMACPP_BASE)
"""The comparison with llama.cpp, run only when named (``--systems``): the llama.cpp systems need a
llama-server binary, and all three start whole servers."""


@dataclass(frozen=True)
class Profile:
    """One benchmark profile."""

    name: str
    """``quick`` or ``full``."""
    workload: WorkloadSpec
    """The default workload (S-LoRA Table 2's role); its rate saturates loramesh."""
    adapter_counts: tuple[int, ...]
    """n of the adapters sweep (loramesh)."""
    baseline_adapter_counts: tuple[int, ...]
    """n of the adapters sweep for the PEFT baseline."""
    ablation_adapter_counts: tuple[int, ...]
    """n of the adapters sweep for the ablations (e), (f) and (d)."""
    comparison_adapters: int
    """n of the rate and cv sweeps and of the gateway run."""
    rates: tuple[float, ...]
    """Total rates R (req/s) of the rate sweep (loramesh and PEFT)."""
    cvs: tuple[float, ...]
    """cv of the burstiness sweep (loramesh)."""
    cv_rate: float
    """R of the cv sweep: below saturation, where burstiness decides the SLO attainment."""
    drain_s: float
    """The measurement window is the trace's duration plus this."""
    slo_s: float
    """First-token SLO for attainment and user satisfaction."""
    pool_mib: float
    """The engine's unified pool (KV + adapter pages)."""
    host_cache_mib: float
    """Host RAM budget for adapters; the rest are read from disk when needed."""
    max_batch: int
    """Requests run together at most, in every system."""
    pressure_pool_mib: float | None = None
    """Also run loramesh and the no-unified-pool ablation with this smaller pool, where KV and
    adapters compete for memory (the unified pool's case); None: skip."""
    with_gateway: bool = True
    """Also run loramesh through the gateway (a) at ``comparison_adapters``."""
    peer_rate: float = 8.0
    """R of the comparison with llama.cpp at ``comparison_adapters`` (saturates both)."""


QUICK = Profile(
    name="quick",
    workload=WorkloadSpec(
        adapters=100,
        alpha=1.0,
        rate=4.0,
        cv=1.0,
        input_range=(8, 64),
        output_range=(8, 64),
        ranks=(8, 16),
        duration_s=20.0,
        seed=0,
    ),
    adapter_counts=(10, 100, 2000),
    baseline_adapter_counts=(100,),
    ablation_adapter_counts=(100,),
    comparison_adapters=100,
    rates=(1.0, 2.0, 4.0),
    cvs=(1.0, 4.0),
    cv_rate=2.0,
    drain_s=10.0,
    slo_s=6.0,
    pool_mib=256,
    host_cache_mib=48,
    max_batch=32,
    pressure_pool_mib=128,
)

FULL = replace(
    QUICK,
    name="full",
    workload=replace(QUICK.workload, duration_s=60.0),
    adapter_counts=(1, 10, 100, 500, 1000, 2000),
    baseline_adapter_counts=(1, 10, 100),
    ablation_adapter_counts=(1, 10, 100, 1000),
    rates=(0.5, 1.0, 2.0, 3.0, 4.0),
    cvs=(1.0, 2.0, 4.0, 8.0),
    drain_s=20.0,
)
"""QUICK's settings over longer traces, more adapter counts, rates and cvs."""

PROFILES = {p.name: p for p in (QUICK, FULL)}


@dataclass(frozen=True)
class Experiment:
    """One run: a system on a workload, and the sweeps it belongs to."""

    system: str
    workload: WorkloadSpec
    sweeps: tuple[str, ...]
    """Which plots/tables use it: ``adapters``, ``rate``, ``cv``, ``comparison``, ``ablation``,
    ``pressure``, ``llamacpp``."""
    pool_mib: float | None = None
    """The engine's pool for this run; None: the profile's."""

    @property
    def key(self) -> str:
        w = self.workload
        pool = f" pool={self.pool_mib:g}MiB" if self.pool_mib is not None else ""
        return f"{self.system} n={w.adapters} R={w.rate:g} cv={w.cv:g}{pool}"


def experiments(profile: Profile) -> list[Experiment]:
    """The profile's runs, each (system, workload) once, sweeps merged."""
    base = profile.workload
    planned: list[tuple[str, WorkloadSpec, str, float | None]] = []
    planned += [(LORAMESH, replace(base, adapters=n), "adapters", None) for n in profile.adapter_counts]
    planned += [(PEFT, replace(base, adapters=n), "adapters", None) for n in profile.baseline_adapter_counts]
    for system in (PADDED_BMM, NO_UNIFIED_POOL, MERGED):
        planned += [
            (system, replace(base, adapters=n), "ablation", None) for n in profile.ablation_adapter_counts
        ]
    comparison = replace(base, adapters=profile.comparison_adapters)
    planned += [(system, comparison, "comparison", None) for system in (LORAMESH, PEFT)]
    if profile.with_gateway:
        planned.append((GATEWAY, comparison, "comparison", None))
    if profile.pressure_pool_mib is not None:
        planned += [
            (s, comparison, "pressure", profile.pressure_pool_mib) for s in (LORAMESH, NO_UNIFIED_POOL)
        ]
    for system in (LORAMESH, PEFT):
        planned += [(system, replace(comparison, rate=r), "rate", None) for r in profile.rates]
    planned += [
        (LORAMESH, replace(comparison, rate=profile.cv_rate, cv=cv), "cv", None) for cv in profile.cvs
    ]
    peers = replace(comparison, rate=profile.peer_rate)
    planned += [(system, peers, "llamacpp", None) for system in PEER_SYSTEMS]
    merged: dict[tuple[str, WorkloadSpec, float | None], list[str]] = {}
    for system, workload, sweep, pool in planned:
        sweeps = merged.setdefault((system, workload, pool), [])
        if sweep not in sweeps:
            sweeps.append(sweep)
    return [
        Experiment(system, workload, tuple(sweeps), pool)
        for (system, workload, pool), sweeps in merged.items()
    ]
