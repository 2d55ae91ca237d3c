"""The loop-lag probe's report: stretches that overlap in time are one line, named with how many
services they were seen in (bench/fuzz/loop_lag.py)."""

from __future__ import annotations

from bench.fuzz.loop_lag import Stretch, stretch_lines


def test_overlapping_stretches_are_one_line_and_a_lone_one_its_own():
    stretches = [
        Stretch("gateway", 10.0, 2.2, True, "HTTP POST /generate_stream [no key]"),
        Stretch("gpu_worker", 50.0, 3.0, False, "gRPC gpu_worker Worker/Prefetch [scheduler]"),
        Stretch("adapter_store", 10.5, 2.0, True, "HTTP POST /generate_stream [no key]"),
    ]
    assert stretch_lines(stretches) == [
        "2 services at once: gateway 2.20 s, adapter_store 2.00 s, during HTTP POST /generate_stream [no key]",
        "gpu_worker 3.00 s (no answer), during gRPC gpu_worker Worker/Prefetch [scheduler]",
    ]
