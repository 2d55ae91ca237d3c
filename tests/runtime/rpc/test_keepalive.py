"""Keepalive between services: a stream quiet for several ping periods (a request waiting in a
worker's queue) outlives its caller's pings, because the services' servers accept them, while a
server on gRPC's default policy ends it with GOAWAY "too_many_pings" at the third ping; and once
the link under it is cut (a partition: nothing refused, nothing reset), the stream fails with
UNAVAILABLE at the next unanswered ping instead of waiting for a next message forever. The ping
period is scaled down to a second; the two channels ping on the same schedule, so the kept stream
is released only once the control has been cut (no clock is raced)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio
from support.tcp_link import TcpLink

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
CALL_GUARD_S = 30.0
"""The kept call's deadline: with gRPC's defaults (a minute to give a ping up, one ping a minute
after two without the caller writing) the cut would be noticed only after it; with ours, about
two seconds after the cut."""


async def quiet_server(options) -> tuple[aio.Server, str, asyncio.Event]:
    """A server whose one stream sends a message, says nothing until released, then another, then
    nothing again."""
    release = asyncio.Event()

    async def stream(request: bytes, context) -> object:
        yield b"first"
        await release.wait()
        yield b"second"
        await asyncio.Event().wait()

    server = aio.server(options=list(options))
    handlers = {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Quiet", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", release


def test_servers_accept_pings_at_the_period_the_services_and_the_sdk_send_them():
    for options in (CHANNEL_OPTIONS, sdk_channels.CHANNEL_OPTIONS):
        settings = dict(options)
        ping_every_s = settings["grpc.keepalive_time_ms"] / 1000
        assert MIN_PING_INTERVAL_S <= ping_every_s / 2 and PING_TIMEOUT_S < ping_every_s
        assert settings["grpc.http2.ping_timeout_ms"] == settings["grpc.keepalive_timeout_ms"]
        assert settings["grpc.http2.max_pings_without_data"] == 0


async def test_a_quiet_stream_outlives_pings_a_default_server_cuts_it_for_and_fails_fast_once_cut_off():
    ours, ours_address, release = await quiet_server(server_options(PING_S, PING_S, PING_S / 2))
    default, default_address, _ = await quiet_server(())
    link = await TcpLink(ours_address).start()
    options = channel_options(ping_every_s=PING_S, ping_timeout_s=PING_S)
    try:
        async with (
            aio.insecure_channel(link.address, options=options) as kept_channel,
            aio.insecure_channel(default_address, options=options) as cut_channel,
        ):
            kept = kept_channel.unary_stream("/test.Quiet/Stream")(b"", timeout=CALL_GUARD_S)
            cut = cut_channel.unary_stream("/test.Quiet/Stream")(b"")
            assert await kept.read() == b"first" and await cut.read() == b"first"
            with pytest.raises(aio.AioRpcError) as goaway:
                await cut.read()
            assert goaway.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "ping" in goaway.value.details().lower()
            release.set()
            assert await kept.read() == b"second"

            link.cut()
            with pytest.raises(aio.AioRpcError) as unanswered:
                await kept.read()
            assert unanswered.value.code() == grpc.StatusCode.UNAVAILABLE, unanswered.value.details()
            assert "ping timeout" in unanswered.value.details()
    finally:
        await link.close()
        await ours.stop(None)
        await default.stop(None)
