"""Incremental detokenization against the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from services.gateway.detokenizer import IncrementalDetokenizer
from services.model_files.tokenizer_loading import load_tokenizer

TEXTS = [
    "Hello, world!",
    "naïve café — 日本語のテキスト 🎉👩‍👩‍👧",
    "def f(x):\n    return x ** 2\n",
    "  spaces  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer().tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_rebuild_the_text_and_are_always_valid_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer.id_to_bytes)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_split_over_byte_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1, "the test needs a character spanning several tokens"
    detok = IncrementalDetokenizer(tokenizer.id_to_bytes)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"


def sent_until_stop(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    """What a relay feeding ``ids`` one by one sends before the detokenizer reports a stop."""
    sent = ""
    for i in ids:
        sent += detok.add([i])
        if detok.stopped:
            break
    return sent


def test_stop_string_across_tokens_is_never_sent(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    detok = IncrementalDetokenizer(tokenizer.id_to_bytes, stop_strings=("END",))
    sent = sent_until_stop(detok, ids)
    assert detok.stopped and sent == "The answer is 42. " and detok.flush() == ""


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer):
    detok = IncrementalDetokenizer(lambda i: bytes([i]), stop_strings=("STOP",))
    assert detok.add(b"ST") == ""
    assert detok.add(b"ar") == "STar"
    assert detok.add(b"S") == ""
    assert detok.flush() == "S"


def test_stop_string_starting_and_ending_inside_tokens_leaks_nothing_after_it(tokenizer):
    """ "TOPPE" starts inside " ST" and ends inside "ED" (" ST|OP|P|ED"): the text before it is
    returned exactly, and not one character from the stop on."""
    ids = tokenizer.encode("say STOPPED now")
    assert [tokenizer.id_to_bytes(i) for i in ids][1:5] == [b" ST", b"OP", b"P", b"ED"]
    detok = IncrementalDetokenizer(tokenizer.id_to_bytes, stop_strings=("TOPPE",))
    sent = sent_until_stop(detok, ids)
    assert detok.stopped and sent == "say S" and detok.add(ids) == "" and detok.flush() == ""


def test_text_held_back_is_bounded_by_the_longest_stop_string(tokenizer):
    """The work per token stays constant however long the output: at most the longest stop
    string minus one character is ever waiting, never the output so far."""
    stops = ("<|done|>", "###")
    ids = tokenizer.encode("Some text with # and <| and ## but no stop. " * 300)
    detok = IncrementalDetokenizer(tokenizer.id_to_bytes, stop_strings=stops)
    sent = ""
    for n, token_id in enumerate(ids, 1):
        sent += detok.add([token_id])
        whole = tokenizer.decode(ids[:n]).rstrip("\ufffd")
        assert whole.startswith(sent) and len(whole) - len(sent) <= max(map(len, stops)) - 1
    assert not detok.stopped and sent + detok.flush() == tokenizer.decode(ids)
