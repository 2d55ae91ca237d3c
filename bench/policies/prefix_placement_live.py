"""Prefix-aware placement against residency-only placement (least-estimated-wait) on a live mesh:
``loramesh up --workers 3`` once per policy, the same requests sent to each through the OpenAI
HTTP API.

The workload: ``--prefixes`` shared prompts (system prompts, ``--prefix-tokens`` token ids each)
and, for each, ``--per-prefix`` requests made of it and a short question of their own, in one
shuffled order, sent by ``--concurrency`` clients in a closed loop (each sends its next request
when its last one ends), greedy, ``--max-tokens`` tokens, streamed with the usage. Base model
only: prefix-aware placement's adapter keys are tested elsewhere; here what is measured is
where the prompts go. Per policy: the share of prompt tokens the workers found cached (OpenAI's
``prompt_tokens_details.cached_tokens``), time to first token (arrival to first chunk, as the
client sees it) p50/p99, and requests per second over the run. The meshes run one after the
other, the policies' order alternating per round, so the host's drift falls on both.

    .venv/bin/python -m bench.policies.prefix_placement_live --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.out_dir import default_out
from bench.quantized_bench import cpu_name
from bench.served_batch_one import SSE_DATA
from bench.systems.loramesh_up_system import _loramesh
from loramesh_cli.mesh_file import MeshFile

POLICIES = ("least-estimated-wait", "prefix-aware")
LEAN_MESH = ("--gateways", "1", "--schedulers", "1", "--adapter-stores", "1", "--kv-managers", "0")


@contextmanager
def mesh(placement: str, workers: int) -> Iterator[dict]:
    """A detached ``loramesh up --workers N --placement P``; yields how to reach its OpenAI API."""
    with tempfile.TemporaryDirectory(prefix=f"loramesh-bench-{placement}-") as state_dir:
        state = Path(state_dir)
        _loramesh(state, "up", "--detach", "--workers", str(workers), "--placement", placement, *LEAN_MESH)
        try:
            info = MeshFile.read(state)
            yield {
                "url": f"http://{info.services['gateway'].openai_address}",
                "headers": {"Authorization": f"Bearer {info.admin_api_key}"},
            }
        finally:
            _loramesh(state, "down")


def workload(prefixes: int, per_prefix: int, prefix_tokens: int, seed: int) -> list[list[int]]:
    """The prompts (token ids), shuffled: each shared prompt, then a 16-token question."""
    rng = random.Random(seed)
    shared = [[rng.randrange(1000, 40000) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    prompts = [p + [rng.randrange(1000, 40000) for _ in range(16)] for p in shared for _ in range(per_prefix)]
    rng.shuffle(prompts)
    return prompts


def send(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first, usage = None, {}
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            payload = line[len(SSE_DATA) :].strip()
            if not line.startswith(SSE_DATA) or payload == "[DONE]":
                continue
            chunk = json.loads(payload)
            if first is None and (chunk.get("choices") or [{}])[0].get("text"):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": (first or time.perf_counter()) - start, "prompt": len(prompt), "cached": cached}


def run(placement: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    with mesh(placement, args.workers) as live:
        clients = [httpx.Client(headers=live["headers"], timeout=600) for _ in range(args.concurrency)]
        model = clients[0].get(f"{live['url']}/v1/models").json()["data"][0]["id"]
        pending: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        for prompt in prompts:
            pending.put(prompt)
        began = time.perf_counter()

        def loop(client: httpx.Client) -> list[dict]:
            done = []
            while True:
                try:
                    prompt = pending.get_nowait()
                except queue.Empty:
                    return done
                done.append(send(client, live["url"], model, prompt, args.max_tokens))

        with ThreadPoolExecutor(args.concurrency) as pool:
            results = [r for rs in pool.map(loop, clients) for r in rs]
        wall = time.perf_counter() - began
        for client in clients:
            client.close()
    ttft = sorted(r["ttft_s"] for r in results)
    return {
        "placement": placement,
        "requests": len(results),
        "hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "throughput_rps": len(results) / wall,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--per-prefix", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=384)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--out", default=str(default_out("prefix_placement_live")))
    args = parser.parse_args()
    prompts = workload(args.prefixes, args.per_prefix, args.prefix_tokens, seed=0)
    rows = []
    for round_ in range(args.rounds):
        for placement in POLICIES if round_ % 2 == 0 else POLICIES[::-1]:
            row = {"round": round_, **run(placement, args, prompts)}
            rows.append(row)
            print(f"round {round_} {placement:22s} hit {row['hit_rate']:6.1%} ttft p50 {row['ttft_p50_s']:6.2f} "
                  f"p99 {row['ttft_p99_s']:6.2f} thr {row['throughput_rps']:5.2f} req/s "
                  f"load {row['load_average'][0]:.1f}", flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), **{k: v for k, v in vars(args).items() if k != "out"}}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
