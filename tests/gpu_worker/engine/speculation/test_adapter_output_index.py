"""An adapter's recent outputs as a draft source: the latest continuation of the longest suffix
found, bounded in tokens, outputs dropped oldest first."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine.speculation.adapter_output_index import AdapterOutputIndex


def test_drafts_what_followed_the_suffix_in_an_earlier_output():
    index = AdapterOutputIndex(max_tokens=100, max_ngram=4)
    index.add([10, 11, 12, 13, 14, 15])
    assert index.match([7, 7, 11, 12], 3) == (2, (13, 14, 15))


def test_the_longest_suffix_wins_and_the_latest_output_on_a_tie():
    index = AdapterOutputIndex(max_tokens=100, max_ngram=4)
    index.add([1, 2, 3, 40])
    index.add([9, 2, 3, 50])
    index.add([5, 3, 60])
    assert index.match([1, 2, 3], 1) == (3, (40,))  # "1 2 3" beats the later "2 3" and "3"
    assert index.match([8, 2, 3], 1) == (2, (50,))  # "2 3": the latest output with it


def test_single_token_and_unknown_suffixes_draft_nothing():
    index = AdapterOutputIndex(max_tokens=100, max_ngram=4)  # min_ngram 2: one shared token is noise
    index.add([1, 2, 3])
    assert index.match([9, 2], 2) == (0, ())
    assert index.match([4, 5], 2) == (0, ())
    assert index.match([1, 2], 0) == (0, ())


def test_tokens_are_bounded_and_the_oldest_output_goes_first():
    index = AdapterOutputIndex(max_tokens=8, max_ngram=3)
    index.add([1, 2, 3, 4])
    index.add([5, 6, 7, 8])
    assert index.match([1, 2], 2) == (2, (3, 4))
    index.add([20, 21, 22])
    assert index.tokens == 7
    assert index.match([1, 2], 2) == (0, ())  # its output was dropped
    assert index.match([5, 6], 1) == (2, (7,))
    index.add(list(range(100, 120)))  # longer than the bound: its last 8 tokens are kept
    assert index.tokens == 8
    assert index.match([113, 114], 2) == (2, (115, 116))
    assert index.match([100, 101], 1) == (0, ())


def test_the_map_stays_bounded_however_many_outputs_pass():
    index = AdapterOutputIndex(max_tokens=16, max_ngram=3)
    for i in range(500):
        index.add([1000 + i * 8 + j for j in range(8)])
    assert index.tokens == 16
    assert len(index._grams) <= 2 * 16 * 2


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        AdapterOutputIndex(max_tokens=0, max_ngram=3)
