"""What the speculator's step-cost model prices a draft row at, request after request, in one
process: the ``sql`` demo adapter rewriting the SQL query at batch 1 (``bench.speculative_bench``'s
prompt), with batches of 8 quick-trace requests in between, as the served bench sends them.

Before each item it prints the fitted step cost and what it makes of a batch-1 step: an accepted
token's saving (``token_s``), a row's cost (``row_s``) and their ratio (a draft's k-th token is
worth its row while its chance of acceptance to the k-th exceeds it). After each SQL rewrite, its
tokens per decode step. Decisions, not speed, are the point: the ratio should stay well below 1
at batch 1 (a row measured 0.07-0.22 of a step on 2 EPYC cores, quiet) whatever the machine's
load; under others' load (5-9) it did not, with any of three fits tried (the engine's least
squares over every step, the same over decode steps only, each decode shape's fastest run):
bench/results/speculative/cost_fit_loaded_2026-12-07.txt.

    PYTHONPATH=. .venv/bin/python -m bench.speculative_cost_fit --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os

from bench.engine_drain import serve_to_the_end
from bench.sample_adapters import read_peft_directory
from bench.speculative_adapters import demo_adapter_dirs
from bench.speculative_bench import decode_rate, sql_rewrite
from bench.speculative_workloads import non_repetitive
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.engine.speculation.draft_budget import DraftSettings
from services.gpu_worker.engine.speculation.draft_cost import draft_prices

SEQUENCE = ("sql", "sql", "group", "sql", "sql", "group", "sql")
"""What runs, in order: the SQL rewrite alone, or a batch of 8 quick-trace requests."""


def show_prices(engine: Engine, before: str) -> None:
    assert engine.speculator is not None
    cost = engine.speculator.cost.cost
    settings = DraftSettings()
    prices = draft_prices(cost, 1, 1, settings.min_row_share, settings.verify_step_share)
    terms = ", ".join(f"{k} {1000 * v:.3f}" for k, v in cost.as_dict().items())
    print(
        f"  before {before}: fit (ms) {terms}; batch 1: token_s {1000 * prices.token_s:.2f} ms, "
        f"row_s {1000 * prices.row_s:.2f} ms, row/token {prices.row_s / max(prices.token_s, 1e-9):.2f}",
        flush=True,
    )


def run_group(engine: Engine, seed: int) -> float:
    """8 quick-trace requests at once, to the demo adapters and the base model in turn; seconds."""
    requests = [
        GenerationRequest(
            f"g{seed}-{i}",
            tuple(item.prompt_ids),
            SamplingParams(max_tokens=item.max_tokens, ignore_eos=True),
            item.adapter or None,
        )
        for i, item in enumerate(non_repetitive(8, seed=seed))
    ]
    return serve_to_the_end(engine, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    _, model, prompt = sql_rewrite("q4_1", args.dtype)
    engine = local_engine(model, EngineConfig(pool_mib=256, speculative="ngram", prefix_cache=False))
    for name, directory in demo_adapter_dirs().items():
        engine.add_adapter(read_peft_directory(name, directory, model.dtype))
    print(f"q4_1 {args.dtype}, ngram, load average {os.getloadavg()}")
    for index, what in enumerate(SEQUENCE):
        show_prices(engine, what)
        if what == "sql":
            decoded = decode_rate(engine, prompt, args.tokens, "sql")
            print(
                f"sql rewrite: {decoded.rate:.1f} tok/s, {decoded.tokens_per_step:.2f} tokens a step",
                flush=True,
            )
        else:
            print(f"group of 8: {run_group(engine, 100 + index):.2f} s", flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
