"""What the prefix cache saves: time to first token of requests sharing a long system prompt, with
the cache (``EngineConfig.prefix_cache``) and without, side by side in one run.

    .venv/bin/python -m bench.prefix_cache_bench
    .venv/bin/python -m bench.prefix_cache_bench --quick      # 1 request per adapter

SmolLM2-135M-Instruct in fp32, in-process engines sharing one model. ``--adapters`` PEFT adapters
(ranks 8/16/32/64 on all seven projections), each with its own ``--system-tokens``-token system
prompt; every request is its adapter's system prompt plus a short distinct question. Each engine
first serves one request per adapter (the warm-up: with the cache, the system prompts' blocks are
then cached), then the measured requests, one at a time (each alone on its engine, so its TTFT is
its own prefill), the two engines alternating request by request so that the host's drift hits
both alike; then, as a control, one request per adapter whose prompt shares nothing cached (the
cache can only cost there). TTFT is arrival to first token; the figure is cached ÷ uncached of
the median TTFTs.
Greedy outputs of the two engines are compared (they must be identical). Results: a markdown
table on stdout and ``bench/out/prefix_cache_bench/results.json``. No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench.out_dir import default_out
from bench.worker_bench import machine, make_adapters
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model

MODES = {"uncached": False, "cached": True}
"""Engine name -> its ``prefix_cache`` setting."""
NEW_TOKENS = 4
"""Tokens each request generates (its first one is what TTFT times; the rest check outputs)."""
TOPICS = ("databases", "astronomy", "cooking", "contract law", "birdwatching", "compilers")


def system_prompt(tokenizer, index: int, length: int) -> list[int]:
    """Adapter ``index``'s system prompt: ``length`` tokens of real text of its own."""
    text = (
        f"You are assistant number {index}, an expert in {TOPICS[index % len(TOPICS)]}. Answer the "
        "user's question in plain words, cite what you rely on, say when you are unsure, keep to "
        "the facts you were given, and never invent names, numbers or quotes. Prefer short answers; "
        "give an example when it helps, and ask one clarifying question when the request is vague. "
    ) * 12
    ids = tokenizer.encode(text)
    if len(ids) < length:
        raise ValueError("system prompt text too short")
    return ids[:length]


def run_one(engine: Engine, request: GenerationRequest) -> tuple[float, list[int]]:
    """Serve ``request`` alone: its TTFT (seconds) and greedy tokens."""
    tokens: list[int] = []
    first: list[float] = []

    def sink(event) -> None:
        if event.token_id is not None:
            tokens.append(event.token_id)
            if event.timings.first_token is not None and not first:
                first.append(event.timings.first_token - event.timings.arrived)

    engine.submit(request, sink)
    while engine.has_work():
        engine.step()
    return first[0], tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--requests-per-adapter", type=int, default=4, help="measured, after the warm-up")
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="1 measured request per adapter")
    parser.add_argument("--out", type=Path, default=default_out("prefix_cache_bench") / "results.json")
    args = parser.parse_args(argv)
    per_adapter = 1 if args.quick else args.requests_per_adapter

    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    with tempfile.TemporaryDirectory() as root:
        adapters = make_adapters(args.adapters, torch.float32, Path(root))
    engines = {}
    for name, cached in MODES.items():
        engines[name] = local_engine(model, EngineConfig(pool_mib=256, prefix_cache=cached))
        for adapter in adapters:
            engines[name].add_adapter(adapter)
    systems = [system_prompt(loaded.tokenizer, i, args.system_tokens) for i in range(len(adapters))]
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    def request(rid: str, adapter_index: int, question: int) -> GenerationRequest:
        suffix = loaded.tokenizer.encode(
            f"\nQuestion {question}: what is point {question * 7 + 3} about?\nAnswer:"
        )
        prompt = tuple(systems[adapter_index] + suffix)
        return GenerationRequest(rid, prompt, sampling, adapters[adapter_index].adapter_id)

    for i in range(len(adapters)):  # warm-up: one request per adapter on each engine
        for engine in engines.values():
            run_one(engine, request(f"warm{i}", i, 1000 + i))
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    order = list(engines)

    def measure(requests: list[GenerationRequest]) -> dict[str, list[float]]:
        """Each request alone on each engine, who goes first alternating: TTFTs per engine."""
        ttft: dict[str, list[float]] = {name: [] for name in engines}
        for one in requests:
            for name in order:
                seconds, tokens = run_one(engines[name], one)
                ttft[name].append(seconds)
                outputs[name][one.request_id] = tokens
            order.reverse()
        return ttft

    ttft = measure([request(f"a{i}-q{q}", i, q) for q in range(per_adapter) for i in range(len(adapters))])
    # Control: prompts that share nothing cached (another system prompt each, never seen), so
    # the cache can only cost (hashing, lookups), not save.
    miss_ttft = measure(
        [
            GenerationRequest(
                f"miss{i}",
                tuple(system_prompt(loaded.tokenizer, 100 + i, args.system_tokens)),
                sampling,
                a.adapter_id,
            )
            for i, a in enumerate(adapters)
        ]
    )
    median = {name: statistics.median(times) for name, times in ttft.items()}
    ratio = median["cached"] / median["uncached"]
    miss_median = {name: statistics.median(times) for name, times in miss_ttft.items()}
    miss_ratio = miss_median["cached"] / miss_median["uncached"]
    stats = engines["cached"].stats()
    results = {
        "machine": machine(),
        "adapters": len(adapters),
        "system_tokens": args.system_tokens,
        "measured_requests": len(ttft["cached"]),
        "prompt_tokens": len(request("x", 0, 0).prompt_ids),
        "ttft_s": ttft,
        "median_ttft_s": median,
        "ttft_ratio_cached_over_uncached": ratio,
        "miss_ttft_s": miss_ttft,
        "miss_median_ttft_s": miss_median,
        "miss_ttft_ratio_cached_over_uncached": miss_ratio,
        "outputs_identical": outputs["cached"] == outputs["uncached"],
        "prefix_cache_hit_blocks": stats.prefix_cache_hit_blocks,
        "prefix_cache_missed_blocks": stats.prefix_cache_missed_blocks,
        "prefix_cache_blocks": stats.prefix_cache_blocks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"CPU: {results['machine'].get('cpu')}, torch threads {results['machine'].get('torch_threads')}")
    print(
        f"{len(adapters)} adapters, {args.system_tokens}-token system prompt each, "
        f"{results['measured_requests']} measured requests of ~{results['prompt_tokens']} tokens, fp32\n"
    )
    print("| engine | median TTFT (ms) | min | max |")
    print("|---|---:|---:|---:|")
    for name, times in ttft.items():
        print(f"| {name} | {median[name] * 1e3:.1f} | {min(times) * 1e3:.1f} | {max(times) * 1e3:.1f} |")
    for name, times in miss_ttft.items():
        print(
            f"| {name}, no shared prefix | {miss_median[name] * 1e3:.1f} | {min(times) * 1e3:.1f} | {max(times) * 1e3:.1f} |"
        )
    print(f"\nTTFT ratio cached / uncached: {ratio:.3f} (no shared prefix: {miss_ratio:.3f})")
    print(f"outputs identical: {results['outputs_identical']}")
    print(
        f"prefix cache: {stats.prefix_cache_hit_blocks} hit blocks, "
        f"{stats.prefix_cache_missed_blocks} missed, {stats.prefix_cache_blocks} cached"
    )
    print(f"results: {args.out}", file=sys.stderr)
    return 0 if results["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
