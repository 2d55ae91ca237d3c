"""What structured outputs cost: decode tokens/s with every request constrained by a JSON Schema
÷ the same batch unconstrained, the same number of tokens per request, side by side in one run.

    .venv/bin/python -m bench.structured_output_bench                  # batch 8 and 32, ~3 min on 2 cores
    .venv/bin/python -m bench.structured_output_bench --batch 8 --rounds 1

SmolLM2-135M-Instruct as ``loramesh up`` runs it on a CPU by default (``--quantization auto``:
q4_1; ``--dtype`` as given, float32 by default), in-process, on ``--adapters`` PEFT adapters
(rank 16, all projections), the batch's requests spread over them. Each constrained request asks
for one of three bounded schemas (nested objects, enums, arrays, ``maxLength``); it runs greedy to
its EOS. The unconstrained twin of each request has the same prompt and adapter and generates
exactly as many tokens (``ignore_eos``), so the two engines do the same forward passes and the
ratio is what the masks cost: computing them on a helper thread while the forward pass runs,
and applying them. Rounds alternate which engine goes first. Results: a markdown table on stdout
and ``bench/out/structured_output_bench/results.json``. No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.out_dir import default_out
from bench.worker_bench import machine, make_adapters
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.structured_output import GrammarCompiler
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.quantization_setting import resolve_quantization
from services.runtime.sampling.sampling_params import SamplingParams, StructuredOutput

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 10}, "qty": {"enum": [1, 2, 3, 4]}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
            "express": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 40},
        },
        "required": ["items", "express", "note"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 32},
            "stars": {"enum": [1, 2, 3, 4, 5]},
            "pros": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
        },
        "required": ["title", "stars", "pros"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "person": "Describe a user of a website as JSON.",
    "order": "Write a shop order as JSON.",
    "review": "Write a short product review as JSON.",
}
MAX_TOKENS = 200
"""More than any document the three schemas allow."""


def chat_ids(tokenizer, text: str) -> tuple[int, ...]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tuple(tokenizer.encode(rendered))


def run_batch(engine: Engine, requests: list[GenerationRequest]) -> tuple[float, dict[str, list[int]]]:
    """Serve ``requests`` together from an idle engine: seconds and each one's tokens."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    started = time.perf_counter()
    for request in requests:
        engine.submit(request, lambda e: e.token_id is not None and tokens[e.request_id].append(e.token_id))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - started, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds per batch size")
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=default_out("structured_output_bench") / "results.json")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    quantization = resolve_quantization("auto", "cpu")
    loaded = load_model(quantization=quantization, dtype=dtype)
    model = LlamaModel(loaded.config, loaded.weights, dtype)
    with tempfile.TemporaryDirectory() as root:
        adapters = make_adapters(args.adapters, dtype, Path(root))
    grammars = GrammarCompiler(
        loaded.tokenizer.backend.to_str(), loaded.config.vocab_size, loaded.config.eos_token_ids
    )
    engines = {}
    for name in ("constrained", "free"):
        engines[name] = local_engine(
            model, EngineConfig(pool_mib=512), eos_token_ids=loaded.config.eos_token_ids, grammars=grammars
        )
        for adapter in adapters:
            engines[name].add_adapter(adapter)

    rows = []
    for batch in args.batch:
        kinds = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(batch)]
        constrained = [
            GenerationRequest(
                f"c{i}",
                chat_ids(loaded.tokenizer, PROMPTS[kind]),
                SamplingParams(
                    max_tokens=MAX_TOKENS,
                    structured_output=StructuredOutput("json_schema", json.dumps(SCHEMAS[kind])),
                ),
                adapters[i % len(adapters)].adapter_id,
            )
            for i, kind in enumerate(kinds)
        ]
        run_batch(engines["constrained"], constrained[:2])  # warm-up: grammars compiled, kernels built
        seconds: dict[str, list[float]] = {"constrained": [], "free": []}
        order = ["constrained", "free"]
        lengths: list[int] = []
        for _ in range(args.rounds):
            for name in order:
                if name == "constrained":
                    took, tokens = run_batch(engines[name], constrained)
                    lengths = [len(tokens[r.request_id]) for r in constrained]
                else:
                    free = [
                        GenerationRequest(
                            f"f{i}", r.prompt_ids, SamplingParams(max_tokens=n, ignore_eos=True), r.adapter_id
                        )
                        for i, (r, n) in enumerate(zip(constrained, lengths))
                    ]
                    took, _ = run_batch(engines[name], free)
                seconds[name].append(took)
            order.reverse()
        generated = sum(lengths)
        rate = {name: generated / min(times) for name, times in seconds.items()}
        rows.append(
            {
                "batch": batch,
                "tokens_per_request_mean": generated / batch,
                "seconds": seconds,
                "tokens_per_s": rate,
                "ratio_constrained_over_free": rate["constrained"] / rate["free"],
            }
        )
    results = {"machine": machine(), "quantization": quantization, "dtype": args.dtype, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"structured outputs, {quantization} {args.dtype}, {machine().get('cpu', '')}")
    print("| batch | tokens/request | constrained tok/s | unconstrained tok/s | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['batch']} | {row['tokens_per_request_mean']:.1f} | {row['tokens_per_s']['constrained']:.1f} "
            f"| {row['tokens_per_s']['free']:.1f} | {row['ratio_constrained_over_free']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
