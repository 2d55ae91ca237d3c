"""The delaying proxy: bytes arrive whole and in order, at least the configured delay late in
each direction (only the lower bound is a test; the added latency is measured in
``bench.cluster.delay_proxy_bench``), over many connections, half-close and gRPC streams."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.cluster.delay_proxy import DelayProxy, parse_address

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


def address_of(server: asyncio.Server) -> tuple[str, int]:
    return server.sockets[0].getsockname()[:2]


async def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer.write(payload)
    await reader.readexactly(len(payload))
    return loop.time() - start


async def test_a_round_trip_takes_at_least_twice_the_delay_which_changes_at_run_time():
    server = await echo_server()
    async with server, DelayProxy(address_of(server), delay_s=0.02) as proxy:
        reader, writer = await asyncio.open_connection(*proxy.address)
        assert all([await round_trip(reader, writer, b"ping") >= 0.04 for _ in range(5)])
        proxy.delay_s = 0.05
        assert await round_trip(reader, writer, b"ping") >= 0.1
        proxy.delay_s = 0.0
        assert await round_trip(reader, writer, b"ping") >= 0.0
        writer.close()
        with pytest.raises(ValueError, match="0 or more seconds"):
            proxy.delay_s = -0.001


async def test_many_connections_keep_their_bytes_whole_and_in_order():
    server = await echo_server()
    async with server, DelayProxy(address_of(server), delay_s=0.005) as proxy:

        async def client(i: int) -> bool:
            reader, writer = await asyncio.open_connection(*proxy.address)
            sent = b"".join(hashlib.sha256(f"{i}-{k}".encode()).digest() * 64 for k in range(100))
            for k in range(0, len(sent), 7919):  # many writes of an odd size
                writer.write(sent[k : k + 7919])
            writer.write_eof()
            received = await reader.read()  # to the echo server's EOF: half-close went through
            writer.close()
            return received == sent

        assert all(await asyncio.gather(*(client(i) for i in range(50))))


async def test_a_half_closed_connection_still_carries_the_answer():
    async def count_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        total = len(await reader.read())  # everything up to the client's EOF
        writer.write(f"got {total} bytes".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(count_then_answer, "127.0.0.1", 0)
    async with server, DelayProxy(address_of(server), delay_s=0.01) as proxy:
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"x" * 300_000)
        writer.write_eof()
        assert await reader.read() == b"got 300000 bytes"
        writer.close()


async def test_grpc_calls_and_server_streams_pass_through():
    server = aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set("svc", SERVING)
    try:
        async with (
            DelayProxy(("127.0.0.1", port), delay_s=0.01) as proxy,
            aio.insecure_channel("{}:{}".format(*proxy.address)) as channel,
        ):
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest(service="svc"))).status == SERVING
            loop = asyncio.get_running_loop()
            start = loop.time()
            await stub.Check(health_pb2.HealthCheckRequest(service="svc"))
            assert loop.time() - start >= 0.02
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"))
            assert (await watch.read()).status == SERVING
            await health_servicer.set("svc", NOT_SERVING)
            assert (await watch.read()).status == NOT_SERVING
            watch.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.Check(health_pb2.HealthCheckRequest(service="other"))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(None)


async def test_a_target_that_refuses_closes_the_client_connection():
    server = await echo_server()
    target = address_of(server)
    server.close()
    await server.wait_closed()
    async with DelayProxy(target) as proxy:
        reader, writer = await asyncio.open_connection(*proxy.address)
        try:
            assert await reader.read() == b""
        except ConnectionResetError:
            pass
        writer.close()


def test_addresses_are_host_and_port():
    assert parse_address("10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="expected host:port"):
        parse_address("10.0.0.2")


async def test_the_command_line_proxy_takes_its_delay_from_stdin():
    server = await echo_server()
    target = "{}:{}".format(*address_of(server))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.cluster.delay_proxy", "--route", f"127.0.0.1:0={target}", "--delay-ms", "20",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        listening = (await process.stdout.readline()).decode().split()
        assert listening[0] == "listening" and listening[-1] == target
        reader, writer = await asyncio.open_connection(*parse_address(listening[1]))
        assert await round_trip(reader, writer, b"ping") >= 0.04
        process.stdin.write(b"delay_ms 30\n")
        assert (await process.stdout.readline()).decode().strip() == "delay_ms 30"
        assert await round_trip(reader, writer, b"ping") >= 0.06
        writer.close()
    finally:
        process.kill()
        await process.wait()
        server.close()
