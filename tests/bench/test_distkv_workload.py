"""The DistKV benchmark's workload: the long share, lengths, placement and prompts are fixed by
the seed."""

from __future__ import annotations

import pytest

from bench.distkv.workload import TOKEN_ID_RANGE, long_count, make_mix, prompt_ids

SHORT, LONG = (128, 320), (1100, 1300)


def mix(fraction: float, count: int = 20, seed: int = 13):
    return make_mix(fraction, count, 3, SHORT, LONG, 8, seed)


@pytest.mark.parametrize(
    ("fraction", "count", "expected"),
    [(0.0, 20, 0), (0.01, 20, 1), (0.01, 100, 1), (0.10, 20, 2), (0.50, 20, 10), (1.0, 7, 7)],
)
def test_long_count_rounds_but_keeps_one_long_request_for_any_positive_share(fraction, count, expected):
    assert long_count(fraction, count) == expected


def test_long_count_rejects_a_share_outside_zero_one():
    with pytest.raises(ValueError, match="long_fraction"):
        long_count(1.5, 10)


def test_a_mix_has_its_long_share_with_lengths_in_their_ranges():
    requests = mix(0.5)
    longs = [r for r in requests if r.long]
    assert len(requests) == 20 and len(longs) == 10
    assert all(LONG[0] <= r.prompt_tokens <= LONG[1] for r in longs)
    assert all(SHORT[0] <= r.prompt_tokens <= SHORT[1] for r in requests if not r.long)
    assert all(r.new_tokens == 8 for r in requests)


def test_requests_go_to_the_workers_round_robin_with_unique_ids():
    requests = mix(0.1)
    assert [r.worker for r in requests[:6]] == [0, 1, 2, 0, 1, 2]
    assert len({r.request_id for r in requests}) == len(requests)


def test_the_same_seed_gives_the_same_mix_and_another_seed_another():
    assert mix(0.1) == mix(0.1)
    assert mix(0.1, seed=14) != mix(0.1)


def test_prompts_are_reproducible_distinct_and_in_the_token_range():
    first = prompt_ids(500, 13, "r0001")
    assert first == prompt_ids(500, 13, "r0001") and len(first) == 500
    assert first != prompt_ids(500, 13, "r0002")
    assert all(TOKEN_ID_RANGE[0] <= t < TOKEN_ID_RANGE[1] for t in first)


def test_bad_ranges_and_counts_are_refused():
    with pytest.raises(ValueError, match="range"):
        make_mix(0.1, 10, 3, (300, 200), LONG, 8, 1)
    with pytest.raises(ValueError, match="at least one"):
        make_mix(0.1, 0, 3, SHORT, LONG, 8, 1)
