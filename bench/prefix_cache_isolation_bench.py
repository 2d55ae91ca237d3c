"""What another tenant's cached prompt does to a request's time to first token (issue 50): nothing
by default, the prefix cache's whole saving when both pass one ``cache_salt``. Side by side in
one run, through the real gateway core and relay and a real worker over gRPC.

    .venv/bin/python -m bench.prefix_cache_isolation_bench
    .venv/bin/python -m bench.prefix_cache_isolation_bench --quick     # 2 rounds

SmolLM2-135M-Instruct in fp32, one in-process engine with the prefix cache on, served by the
worker's gRPC servicer on loopback; the gateway's core (tenants alice and bob) places every
request on it through its relay, which names the request's prefix-cache namespace as it does in
a mesh. Each round takes a fresh ``--prompt-tokens``-token prompt P no one has sent. alice sends
P twice, once plainly and once with the salt S, so P is cached in alice's namespace and in S's.
Then, one at a time, in an order that rotates round by round:

- **other tenant**: bob sends P (his namespace: alice's blocks are not his);
- **shared salt**: bob sends P with S (the namespace alice's salted P is in);
- **same tenant**: alice sends P again (her own namespace);
- **cold**: bob sends a prompt no one has sent (the uncached prefill, the reference).

TTFT is the usage's ``first_token_ms`` (from the gateway receiving the request to its first
token, what a client sees less the network); each case's figure is its median TTFT ÷ the cold
median. The usage's ``cached_prompt_tokens`` of every request is checked: the bench exits
non-zero unless "other tenant" reused nothing and "shared salt" and "same tenant" reused all
they can. Results: a markdown table on stdout and
``bench/out/prefix_cache_isolation_bench/results.json``. No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from grpc import aio

from bench.out_dir import default_out
from bench.prefix_cache_bench import system_prompt
from bench.worker_bench import CpuMonitor, machine
from mesh_api.v1 import gateway_pb2, scheduler_pb2, types_pb2, worker_pb2_grpc
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.relay import Relay
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.servicer import WorkerServicer
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.etcd.discovery import ChannelPool
from services.runtime.rpc.interceptors import ServiceInterceptor

CASES = ("other tenant", "shared salt", "same tenant", "cold")
SALT = "bench-shared-salt-5f0c2a"
NEW_TOKENS = 2
"""Tokens each request generates (its first one is what TTFT times)."""

Send = Callable[[str, list[int], str], Awaitable[gateway_pb2.Usage]]


async def serve(engine: Engine) -> tuple[aio.Server, str]:
    """The worker's servicer for ``engine`` on a loopback port, as a worker process serves it."""
    servicer = WorkerServicer()
    servicer.attach(engine, None, {"model": "SmolLM2-135M-Instruct", "dtype": "float32"})
    server = aio.server(interceptors=[ServiceInterceptor()])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def gateway_sender(core: GatewayCore) -> Send:
    sampling = types_pb2.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def send(tenant: str, prompt: list[int], salt: str) -> gateway_pb2.Usage:
        """One generation through the gateway's core; its usage."""
        replies = [r async for r in core.generate(tenant, prompt, None, sampling, cache_salt=salt)]
        return replies[-1].usage

    return send


async def run_rounds(
    send: Send, tokenizer, rounds: int, prompt_tokens: int
) -> dict[str, list[gateway_pb2.Usage]]:
    """Every case's usage, round by round."""
    usages: dict[str, list[gateway_pb2.Usage]] = {case: [] for case in CASES}
    for r in range(rounds):
        shared = system_prompt(tokenizer, r, prompt_tokens)
        await send("alice", shared, "")  # alice's namespace holds P
        await send("alice", shared, SALT)  # and so does S's
        cases = {
            "other tenant": ("bob", shared, ""),
            "shared salt": ("bob", shared, SALT),
            "same tenant": ("alice", shared, ""),
            "cold": ("bob", system_prompt(tokenizer, 10_000 + r, prompt_tokens), ""),
        }
        for case in CASES[r % len(CASES) :] + CASES[: r % len(CASES)]:
            usages[case].append(await send(*cases[case]))
    return usages


async def measure(rounds: int, prompt_tokens: int) -> tuple[dict[str, list[gateway_pb2.Usage]], int, float]:
    """Usages per case, the tokens a hit can reuse, and other processes' share of the CPUs."""
    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    config = EngineConfig(pool_mib=256, prefix_cache=True)
    engine = local_engine(model, config)
    engine.start()
    server, address = await serve(engine)
    channels = ChannelPool()

    async def place(request: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        return scheduler_pb2.PlaceResponse(worker_id="bench-worker", address=address)

    core = GatewayCore(GatewayConfig(), ApiKeys.from_config("key-a=alice,key-b=bob", ""))
    core.attach(load_tokenizer(), Relay(place, channels, max_resumes=0))
    try:
        monitor = CpuMonitor()
        usages = await run_rounds(gateway_sender(core), loaded.tokenizer, rounds, prompt_tokens)
        others = monitor.total()
    finally:
        core.close()
        await channels.close()
        await server.stop(None)
        engine.stop()
    block = config.kv_block_tokens
    return usages, (prompt_tokens - 1) // block * block, others


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument(
        "--out", type=Path, default=default_out("prefix_cache_isolation_bench") / "results.json"
    )
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else args.rounds

    usages, reusable, others = asyncio.run(measure(rounds, args.prompt_tokens))
    ttft = {case: [u.first_token_ms for u in usages[case]] for case in CASES}
    cached = {case: [u.cached_prompt_tokens for u in usages[case]] for case in CASES}
    median = {case: statistics.median(times) for case, times in ttft.items()}
    ratio = {case: median[case] / median["cold"] for case in CASES}
    expected = {"other tenant": 0, "shared salt": reusable, "same tenant": reusable, "cold": 0}
    accounting_ok = all(set(cached[case]) == {expected[case]} for case in CASES)
    results = {
        "machine": machine(),
        "rounds": rounds,
        "prompt_tokens": args.prompt_tokens,
        "reusable_tokens": reusable,
        "other_processes_cpu_share": others,
        "ttft_ms": ttft,
        "median_ttft_ms": median,
        "ttft_ratio_over_cold": ratio,
        "cached_prompt_tokens": cached,
        "accounting_ok": accounting_ok,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"CPU: {results['machine'].get('cpu')}, torch threads {results['machine'].get('torch_threads')}")
    print(
        f"{rounds} rounds, {args.prompt_tokens}-token prompts, fp32; other processes used "
        f"{100 * others:.0f}% of the CPUs meanwhile\n"
    )
    print(
        "| bob's (or alice's) request for alice's cached prompt | cached prompt tokens | median TTFT (ms) | min | max | ÷ cold |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for case in CASES:
        times = ttft[case]
        tokens = "/".join(str(t) for t in sorted(set(cached[case])))
        print(
            f"| {case} | {tokens} | {median[case]:.1f} | {min(times):.1f} | {max(times):.1f} | {ratio[case]:.3f} |"
        )
    print(
        f"\naccounting (other tenant 0, shared salt and same tenant {reusable}): {'ok' if accounting_ok else 'WRONG'}"
    )
    print(f"results: {args.out}", file=sys.stderr)
    return 0 if accounting_ok else 1


if __name__ == "__main__":
    sys.exit(main())
