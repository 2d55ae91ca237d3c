"""The end of a request's life as its caller sees it: each new token's event, why a request
finishes (EOS, stop tokens and strings, length, context), and its last event."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.gpu_worker.engine.request import EngineRequest, FinishReason, RequestState, TokenEvent

EventSink = Callable[[TokenEvent], None]


class RequestEvents:
    """Sends requests' events to their sinks (engine thread) and counts the requests and tokens
    of each adapter."""

    def __init__(
        self,
        eos_token_ids: frozenset[int],
        detokenize: Callable[[list[int]], str] | None,
        max_positions: int,
    ):
        self.eos_token_ids = eos_token_ids
        self.detokenize = detokenize
        self.max_positions = max_positions
        self.sinks: dict[str, EventSink] = {}
        self.tokens_generated = 0
        self.tokens_by_adapter: dict[str, int] = {}
        """Tokens generated per adapter id since start."""
        self.requests_by_adapter: dict[str, int] = {}
        """Requests taken up per adapter id since start (what ranks adapters for metric labels)."""

    def arrived(self, request: EngineRequest, sink: EventSink) -> None:
        """``request`` was taken up by the engine thread: its events go to ``sink``."""
        self.sinks[request.request_id] = sink
        adapter_id = request.spec.adapter_id
        if adapter_id is not None:
            self.requests_by_adapter[adapter_id] = self.requests_by_adapter.get(adapter_id, 0) + 1

    def token(self, request: EngineRequest, token: int, now: float) -> FinishReason | None:
        """Append ``request``'s new ``token`` and send its event, unless the token ends the
        request: then the reason (the caller ends it with :meth:`finished`)."""
        request.append_output(token)
        self.tokens_generated += 1
        adapter_id = request.spec.adapter_id
        if adapter_id is not None:
            self.tokens_by_adapter[adapter_id] = self.tokens_by_adapter.get(adapter_id, 0) + 1
        if request.timings.first_token is None:
            request.timings.first_token = now
        reason = self._finish_reason(request, token)
        if reason is None:
            self.sinks[request.request_id](
                TokenEvent(
                    request.request_id,
                    token,
                    None,
                    request.timings,
                    len(request.output_ids),
                    logprobs=request.last_logprobs,
                    cached_prompt_tokens=request.cached_prompt_tokens,
                )
            )
        return reason

    def _finish_reason(self, request: EngineRequest, token: int) -> FinishReason | None:
        params = request.spec.sampling
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return FinishReason.STOP
        if params.stop_strings and self.detokenize is not None:
            text = self.detokenize(request.output_ids)
            if any(stop in text for stop in params.stop_strings):
                return FinishReason.STOP
        if len(request.output_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if request.total_len >= self.max_positions:
            return FinishReason.LENGTH
        return None

    def finished(
        self, request: EngineRequest, reason: FinishReason, token: int | None, error: str = ""
    ) -> None:
        """Mark ``request`` finished and send its last event (with ``token`` if one ended it)."""
        request.state = RequestState.FINISHED
        request.timings.finished = time.monotonic()
        sink = self.sinks.pop(request.request_id, None)
        if sink is not None:
            sink(
                TokenEvent(
                    request.request_id,
                    token,
                    reason,
                    request.timings,
                    len(request.output_ids),
                    error,
                    logprobs=request.last_logprobs if token is not None else None,
                    cached_prompt_tokens=request.cached_prompt_tokens,
                )
            )
