"""PetS coordinated batching for prefill (seed 002, Algorithms 1 and 2; SEED-SPECS §4).

Prompts wait to be prefilled; a step's cost is α(N, L) for the shared (base) ops of N prompts
padded to length L plus, per adapter (PetS's "task"), β(n, l) for its n prompts of length up to
l. Two dynamic programs choose how to split the queue into steps:
1. per adapter, its prompts sorted by length are cut into mini-batches minimising Σ β;
2. the mini-batches, sorted by their longest prompt, are grouped into macro-batches (steps)
   minimising Σ α (each macro-batch pads to its longest prompt).
The plan admits the first macro-batch this step (the one of shortest prompts); the rest wait.

α and β come from the online step cost model: α(N, L) = fixed + per_prefill_token·N·L (padded
tokens) and β(n, l) = per_adapter + lora_token_share·per_prefill_token·n·l. That is PetS's
padded model; our engine packs prompts without padding, which the benchmark weighs against
greedy FCFS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.gpu_worker.engine.policies.batch_policy import BatchPlan, BatchView, QueuedRequest, StepOutcome
from services.gpu_worker.engine.policies.linear_cost import OnlineFit
from services.gpu_worker.engine.policies.step_cost_model import step_cost_model

Cost = Callable[[int, int], float]
"""(prompts, padded length) -> seconds."""


@dataclass(frozen=True)
class MiniBatch:
    """Prompts of one adapter prefilled together."""

    adapter_id: str | None
    requests: tuple[QueuedRequest, ...]

    @property
    def max_len(self) -> int:
        return max(r.prefill_tokens for r in self.requests)


def split_by_cost(
    lengths: Sequence[int], cost: Cost, sizes: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Cut items sorted by ``lengths`` (ascending) into contiguous groups [start, end) minimising
    Σ cost(prompts in group, longest in group), where item k holds ``sizes[k]`` prompts (1 each
    by default): ``state[i] = min_j state[j] + cost(prompts of j..i−1, lengths[i−1])``."""
    n = len(lengths)
    prefix = [0]
    for size in sizes if sizes is not None else [1] * n:
        prefix.append(prefix[-1] + size)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):
            total = best[j] + cost(prefix[i] - prefix[j], lengths[i - 1])
            if total < best[i]:
                best[i], cut[i] = total, j
    groups = []
    i = n
    while i:
        groups.append((cut[i], i))
        i = cut[i]
    return groups[::-1]


def coordinated_batches(waiting: Sequence[QueuedRequest], alpha: Cost, beta: Cost) -> list[list[MiniBatch]]:
    """PetS's two-level DP: macro-batches (steps) of per-adapter mini-batches, shortest first."""
    by_adapter: dict[str | None, list[QueuedRequest]] = {}
    for request in waiting:
        by_adapter.setdefault(request.adapter_id, []).append(request)
    minis: list[MiniBatch] = []
    for adapter_id, requests in by_adapter.items():
        requests = sorted(requests, key=lambda r: (r.prefill_tokens, r.arrived_s))
        for start, end in split_by_cost([r.prefill_tokens for r in requests], beta):
            minis.append(MiniBatch(adapter_id, tuple(requests[start:end])))
    minis.sort(key=lambda m: (m.max_len, min(r.arrived_s for r in m.requests)))
    groups = split_by_cost([m.max_len for m in minis], alpha, [len(m.requests) for m in minis])
    return [minis[start:end] for start, end in groups]


@dataclass(frozen=True)
class PetsPrefillConfig:
    """The β model's one knob."""

    lora_token_share: float = 0.39
    """Cost of the LoRA delta per padded token, as a share of the base's (dLoRA measures
    BAx at 38.9% of Wx; SEED-SPECS §2)."""

    def __post_init__(self) -> None:
        if self.lora_token_share < 0:
            raise ValueError(f"lora_token_share must be >= 0, got {self.lora_token_share}")


class PetsPrefill:
    """Admit the first macro-batch of PetS's coordinated batching; decodes keep stepping."""

    name = "pets"

    def __init__(
        self, config: PetsPrefillConfig = PetsPrefillConfig(), cost: OnlineFit[StepOutcome] | None = None
    ):
        self.config = config
        self.cost = cost or step_cost_model()

    def alpha(self, prompts: int, padded_len: int) -> float:
        c = self.cost.cost
        return c["fixed"] + c["per_prefill_token"] * prompts * padded_len

    def beta(self, prompts: int, padded_len: int) -> float:
        c = self.cost.cost
        return c["per_adapter"] + self.config.lora_token_share * c["per_prefill_token"] * prompts * padded_len

    def plan(self, view: BatchView) -> BatchPlan:
        started = [r for r in view.waiting if r.started]
        fresh = [r for r in view.waiting if not r.started]
        steps = coordinated_batches(fresh, self.alpha, self.beta)
        first = [r for mini in steps[0] for r in mini.requests] if steps else []
        return BatchPlan(
            run=tuple(r.request_id for r in view.running)
            + tuple(r.request_id for r in started)
            + tuple(r.request_id for r in first)
        )

    def observe(self, outcome: StepOutcome) -> None:
        self.cost.observe(outcome)

    def decisions(self) -> dict[str, float]:
        return {}
