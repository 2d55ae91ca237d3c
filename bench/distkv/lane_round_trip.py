"""What one lending round trip costs between two Python processes over TCP, by carrier: a gRPC
unary call (the gRPC lane: one call per layer), one long-lived bidirectional gRPC stream carrying
every call, and framed messages on a raw TCP socket (the TCP lane), with and without TLS.

This is the measurement the TCP lane was chosen by (docs/benchmarks.md, "DistKV between nodes"):
the server is a separate process that answers each message from a worker thread, as a creditor
does (``asyncio.to_thread`` in the servicer, the lane's thread per debtor), and the messages are
the size of a decode step's ``AttendRemote`` for SmolLM2-135M (~3 KB out, ~2.4 KB back).

```sh
.venv/bin/python -m bench.distkv.lane_round_trip --rounds 2000
.venv/bin/python -m bench.distkv.lane_round_trip --rounds 500 --link-delays-ms 0,0.2,1   # through the delaying proxy
```

With ``--link-delays-ms`` every carrier's connection goes through ``bench.cluster.thread_delay_proxy``
at each one-way delay in turn (the link of ``bench.distkv.step_ratio``), passes interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import socket
import ssl
import statistics
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc import aio

from bench.cluster.thread_delay_proxy_bench import ProxyProcess
from bench.distkv.step_ratio import _delays

_UNARY = "/bench.Echo/Unary"
_STREAM = "/bench.Echo/Stream"
_HEADER = struct.Struct("<BI")


def _identity(data: bytes) -> bytes:
    return data


def _reply(size: int):
    payload = os.urandom(size)
    return lambda request: payload


async def _serve_grpc(port_out, reply_bytes: int) -> None:
    answer = _reply(reply_bytes)

    async def unary(request: bytes, context) -> bytes:
        return await asyncio.to_thread(answer, request)

    async def stream(requests, context):
        async for request in requests:
            yield await asyncio.to_thread(answer, request)

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _identity, _identity),
        },
    )
    server = aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_out.send(port)
    await server.wait_for_termination()


def _read_exactly(connection, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = connection.recv(left)
        if not chunk:
            raise ConnectionError("closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _serve_tcp(port_out, reply_bytes: int, tls_dir: str) -> None:
    answer = _reply(reply_bytes)
    listener = socket.create_server(("127.0.0.1", 0))
    context = None
    if tls_dir:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(f"{tls_dir}/cert.pem", f"{tls_dir}/key.pem")
    port_out.send(listener.getsockname()[1])

    def serve(connection) -> None:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:
            connection = context.wrap_socket(connection, server_side=True)
        with connection:
            try:
                while True:
                    _, size = _HEADER.unpack(_read_exactly(connection, _HEADER.size))
                    reply = answer(_read_exactly(connection, size))
                    connection.sendall(_HEADER.pack(0, len(reply)) + reply)
            except (ConnectionError, OSError):
                return

    while True:
        connection, _ = listener.accept()
        threading.Thread(target=serve, args=(connection,), daemon=True).start()


def _grpc_server(port_out, reply_bytes: int) -> None:
    asyncio.run(_serve_grpc(port_out, reply_bytes))


def _timed(rounds: int, one) -> dict:
    for _ in range(min(100, rounds)):
        one()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        one()
        times.append(time.perf_counter() - start)
    times.sort()
    return {
        "p50_us": round(1e6 * statistics.median(times), 1),
        "p90_us": round(1e6 * times[int(0.9 * len(times))], 1),
        "mean_us": round(1e6 * statistics.fmean(times), 1),
    }


def _grpc_unary(address: tuple[str, int], request: bytes, rounds: int) -> dict:
    with grpc.insecure_channel("{}:{}".format(*address)) as channel:
        call = channel.unary_unary(_UNARY, request_serializer=_identity, response_deserializer=_identity)
        return _timed(rounds, lambda: call.future(request).result())


def _grpc_stream(address: tuple[str, int], request: bytes, rounds: int) -> dict:
    with grpc.insecure_channel("{}:{}".format(*address)) as channel:
        call = channel.stream_stream(_STREAM, request_serializer=_identity, response_deserializer=_identity)
        sent: queue.SimpleQueue = queue.SimpleQueue()
        replies = call(iter(sent.get, None))

        def one() -> None:
            sent.put(request)
            next(replies)

        try:
            return _timed(rounds, one)
        finally:
            sent.put(None)
            replies.cancel()


def _tcp(address: tuple[str, int], request: bytes, rounds: int, tls_dir: str) -> dict:
    connection = socket.create_connection(address)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls_dir:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(f"{tls_dir}/cert.pem")
        connection = context.wrap_socket(connection, server_hostname="localhost")
    frame = _HEADER.pack(1, len(request)) + request

    def one() -> None:
        connection.sendall(frame)
        _, size = _HEADER.unpack(_read_exactly(connection, _HEADER.size))
        _read_exactly(connection, size)

    with connection:
        return _timed(rounds, one)


def _self_signed(directory: str) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", f"{directory}/key.pem", "-out", f"{directory}/cert.pem", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip


def _started(target, *args) -> tuple[multiprocessing.Process, int]:
    receive, send = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.get_context("spawn").Process(target=target, args=(send, *args), daemon=True)
    process.start()
    return process, receive.recv()


@contextlib.asynccontextmanager
async def _links(ports: list[int], delays_ms: list[float]):
    """The addresses the clients dial for ``ports``, and how to set the link's delay: the
    delaying proxy's routes with ``delays_ms``, else the servers themselves."""
    if not delays_ms:
        yield [("127.0.0.1", port) for port in ports], None
        return
    async with ProxyProcess([f"127.0.0.1:0=127.0.0.1:{port}" for port in ports]) as proxy:
        yield proxy.addresses, proxy.set_delay_ms


async def run(args: argparse.Namespace) -> dict:
    request = os.urandom(args.request_bytes)
    results: dict[str, list] = {}
    delays: list[float | None] = args.link_delays_ms or [None]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tls_dir:
        _self_signed(tls_dir)
        grpc_server, grpc_port = _started(_grpc_server, args.reply_bytes)
        tcp_server, tcp_port = _started(_serve_tcp, args.reply_bytes, "")
        tls_server, tls_port = _started(_serve_tcp, args.reply_bytes, tls_dir)
        try:
            async with _links([grpc_port, tcp_port, tls_port], args.link_delays_ms) as (addresses, set_delay):
                grpc_at, tcp_at, tls_at = addresses
                # Interleaved passes, so a change of the machine's load falls on every carrier alike.
                for _ in range(args.passes):
                    for delay in delays:
                        if set_delay is not None:
                            await set_delay(delay)
                        for carrier, measure in (
                            ("grpc_unary", lambda: _grpc_unary(grpc_at, request, args.rounds)),
                            ("grpc_stream", lambda: _grpc_stream(grpc_at, request, args.rounds)),
                            ("tcp", lambda: _tcp(tcp_at, request, args.rounds, "")),
                            ("tcp_tls", lambda: _tcp(tls_at, request, args.rounds, tls_dir)),
                        ):
                            name = carrier if delay is None else f"{carrier}@{delay:g}ms"
                            results.setdefault(name, []).append(await asyncio.to_thread(measure))
        finally:
            for process in (grpc_server, tcp_server, tls_server):
                process.kill()
    return {
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "request_bytes": args.request_bytes,
        "reply_bytes": args.reply_bytes,
        "rounds": args.rounds,
        **{name: {"p50_us": statistics.median(p["p50_us"] for p in passes), "passes": passes}
           for name, passes in results.items()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per carrier and pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--request-bytes", type=int, default=3000)
    parser.add_argument("--reply-bytes", type=int, default=2400)
    parser.add_argument("--link-delays-ms", type=_delays, default=[],
                        help="one-way delays of a delaying proxy in front of every server, comma-separated")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/out/distkv_lane_round_trip.json"))
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v["p50_us"] if isinstance(v, dict) else v for k, v in result.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
