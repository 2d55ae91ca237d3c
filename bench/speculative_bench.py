"""Speculative decoding (``speculative: ngram``) against ``off`` at batch 1, side by side.

One engine per setting over the same model, both greedy on one repetitive prompt (the chat
template around "rewrite this SQL query", the query in the prompt), rounds alternating off and
ngram so that machine load falls on both alike. Reports each round's decode tokens/s (from the
first token to the last), the median of the ratio ngram/off, and the acceptance, and checks the
two settings' tokens are the same. Engine-level (no gRPC, no gateway): a first figure, not the
served bench the issue asks for.

    .venv/bin/python -m bench.speculative_bench --rounds 6 --tokens 96
    .venv/bin/python -m bench.speculative_bench --rounds 6 --tokens 96 --adapter sql  # a demo adapter
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.sample_adapters import read_peft_directory
from bench.speculative_served_bench import demo_adapter_dirs
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import LoadedModel, load_model

QUERY = (
    "select o.id, o.created_at, c.name, c.email, sum(i.price * i.quantity) as total "
    "from orders o join customers c on c.id = o.customer_id join order_items i on i.order_id = o.id "
    "where o.created_at >= '2024-01-01' and c.country = 'DE' group by o.id, o.created_at, c.name, c.email "
    "order by total desc limit 20"
)
PROMPT = f"Rewrite this SQL query with upper-case keywords, changing nothing else:\n\n{QUERY}"


def sql_rewrite(quantization: str, dtype_name: str) -> tuple[LoadedModel, LlamaModel, tuple[int, ...]]:
    """The model loaded as asked, and the chat prompt asking it to rewrite :data:`QUERY`."""
    dtype = getattr(torch, dtype_name)
    loaded = load_model(quantization=quantization, dtype=dtype)
    chat = [{"role": "user", "content": PROMPT}]
    prompt = tuple(
        loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True))
    )
    return loaded, LlamaModel(loaded.config, loaded.weights, dtype), prompt


def decode_rate(
    engine: Engine, prompt: tuple[int, ...], tokens: int, adapter: str | None = None
) -> tuple[float, float, list[int]]:
    """Tokens/s from the first token to the last, tokens per decode step (machine speed does not
    change it), and the tokens (of ``adapter``, a name the engine holds; None: the base model)."""
    stamps: list[float] = []
    out: list[int] = []

    def sink(event) -> None:
        if event.token_id is not None:
            stamps.append(time.perf_counter())
            out.append(event.token_id)

    engine.submit(
        GenerationRequest("r", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), adapter), sink
    )
    engine.step()  # the prefill, which draws the first token
    first_step = engine.steps
    while engine.has_work():
        engine.step()
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), (len(out) - 1) / (engine.steps - first_step), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--quantization", default="q4_1", choices=["none", "q8_0", "q4_1"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--adapter", default=None, help="a demo adapter the request uses (e.g. sql)")
    args = parser.parse_args()
    loaded, model, prompt = sql_rewrite(args.quantization, args.dtype)
    engines = {
        mode: local_engine(model, EngineConfig(pool_mib=128, speculative=mode, prefix_cache=False))
        for mode in ("off", "ngram")
    }
    if args.adapter is not None:
        for engine in engines.values():
            engine.add_adapter(
                read_peft_directory(args.adapter, demo_adapter_dirs()[args.adapter], model.dtype)
            )
    rates: dict[str, list[float]] = {"off": [], "ngram": []}
    per_step: dict[str, list[float]] = {"off": [], "ngram": []}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            rate, tokens_per_step, outputs[mode] = decode_rate(engine, prompt, args.tokens, args.adapter)
            rates[mode].append(rate)
            per_step[mode].append(tokens_per_step)
    counts = engines["ngram"].speculator.counts
    drafted, accepted = sum(counts.drafted.values()), sum(counts.accepted.values())
    ratios = [s / o for s, o in zip(rates["ngram"], rates["off"])]
    print(
        f"{args.quantization} {args.dtype}, adapter {args.adapter}, prompt {len(prompt)} tokens, "
        f"{args.tokens} greedy tokens, batch 1"
    )
    for mode, values in rates.items():
        steps = ", ".join(f"{v:.2f}" for v in per_step[mode])
        print(
            f"  {mode:5}: "
            + ", ".join(f"{v:.1f}" for v in values)
            + f" tok/s; tokens per decode step {steps}"
        )
    print(
        f"  ngram/off per round: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x"
    )
    print(f"  drafted {drafted}, accepted {accepted} ({accepted / max(drafted, 1):.0%})")
    print(f"  same tokens: {outputs['off'] == outputs['ngram']}")
    print("  output: " + loaded.tokenizer.decode(outputs["off"]).replace("\n", " ")[:300])


if __name__ == "__main__":
    main()
