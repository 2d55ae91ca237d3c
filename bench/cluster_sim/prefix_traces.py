"""Prefix-sharing traces for prefix-aware placement: many adapters of a few tenants behind a few
long shared prompts (system prompts, retrieved documents).

Each tenant has ``prefixes_per_tenant`` shared prompts; every request names one adapter (power law
over all, as S-LoRA's traces; an adapter belongs to one tenant) and one of its tenant's shared
prompts (power law within the tenant), followed by a suffix of its own. A share of the adapters
are activated LoRAs (aLoRA): their prompt is the shared one, the suffix, then the invocation and a
few tokens, and everything before the invocation is base-model KV — shared with the tenant's other
aLoRA adapters. A standard adapter's whole prompt is keyed in its own key space: it shares its
prefix with its own requests only. Blocks are named by the workers' own chain keys
(:func:`services.runtime.prefix_keys.prompt_block_keys`), in the tenant's namespace.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from bench.cluster_sim.simulator import PromptTraceRequest
from bench.workload import WorkloadSpec, generate_shared_arrivals
from services.runtime.prefix_keys import adapter_key_space, prompt_block_keys

INVOCATION = (1, 2, 3)
"""The aLoRA adapters' invocation sequence (token ids no shared prompt or suffix holds)."""


@dataclass(frozen=True)
class PrefixWorkload:
    """A prefix-sharing trace."""

    arrivals: WorkloadSpec
    """Arrival process, adapters (count, power law), ranks, output lengths and seed; its
    ``input_range`` is unused (prompts are a shared prompt + a suffix)."""
    tenants: int = 8
    """Tenants, each its own cache namespace; adapter ``i`` belongs to tenant ``i % tenants``."""
    prefixes_per_tenant: int = 8
    """Shared prompts per tenant."""
    prefix_alpha: float = 1.0
    """Power-law exponent of a tenant's shared prompts' popularity."""
    prefix_range: tuple[int, int] = (256, 1024)
    """Length of a shared prompt in tokens, inclusive."""
    suffix_range: tuple[int, int] = (16, 128)
    """Length of a request's own part in tokens, inclusive."""
    alora_share: float = 0.5
    """Share of the adapters that are activated LoRAs (every ``1/alora_share``-th one)."""
    block_tokens: int = 16
    """Tokens per block (the workers' ``--kv-block-tokens``)."""


def prefix_trace(workload: PrefixWorkload) -> list[PromptTraceRequest]:
    """The trace, sorted by arrival time; ``input_len`` is each prompt's whole length."""
    spec = workload.arrivals
    rng = np.random.default_rng([spec.seed, 7])
    count = workload.tenants * workload.prefixes_per_tenant
    lengths = rng.integers(workload.prefix_range[0], workload.prefix_range[1] + 1, size=count)
    shared = [list(range(100_000 * (p + 1), 100_000 * (p + 1) + int(n))) for p, n in enumerate(lengths)]
    weights = np.arange(1, workload.prefixes_per_tenant + 1, dtype=np.float64) ** -workload.prefix_alpha
    weights /= weights.sum()
    every = round(1 / workload.alora_share) if workload.alora_share > 0 else 0
    trace = []
    for k, item in enumerate(generate_shared_arrivals(spec)):
        tenant = item.adapter % workload.tenants
        prefix = shared[tenant * workload.prefixes_per_tenant + int(rng.choice(len(weights), p=weights))]
        suffix_len = int(rng.integers(workload.suffix_range[0], workload.suffix_range[1] + 1))
        suffix = list(range(10_000_000 + 1_000 * k, 10_000_000 + 1_000 * k + suffix_len))
        alora = every > 0 and item.adapter % every == 0
        prompt = prefix + suffix + (list(INVOCATION) + suffix[:8] if alora else [])
        blocks = prompt_block_keys(
            f"tenant:t{tenant}",
            prompt,
            workload.block_tokens,
            adapter_key_space(f"a{item.adapter}", f"sha-{item.adapter}"),
            INVOCATION if alora else None,
        )
        base = replace(item, input_len=len(prompt))
        trace.append(PromptTraceRequest(**vars(base), prefix_blocks=tuple(blocks)))
    return trace
