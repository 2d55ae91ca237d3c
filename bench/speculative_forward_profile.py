"""What a verifying row costs inside the forward pass, op by op (engine-level, no gRPC).

An ``ngram`` engine over the q4_1 model decodes ``--requests`` copies of the SQL rewrite
(``bench.speculative_bench``'s prompt) with its drafts priced as free (it drafts whenever the
index finds a match), an ``off`` engine the same; the last step batch of each shape (its decode
rows in all, and how many requests verify drafts) is kept. Then every kept batch is run through
``LlamaModel.forward`` ``--reps`` times, the shapes in turn, each op class timed (the base
matmuls by projection, attention, the rest of the glue, the LoRA deltas); the minimum over the
repetitions is reported (a loaded machine only adds time), and their sum (``ops``: under load
the minimum of whole passes still holds stalls, the sum of each op's minimum far fewer), ÷ the
``off`` engine's one-row step (``x plain``).

    .venv/bin/python -m bench.speculative_forward_profile --requests 1 --reps 20
    .venv/bin/python -m bench.speculative_forward_profile --requests 8 --reps 10
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

from bench.speculative_bench import sql_rewrite
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model import native_step_ops
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.step_batch import StepBatch
from tests.support.draft_cost import pin_draft_cost

FREE_ROWS = LinearCost.named(STEP_TERMS, fixed=0.02, per_decode_token=0.0)
"""Drafts priced as free: every step drafts what the index finds, so every row count shows up."""

COLUMNS = (
    "total", "mm qkv", "mm o", "mm gate_up", "mm down", "mm lm_head", "attention", "rope+kv", "add+norm",
    "swiglu", "lora",
)  # fmt: skip


def captured_batches(model: LlamaModel, prompt: tuple[int, ...], requests: int, tokens: int):
    """The last batch of each (decode rows, verifying requests) shape, from both engines."""
    kept: dict[tuple[str, int, int], StepBatch] = {}
    view = None
    for mode in ("off", "ngram"):
        engine = pin_draft_cost(
            local_engine(model, EngineConfig(pool_mib=256, speculative=mode, prefix_cache=False)), FREE_ROWS
        )
        inputs = engine.executor.inputs
        build = inputs.build

        def keep(plan, *args, _build=build, _mode=mode):
            batch = _build(plan, *args)
            if all(p.draft_tokens + 1 == len(p.token_ids) for p in plan.requests):  # decode steps only
                rows = sum(len(p.token_ids) for p in plan.requests)
                kept[(_mode, rows, sum(1 for p in plan.requests if p.draft_tokens))] = batch
            return batch

        inputs.build = keep
        sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
        for i in range(requests):
            engine.submit(GenerationRequest(f"r{i}", prompt, sampling), lambda event: None)
        while engine.has_work():
            engine.step()
        view = engine.executor.view
    return kept, view


def timed_ops(spent: dict[str, float]) -> None:
    """Wrap the step ops and the LoRA call so each adds its seconds to ``spent``."""

    def timer(name: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = function(*args, **kwargs)
            spent[name] += time.perf_counter() - started
            return result

        return timed

    ops = native_step_ops.NativeStepOps
    linear = ops.linear

    def timed_linear(self, name, *args, **kwargs):
        started = time.perf_counter()
        result = linear(self, name, *args, **kwargs)
        spent[f"mm {name}"] += time.perf_counter() - started
        return result

    ops.linear = timed_linear
    for method, column in (
        ("attention", "attention"), ("rotate_and_cache", "rope+kv"), ("add_rms_norm", "add+norm"),
        ("rms_norm", "add+norm"), ("swiglu", "swiglu"),
    ):  # fmt: skip
        setattr(ops, method, timer(column, getattr(ops, method)))
    LlamaModel._lora = staticmethod(timer("lora", LlamaModel._lora))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    _, model, prompt = sql_rewrite("q4_1", args.dtype)
    kept, view = captured_batches(model, prompt, args.requests, args.tokens)
    spent: dict[str, float] = defaultdict(float)
    timed_ops(spent)
    best: dict[tuple, dict[str, float]] = {key: {} for key in kept}
    for _ in range(args.reps):
        for key, batch in sorted(kept.items()):
            spent.clear()
            started = time.perf_counter()
            model.forward(batch, view)
            spent["total"] = time.perf_counter() - started
            for column, seconds in spent.items():
                best[key][column] = min(best[key].get(column, seconds), seconds)
    print(f"q4_1 {args.dtype}, {args.requests} request(s); forward ms, minimum of {args.reps}")
    print("mode  rows verifying " + "".join(f"{c:>11}" for c in COLUMNS) + "        ops   x plain")
    ops = {
        key: sum(seconds for column, seconds in row.items() if column != "total") for key, row in best.items()
    }
    plain = ops[min(key for key in kept if key[0] == "off")]
    for key in sorted(kept):
        row = best[key]
        cells = "".join(f"{1000 * row[c]:11.2f}" if c in row else f"{'-':>11}" for c in COLUMNS)
        print(f"{key[0]:5} {key[1]:4} {key[2]:9} {cells}{1000 * ops[key]:11.2f}   {ops[key] / plain:.2f}")


if __name__ == "__main__":
    main()
