"""Continuations in the gateway's domain (no gRPC): cut a stream anywhere, continue it from what
was delivered, and the client has exactly the undisturbed tokens and text; a continuation of a
generation that had ended ends at once; bad continuations are refused naming the field. The
streams are the real SmolLM2 tokenizer's, one token per message as the relay sends them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mesh_api.v1 import types_pb2
from services.gateway.continuation import NOTHING_DELIVERED, Delivered, ModelTokens, ResumePoint, resume_point
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.sampling.request_validation import InvalidField

STOP = types_pb2.FINISH_REASON_STOP
LENGTH = types_pb2.FINISH_REASON_LENGTH
EOS = 2
PROMPT_TOKENS = 5
CONTEXT = 64
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model() -> ModelTokens:
    tokenizer = load_tokenizer().tokenizer
    return ModelTokens(tokenizer.id_to_bytes, tokenizer.vocab_size, frozenset({EOS}), CONTEXT)


@pytest.fixture(scope="module")
def encode():
    return load_tokenizer().tokenizer.encode


def sampling(max_tokens: int = MAX_TOKENS, stop: tuple[str, ...] = (), **fields) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(max_tokens=max_tokens, stop_strings=stop, **fields)


@dataclass
class Message:
    token_id: int
    text: str


def messages_from(start: ResumePoint, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[Message]:
    """What the relay sends for ``ids`` (one token per worker reply) after ``start``: each
    token's text, the end's flush with the last one, nothing after the generation ends."""
    sent, detok, generated = [], start.detokenizer, len(start.generated)
    for token in ids:
        generated += 1
        ends = token in start.stop_ids
        text = "" if ends else detok.add([token])
        if ends or detok.stopped or generated == max_tokens:
            return [*sent, Message(token, text + detok.flush())]
        sent.append(Message(token, text))
    return sent


def delivered(messages: list[Message]) -> Delivered:
    return Delivered(tuple(m.token_id for m in messages), "".join(m.text for m in messages))


def undisturbed(model, ids: list[int], params: types_pb2.SamplingParams) -> list[Message]:
    return messages_from(
        resume_point(NOTHING_DELIVERED, PROMPT_TOKENS, params, model), ids, params.max_tokens
    )


STREAMS = {
    "ascii": ("The answer is 42, and that is all.", ()),
    "characters split over tokens": ("naïve café — 日本語 🎉👩‍👩‍👧 done", ()),
    "a stop string inside tokens": ("say STOPPED now and more after", ("TOPPE",)),
    "a stop string behind a lookalike": ("a <|do <|done|> never sent", ("<|done|>", "##")),
}


@pytest.mark.parametrize("name", STREAMS)
def test_a_stream_cut_anywhere_continues_with_exactly_the_rest(model, encode, name):
    text, stops = STREAMS[name]
    ids = encode(text)
    params = sampling(stop=stops)
    whole = undisturbed(model, ids, params)
    sent = "".join(m.text for m in whole)
    assert sent == text if not stops else len(whole) < len(ids) and text.startswith(sent)
    for cut in range(len(whole)):
        start = resume_point(delivered(whole[:cut]), PROMPT_TOKENS, params, model)
        assert start.generated == ids[:cut] and not start.finished
        rest = messages_from(start, ids[cut:])
        assert delivered(whole[:cut] + rest) == delivered(whole), f"cut after {cut} tokens"


def test_a_stop_string_spanning_the_break_still_ends_the_generation(model, encode):
    ids = encode("say STOPPED now")  # "say| ST|OP|P|ED| now": the stop "TOPPE" begins in " ST"
    params = sampling(stop=("TOPPE",))
    start = resume_point(Delivered(tuple(ids[:2]), "say S"), PROMPT_TOKENS, params, model)
    rest = messages_from(start, ids[2:])
    assert [(m.token_id, m.text) for m in rest] == [(ids[2], ""), (ids[3], ""), (ids[4], "")]
    assert start.detokenizer.stopped


def test_text_held_back_at_the_break_comes_with_the_next_token(model, encode):
    ids = encode("🎉")
    assert len(ids) > 1, "the test needs a character spanning several tokens"
    start = resume_point(Delivered(tuple(ids[:-1]), ""), PROMPT_TOKENS, sampling(), model)
    assert start.detokenizer.add(ids[-1:]) == "🎉"


def test_an_eos_is_text_like_any_token_with_ignore_eos(model, encode):
    ids = [*encode("one"), EOS, *encode(" two")]
    params = sampling(ignore_eos=True)
    whole = undisturbed(model, ids, params)
    assert len(whole) == len(ids)
    start = resume_point(delivered(whole[:2]), PROMPT_TOKENS, params, model)
    assert delivered(whole[:2] + messages_from(start, ids[2:])) == delivered(whole)


ENDED = {
    "by a stop token": (lambda encode: [*encode("Hello there"), 7], sampling(stop_token_ids=[7]), STOP),
    "by the end-of-sequence token": (lambda encode: [*encode("Hello there"), EOS], sampling(), STOP),
    "by a stop string": (lambda encode: encode("Hello there, stop here"), sampling(stop=("stop",)), STOP),
    "at max_tokens": (lambda encode: encode("Hello there")[:2], sampling(max_tokens=2), LENGTH),
    "with the context full": (
        lambda encode: (encode("Hello there") * CONTEXT)[: CONTEXT - PROMPT_TOKENS],
        sampling(max_tokens=CONTEXT),
        LENGTH,
    ),
}


@pytest.mark.parametrize("how", ENDED)
def test_a_generation_that_had_ended_ends_at_once(model, encode, how):
    make_ids, params, finished = ENDED[how]
    whole = undisturbed(model, make_ids(encode), params)
    start = resume_point(delivered(whole), PROMPT_TOKENS, params, model)
    assert start.finished == finished
    assert start.detokenizer.flush() == ""  # everything was delivered with the last token


def refusal(model, delivered: Delivered, params: types_pb2.SamplingParams | None = None) -> InvalidField:
    with pytest.raises(InvalidField) as refused:
        resume_point(delivered, PROMPT_TOKENS, params or sampling(), model)
    return refused.value


def test_token_ids_outside_the_vocabulary_are_refused_by_index(model):
    error = refusal(model, Delivered((5, model.vocab_size), ""))
    assert error.field == "continuation.token_ids"
    assert str(error) == f"continuation.token_ids[1] is {model.vocab_size}, outside the vocabulary [0, 49152)"


def test_more_tokens_than_max_tokens_are_refused(model):
    error = refusal(model, Delivered((5, 6, 7), ""), sampling(max_tokens=2))
    assert error.field == "continuation.token_ids"
    assert "3 tokens, more than sampling.max_tokens 2" in str(error)


@pytest.mark.parametrize(
    "ids, params",
    [((5, EOS, 6), sampling()), ((5, 7, 6), sampling(stop_token_ids=[7]))],
    ids=["after the end-of-sequence token", "after a stop token"],
)
def test_tokens_after_the_end_are_refused(model, ids, params):
    error = refusal(model, Delivered(ids, ""), params)
    assert error.field == "continuation.token_ids"
    assert "continuation.token_ids[1] ended the generation" in str(error) and "1 more tokens" in str(error)


def test_tokens_after_a_stop_string_are_refused(model, encode):
    ids = encode("one stop two")
    error = refusal(model, Delivered(tuple(ids), "one "), sampling(stop=("stop",)))
    assert error.field == "continuation.token_ids" and "ended the generation" in str(error)


@pytest.mark.parametrize("text", ["Hello the", "Hello theree", "Hellö there", ""])
def test_text_other_than_the_tokens_gave_is_refused(model, encode, text):
    error = refusal(model, Delivered(tuple(encode("Hello there")), text))
    assert error.field == "continuation.text"
    assert "continuation.text is not the text continuation.token_ids were delivered with" in str(error)


def test_text_without_tokens_is_refused(model):
    assert refusal(model, Delivered((), "Hi")).field == "continuation.text"
