"""What one engine step computes, as plain values: the contract between the engine and its executor.

The engine plans (who runs, which tokens, which KV pages and adapter rows) and samples; an
:class:`~services.gpu_worker.engine.executor.Executor` runs a :class:`StepPlan` and returns
logits. A plan holds no tensors and no engine objects, so it can be broadcast unchanged to every
rank of a tensor-parallel group, whose pools hold the same page ids and adapter placements.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class AdapterSlot:
    """Where a request's adapter is in the pool."""

    adapter_id: str
    placement: int
    """``ResidentAdapter.placement`` of the load in force: with the id it names where the rows sit
    (an adapter paged out and in again gets a new one)."""


@dataclass(frozen=True)
class PlannedRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: tuple[int, ...]
    """This step's new tokens: the context not computed yet (prefill: several; decode: one)."""
    start_position: int
    """Position of ``token_ids[0]`` (= ``EngineRequest.num_computed``)."""
    kv_blocks: tuple[tuple[int, ...], ...]
    """Its local KV: per block, one page id per layer, covering every position to the last of
    ``token_ids`` (() when borrowed)."""
    adapter: AdapterSlot | None
    """None: the base model, or the adapter merged into the base weights."""
    sampling: SamplingParams
    """How its next token is drawn (the engine samples; executors may ignore it)."""
    borrowed: bool = False
    """Its KV is in an rManager block table (DistKV-LLM borrowing): ``LocalExecutor`` only."""
    adapter_from: int = 0
    """First position ``adapter`` applies to (an activated LoRA's invocation start): its tokens
    before it get no LoRA delta; 0: all of them."""
    draft_tokens: int = 0
    """How many of the last ``token_ids`` are drafted tokens to verify (speculative decoding):
    its logits rows are those of its last ``1 + draft_tokens`` tokens, the first the row its
    next token is drawn from, each next one the row that checks one more draft."""

    @property
    def logits_rows(self) -> int:
        """Rows of the step's logits that are its: one, and one per draft."""
        return 1 + self.draft_tokens

    @property
    def end_position(self) -> int:
        """One past the position of its last new token: its context length after this step."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """One step: every request that runs in it, in the order of the returned logits' rows
    (:attr:`PlannedRequest.logits_rows` each)."""

    requests: tuple[PlannedRequest, ...]
    lora_backend: str
    """Kernel backend of the LoRA deltas (``EngineConfig.lora_backend``)."""
    batch_invariant: bool
    """Run the model's batch-invariant path (deterministic serving)."""
