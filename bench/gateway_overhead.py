"""Streaming throughput through the gateway vs calling the workers directly, same load, one run.

    .venv/bin/python bench/gateway_overhead.py [--requests 16] [--max-tokens 32] [--rounds 3]

A local mesh (2 workers, float32) is started with ``loramesh up``. Each round sends the same
batch of concurrent streamed requests twice, alternating which path goes first: (a) through
``loramesh.v1.Gateway/Generate`` with the SDK (auth, tokenization, scheduling, detokenization,
relay), (b) straight to ``loramesh.v1.Worker/Generate`` with pre-tokenized prompts, spread
round-robin over the workers. Reported: generated tokens per second of each path (median over
rounds) and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpc import aio

from loramesh.async_client import AsyncClient
from loramesh.cli.mesh_file import MeshFile
from loramesh.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.model.loading import load_model

PROMPTS = [f"Write a short story about a {thing}." for thing in ("cat", "ship", "tree", "robot")]


async def through_gateway(mesh: MeshFile, requests: int, max_tokens: int) -> int:
    async with AsyncClient(mesh.services["gateway"].address, mesh.admin_api_key) as client:
        results = await asyncio.gather(
            *(client.generate(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens) for i in range(requests))
        )
    return sum(len(r.token_ids) for r in results)


async def direct(mesh: MeshFile, prompts: list[list[int]], requests: int, max_tokens: int) -> int:
    workers = [entry.address for name, entry in mesh.services.items() if name.startswith("gpu_worker")]
    channels = [aio.insecure_channel(a) for a in workers]

    async def one(i: int) -> int:
        stub = worker_pb2_grpc.WorkerStub(channels[i % len(channels)])
        request = worker_pb2.GenerateRequest(
            prompt_token_ids=prompts[i % len(prompts)],
            sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
        )
        return sum([len(reply.token_ids) async for reply in stub.Generate(request)])

    try:
        return sum(await asyncio.gather(*(one(i) for i in range(requests))))
    finally:
        for channel in channels:
            await channel.close()


async def measure(mesh: MeshFile, args) -> dict:
    tokenizer = load_model().tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    await through_gateway(mesh, 4, 4)  # warm-up: adapters none, models loaded, channels open
    rates: dict[str, list[float]] = {"gateway": [], "direct": []}
    for round_index in range(args.rounds):
        order = ["gateway", "direct"] if round_index % 2 == 0 else ["direct", "gateway"]
        for path in order:
            started = time.perf_counter()
            if path == "gateway":
                tokens = await through_gateway(mesh, args.requests, args.max_tokens)
            else:
                tokens = await direct(mesh, prompts, args.requests, args.max_tokens)
            rates[path].append(tokens / (time.perf_counter() - started))
    gateway, direct_rate = statistics.median(rates["gateway"]), statistics.median(rates["direct"])
    return {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "gateway_tokens_per_s": round(gateway, 1),
        "direct_tokens_per_s": round(direct_rate, 1),
        "ratio": round(gateway / direct_rate, 3),
        "all_rates": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="lm-gw-bench-"))
    cli = [sys.executable, "-m", "loramesh.cli.main", "--state-dir", str(state)]
    subprocess.run(
        [*cli, "up", "--detach", "--workers", "2", "--dtype", "float32", "--pool-mib", "256"], check=True
    )
    try:
        result = asyncio.run(measure(MeshFile.read(state), args))
    finally:
        subprocess.run([*cli, "down"], check=False)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
