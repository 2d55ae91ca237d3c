"""A request's token events as few ``GenerateResponse`` messages as they allow.

With speculation a step emits each accepted draft and the token drawn after them as events of
their own, all at once. One reply each cost the gateway a message to parse, detokenise and
stream as a chunk of its own, and the client one more to read: on 2 cores that host work is
taken from the forward pass (the served SQL rewrite, load 6-12: 1.41 ms of the gateway's CPU a
token with a reply per token, 0.63 ms with a reply per step). So the events already waiting go
out in one reply, their tokens in order; an end that becomes an error status (``ABORTED``,
``NO_KV``) stays apart, after the tokens before it.
"""

from __future__ import annotations

from collections import deque

from mesh_api.v1 import types_pb2, worker_pb2
from services.gpu_worker.engine.request import FinishReason, TokenEvent
from services.gpu_worker.engine.sampling import TokenLogprobs

ERROR_ENDS = (FinishReason.ABORTED, FinishReason.NO_KV)
"""Ends the servicer answers with an error status instead of a reply."""


def take_reply(pending: deque[TokenEvent], request_id: str) -> tuple[worker_pb2.GenerateResponse, TokenEvent]:
    """The reply for the first of ``pending`` (not an error end) and the token events after it
    that may join it, taken off ``pending``; and the last event taken (whose end, if any, the
    reply is to carry)."""
    event = pending.popleft()
    reply = worker_pb2.GenerateResponse(request_id=request_id)
    _add(reply, event)
    while event.finish_reason is None and pending and _joins(pending[0]):
        event = pending.popleft()
        _add(reply, event)
    return reply, event


def logprobs_to_proto(logprobs: TokenLogprobs) -> types_pb2.TokenLogprobs:
    return types_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top_token_ids=[token for token, _ in logprobs.top],
        top_logprobs=[value for _, value in logprobs.top],
    )


def _joins(event: TokenEvent) -> bool:
    """Whether ``event`` may join the reply of the token events before it."""
    return event.token_id is not None and event.finish_reason not in ERROR_ENDS


def _add(reply: worker_pb2.GenerateResponse, event: TokenEvent) -> None:
    if event.token_id is not None:
        reply.token_ids.append(event.token_id)
        reply.cached_prompt_tokens = event.cached_prompt_tokens
    if event.logprobs is not None:
        reply.logprobs.append(logprobs_to_proto(event.logprobs))
