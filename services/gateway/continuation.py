"""Continuing a generation right after what its client was delivered.

A client whose stream broke (its gateway died mid-stream) sends the same request again with
what it received, :class:`Delivered`: every message's token ids and text, each joined. The
gateway continues as it does after a worker failure: a worker recomputes prompt + delivered
tokens and generates the rest (a seeded sampled request draws what it would have drawn: the
workers key each draw by the seed and the token's position). The text is rebuilt by feeding the
delivered tokens to a fresh detokenizer one by one, as the relay fed them: it then holds back
exactly what it held at the break (an incomplete UTF-8 character, text that may begin a stop
string), so the client gets exactly the rest of the text, and a stop string that began before
the break still ends the generation.

Nothing in a continuation is trusted, so it needs no signature and no key shared by the
gateways: the request is authenticated, authorized (its adapter) and limited as any other; the
delivered tokens are checked like prompt tokens (in the vocabulary), count against
``max_tokens`` as the tokens generated, and must give exactly the delivered text. Tokens a
client made up are only a longer prompt, which it could send anyway.

A new request starts from an empty :class:`Delivered` through the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mesh_api.v1 import types_pb2
from services.gateway.detokenizer import IncrementalDetokenizer
from services.runtime.sampling.request_validation import InvalidField

TOKENS_FIELD = "continuation.token_ids"
TEXT_FIELD = "continuation.text"


@dataclass(frozen=True)
class Delivered:
    """What a client received of a generation before its stream broke (empty: a new one)."""

    token_ids: tuple[int, ...] = ()
    """Every message's ``token_ids``, in order."""
    text: str = ""
    """Every message's ``text``, joined."""


NOTHING_DELIVERED = Delivered()
"""A new request's: it starts at the beginning."""


@dataclass(frozen=True)
class ModelTokens:
    """What the gateway knows of the model's tokens (from its tokenizer, without the weights)."""

    token_bytes: Callable[[int], bytes]
    vocab_size: int
    eos_token_ids: frozenset[int]
    context_length: int
    """Longest prompt + output; a generation that fills it ends (``length``)."""


@dataclass
class ResumePoint:
    """Where a generation (re)starts: what it generated so far and the detokenizer that made
    the text delivered of it."""

    generated: list[int]
    """The delivered tokens (none for a new request)."""
    detokenizer: IncrementalDetokenizer
    """Fed with ``generated``: what it holds back was not delivered yet."""
    stop_ids: frozenset[int]
    """Tokens that end the generation: reported in ``token_ids``, not as text."""
    finished: types_pb2.FinishReason.ValueType
    """Set when the delivered tokens already ended the generation (FINISH_REASON_UNSPECIFIED:
    not)."""


def resume_point(
    delivered: Delivered, prompt_tokens: int, sampling: types_pb2.SamplingParams, model: ModelTokens
) -> ResumePoint:
    """Where the generation of a prompt of ``prompt_tokens`` tokens stands after ``delivered``.

    Args:
        delivered: What the client received (empty for a new request).
        prompt_tokens: Length of the tokenized prompt.
        sampling: The request's sampling, ``max_tokens`` resolved (it counts ``delivered``).
        model: The model's vocabulary, end-of-sequence ids and context length.

    Raises:
        InvalidField: ``continuation.token_ids`` out of the vocabulary, more than
            ``max_tokens``, or going on after a token that ended the generation;
            ``continuation.text`` not the text those tokens were delivered with.
    """
    ids = delivered.token_ids
    if len(ids) > sampling.max_tokens:
        raise InvalidField(
            TOKENS_FIELD,
            f"{TOKENS_FIELD} has {len(ids)} tokens, more than sampling.max_tokens {sampling.max_tokens} "
            f"(which counts the delivered tokens)",
        )
    for i, token in enumerate(ids):
        if not 0 <= token < model.vocab_size:
            raise InvalidField(
                TOKENS_FIELD,
                f"{TOKENS_FIELD}[{i}] is {token}, outside the vocabulary [0, {model.vocab_size})",
            )
    stop_ids = frozenset(sampling.stop_token_ids) | (
        frozenset() if sampling.ignore_eos else model.eos_token_ids
    )
    detokenizer = IncrementalDetokenizer(model.token_bytes, tuple(sampling.stop_strings))
    text = ""
    finished = types_pb2.FINISH_REASON_UNSPECIFIED
    for i, token in enumerate(ids):
        if finished:
            raise InvalidField(
                TOKENS_FIELD,
                f"{TOKENS_FIELD}[{i - 1}] ended the generation (a stop token or stop string), "
                f"yet {len(ids) - i} more tokens follow it",
            )
        if token in stop_ids:
            finished = types_pb2.FINISH_REASON_STOP
            continue
        text += detokenizer.add([token])
        if detokenizer.stopped:
            finished = types_pb2.FINISH_REASON_STOP
    if not finished and (len(ids) == sampling.max_tokens or prompt_tokens + len(ids) >= model.context_length):
        finished = types_pb2.FINISH_REASON_LENGTH
    if finished:
        text += detokenizer.flush()  # the last message of the stream carried it
    if text != delivered.text:
        differs_at = next(
            (i for i, (a, b) in enumerate(zip(text, delivered.text)) if a != b),
            min(len(text), len(delivered.text)),
        )
        raise InvalidField(
            TEXT_FIELD,
            f"{TEXT_FIELD} is not the text {TOKENS_FIELD} were delivered with: they give "
            f"{len(text)} characters, {TEXT_FIELD} has {len(delivered.text)}, the first difference "
            f"is at character {differs_at}",
        )
    return ResumePoint(list(ids), detokenizer, stop_ids, finished)
