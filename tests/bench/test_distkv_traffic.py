"""Bytes of a borrowing decode step, from the real lending messages, against the remote KV."""

from __future__ import annotations

import pytest

from bench.distkv.traffic import ModelShape, decode_step_traffic
from bench.distkv.traffic_counters import per_step, read_counters

SMOLLM2 = ModelShape()


def test_a_smollm2_fp32_block_is_720_kib():
    assert SMOLLM2.kv_dim == 192
    assert SMOLLM2.block_bytes == 720 * 1024
    assert ModelShape(dtype="bfloat16").block_bytes == 360 * 1024


def test_no_remote_block_moves_nothing():
    traffic = decode_step_traffic(SMOLLM2, {}, 900)
    assert (traffic.sent, traffic.received, traffic.kv_bytes, traffic.kv_over_moved) == (0, 0, 0, 0.0)


def test_each_creditor_gets_a_query_per_layer_and_returns_a_partial_and_its_lse():
    one = decode_step_traffic(SMOLLM2, {"c1": 10}, 1200)
    two = decode_step_traffic(SMOLLM2, {"c1": 5, "c2": 5}, 1200)
    query = 9 * 64 * 4
    partial = 9 * 64 * 4 + 9 * 4
    new_kv = 2 * 192 * 4
    # Payload dominates the protobuf framing: per layer one query out, one partial back, and
    # the new token's K and V to the tail block's creditor.
    assert one.received == pytest.approx(30 * partial, rel=0.05)
    assert one.sent == pytest.approx(30 * (query + new_kv), rel=0.05)
    assert two.received == pytest.approx(2 * one.received, rel=0.01)
    assert two.sent == pytest.approx(one.sent + 30 * query, rel=0.05)
    assert one.kv_bytes == two.kv_bytes == 10 * 720 * 1024


def test_moving_the_kv_costs_about_its_token_count_more_than_moving_the_queries():
    traffic = decode_step_traffic(SMOLLM2, {"c1": 40, "c2": 40}, 2000)
    assert traffic.moved == traffic.sent + traffic.received
    assert 100 < traffic.kv_over_moved < 400


def test_counters_are_read_only_when_the_worker_reports_them():
    assert read_counters({"queue": 0, "free_blocks": 3}) is None
    load = {"remote_attention_s": 1.5, "remote_attention_calls": "60", "remote_bytes_sent": "1000",
            "remote_bytes_received": "2000", "lent_attention_s": 0.0, "decode_steps": "10"}  # fmt: skip
    assert read_counters(load)["remote_attention_calls"] == 60.0


def test_per_step_divides_the_deltas_by_the_steps_between_two_readings():
    before = {"remote_attention_s": 1.0, "remote_attention_calls": 60, "remote_bytes_sent": 1000,
              "remote_bytes_received": 2000, "lent_attention_s": 0.0, "decode_steps": 10}  # fmt: skip
    after = {**before, "remote_attention_s": 3.0, "remote_attention_calls": 300,
             "remote_bytes_sent": 5000, "remote_bytes_received": 10000, "decode_steps": 14}  # fmt: skip
    steps = per_step(before, after)
    assert steps == {
        "steps": 4, "remote_attention_ms_per_step": 500.0, "remote_calls_per_step": 60.0,
        "bytes_sent_per_step": 1000.0, "bytes_received_per_step": 2000.0,
    }  # fmt: skip
    assert per_step(after, after) is None
