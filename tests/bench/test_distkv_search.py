"""The longest-context search: bisection over a stand-in configuration that serves contexts up to
a known length (the probe is the only part replaced; the search is what is tested)."""

from __future__ import annotations

import pytest

from bench.distkv.search import Probe, longest_servable


def serving_up_to(limit: int, probed: list[int]):
    async def probe(context: int) -> Probe:
        probed.append(context)
        return Probe(context, context <= limit, "" if context <= limit else "refused")

    return probe


async def test_bisection_narrows_the_bracket_to_the_resolution():
    probed: list[int] = []
    result = await longest_servable(serving_up_to(1024, probed), 512, 1026, 16, max_probes=10)
    assert result.longest_served == 1024
    assert result.shortest_refused == 1026  # the bound itself is never probed
    assert probed == [512, 768, 896, 960, 992, 1008, 1024]
    assert [p.context_tokens for p in result.probes] == probed


async def test_a_limit_between_probes_is_bracketed():
    result = await longest_servable(serving_up_to(1000, []), 512, 1026, 16, max_probes=10)
    assert result.longest_served <= 1000 < result.shortest_refused
    assert result.shortest_refused - result.longest_served <= 16


async def test_max_probes_stops_the_search_with_the_bracket_reached():
    probed: list[int] = []
    result = await longest_servable(serving_up_to(1000, probed), 512, 1026, 16, max_probes=3)
    assert len(probed) == 3
    assert (result.longest_served, result.shortest_refused) == (896, 1026)


async def test_the_first_split_is_probed_second_and_settles_a_goal():
    probed: list[int] = []
    result = await longest_servable(
        serving_up_to(2700, probed), 1024, 2818, 128, max_probes=3, first_split=2560
    )
    assert probed == [1024, 2560, 2688]
    assert (result.longest_served, result.shortest_refused) == (2688, 2818)


async def test_a_goal_not_served_becomes_the_upper_end():
    probed: list[int] = []
    result = await longest_servable(
        serving_up_to(2000, probed), 1024, 2818, 128, max_probes=3, first_split=2560
    )
    assert probed == [1024, 2560, 1792]
    assert (result.longest_served, result.shortest_refused) == (1792, 2560)


async def test_when_even_the_low_end_fails_nothing_is_served():
    probed: list[int] = []
    result = await longest_servable(serving_up_to(100, probed), 512, 1026, 16, max_probes=10)
    assert probed == [512]
    assert (result.longest_served, result.shortest_refused) == (None, 512)


@pytest.mark.parametrize(
    ("low", "unservable", "resolution", "probes"),
    [(0, 10, 1, 1), (10, 10, 1, 1), (1, 10, 0, 1), (1, 10, 1, 0)],
)
async def test_bad_arguments_are_refused(low, unservable, resolution, probes):
    with pytest.raises(ValueError):
        await longest_servable(serving_up_to(5, []), low, unservable, resolution, probes)
