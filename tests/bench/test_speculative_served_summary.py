"""The served speculative bench's summaries: ratios of the speculating mesh to ``off`` and, with
llama-server beside them, of each mesh's batch-1 rate to llama-server's; and its quick-trace
requests, drawn afresh for each use (no mesh started)."""

from __future__ import annotations

import pytest

from bench.speculative_served_bench import LLAMA, fresh_trace, medians, pooled, summarise_round


def a_group(tok_s: float, tokens: list[int], output_tokens: int = 100) -> dict:
    return {
        "tok_s": tok_s,
        "output_tokens": output_tokens,
        "seconds": output_tokens / tok_s,
        "tokens": {"g": tokens},
    }


def measured(rates: dict[str, float], tokens: list[int], group: float) -> dict:
    return {
        "batch_one": {"decode_tok_s": rates, "tokens": {item: tokens for item in rates}},
        "concurrent": pooled(a_group(group, tokens), a_group(group, tokens)),
    }


def test_a_meshs_two_concurrent_groups_pool_their_tokens_over_their_wall_times():
    first, second = a_group(100.0, [1], output_tokens=200), a_group(200.0, [2], output_tokens=200)
    both = pooled(first, second)
    assert both["tok_s"] == pytest.approx(400 / 3)  # 400 tokens in 2 s + 1 s, not the mean 150
    assert both["group_tok_s"] == [100.0, 200.0]
    assert both["tokens"] == {"g": [1]}


def a_round(spec_rate: float, llama_rate: float) -> dict:
    row = {
        "w": {
            "off": measured({"a": 100.0, "b": 50.0}, [1, 2], 200.0),
            "ngram": measured({"a": spec_rate, "b": 100.0}, [1, 2], 220.0),
            LLAMA: {
                "batch_one": {"decode_tok_s": {"a": llama_rate, "b": 50.0}, "tokens": {"a": [1, 2], "b": [3]}}
            },
        }
    }
    return summarise_round(row, ("off", "ngram"))


def test_ratios_against_off_and_llama_server_per_item_and_as_the_median_of_geometric_means():
    rounds = [a_round(200.0, 100.0), a_round(150.0, 50.0), a_round(400.0, 100.0)]

    assert rounds[0]["w"]["batch_one_ratio"] == {"a": 2.0, "b": 2.0}
    assert rounds[0]["w"]["batch_one_ratio_vs_llama"] == {
        "off": {"a": 1.0, "b": 1.0},
        "ngram": {"a": 2.0, "b": 2.0},
    }
    assert rounds[0]["w"]["llama_same_tokens_as_off"] == {"a": True, "b": False}
    summary = medians(rounds)["w"]
    # Per round ngram/llama: sqrt(2*2)=2, sqrt(3*2)=2.449, sqrt(4*2)=2.828.
    assert summary["batch_one_ratio_vs_llama"]["ngram"] == pytest.approx(6**0.5)
    assert summary["batch_one_ratio_vs_llama_per_item"]["off"] == {"a": 1.0, "b": 1.0}
    assert summary["concurrent_ratio"] == pytest.approx(1.1)


def test_without_llama_server_no_ratio_against_it():
    row = {"w": {"off": measured({"a": 1.0}, [1], 1.0), "ngram": measured({"a": 2.0}, [1], 1.0)}}
    rounds = [summarise_round(row, ("off", "ngram"))]
    assert "batch_one_ratio_vs_llama" not in rounds[0]["w"]
    assert "batch_one_ratio_vs_llama" not in medians(rounds)["w"]


def test_no_trace_prompt_is_sent_twice_while_the_trace_keeps_its_shape():
    uses = [fresh_trace(8, index, group) for index in (-1, 0, 1) for group in (False, True)]
    prompts = [item.prompt_ids for items in uses for item in items]
    assert len(set(prompts)) == len(prompts) == 48
    shapes = {
        tuple((item.adapter, item.max_tokens, len(item.prompt_ids)) for item in items) for items in uses
    }
    assert len(shapes) == 1
