"""The loop-lag probe's report: stretches that overlap in time are one line, named with how many
services they were seen in, and those the idle control saw too are the machine's
(bench/fuzz/loop_lag.py)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.fuzz.loop_lag import CONTROL, IdleControl, Stretch, split_by_control, stretch_lines


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


def test_a_stretch_the_idle_control_saw_too_is_the_machines():
    stretches = [
        Stretch("gateway", 10.0, 2.2, True, "HTTP POST /generate_stream [no key]"),
        Stretch(CONTROL, 10.4, 1.5, True, "HTTP POST /generate_stream [no key]"),
        Stretch("gpu_worker", 50.0, 3.0, False, "gRPC gpu_worker Worker/Prefetch [scheduler]"),
    ]
    own, machine = split_by_control(stretches)
    assert [s.service for s in own] == ["gpu_worker"]
    assert [s.service for s in machine] == ["gateway", CONTROL]


def test_the_idle_control_answers_health_checks_from_a_process_of_its_own():
    with IdleControl() as control:
        reply = health_pb2_grpc.HealthStub(control.channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
