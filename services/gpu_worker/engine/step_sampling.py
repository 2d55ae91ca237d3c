"""The end of a step: each request's next token drawn from its logits (masked by its grammar),
accepted by its grammar, and handed to the scheduler to emit."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.gpu_worker.engine.request import EngineRequest, FinishReason
from services.gpu_worker.engine.request_scheduler import RequestScheduler
from services.gpu_worker.engine.sampling import sample_batch
from services.gpu_worker.engine.structured_output import StepMasks


def sample_and_emit(
    batch: list[EngineRequest],
    logits: torch.Tensor,
    masks: StepMasks | None,
    scheduler: RequestScheduler,
    now: float,
    on_logits: Callable[[str, torch.Tensor], None] | None = None,
) -> None:
    """Draw and emit ``batch``'s tokens (``logits``: one float32 row per request); a request whose
    grammar allows no token at all ends with an error. ``on_logits`` sees each raw row first."""
    if on_logits is not None:
        for request, row in zip(batch, logits):
            on_logits(request.request_id, row)
    tokens = sample_batch(
        logits if masks is None else masks.apply(logits),
        [r.spec.sampling for r in batch],
        lambda i: (batch[i].spec.original_prompt_ids, [*batch[i].spec.resumed_ids, *batch[i].output_ids]),
        [r.next_draw_generator() for r in batch],
    )
    kept = [
        i for i, (r, token) in enumerate(zip(batch, tokens)) if r.grammar is None or r.grammar.accept(token)
    ]
    if len(kept) < len(batch):
        for request in (r for i, r in enumerate(batch) if i not in kept):
            scheduler.finish(request, FinishReason.ERROR, None, f"structured_output: {request.grammar.error}")
        batch, tokens, logits = [batch[i] for i in kept], [tokens[i] for i in kept], logits[kept]
    # Logprobs are of the raw logits, as without a grammar (OpenAI's semantics).
    scheduler.emit(batch, tokens, logits, now)
