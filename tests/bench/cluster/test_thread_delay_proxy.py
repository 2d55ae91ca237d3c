"""The threaded delaying proxy: the asyncio proxy's tests run on it (bytes whole and in order
over many connections, half-close, gRPC calls and server streams, a delay that changes at run
time), with sub-millisecond delays (only the lower bound is a test; what it adds is measured in
``bench.cluster.thread_delay_proxy_bench``), a target that refuses, and its command line."""

from __future__ import annotations

import asyncio

import pytest

from bench.cluster.thread_delay_proxy import ThreadDelayProxy
from bench.cluster.thread_delay_proxy_bench import ProxyProcess
from tests.bench.cluster import test_delay_proxy
from tests.bench.cluster.test_delay_proxy import address_of, echo_server, round_trip


@pytest.fixture(autouse=True)
def threaded_proxy(monkeypatch):
    """The asyncio proxy's tests below, each on this proxy (same constructor, ``async with``)."""
    monkeypatch.setattr(test_delay_proxy, "DelayProxy", ThreadDelayProxy)


test_a_round_trip_takes_at_least_twice_the_delay_which_changes_at_run_time = (
    test_delay_proxy.test_a_round_trip_takes_at_least_twice_the_delay_which_changes_at_run_time
)
test_many_connections_keep_their_bytes_whole_and_in_order = (
    test_delay_proxy.test_many_connections_keep_their_bytes_whole_and_in_order
)
test_a_half_closed_connection_still_carries_the_answer = (
    test_delay_proxy.test_a_half_closed_connection_still_carries_the_answer
)
test_grpc_calls_and_server_streams_pass_through = (
    test_delay_proxy.test_grpc_calls_and_server_streams_pass_through
)


async def test_sub_millisecond_delays_are_added_to_each_direction():
    server = await echo_server()
    async with server, ThreadDelayProxy(address_of(server), delay_s=0.0002) as proxy:
        reader, writer = await asyncio.open_connection(*proxy.address)
        assert all([await round_trip(reader, writer, b"ping") >= 0.0004 for _ in range(20)])
        proxy.delay_s = 0.001
        assert all([await round_trip(reader, writer, b"ping") >= 0.002 for _ in range(20)])
        writer.close()


async def test_a_target_that_refuses_closes_the_client_connection():
    server = await echo_server()
    target = address_of(server)
    server.close()
    await server.wait_closed()
    async with ThreadDelayProxy(target) as proxy:
        try:  # the reset may come before the client's event loop has seen its connection open
            reader, writer = await asyncio.open_connection(*proxy.address)
            assert await reader.read() == b""
            writer.close()
        except ConnectionResetError:
            pass


async def test_the_command_line_proxy_takes_its_delay_from_stdin():
    server = await echo_server()
    target = "{}:{}".format(*address_of(server))
    async with server, ProxyProcess([f"127.0.0.1:0={target}"]) as proxy:
        reader, writer = await asyncio.open_connection(*proxy.addresses[0])
        await proxy.set_delay_ms(20)
        assert await round_trip(reader, writer, b"ping") >= 0.04
        await proxy.set_delay_ms(0.5)
        assert await round_trip(reader, writer, b"ping") >= 0.001
        writer.close()
