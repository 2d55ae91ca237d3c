"""What a client stream of bytes costs gRPC itself on this machine (issue 30): the ceiling of an
upload's registration rate before the store does anything with the bytes.

    .venv/bin/python -m bench.grpc_stream_ceiling
    .venv/bin/python -m bench.grpc_stream_ceiling --mb 1500 --chunk-kib 1024 --rounds 3

A server process (grpc asyncio, one stream-unary method that counts the bytes it receives and
nothing more) and this process as its client (grpc asyncio, ``--concurrency`` streams at a time,
each ``--stream-mb`` in ``--chunk-kib`` messages, as an upload sends them) over loopback, with the
message limits the mesh uses. Reported per round: MB/s, and the CPU each side spent per MB (the
server's from ``/proc``, the client's own process time). On a machine where both share the same
cores, 2 cores ÷ (server + client ms per MB) bounds any upload path; the store's upload rate
÷ this rate is how much of the transport's ceiling its own work leaves.

Both processes retain freed memory (``services.runtime.process.allocator``), as the adapter store, the
gateway and the scale bench's driver do: without it every 4 MiB message lands in freshly mapped
pages, and the page faults cost the server as much as the rest of its work
(``--retain-freed-memory false`` measures that).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time
from pathlib import Path

import grpc
from grpc import aio

from services.runtime.process.allocator import retain_freed_memory
from services.runtime.process.ports import free_port
from services.runtime.rpc.server import MAX_MESSAGE_BYTES

MB = 1 << 20
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
METHOD = "/bench.Bytes/Count"


def serve(port: int, ready, retain: bool) -> None:
    if retain:
        retain_freed_memory()

    async def count(request_iterator, context) -> bytes:
        received = 0
        async for chunk in request_iterator:
            received += len(chunk)
        return received.to_bytes(8, "little")

    async def main() -> None:
        server = aio.server(options=OPTIONS)
        handler = grpc.stream_unary_rpc_method_handler(count)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("bench.Bytes", {"Count": handler})]
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_round(port: int, server_pid: int, args) -> dict:
    chunk = os.urandom(args.chunk_kib * 1024)
    per_stream = args.stream_mb * MB

    async with aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
        count = channel.stream_unary(METHOD)

        async def stream() -> int:
            async def chunks():
                left = per_stream
                while left > 0:
                    yield chunk[: min(len(chunk), left)]
                    left -= len(chunk)

            return int.from_bytes(await count(chunks()), "little")

        await stream()  # connection and first-call set-up, untimed
        streams = max(1, args.mb // args.stream_mb)
        limit = asyncio.Semaphore(args.concurrency)

        async def limited() -> int:
            async with limit:
                return await stream()

        server_before, client_before = process_cpu_s(server_pid), time.process_time()
        started = time.perf_counter()
        total = sum(await asyncio.gather(*(limited() for _ in range(streams))))
        elapsed = time.perf_counter() - started
        server_cpu = process_cpu_s(server_pid) - server_before
        client_cpu = time.process_time() - client_before
    mb = total / MB
    return {
        "mb_received": round(mb, 3),
        "mb_per_s": round(mb / elapsed, 1),
        "server_cpu_ms_per_mb": round(server_cpu * 1e3 / mb, 2),
        "client_cpu_ms_per_mb": round(client_cpu * 1e3 / mb, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=3000, help="MB streamed per round")
    parser.add_argument("--stream-mb", type=int, default=5, help="MB per stream (one upload)")
    parser.add_argument("--chunk-kib", type=int, default=4096, help="KiB per message")
    parser.add_argument("--concurrency", type=int, default=8, help="streams at a time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--retain-freed-memory",
        choices=("true", "false"),
        default="true",
        help="both processes keep freed buffers for reuse, as the store and the gateway do",
    )
    args = parser.parse_args()
    retain = args.retain_freed_memory == "true"
    if retain:
        retain_freed_memory()
    port = free_port()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=serve, args=(port, ready, retain), daemon=True)
    server.start()
    try:
        while not ready.wait(1):  # no deadline: only a server that died stops the wait
            if not server.is_alive():
                raise SystemExit(f"the server exited ({server.exitcode}) before it served")
        rounds = [asyncio.run(one_round(port, server.pid, args)) for _ in range(args.rounds)]
    finally:
        server.terminate()
    print(json.dumps({"cores": os.cpu_count(), "args": vars(args), "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
