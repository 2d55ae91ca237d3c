"""Incremental detokenization against the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gpu_worker.model.loading import load_model

TEXTS = [
    "Hello, world!",
    "naïve café — 日本語のテキスト 🎉👩‍👩‍👧",
    "def f(x):\n    return x ** 2\n",
    "  spaces  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model().tokenizer


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


def test_stop_string_across_tokens_is_never_sent(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    detok = IncrementalDetokenizer(tokenizer.id_to_bytes, stop_strings=("END",))
    sent = ""
    for i in ids:
        sent += detok.add([i])
        if detok.stopped:
            break
    assert detok.stopped and sent == "The answer is 42. " and detok.flush() == ""


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer):
    detok = IncrementalDetokenizer(lambda i: bytes([i]), stop_strings=("STOP",))
    assert detok.add(b"ST") == ""
    assert detok.add(b"ar") == "STar"
    assert detok.add(b"S") == ""
    assert detok.flush() == "S"
