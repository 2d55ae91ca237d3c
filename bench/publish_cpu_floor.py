"""The least CPU a publish of one adapter version can cost on this machine: each primitive a
publish must do to its bytes, timed alone, then added up the way the mesh's path does them.

    .venv/bin/python -m bench.publish_cpu_floor [--mb 9.8] [--rounds 30] [--dir /tmp]

Timed per version of ``--mb`` MB (the bench's rank-16 adapter is 9.8 MB), in CPU time
(``time.process_time``, every thread of this process; waits for the disk are not CPU), min and
median of ``--rounds``:

- *read*: the file read from the page cache (the publisher reading its adapter);
- *copy*: one copy in user space into memory already in use (a join into a reused buffer), and
  *copy into a fresh mapping*, its pages faulted in by the kernel at once (the store's join of
  a publish into the mapping its RAM tier keeps);
- *sha256*: the one hash that names the content (and a worker's check of what it received);
- *durable write*: written past the page cache (``O_DIRECT``, whole pages) and flushed, as the
  store's blob tier writes a new blob;
- *gRPC hop*: the bytes sent over loopback as a stream of 1 MiB messages and received, both ends
  in this process (``time.process_time``: the sender's and the receiver's CPU together, gRPC's
  own threads included);
- *float16 → float32*: the dtype conversion a float32 worker makes of the weights (its parse),
  on one thread.

Not in it: etcd's side of the commit and its watchers (about 5 ms of etcd's CPU a publish in
:mod:`bench.adapter_publish_bench`), the store's validation, the workers' first token.

Then the floor of each path, the sum of its primitives' medians (each timed alone, its data hot in
the cache: the mesh doing the same work among other processes costs more, not less; the minima
are not used, as a virtual machine's CPU clock undercounts a few rounds), and what it takes of two
cores at ``--rate`` publishes a second. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch
from grpc import aio

from services.adapter_store.blobs.page_aligned import populated_mapping
from services.runtime.rpc.server import MAX_MESSAGE_BYTES

CHUNK = 1 << 20
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def timed(work: Callable[[], object], rounds: int, clock: Callable[[], float] = time.process_time) -> dict:
    spent = []
    for _ in range(rounds):
        before = clock()
        work()
        spent.append(1000 * (clock() - before))
    return {"min_ms": round(min(spent), 2), "p50_ms": round(statistics.median(spent), 2)}


def durable_write(directory: Path, data: memoryview) -> Callable[[], None]:
    aligned = mmap.mmap(-1, len(data))  # page-aligned, as O_DIRECT needs (the store joins into one)
    aligned.write(data)
    path = directory / "blob"

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
        try:
            os.write(fd, aligned)
            os.fsync(fd)
        finally:
            os.close(fd)

    return write


async def grpc_hop(data: bytes, rounds: int) -> dict:
    """Send ``data`` in 1 MiB messages to a server in this process, ``rounds`` times."""

    async def count(request_iterator, context) -> bytes:
        received = 0
        async for chunk in request_iterator:
            received += len(chunk)
        return received.to_bytes(8, "little")

    server = aio.server(options=OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(count)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Bytes", {"Count": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    view = memoryview(data)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            send = channel.stream_unary("/bench.Bytes/Count")

            async def one() -> None:
                async def chunks():
                    for start in range(0, len(view), CHUNK):
                        yield bytes(view[start : start + CHUNK])  # as a message's bytes field

                assert int.from_bytes(await send(chunks()), "little") == len(data)

            await one()  # the connection's set-up, untimed
            spent = []
            for _ in range(rounds):
                before = time.process_time()
                await one()
                spent.append(1000 * (time.process_time() - before))
    finally:
        await server.stop(None)
    return {"min_ms": round(min(spent), 2), "p50_ms": round(statistics.median(spent), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=9.8, help="MB of weights in one version")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--rate", type=float, default=10.0, help="publishes a second")
    parser.add_argument("--dir", default=None, help="where the durable write goes (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the least CPU: a team of threads only adds its spinning
    size = int(args.mb * 1e6) // 4096 * 4096
    data = os.urandom(size)
    reused = bytearray(size)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        (directory / "adapter").write_bytes(data)
        parts = {
            "read": timed(lambda: (directory / "adapter").read_bytes(), args.rounds),
            "copy": timed(lambda: reused.__setitem__(slice(None), data), args.rounds),
            "copy_into_a_fresh_mapping": timed(lambda: populated_mapping(size).write(data), args.rounds),
            "sha256": timed(lambda: hashlib.sha256(data).hexdigest(), args.rounds),
            "durable_write": timed(durable_write(directory, memoryview(data)), args.rounds),
            "float16_to_float32": timed(
                lambda: torch.frombuffer(bytearray(data), dtype=torch.float16).to(torch.float32), args.rounds
            ),
            "grpc_hop": asyncio.run(grpc_hop(data, args.rounds)),
        }
    cost = {name: part["p50_ms"] for name, part in parts.items()}
    # The mesh's paths, in primitives. The copy in the conversion's input stands for the parse's
    # own (it converts from the received chunks).
    store = cost["sha256"] + cost["durable_write"]
    relayed = cost["read"] + 2 * cost["grpc_hop"] + store
    direct = cost["read"] + cost["grpc_hop"] + store
    worker_pull = cost["grpc_hop"] + cost["sha256"] + cost["float16_to_float32"] + cost["copy"]
    floors = {
        "publish_relayed_by_a_gateway_ms": round(relayed, 1),
        "publish_straight_to_the_store_ms": round(direct, 1),
        "each_worker_pull_and_page_in_ms": round(worker_pull, 1),
        "publish_relayed_then_two_workers_ms": round(relayed + 2 * worker_pull, 1),
    }
    two_cores_ms = 2000.0
    print(
        json.dumps(
            {
                "bytes": size,
                "rounds": args.rounds,
                "cpus": os.cpu_count(),
                "load_before": [round(v, 2) for v in load_before],
                "load_after": [round(v, 2) for v in os.getloadavg()],
                "parts": parts,
                "floors": floors,
                "share_of_two_cores_at_rate": {
                    name: round(args.rate * ms / two_cores_ms, 3) for name, ms in floors.items()
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
