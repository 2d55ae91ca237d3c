"""What a generation request may ask for: one set of checks for the gateway and the workers.

The gateway checks a request before it places it, the worker again when it arrives (a worker
can be called directly); both call these functions, so a refusal reads the same wherever it
happens. Checks that need no tokenizer (sampling ranges, stop strings, number of choices) come
first; those that do take the vocabulary size and the context length as numbers, so nothing
here loads a tokenizer or a model.

Every refusal is an :class:`InvalidField`: an ``INVALID_ARGUMENT`` that also names the field,
which the OpenAI front end reports as ``param``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.runtime.errors import InvalidArgument

if TYPE_CHECKING:
    from services.runtime.sampling.sampling_params import SamplingParams, StructuredOutput

MAX_TEMPERATURE = 100.0
"""Highest temperature accepted (beyond it sampling is uniform noise anyway)."""
MAX_REPETITION_PENALTY = 10.0
"""Highest repetition penalty accepted."""
SEED_LIMIT = 2**64
"""Seeds are in ``[0, SEED_LIMIT)`` (the wire's ``uint64``)."""
MAX_STOP_STRINGS = 16
"""Most stop strings one request may give."""
MAX_TOP_LOGPROBS = 20
"""Alternatives a request may ask for per token (OpenAI's limit)."""
MAX_STOP_STRING_BYTES = 256
"""Longest stop string, in UTF-8 bytes. Bounds the text the worker rescans per token
(:mod:`services.runtime.sampling.stop_window`)."""
MAX_CHOICES = 16
"""Most generations one request may ask for (OpenAI's ``n`` × prompts)."""
MAX_PENALTY = 2.0
"""``presence_penalty`` and ``frequency_penalty`` are within ``[-MAX_PENALTY, MAX_PENALTY]``
(OpenAI's range)."""
MAX_LOGIT_BIAS = 100.0
"""Each ``logit_bias`` value is within ``[-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]`` (OpenAI's range)."""
MAX_LOGIT_BIAS_ENTRIES = 300
"""Most tokens one request may bias (OpenAI's limit)."""


class InvalidField(InvalidArgument):
    """A request field out of range; ``field`` names it as the request spelled it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# -- without a tokenizer ----------------------------------------------------------------------


def check_max_tokens(max_tokens: int) -> None:
    if max_tokens < 1:
        raise InvalidField("max_tokens", f"max_tokens must be at least 1, got {max_tokens}")


def check_sampling(
    *,
    max_tokens: int | None,
    temperature: float,
    top_k: int,
    top_p: float,
    repetition_penalty: float,
    seed: int | None,
    stop_strings: Sequence[str],
    top_logprobs: int | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_p: float = 0.0,
    logit_bias: Sequence[tuple[int, float]] = (),
    structured_output: StructuredOutput | None = None,
) -> None:
    """Raise :class:`InvalidField` for the first value out of range. Values are as the engine
    reads them (defaults filled in), except ``max_tokens``: ``None`` when the server's default
    will apply. ``logit_bias``'s ids are checked against the vocabulary by :func:`check_request`."""
    if max_tokens is not None:
        check_max_tokens(max_tokens)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidField(
            "temperature", f"temperature must be within [0, {MAX_TEMPERATURE:g}], got {temperature}"
        )
    if top_k < 0:
        raise InvalidField("top_k", f"top_k must be ≥ 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise InvalidField("top_p", f"top_p must be within (0, 1], got {top_p}")
    if not 0.0 < repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidField(
            "repetition_penalty",
            f"repetition_penalty must be within (0, {MAX_REPETITION_PENALTY:g}], got {repetition_penalty}",
        )
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise InvalidField("seed", f"seed must be within [0, 2^64), got {seed}")
    check_stop_strings(stop_strings)
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidField(
            "top_logprobs", f"top_logprobs must be within [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}"
        )
    for name, penalty in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -MAX_PENALTY <= penalty <= MAX_PENALTY:
            raise InvalidField(
                name, f"{name} must be within [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {penalty}"
            )
    if not 0.0 <= min_p <= 1.0:
        raise InvalidField("min_p", f"min_p must be within [0, 1], got {min_p}")
    check_logit_bias(logit_bias)
    if structured_output is not None:
        check_structured_output(structured_output)


def check_logit_bias(logit_bias: Sequence[tuple[int, float]]) -> None:
    """(token id, bias) pairs: at most :data:`MAX_LOGIT_BIAS_ENTRIES`, ids distinct and >= 0,
    biases within ``[-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]``."""
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidField(
            "logit_bias", f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}"
        )
    if len({token for token, _ in logit_bias}) != len(logit_bias):
        raise InvalidField("logit_bias", "logit_bias names a token id more than once")
    for token, bias in logit_bias:
        if token < 0:
            raise InvalidField("logit_bias", f"logit_bias token id {token} is negative")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidField(
                "logit_bias",
                f"logit_bias of token {token} must be within [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
            )


def check_structured_output(structured: StructuredOutput) -> None:
    """``json_object`` with no schema, or ``json_schema`` with a schema that is a JSON object.
    Refusals name ``response_format``, the field OpenAI's API spells it with."""
    if structured.kind == "json_object":
        if structured.schema:
            raise InvalidField("response_format", "response_format json_object takes no schema")
        return
    if structured.kind != "json_schema":
        raise InvalidField(
            "response_format",
            f"response_format must be json_schema or json_object, got {structured.kind!r}",
        )
    if not structured.schema:
        raise InvalidField("response_format", "response_format json_schema is empty: give a JSON Schema")
    try:
        schema = json.loads(structured.schema)
    except ValueError as error:
        raise InvalidField(
            "response_format", f"response_format json_schema is not valid JSON: {error}"
        ) from None
    if not isinstance(schema, dict):
        raise InvalidField(
            "response_format",
            f"response_format json_schema must be a JSON object, got {type(schema).__name__}",
        )


def check_stop_strings(stop_strings: Sequence[str]) -> None:
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise InvalidField("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop_strings)}")
    for i, stop in enumerate(stop_strings):
        if not stop:
            raise InvalidField("stop", f"stop string {i} is empty")
        if len(stop.encode()) > MAX_STOP_STRING_BYTES:
            raise InvalidField(
                "stop", f"stop string {i} is {len(stop.encode())} bytes; the limit is {MAX_STOP_STRING_BYTES}"
            )


def check_choices(n: int) -> None:
    """``n``, generations asked for by one request."""
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidField("n", f"n must be within [1, {MAX_CHOICES}], got {n}")


def check_first_token_deadline(deadline_ms: float) -> None:
    """``first_token_deadline_ms``: milliseconds to the first token, a finite number >= 0 (0: the
    default SLO)."""
    if not math.isfinite(deadline_ms) or deadline_ms < 0:
        raise InvalidField(
            "first_token_deadline_ms",
            f"first_token_deadline_ms must be a finite number >= 0 (0: the default), got {deadline_ms}",
        )


# -- with the model's vocabulary and context ---------------------------------------------------


def check_token_ids(field: str, what: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """``what`` (the ids of ``field``) must all be in the vocabulary."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise InvalidField(field, f"{what} must be within [0, {vocab_size})")


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, context_length: int) -> None:
    """A tokenized prompt: not empty, ids in the vocabulary, room for at least one new token."""
    if not prompt_ids:
        raise InvalidField("prompt", "prompt is empty: give at least one token")
    if len(prompt_ids) >= context_length:
        raise InvalidField(
            "prompt", f"prompt has {len(prompt_ids)} tokens; the model's context is {context_length}"
        )
    check_token_ids("prompt", "prompt token ids", prompt_ids, vocab_size)


def check_request(
    prompt_ids: Sequence[int], sampling: SamplingParams, vocab_size: int, context_length: int
) -> None:
    """Everything about one generation: its prompt and its sampling, stop token ids included."""
    check_prompt(prompt_ids, vocab_size, context_length)
    sampling.validate()
    check_token_ids("stop_token_ids", "stop_token_ids", sampling.stop_token_ids, vocab_size)
    check_token_ids(
        "logit_bias", "logit_bias token ids", [token for token, _ in sampling.logit_bias], vocab_size
    )
