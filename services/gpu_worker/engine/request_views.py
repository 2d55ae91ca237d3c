"""Requests as the batch and preemption policies see them: plain values, no engine objects."""

from __future__ import annotations

from services.gpu_worker.engine.policies.batch_policy import QueuedRequest, RunningRequest
from services.gpu_worker.engine.request import EngineRequest


def tokens_left(request: EngineRequest, max_positions: int) -> int:
    """Tokens ``request`` may still generate (``max_tokens`` or the context ends it first)."""
    by_max_tokens = request.spec.sampling.max_tokens - len(request.output_ids)
    by_context = max_positions - request.total_len
    return max(1, min(by_max_tokens, by_context))


def queued_view(request: EngineRequest, max_positions: int) -> QueuedRequest:
    return QueuedRequest(
        request.request_id,
        request.spec.adapter_id,
        request.timings.arrived,
        request.total_len,
        started=request.timings.first_token is not None,
        predicted_output_tokens=request.spec.predicted_output_tokens,
        max_new_tokens=tokens_left(request, max_positions),
        first_token_deadline_s=request.spec.first_token_deadline_s,
    )


def running_view(request: EngineRequest, max_positions: int) -> RunningRequest:
    return RunningRequest(
        request.request_id,
        request.spec.adapter_id,
        request.timings.arrived,
        remaining_tokens=tokens_left(request, max_positions),
        context_tokens=request.total_len,
    )
