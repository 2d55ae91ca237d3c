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

import asyncio
import json

from grpc import aio

from bench.side_by_side import alternating_rounds, load_arguments, local_mesh, medians, rounded
from loramesh.async_client import AsyncClient
from loramesh_cli.mesh_file import MeshFile
from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.model_files.tokenizer_loading import load_tokenizer

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
    tokenizer = load_tokenizer().tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    await through_gateway(mesh, 4, 4)  # warm-up: adapters none, models loaded, channels open
    rates, _ = await alternating_rounds(
        {
            "gateway": lambda: through_gateway(mesh, args.requests, args.max_tokens),
            "direct": lambda: direct(mesh, prompts, args.requests, args.max_tokens),
        },
        args.rounds,
    )
    median = medians(rates)
    return {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "gateway_tokens_per_s": round(median["gateway"], 1),
        "direct_tokens_per_s": round(median["direct"], 1),
        "ratio": round(median["gateway"] / median["direct"], 3),
        "all_rates": rounded(rates),
    }


def main() -> None:
    args = load_arguments(__doc__.split("\n\n")[0]).parse_args()
    with local_mesh() as mesh:
        result = asyncio.run(measure(mesh, args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
