"""OpenAI request bodies: parsed and checked here, before anything is placed.

Every field of OpenAI's chat completions and completions requests is declared, so each is either
honoured or, when the engine cannot do what it asks, refused with a 400 that names it; a neutral
value of a refused field (``tool_choice: "none"``, ``store: false``...) is accepted. Fields that
change nothing here (``user``, ``metadata``...) are accepted. vLLM's extra fields ``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos`` and ``return_token_ids`` (each choice, each
chunk, carries its generated token ids) and ``cache_salt`` (whose cached prompt KV it shares)
are accepted too, and so are loramesh's own ``first_token_deadline_ms`` (the request's
time-to-first-token deadline, as the gRPC API's) and ``no_speculation`` (no drafts for it).
Any other field is ignored and logged (:mod:`.ignored_fields`), as vLLM does. The whole table
is docs/openai-fields.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictStr

from mesh_api.v1 import types_pb2
from services.gateway.http.errors import OpenAIError
from services.gateway.http.openai.ignored_fields import log_ignored
from services.gateway.http.response_format import ResponseFormat
from services.gateway.prefix_cache_namespace import check_cache_salt
from services.gateway.tool_calls import (
    ChatMessage,
    ToolRequest,
    call_schema,
    parse_message_tool_calls,
    parse_tool_request,
)
from services.runtime.sampling.request_validation import (
    MAX_CHOICES,
    MAX_TOP_LOGPROBS,
    InvalidField,
    check_choices,
    check_first_token_deadline,
    check_sampling,
)

MAX_COMPLETION_LOGPROBS = 5
"""The legacy completions API's ``logprobs`` limit (OpenAI's)."""
TOKEN_ID_LIMIT = 2**32
"""Token ids are below this on the wire (``uint32``); the vocabulary is checked by the core."""
MAX_TOKEN_ID_CHARS = 10
"""Digits of the longest ``logit_bias`` key (``TOKEN_ID_LIMIT`` has 10)."""
VLLM_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
"""vLLM's own structured-output fields: refused, pointing to ``response_format``, rather than
ignored (which would let unconstrained text through as if it were constrained)."""
NO_FUNCTIONS = "deprecated by OpenAI: use tools and tool_choice"


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does: clients add fields faster than servers.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationBody(_Body):
    """The fields completions and chat completions share."""

    # Kept (not dropped) so that the ones no field reads can be logged.
    model_config = ConfigDict(extra="allow")
    ROUTE: ClassVar[str]

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    no_speculation: bool = False
    """Extension: true turns the worker's speculative decoding off for this request."""
    return_token_ids: bool = False
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    first_token_deadline_ms: StrictFloat | None = None
    """Extension: milliseconds from arrival to the first token (the scheduler refuses what no
    worker can meet; the workers' early_abort policy holds the request to it); None or 0: the
    gateway's default."""
    cache_salt: StrictStr | None = None
    """vLLM's: share cached prompt KV only with requests passing the same salt, whichever tenant
    sends them; None: only within the caller's tenant
    (:mod:`services.gateway.prefix_cache_namespace`). Non-empty, at most 256 UTF-8 bytes."""

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        """``(field, set, why)`` for every field the engine cannot do."""
        return [(name, getattr(self, name) is not None, "use response_format") for name in VLLM_GUIDED_FIELDS]

    def check(self) -> None:
        """Refuse what the engine cannot do, naming the field; log the fields nothing reads."""
        log_ignored(self.ROUTE, self.model_extra or {})
        for field, is_set, why in self._unsupported():
            if is_set:
                raise OpenAIError(
                    400, f"{field} is not supported by loramesh ({why})", field, "unsupported_parameter"
                )
        self.structured_output()  # a malformed response_format is refused here, like the rest
        if self.cache_salt == "":
            raise OpenAIError(400, "cache_salt must be a non-empty string when given", "cache_salt")
        try:
            check_cache_salt(self.cache_salt or "")
            check_first_token_deadline(self.deadline_ms())
            check_choices(self.n)
            check_sampling(
                max_tokens=self.max_tokens,
                seed=self.seed,
                logit_bias=self.logit_bias_pairs(),
                **self._sampling_values(),
            )
        except InvalidField as error:  # the checks the gateway and workers share, as a 400 here
            raise OpenAIError(400, error.message, error.field) from None

    def _sampling_values(self) -> dict[str, Any]:
        """Sampling fields with OpenAI's defaults (temperature 1, top_p 1) filled in."""
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k in (None, -1) else self.top_k,  # vLLM: -1 is off too
            "min_p": self.min_p or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "stop_strings": self.stop_strings(),
        }

    def logit_bias_pairs(self) -> list[tuple[int, float]]:
        """``logit_bias`` as ``(token id, bias)``; OpenAI's keys are token ids written as strings."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if (
                not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_CHARS)
                or int(key) >= TOKEN_ID_LIMIT
            ):
                raise OpenAIError(400, f"logit_bias keys must be token ids, got {key[:16]!r}", "logit_bias")
            pairs.append((int(key), bias))
        return pairs

    def structured_output(self) -> types_pb2.StructuredOutput | None:
        """What ``response_format`` constrains the output to; None: free text."""
        return self.response_format.structured_output() if self.response_format else None

    def deadline_ms(self) -> float:
        """``first_token_deadline_ms`` as the gateway core takes it (0: its default)."""
        return self.first_token_deadline_ms or 0.0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    def sampling(self) -> types_pb2.SamplingParams:
        """The engine's sampling parameters (after :meth:`check`)."""
        return types_pb2.SamplingParams(
            max_tokens=self.max_tokens or 0,  # 0: the gateway's default
            ignore_eos=self.ignore_eos,
            no_speculation=self.no_speculation,
            logit_bias=dict(self.logit_bias_pairs()),
            seed=self.seed,  # protobuf leaves a field given None unset: no seed
            structured_output=self.structured_output(),  # None: free text
            **self._sampling_values(),
        )


class CompletionBody(_GenerationBody):
    """``POST /v1/completions``."""

    ROUTE = "/v1/completions"

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return [
            *super()._unsupported(),
            ("echo", self.echo, "the prompt is not returned"),
            ("suffix", bool(self.suffix), "no fill-in-the-middle"),
            ("best_of", (self.best_of or 1) > 1, "use n"),
        ]

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt is empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def sampling(self) -> types_pb2.SamplingParams:
        sampling = super().sampling()
        if self.logprobs is not None:
            sampling.top_logprobs = self.logprobs
        return sampling

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise OpenAIError(400, f"logprobs must be within [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise OpenAIError(400, f"prompts × n must be at most {MAX_CHOICES}", "n")


class TextPart(_Body):
    type: str
    text: str = ""


class ChatMessageBody(_Body):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    """A ``tool`` message's answer to this call of the assistant's."""
    name: str | None = None

    def chat_message(self, index: int) -> ChatMessage:
        """The message as the gateway core renders it; OpenAI's ``developer`` role is a system
        message."""
        field = f"messages[{index}].tool_calls"
        calls = (
            _invalid_field_as_400(lambda: parse_message_tool_calls(self.tool_calls, field))
            if self.tool_calls
            else ()
        )
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role, self.text(index), calls, self.tool_call_id or "")

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise OpenAIError(
                    400,
                    f"content parts of type {part.type!r} are not supported (text only)",
                    f"messages[{index}].content[{j}].type",
                )
        return "".join(part.text for part in self.content)


class ChatCompletionBody(_GenerationBody):
    """``POST /v1/chat/completions``."""

    ROUTE = "/v1/chat/completions"

    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    moderation: Any = None
    store: bool | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return [
            *super()._unsupported(),
            ("functions", bool(self.functions), NO_FUNCTIONS),
            ("function_call", self.function_call not in (None, "none", "auto"), NO_FUNCTIONS),
            ("audio", self.audio is not None, "text output only"),
            ("modalities", any(m != "text" for m in self.modalities or ()), "text output only"),
            ("prediction", self.prediction is not None, "no predicted outputs"),
            ("reasoning_effort", self.reasoning_effort not in (None, "none"), "the model does not reason"),
            ("verbosity", self.verbosity not in (None, "medium"), "the model has no verbosity setting"),
            ("web_search_options", self.web_search_options is not None, "no web search"),
            ("moderation", self.moderation is not None, "no moderation"),
            ("store", bool(self.store), "completions are not stored"),
            ("service_tier", self.service_tier not in (None, "auto", "default"), "one service tier"),
        ]  # fmt: skip

    def check(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise OpenAIError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise OpenAIError(400, f"top_logprobs must be within [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        tools = self.tool_request()
        if tools is not None and self.logprobs:
            # A reply rewritten into tool-call deltas no longer lines up with per-token logprobs.
            raise OpenAIError(400, "logprobs cannot be combined with tools", "logprobs")
        constrained = tools is not None and tools.constrained
        if constrained and self.response_format and self.response_format.structured_output() is not None:
            why = "a required or named tool_choice already constrains the reply: drop response_format"
            raise OpenAIError(400, why, "tool_choice")
        super().check()

    def tool_request(self) -> ToolRequest | None:
        """The tools offered and how the reply may use them; None: no tools (or ``tool_choice: none``)."""
        return _invalid_field_as_400(
            lambda: parse_tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)
        )

    def structured_output(self) -> types_pb2.StructuredOutput | None:
        """A required or named tool's call schema, else what ``response_format`` asks for."""
        tools = self.tool_request()
        schema = call_schema(tools) if tools is not None else None
        if schema is not None:
            return types_pb2.StructuredOutput(json_schema=json.dumps(schema))
        return super().structured_output()

    def chat_messages(self) -> list[ChatMessage]:
        return chat_messages(self.messages)

    def sampling(self) -> types_pb2.SamplingParams:
        sampling = super().sampling()
        if self.logprobs:
            sampling.top_logprobs = self.top_logprobs or 0
        return sampling


def chat_messages(messages: list[ChatMessageBody]) -> list[ChatMessage]:
    """The messages as the gateway core renders them."""
    return [m.chat_message(i) for i, m in enumerate(messages)]


T = TypeVar("T")


def _invalid_field_as_400(parse: Callable[[], T]) -> T:
    try:
        return parse()
    except InvalidField as error:
        raise OpenAIError(400, error.message, error.field) from None
