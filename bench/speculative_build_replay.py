"""The host side of speculative steps: what building each step's inputs from its plan costs, with
and without drafts, replayed (engine-level, no model run in the timing).

An ``ngram`` engine with drafts priced as free (it drafts whenever the index finds a match) and an
``off`` engine decode the SQL rewrite (``bench.speculative_bench``'s prompt) at batch 1, through a
demo adapter (``--adapter``) or the base model; every plan each one ran is kept in order. Then
each engine's plan sequence is replayed ``--reps`` times through its executor's
``StepInputs.build`` (the persistent batch, the step builder and their caches, as in the run),
each build timed; the minimum per step over the replays is reported, summed by the step's rows
(a loaded machine only adds time).

    .venv/bin/python -m bench.speculative_build_replay --adapter sql --reps 20
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from bench.sample_adapters import read_peft_directory
from bench.speculative_bench import sql_rewrite
from bench.speculative_forward_profile import FREE_ROWS
from bench.speculative_served_bench import demo_adapter_dirs
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from tests.support.draft_cost import pin_draft_cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="sql", help="a demo adapter, or '' for the base model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    adapter = args.adapter or None
    _, model, prompt = sql_rewrite("q4_1", "float32")
    print(f"q4_1 float32, batch 1, adapter {adapter}, {args.tokens} tokens; build ms, minimum of {args.reps}")
    for mode in ("off", "ngram"):
        engine = pin_draft_cost(
            local_engine(model, EngineConfig(pool_mib=128, speculative=mode, prefix_cache=False)), FREE_ROWS
        )
        if adapter is not None:
            engine.add_adapter(read_peft_directory(adapter, demo_adapter_dirs()[adapter], torch.float32))
        executor = engine.executor
        plans = []
        execute = executor.execute

        def keep(plan, _execute=execute, _plans=plans):
            _plans.append(plan)
            return _execute(plan)

        executor.execute = keep
        sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        engine.submit(GenerationRequest("r", prompt, sampling, adapter), lambda event: None)
        while engine.has_work():
            engine.step()
        decode = [p for p in plans if all(r.draft_tokens + 1 == len(r.token_ids) for r in p.requests)]
        best = [float("inf")] * len(decode)
        for _ in range(args.reps):
            for i, plan in enumerate(decode):
                started = time.perf_counter()
                executor.inputs.build(plan, executor._resident.get, None)
                best[i] = min(best[i], time.perf_counter() - started)
        by_rows: dict[int, list[float]] = defaultdict(list)
        for plan, seconds in zip(decode, best):
            by_rows[sum(len(r.token_ids) for r in plan.requests)].append(seconds)
        cells = ", ".join(
            f"{rows} rows {1000 * sum(v) / len(v):.3f} (n={len(v)})" for rows, v in sorted(by_rows.items())
        )
        print(
            f"  {mode}: {len(decode)} decode steps, {1000 * sum(best):.2f} ms in all; mean per step: {cells}"
        )


if __name__ == "__main__":
    main()
