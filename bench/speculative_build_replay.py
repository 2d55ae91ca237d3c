"""The host side of speculative steps: what building each step's inputs from its plan costs, with
and without drafts, replayed (engine-level), with the step builder's LoRA segments kept for the
recent step shapes and, beside it, for the last step only (the code before they were kept).

Three engines decode the SQL rewrite (``bench.speculative_bench``'s prompt) at batch 1, through a
demo adapter (``--adapter``) or the base model: ``off``, and two ``ngram`` ones with drafts priced
as free (they draft whenever the index finds a match, the same drafts); every plan each ran is
kept in order. Then the plan sequences are replayed ``--reps`` times, the engines in turn within
each repetition, through each executor's ``StepInputs.build`` (the persistent batch, the step
builder and their caches, as in the run); ``ngram last only`` keeps one step's segments
(``LORA_SEGMENTS_KEPT`` 1 while it runs, its builder's others dropped first). The minimum per step over the replays is reported,
averaged by the step's rows (a loaded machine only adds time). ``--forward`` times the whole
``execute`` instead (the build and the forward pass, its KV written again with the same values).

    .venv/bin/python -m bench.speculative_build_replay --adapter sql --reps 20
    .venv/bin/python -m bench.speculative_build_replay --adapter sql --reps 10 --forward --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from bench.sample_adapters import read_peft_directory
from bench.speculative_adapters import workload_adapter_dir
from bench.speculative_bench import sql_rewrite
from bench.speculative_forward_profile import FREE_ROWS
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.executor import step_builder
from tests.support.draft_cost import pin_draft_cost

SETUPS = {"off": ("off", None), "ngram kept": ("ngram", None), "ngram last only": ("ngram", 1)}
"""Name -> (speculative mode, LoRA segments kept while it replays; None: the default)."""


def captured_run(model, prompt, mode: str, adapter: str | None, tokens: int):
    """An engine that ran the request, and its decode steps' plans in order."""
    engine = pin_draft_cost(
        local_engine(model, EngineConfig(pool_mib=128, speculative=mode, prefix_cache=False)), FREE_ROWS
    )
    if adapter is not None:
        engine.add_adapter(read_peft_directory(adapter, workload_adapter_dir(adapter), model.dtype))
    executor = engine.executor
    plans = []
    execute = executor.execute

    def keep(plan):
        plans.append(plan)
        return execute(plan)

    executor.execute = keep
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.submit(GenerationRequest("r", prompt, sampling, adapter), lambda event: None)
    while engine.has_work():
        engine.step()
    executor.execute = execute
    return executor, [p for p in plans if all(r.draft_tokens + 1 == len(r.token_ids) for r in p.requests)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="sql", help="a demo adapter, or '' for the base model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--forward", action="store_true", help="time the whole execute, not the build")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    adapter = args.adapter or None
    _, model, prompt = sql_rewrite("q4_1", args.dtype)
    runs = {
        name: captured_run(model, prompt, mode, adapter, args.tokens) for name, (mode, _) in SETUPS.items()
    }
    best = {name: [float("inf")] * len(plans) for name, (_, plans) in runs.items()}
    default_kept = step_builder.LORA_SEGMENTS_KEPT
    for _ in range(args.reps):
        for name, (executor, plans) in runs.items():
            kept = step_builder.LORA_SEGMENTS_KEPT = SETUPS[name][1] or default_kept
            segments = executor.inputs.builder._loras
            while len(segments) > kept:
                segments.popitem(last=False)
            for i, plan in enumerate(plans):
                started = time.perf_counter()
                if args.forward:
                    executor.execute(plan)
                else:
                    executor.inputs.build(plan, executor._resident.get, None)
                best[name][i] = min(best[name][i], time.perf_counter() - started)
    step_builder.LORA_SEGMENTS_KEPT = default_kept
    print(
        f"q4_1 {args.dtype}, batch 1, adapter {adapter}, {args.tokens} tokens; "
        f"{'execute' if args.forward else 'build'} ms, minimum of {args.reps}"
    )
    for name, (_, plans) in runs.items():
        by_rows: dict[int, list[float]] = defaultdict(list)
        for plan, seconds in zip(plans, best[name]):
            by_rows[sum(len(r.token_ids) for r in plan.requests)].append(seconds)
        cells = ", ".join(
            f"{rows} rows {1000 * sum(v) / len(v):.3f} (n={len(v)})" for rows, v in sorted(by_rows.items())
        )
        print(
            f"  {name}: {len(plans)} decode steps, {1000 * sum(best[name]):.2f} ms in all; per step: {cells}"
        )


if __name__ == "__main__":
    main()
