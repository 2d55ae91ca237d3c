"""LoRAX's (text-generation-inference's) response objects and error shape.

Every generated token is one ``{"id", "text", "logprob", "special"}`` (``alternative_tokens``
too when ``return_k_alternatives`` was asked for). A token's ``text`` is the text it adds to
the output, so the texts of a generation's tokens concatenate to its ``generated_text``: a
token that completes no whole character yet, or whose text is held back while it may begin a
stop sequence, has ``""`` and a later one carries the text. The end-of-sequence token that ends
a generation adds no text and has ``special: true``. ``logprob`` is the model's log-probability
of the token before temperature, top-k/p and penalties.

Failures are ``{"error": message, "error_type": kind}``; a refused request is a 422
``validation`` error as in LoRAX, the rest keep the HTTP status the OpenAI API gives them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mesh_api.v1 import gateway_pb2, types_pb2
from services.gateway.http.errors import ErrorPayload, error_body

Reply = gateway_pb2.GenerateTextResponse

#: ``error_type`` by status; lorax-client raises its exception class from it (``validation``,
#: ``overloaded``, ``generation``) or else from the status.
_ERROR_TYPES = {
    401: "authentication",
    403: "permission",
    404: "not_found",
    413: "validation",
    422: "validation",
    429: "overloaded",
    503: "unavailable",
}


@dataclass(frozen=True)
class LoraxError(ErrorPayload):
    status: int
    message: str
    error_type: str
    retry_after_s: float | None = None

    def json(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}


#: Fields the OpenAI API's verdicts name that LoRAX's request spells otherwise.
_LORAX_FIELDS = {"response_format.json_schema.schema": "response_format.schema"}


def lorax_error(error: BaseException) -> LoraxError:
    """What ``error`` says to a LoRAX client: the OpenAI API's verdict in LoRAX's shape, its
    message led by the field it names."""
    body = error_body(error)
    status = 422 if body.status == 400 else body.status
    message, param = body.message, body.param
    if param in _LORAX_FIELDS:
        message, param = message.replace(param, _LORAX_FIELDS[param], 1), _LORAX_FIELDS[param]
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return LoraxError(status, message, _ERROR_TYPES.get(status, "generation"), body.retry_after_s)


@dataclass(frozen=True)
class LoraxShape:
    """How one request's tokens and details look."""

    token_bytes: Callable[[int], bytes]
    eos_token_ids: frozenset[int]
    ignore_eos: bool
    alternatives: bool
    """``return_k_alternatives`` was asked for: each token lists its alternatives."""
    adapter_version: str | None = None
    """The adapter version serving the request (:func:`services.gateway.adapter_version.fingerprint`),
    in ``details``; None (null) for the base model."""

    def _text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def ends_with_eos(self, reply: Reply) -> bool:
        """``reply`` is the last one and its last token is the end-of-sequence that ended it."""
        ids = reply.token_ids
        return (
            reply.finish_reason == types_pb2.FINISH_REASON_STOP
            and bool(ids)
            and ids[-1] in self.eos_token_ids
            and not self.ignore_eos
        )

    def finish_reason(self, reply: Reply) -> str:
        """LoRAX's name for the last reply's finish reason."""
        if reply.finish_reason == types_pb2.FINISH_REASON_STOP:
            return "eos_token" if self.ends_with_eos(reply) else "stop_sequence"
        return "length"

    def tokens(self, reply: Reply) -> list[dict]:
        """One token object per token of ``reply``, its text on the last that adds text."""
        ids = list(reply.token_ids)
        eos_at = len(ids) - 1 if self.ends_with_eos(reply) else -1
        carrier = max((i for i in range(len(ids)) if i != eos_at), default=eos_at)
        tokens = []
        for i, (token, logprobs) in enumerate(zip(ids, reply.logprobs, strict=True)):
            text = reply.text if i == carrier else ""
            item = {
                "id": token,
                "text": text,
                "logprob": logprobs.logprob,
                "special": i == eos_at and not text,
            }
            if self.alternatives:
                item["alternative_tokens"] = [
                    {"id": t, "text": self._text(t), "logprob": v}
                    for t, v in zip(logprobs.top_token_ids, logprobs.top_logprobs)
                ]
            tokens.append(item)
        return tokens

    def end_marker(self, reply: Reply) -> dict:
        """The token of a stream's last event when the last reply has none (the worker ended
        the generation without a token: its pool held no more of it): an end-of-sequence
        token, not generated, carrying whatever text was still held back."""
        return {"id": min(self.eos_token_ids, default=0), "text": reply.text, "logprob": 0.0,
                "special": not reply.text}  # fmt: skip


def stream_details(shape: LoraxShape, last: Reply, seed: int | None) -> dict:
    """``details`` of a stream's last event."""
    return {
        "finish_reason": shape.finish_reason(last),
        "prompt_tokens": last.usage.prompt_tokens,
        "generated_tokens": last.usage.completion_tokens,
        "seed": seed,
        "adapter_version": shape.adapter_version,
    }


def details(shape: LoraxShape, last: Reply, seed: int | None, tokens: list[dict]) -> dict:
    """``details`` of a whole response: the stream's, the tokens, no prompt tokens (``prefill``)."""
    return {**stream_details(shape, last, seed), "prefill": [], "tokens": tokens}
