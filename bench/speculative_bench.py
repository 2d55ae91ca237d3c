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
from dataclasses import dataclass

import torch

from bench.sample_adapters import read_peft_directory
from bench.speculative_adapters import workload_adapter_dir
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


@dataclass(frozen=True)
class Decoded:
    """One request's decode, from its first token to its last."""

    rate: float
    """Tokens/s (wall time)."""
    tokens_per_step: float
    """Tokens per decode step (machine speed does not change it)."""
    cpu_per_token: float
    """The process's CPU seconds per token (both kernel threads; what a loaded machine's waits
    for a core do not inflate)."""
    tokens: list[int]


def decode_rate(engine: Engine, prompt: tuple[int, ...], tokens: int, adapter: str | None = None) -> Decoded:
    """The decode of ``prompt`` through ``adapter`` (a name the engine holds; None: the base
    model)."""
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
    first_step, cpu = engine.steps, time.process_time()
    while engine.has_work():
        engine.step()
    decoded = len(out) - 1
    return Decoded(
        decoded / (stamps[-1] - stamps[0]),
        decoded / (engine.steps - first_step),
        (time.process_time() - cpu) / decoded,
        out,
    )


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
                read_peft_directory(args.adapter, workload_adapter_dir(args.adapter), model.dtype)
            )
    runs: dict[str, list[Decoded]] = {"off": [], "ngram": []}
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            runs[mode].append(decode_rate(engine, prompt, args.tokens, args.adapter))
    rates = {mode: [run.rate for run in values] for mode, values in runs.items()}
    cpu = {mode: [run.cpu_per_token for run in values] for mode, values in runs.items()}
    counts = engines["ngram"].speculator.counts
    drafted, accepted = sum(counts.drafted.values()), sum(counts.accepted.values())
    ratios = [s / o for s, o in zip(rates["ngram"], rates["off"])]
    cpu_ratios = [o / s for s, o in zip(cpu["ngram"], cpu["off"])]
    print(
        f"{args.quantization} {args.dtype}, adapter {args.adapter}, prompt {len(prompt)} tokens, "
        f"{args.tokens} greedy tokens, batch 1"
    )
    for mode, values in rates.items():
        steps = ", ".join(f"{run.tokens_per_step:.2f}" for run in runs[mode])
        print(
            f"  {mode:5}: "
            + ", ".join(f"{v:.1f}" for v in values)
            + f" tok/s; CPU ms per token {', '.join(f'{1000 * v:.2f}' for v in cpu[mode])}; "
            + f"tokens per decode step {steps}"
        )
    print(
        f"  ngram/off per round: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x"
    )
    print(
        f"  off/ngram CPU per token per round: {', '.join(f'{r:.2f}' for r in cpu_ratios)}; "
        f"median {statistics.median(cpu_ratios):.2f}x"
    )
    print(f"  drafted {drafted}, accepted {accepted} ({accepted / max(drafted, 1):.0%})")
    print(f"  same tokens: {runs['off'][-1].tokens == runs['ngram'][-1].tokens}")
    print("  output: " + loaded.tokenizer.decode(runs["off"][-1].tokens).replace("\n", " ")[:300])


if __name__ == "__main__":
    main()
