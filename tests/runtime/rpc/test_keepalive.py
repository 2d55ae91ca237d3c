"""Keepalive between services: a stream quiet for several ping periods (a request waiting in a
worker's queue) outlives its caller's pings, because the services' servers accept them, while a
server on gRPC's default policy ends it with GOAWAY "too_many_pings" at the third ping. The ping
period is scaled down to a second; the two channels ping on the same schedule, so the
kept stream is released only once the control has been cut (no clock is raced)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from loramesh import tls as sdk_channels
from services.runtime.rpc.keepalive import (
    CHANNEL_OPTIONS,
    MIN_PING_INTERVAL_S,
    PING_TIMEOUT_S,
    channel_options,
    server_options,
)

PING_S = 1.0
"""gRPC does not ping more often than once a second, whatever it is asked."""


async def quiet_server(options) -> tuple[aio.Server, str, asyncio.Event]:
    """A server whose one stream sends a message, says nothing until released, then another."""
    release = asyncio.Event()

    async def stream(request: bytes, context) -> object:
        yield b"first"
        await release.wait()
        yield b"second"

    server = aio.server(options=list(options))
    handlers = {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Quiet", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", release


def test_servers_accept_pings_at_the_period_the_services_and_the_sdk_send_them():
    for options in (CHANNEL_OPTIONS, sdk_channels.CHANNEL_OPTIONS):
        ping_every_s = dict(options)["grpc.keepalive_time_ms"] / 1000
        assert MIN_PING_INTERVAL_S <= ping_every_s / 2 and PING_TIMEOUT_S < ping_every_s


async def test_a_quiet_stream_outlives_the_pings_that_a_default_server_would_cut_it_for():
    ours, ours_address, release = await quiet_server(server_options(PING_S, PING_S, PING_S / 2))
    default, default_address, _ = await quiet_server(())
    options = channel_options(ping_every_s=PING_S, ping_timeout_s=PING_S)
    try:
        async with (
            aio.insecure_channel(ours_address, options=options) as kept_channel,
            aio.insecure_channel(default_address, options=options) as cut_channel,
        ):
            kept = kept_channel.unary_stream("/test.Quiet/Stream")(b"")
            cut = cut_channel.unary_stream("/test.Quiet/Stream")(b"")
            assert await kept.read() == b"first" and await cut.read() == b"first"
            with pytest.raises(aio.AioRpcError) as goaway:
                await cut.read()
            assert goaway.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "ping" in goaway.value.details().lower()
            release.set()
            assert await kept.read() == b"second"
    finally:
        await ours.stop(None)
        await default.stop(None)
