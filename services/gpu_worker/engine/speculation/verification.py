"""The end of a step with drafts: every row drawn as if no draft had been made, the longest
prefix of each request's drafts that equals its draws accepted, and the one draw after it.

Lossless by construction. A request's row ``j`` holds the logits of its context followed by its
first ``j`` drafts; when those drafts are the tokens it would have drawn, they are the logits its
``j``-th next token would have been drawn from without speculation (the same numbers, up to the
float rounding of a longer matmul; in fp32 and under ``--deterministic`` the same tokens). Each
row is drawn exactly as the plain step draws: the same penalties over the history it would have
had, and a seeded request's draw keyed by its seed and that token's position
(``sampling.draw_generator``), never by the draws before it. So a draft is accepted only when it
equals the token that position would have drawn, and the output is token for token the output
without speculation, greedy or seeded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from services.gpu_worker.engine.request import EngineRequest, FinishReason, RequestState
from services.gpu_worker.engine.request_scheduler import RequestScheduler
from services.gpu_worker.engine.sampling import History, draw_generator, sample_batch
from services.gpu_worker.engine.speculation.speculator import Speculator
from services.gpu_worker.engine.structured_output import StepMasks


def verify_and_emit(
    batch: list[EngineRequest],
    logits: torch.Tensor,
    masks: StepMasks | None,
    scheduler: RequestScheduler,
    speculator: Speculator,
    now: float,
    on_logits: Callable[[str, torch.Tensor], None] | None = None,
) -> None:
    """Draw every row of ``logits`` (``1 + len(drafts)`` float32 rows per request, in batch
    order), accept each request's drafts up to its first miss and emit its accepted tokens and
    the draw after them. A constrained request (no drafts) whose grammar refuses its token ends
    with an error. ``on_logits`` sees the raw row of each emitted token."""
    firsts = list(itertools.accumulate((1 + len(r.drafts) for r in batch), initial=0))
    drawn_from = logits
    if masks is not None:  # constrained requests draft nothing: their one row is their first
        first_rows = torch.tensor(firsts[:-1], device=logits.device)
        drawn_from = logits.clone()
        drawn_from[first_rows] = masks.apply(logits[first_rows])
    rows = [(request, j) for request in batch for j in range(1 + len(request.drafts))]
    draws = sample_batch(
        drawn_from,
        [request.spec.sampling for request, _ in rows],
        lambda i: _history(*rows[i]),
        [None if r.seed is None else draw_generator(r.seed, r.total_len + j) for r, j in rows],
    )
    for request, first in zip(batch, firsts):
        drafts = request.drafts
        drawn = draws[first : first + 1 + len(drafts)]
        accepted = next((j for j, (d, t) in enumerate(zip(drafts, drawn)) if d != t), len(drafts))
        speculator.verified(request, accepted)
        for j, token in enumerate(drawn[: accepted + 1]):
            row = logits[first + j]
            if on_logits is not None:
                on_logits(request.request_id, row)
            if request.grammar is not None and not request.grammar.accept(token):
                scheduler.finish(
                    request, FinishReason.ERROR, None, f"structured_output: {request.grammar.error}"
                )
                break
            scheduler.emit([request], [token], row[None], now)
            if request.state is RequestState.FINISHED:
                break


def _history(request: EngineRequest, j: int) -> History:
    """What the penalties of ``request``'s row ``j`` read: its prompt and output as they would be
    when that token is drawn, its first ``j`` drafts accepted."""
    spec = request.spec
    return spec.original_prompt_ids, [*spec.resumed_ids, *request.output_ids, *request.drafts[:j]]
