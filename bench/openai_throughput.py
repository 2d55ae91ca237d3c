"""Streaming throughput through the OpenAI HTTP API vs through the gRPC SDK, same mesh, one run.

    .venv/bin/python bench/openai_throughput.py [--requests 16] [--max-tokens 32] [--rounds 3]

A local mesh (2 workers, float32) is started with ``loramesh up``. Each round sends the same
batch of concurrent streamed completions once per path, the order reversed every other round:
(a) through the gateway's ``POST /v1/completions`` with ``stream: true``, read by the official
``openai`` async client (SSE, one chunk per token), (b) through ``loramesh.v1.Gateway/Generate``
with the SDK's ``AsyncClient.stream``, and (c) the requests of (a) read as plain SSE lines with
httpx, which separates the server's HTTP path from the openai client's own CPU. All ask for
greedy decoding of exactly ``--max-tokens`` tokens (``ignore_eos``), so every path does the same
work on the workers. Reported: generated tokens per
second of each path (median over rounds) and the ratios through-HTTP ÷ through-gRPC.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from bench.side_by_side import alternating_rounds, load_arguments, local_mesh, medians, rounded
from loramesh.async_client import AsyncClient
from loramesh_cli.mesh_file import MeshFile

PROMPTS = [f"Write a short story about a {thing}." for thing in ("cat", "ship", "tree", "robot")]
CALL_TIMEOUT_S = 900.0


async def through_http(client: AsyncOpenAI, model: str, requests: int, max_tokens: int) -> int:
    async def one(i: int) -> int:
        stream = await client.completions.create(
            model=model,
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    return sum(await asyncio.gather(*(one(i) for i in range(requests))))


async def through_raw_sse(http: httpx.AsyncClient, model: str, requests: int, max_tokens: int) -> int:
    """The same HTTP requests read as plain SSE lines, only the final usage chunk parsed: the
    server's HTTP path without the openai client's per-chunk parsing, which costs this process
    about twice the SDK's CPU per token and so, on 2 shared cores, slows the server it measures."""

    async def one(i: int) -> int:
        body = {
            "model": model,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        last_chunk = ""
        async with http.stream("POST", "/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    last_chunk = line
        # With include_usage the last chunk before [DONE] carries the usage.
        return json.loads(last_chunk[len("data: ") :])["usage"]["completion_tokens"]

    return sum(await asyncio.gather(*(one(i) for i in range(requests))))


async def through_grpc(client: AsyncClient, requests: int, max_tokens: int) -> int:
    async def one(i: int) -> int:
        deltas = client.stream(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True)
        return sum([len(delta.token_ids) async for delta in deltas])

    return sum(await asyncio.gather(*(one(i) for i in range(requests))))


class CpuMeter:
    """CPU time each path costs the gateway process and this client process, per token: where
    the HTTP path spends what the gRPC path does not, whatever else the machine is running."""

    def __init__(self, gateway_pid: int):
        self._stat = Path(f"/proc/{gateway_pid}/stat")
        self._used: dict[str, dict[str, float]] = {}

    def _gateway_cpu_s(self) -> float:
        # utime and stime, fields 14 and 15, after the command name in parentheses.
        fields = self._stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metered(self, path: str, run: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[int]]:
        used = self._used.setdefault(path, {"gateway": 0.0, "client": 0.0})

        async def run_metered() -> int:
            gateway, client = self._gateway_cpu_s(), time.process_time()
            count = await run()
            used["gateway"] += self._gateway_cpu_s() - gateway
            used["client"] += time.process_time() - client
            return count

        return run_metered

    def per_token(self, tokens: dict[str, list[int]]) -> dict[str, dict[str, float]]:
        return {
            path: {where: round(1000 * s / sum(tokens[path]), 3) for where, s in used.items()}
            for path, used in self._used.items()
        }


async def measure(mesh: MeshFile, args) -> dict:
    gateway = mesh.services["gateway"]
    # Generous call limits on both paths: a busy machine slows the load, it must not fail it.
    http = AsyncOpenAI(
        base_url=f"http://{gateway.openai_address}/v1",
        api_key=mesh.admin_api_key,
        max_retries=0,
        timeout=CALL_TIMEOUT_S,
    )
    raw = httpx.AsyncClient(
        base_url=f"http://{gateway.openai_address}/v1",
        headers={"Authorization": f"Bearer {mesh.admin_api_key}"},
        timeout=CALL_TIMEOUT_S,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )
    async with AsyncClient(gateway.address, mesh.admin_api_key, timeout=CALL_TIMEOUT_S) as grpc_client:
        model = (await http.models.list()).data[0].id  # the base model comes first
        # Warm-up: models loaded, channels and HTTP connections open on both paths.
        await through_http(http, model, 4, 4)
        await through_raw_sse(raw, model, 4, 4)
        await through_grpc(grpc_client, 4, 4)
        cpu = CpuMeter(gateway.pid)
        rates, tokens = await alternating_rounds(
            {
                "http": cpu.metered(
                    "http", lambda: through_http(http, model, args.requests, args.max_tokens)
                ),
                "http_raw_sse": cpu.metered(
                    "http_raw_sse",
                    lambda: through_raw_sse(raw, model, args.requests, args.max_tokens),
                ),
                "grpc": cpu.metered(
                    "grpc", lambda: through_grpc(grpc_client, args.requests, args.max_tokens)
                ),
            },
            args.rounds,
        )
    await http.close()
    await raw.aclose()
    expected = args.requests * args.max_tokens
    if any(count != expected for counts in tokens.values() for count in counts):
        raise SystemExit(f"a path generated other than {expected} tokens: {tokens}")
    median = medians(rates)
    return {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "http_tokens_per_s": round(median["http"], 1),
        "grpc_tokens_per_s": round(median["grpc"], 1),
        "ratio_http_over_grpc": round(median["http"] / median["grpc"], 3),
        "http_raw_sse_tokens_per_s": round(median["http_raw_sse"], 1),
        "ratio_http_raw_sse_over_grpc": round(median["http_raw_sse"] / median["grpc"], 3),
        "all_rates": rounded(rates),
        "cpu_ms_per_token": cpu.per_token(tokens),
    }


def main() -> None:
    parser = load_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the result JSON here")
    args = parser.parse_args()
    with local_mesh() as mesh:
        result = asyncio.run(measure(mesh, args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
