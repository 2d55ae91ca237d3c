"""Stop strings in a bounded tail: the same verdict at every token as decoding the whole output,
for any output and any stop string the validation admits, at a cost that does not grow with the
output."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.sampling.request_validation import MAX_STOP_STRING_BYTES
from services.runtime.sampling.stop_window import StopStringTail, tail_bytes

# A toy byte-level vocabulary with tokens of 1 to 4 bytes, multi-byte characters split across
# tokens and a token that is one whole 4-byte character: every boundary case of real BPE.
VOCAB = [b"a", b"b", b"ab", b"ba", b" ", b"END", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xf0\x9f", b"\x8e\x89",
         b"\xf0\x9f\x8e\x89", b"\n", b"\n\n"]  # fmt: skip


def toy_bytes(token_id: int) -> bytes:
    return VOCAB[token_id]


def first_stop_by_full_decode(ids: list[int], stops: list[str]) -> int | None:
    """The old way: decode everything after each token."""
    for n in range(1, len(ids) + 1):
        text = b"".join(VOCAB[i] for i in ids[:n]).decode("utf-8", errors="replace")
        if any(stop in text for stop in stops):
            return n
    return None


def first_stop_by_tail(ids: list[int], stops: list[str], window_bytes: int) -> int | None:
    tail = StopStringTail(toy_bytes, window_bytes)
    for n in range(1, len(ids) + 1):
        if any(stop in tail(ids[:n]) for stop in stops):
            return n
    return None


STOPS = st.lists(st.text(alphabet="ab é🎉\nEND", min_size=1, max_size=6), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, len(VOCAB) - 1), max_size=60), stops=STOPS)
def test_tail_finds_a_stop_string_at_the_same_token_as_a_whole_decode(ids, stops):
    window = max(len(s.encode()) for s in stops)
    assert first_stop_by_tail(ids, stops, window) == first_stop_by_full_decode(ids, stops)


def test_the_work_per_token_does_not_grow_with_the_output():
    looked_up: list[int] = []

    def counting_bytes(token_id: int) -> bytes:
        looked_up.append(token_id)
        return VOCAB[token_id]

    tail = StopStringTail(counting_bytes, window_bytes=8)
    ids = [0, 1, 2, 3] * 5_000
    for n in (10, 1_000, 20_000):
        looked_up.clear()
        text = tail(ids[:n])
        assert len(looked_up) <= 8 + 1  # the window plus the newest token, never the whole output
        assert len(text.encode()) <= 8 + 2


def test_tail_of_short_outputs_is_all_of_them():
    assert tail_bytes([], toy_bytes, 10) == b""
    assert tail_bytes([0, 1], toy_bytes, 10) == b"ab"
    assert tail_bytes([5, 5, 5], toy_bytes, 2) == b"ENDEND"  # newest token + at least 2 bytes


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer().tokenizer


def test_real_tokenizer_stop_spanning_tokens_is_found_when_completed(smollm2):
    text = "The answer is forty-two. THE END. Nothing more"
    ids = smollm2.encode(text)
    stop = "THE END"
    tail = StopStringTail(smollm2.id_to_bytes)
    completed_at = next(n for n in range(1, len(ids) + 1) if stop in smollm2.decode(ids[:n]))
    assert len(smollm2.encode(stop)) > 1, "the stop string must span tokens for this test"
    assert [stop in tail(ids[:n]) for n in range(1, len(ids) + 1)].index(True) + 1 == completed_at
    assert len(tail(ids).encode()) <= MAX_STOP_STRING_BYTES + max(len(smollm2.id_to_bytes(i)) for i in ids)
