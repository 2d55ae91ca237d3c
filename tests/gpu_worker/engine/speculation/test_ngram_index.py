"""Prompt lookup: the tokens after the latest earlier occurrence of the longest matching suffix."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine.speculation.ngram_index import NgramIndex


def indexed(tokens: list[int], max_ngram: int = 3) -> NgramIndex:
    index = NgramIndex(max_ngram)
    index.sync(tokens)
    return index


def test_proposes_what_followed_the_earlier_occurrence_of_the_suffix():
    assert indexed([1, 2, 3, 4, 5, 9, 1, 2, 3]).propose(3) == (4, 5, 9)


def test_the_longest_suffix_that_occurred_before_wins():
    # "3" last occurred before 7, but "2 3" occurred before 4: the longer match predicts.
    assert indexed([2, 3, 4, 0, 3, 7, 2, 3]).propose(1) == (4,)


def test_the_latest_earlier_occurrence_is_used():
    assert indexed([5, 1, 5, 2, 5]).propose(2) == (2, 5)


def test_a_short_continuation_gives_a_short_draft():
    assert indexed([8, 8]).propose(4) == (8,)


def test_no_draft_without_an_earlier_occurrence_or_budget():
    assert indexed([1, 2, 3]).propose(4) == ()
    assert indexed([1, 2, 1]).propose(0) == ()
    assert NgramIndex().propose(3) == ()


def test_growing_the_sequence_indexes_only_the_new_tokens():
    index = indexed([1, 2, 3])
    index.sync([1, 2, 3, 9, 1, 2])
    assert index.propose(2) == (3, 9)


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramIndex(max_ngram=0)
