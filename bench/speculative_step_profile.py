"""Where a batch-1 speculative step's time goes: drafting, the forward pass by its rows (1 + k),
and drawing and verifying, against ``off`` on the same prompt (engine-level, no gRPC).

One engine per mode over one model, greedy on the SQL rewrite (``bench.speculative_bench``'s
prompt), rounds alternating modes. Each decode step is timed in three parts (the speculator's
``draft``, the executor's forward pass, the rest of the step: drawing, verifying, emitting);
the forward pass is reported per row count, so the cost of a verifying row is read directly,
beside the step-cost model the speculator fitted.

    .venv/bin/python -m bench.speculative_step_profile --rounds 3 --tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict

from bench.sample_adapters import read_peft_directory
from bench.speculative_adapters import workload_adapter_dir
from bench.speculative_bench import decode_rate, sql_rewrite
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.model.llama import LlamaModel


class StepTimer:
    """Wraps one engine's draft and forward calls; what the step spends elsewhere is the rest."""

    def __init__(self, engine: Engine):
        self.forward: dict[int, list[float]] = defaultdict(list)
        """Forward-pass seconds by the step's decode rows (decode steps only), its inputs' build
        included."""
        self.build: dict[int, list[float]] = defaultdict(list)
        """Of those, the seconds building the step's inputs from its plan (host work)."""
        self.draft: list[float] = []
        self.step: list[float] = []
        self.engine = engine
        execute, self._step = engine.executor.execute, engine.step

        def timed_execute(plan):
            started = time.perf_counter()
            logits = execute(plan)
            rows = sum(len(p.token_ids) for p in plan.requests)
            if all(p.draft_tokens + 1 == len(p.token_ids) for p in plan.requests):
                self.forward[rows].append(time.perf_counter() - started)
            return logits

        engine.executor.execute = timed_execute
        inputs = engine.executor.inputs
        build = inputs.build

        def timed_build(plan, *args):
            started = time.perf_counter()
            batch = build(plan, *args)
            if all(p.draft_tokens + 1 == len(p.token_ids) for p in plan.requests):
                self.build[sum(len(p.token_ids) for p in plan.requests)].append(time.perf_counter() - started)
            return batch

        inputs.build = timed_build
        if engine.speculator is not None:
            draft = engine.speculator.draft

            def timed_draft(batch):
                started = time.perf_counter()
                rows = draft(batch)
                self.draft.append(time.perf_counter() - started)
                return rows

            engine.speculator.draft = timed_draft

        def timed_step():
            started = time.perf_counter()
            stepped = self._step()
            self.step.append(time.perf_counter() - started)
            return stepped

        engine.step = timed_step


def make_engine(model: LlamaModel, mode: str, adapter: str | None = None) -> Engine:
    """``mode``: ``off``, ``ngram`` or ``suffix``, with ``:k`` for a ceiling of k draft tokens;
    ``adapter``: a demo adapter the engine holds."""
    speculative, _, k = mode.partition(":")
    engine = local_engine(model, EngineConfig(pool_mib=128, speculative=speculative, prefix_cache=False))
    if adapter is not None:
        engine.add_adapter(read_peft_directory(adapter, workload_adapter_dir(adapter), model.dtype))
    if k:
        engine.speculator.settings = dataclasses.replace(engine.speculator.settings, max_draft_tokens=int(k))
    return engine


def ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.2f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quantization", default="q4_1", choices=["none", "q8_0", "q4_1"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--modes", default="off,ngram", help="e.g. off,ngram,ngram:8 (k's ceiling 8)")
    parser.add_argument("--adapter", default=None, help="a demo adapter the request uses (e.g. sql)")
    args = parser.parse_args()
    _, model, prompt = sql_rewrite(args.quantization, args.dtype)
    engines = {mode: make_engine(model, mode, args.adapter) for mode in args.modes.split(",")}
    timers = {mode: StepTimer(engine) for mode, engine in engines.items()}
    rates: dict[str, list[float]] = defaultdict(list)
    per_step: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            decoded = decode_rate(engine, prompt, args.tokens, args.adapter)
            per_step[mode], outputs[mode] = decoded.tokens_per_step, decoded.tokens
            rates[mode].append(decoded.rate)
    print(
        f"{args.quantization} {args.dtype}, batch 1, adapter {args.adapter}, {args.tokens} tokens x "
        f"{args.rounds} rounds"
    )
    for mode, timer in timers.items():
        print(
            f"  {mode}: {', '.join(f'{r:.1f}' for r in rates[mode])} tok/s, {per_step[mode]:.2f} tokens a "
            f"step; step median {ms(timer.step)} ms, draft {ms(timer.draft)} ms"
        )
        for rows in sorted(timer.forward):
            print(
                f"    forward with {rows} rows: {ms(timer.forward[rows])} ms (n={len(timer.forward[rows])}), "
                f"of which building its inputs {ms(timer.build[rows])} ms"
            )
        speculator = engines[mode].speculator
        if speculator is not None:
            fit = speculator.cost
            coefficients = ", ".join(f"{k} {1000 * v:.3f}" for k, v in fit.cost.as_dict().items())
            print(f"    step-cost model (ms; fitted: {fit.fitted}): {coefficients}")
            counts = speculator.counts
            drafted, accepted = sum(counts.drafted.values()), sum(counts.accepted.values())
            print(f"    drafted {drafted}, accepted {accepted}")
    print(f"  same tokens in every mode: {len({tuple(o) for o in outputs.values()}) == 1}")


if __name__ == "__main__":
    main()
