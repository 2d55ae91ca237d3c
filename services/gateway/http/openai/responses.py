"""OpenAI response objects and their server-sent-event framing.

One :class:`ResponseShape` per endpoint (completions, chat completions) builds the whole
response, each stream chunk, and the usage; :func:`services.gateway.http.events.sse` frames a
chunk, and :data:`SSE_DONE` ends every stream as OpenAI's does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mesh_api.v1 import gateway_pb2, types_pb2
from services.gateway.tool_calls import ToolRequest, parse_reply

SSE_DONE = b"data: [DONE]\n\n"

_FINISH_REASONS = {types_pb2.FINISH_REASON_STOP: "stop", types_pb2.FINISH_REASON_LENGTH: "length"}


def finish_reason(reason: int) -> str | None:
    """OpenAI's name for a finish reason; None while the choice is still generating."""
    if reason == types_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return _FINISH_REASONS.get(reason, "stop")


@dataclass
class UsageTally:
    """A request's ``usage``, added up over its choices as they finish (choice ``i`` is of
    prompt ``i // choices_per_prompt``)."""

    prompt_tokens: int
    """Every prompt's tokens, each counted once however many choices it has (as OpenAI)."""
    choices_per_prompt: int
    completion_tokens: int = 0
    cached_by_prompt: dict[int, int] = field(default_factory=dict)
    """Prompt index -> the most of its tokens any of its choices found in a prefix cache."""

    def add(self, choice: int, usage: gateway_pb2.Usage) -> None:
        """A finished choice's usage."""
        self.completion_tokens += usage.completion_tokens
        prompt = choice // self.choices_per_prompt
        self.cached_by_prompt[prompt] = max(self.cached_by_prompt.get(prompt, 0), usage.cached_prompt_tokens)

    def usage(self) -> dict:
        """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV a
        worker's prefix cache held (vLLM's)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_by_prompt.values())},
        }


@dataclass
class ChoiceText:
    """What one choice has produced so far (non-streaming responses accumulate it here)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[types_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True)
class ResponseShape:
    """How one endpoint's objects look; ``chat`` picks chat completions over completions."""

    model: str
    chat: bool
    return_token_ids: bool = False
    """vLLM's extension: each choice (each chunk) also carries its generated ``token_ids``."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    token_bytes: Callable[[int], bytes] = bytes
    """A token id's bytes (the tokenizer's), to name tokens in ``logprobs``."""
    tools: ToolRequest | None = None
    """Chat with tools offered: replies are read for tool calls (None: plain text)."""
    system_fingerprint: str | None = None
    """The adapter version serving the request
    (:func:`services.gateway.adapter_version.fingerprint`), on the response and every chunk;
    None (null) for the base model."""

    def logprobs(self, token_ids: Sequence[int], logprobs: Sequence[types_pb2.TokenLogprobs]) -> dict | None:
        """OpenAI's ``logprobs`` object for these tokens; None when none were asked for. Chat:
        ``{"content": [{token, logprob, bytes, top_logprobs}]}``; completions: the legacy
        ``{tokens, token_logprobs, top_logprobs}``."""
        if not logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        **self._token(token, lp.logprob),
                        "top_logprobs": [
                            self._token(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)
                        ],
                    }
                    for token, lp in zip(token_ids, logprobs)
                ]
            }
        return {
            "tokens": [self._text(token) for token in token_ids],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [
                {self._text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)} for lp in logprobs
            ],
        }

    def _text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _token(self, token: int, logprob: float) -> dict:
        raw = self.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def _head(self, object_name: str) -> dict:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {
            "id": f"{prefix}-{self.id}",
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def _with_token_ids(self, choice: dict, token_ids) -> dict:
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def response(self, choices: list[ChoiceText], usage_: dict) -> dict:
        """The whole non-streaming response."""
        if self.chat:
            body = [
                {"index": i, **self._message(c), "logprobs": self.logprobs(c.token_ids, c.logprobs)}
                for i, c in enumerate(choices)
            ]
        else:
            body = [
                {
                    "index": i,
                    "text": "".join(c.text),
                    "logprobs": self.logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ]
        body = [self._with_token_ids(b, c.token_ids) for b, c in zip(body, choices)]
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": body,
                "usage": usage_}  # fmt: skip

    def _message(self, choice: ChoiceText) -> dict:
        """A whole chat choice's ``message`` and ``finish_reason``: its text, or with tools
        offered, the tool calls read from it and the text around them."""
        text = "".join(choice.text)
        if self.tools is None:
            return {"message": {"role": "assistant", "content": text}, "finish_reason": choice.finish_reason}
        reply = parse_reply(text, self.tools)
        message: dict = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
        return {"message": message, "finish_reason": reply.finish_reason(choice.finish_reason or "stop")}

    def _chunk(self, choices: list[dict], include_usage: bool) -> dict:
        chunk = {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last, when usage is asked for
        return chunk

    def role_chunk(self, index: int, include_usage: bool) -> dict:
        """Chat streams open each choice with the assistant role."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}  # fmt: skip
        return self._chunk([self._with_token_ids(choice, ())], include_usage)

    def delta_chunk(
        self, index: int, text: str, token_ids, finish: str | None, include_usage: bool, logprobs=()
    ) -> dict:
        lp = self.logprobs(token_ids, logprobs)
        if self.chat:
            return self.chat_delta_chunk(
                index, {"content": text} if text else {}, token_ids, finish, include_usage, lp
            )
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return self._chunk([self._with_token_ids(choice, token_ids)], include_usage)

    def chat_delta_chunk(
        self,
        index: int,
        delta: dict,
        token_ids,
        finish: str | None,
        include_usage: bool,
        logprobs: dict | None = None,
    ) -> dict:
        """A chat chunk carrying ``delta`` as it is (content, or tool-call pieces)."""
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([self._with_token_ids(choice, token_ids)], include_usage)

    def usage_chunk(self, usage_: dict) -> dict:
        """The last chunk of a stream that asked for usage: no choices, the usage."""
        return {**self._chunk([], False), "usage": usage_}
