"""How drafting settings would pay, without timing anything: the bench's workloads' greedy
outputs (generated once in-process with speculation off, cached in ``--cache``) replayed through
the real drafter (``RequestDrafter``) step by step, with each step accepting the drafts that equal
the output. A greedy output is the same with and without speculation, so tokens per step and draft
rows per step are exact whatever the machine's load; the speed-up is then estimated as

    tokens per step / (1 + row_cost * draft rows per step)

with ``row_cost`` the cost of one verifying row relative to a plain step (0.068: a step verifying
5 drafts measured about 1.34 plain steps with Q4_1, docs/benchmarks.md). Requests run one after
the other, so with ``--mode suffix`` a request drafts from the earlier requests' outputs of its
adapter, as on a worker.

    .venv/bin/python -m bench.speculative_policy_sim --tokens 96
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.sample_adapters import read_peft_directory
from bench.speculative_served_bench import demo_adapter_dirs
from bench.speculative_workloads import WorkloadItem, non_repetitive, repetitive
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.engine.speculation.adapter_indexes import AdapterIndexes
from services.gpu_worker.engine.speculation.draft_budget import DraftSettings
from services.gpu_worker.engine.speculation.request_drafter import RequestDrafter
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model

ROW_COST = 0.068


def generate_outputs(items: list[WorkloadItem]) -> list[dict]:
    """Each item's prompt ids and greedy output (q4_1, fp32, speculation off)."""
    loaded = load_model(quantization="q4_1", dtype=torch.float32)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=256, prefix_cache=False))
    for name, directory in demo_adapter_dirs().items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    results = []
    for item in items:
        prompt = item.prompt_ids or tuple(
            loaded.tokenizer.encode(
                loaded.tokenizer.apply_chat_template(list(item.messages), add_generation_prompt=True)
            )
        )
        output: list[int] = []
        sampling = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
        engine.submit(
            GenerationRequest(item.name, prompt, sampling, item.adapter or None),
            lambda e, output=output: e.token_id is None or output.append(e.token_id),
        )
        while engine.has_work():
            engine.step()
        results.append({"name": item.name, "adapter": item.adapter, "prompt": list(prompt), "output": output})
    return results


@dataclass
class Replay:
    steps: int = 0
    tokens: int = 0
    rows: int = 0
    accepted: int = 0

    def speedup(self, row_cost: float) -> float:
        return (self.tokens / self.steps) / (1 + row_cost * self.rows / self.steps)


def replay(requests: list[dict], settings: DraftSettings, suffix: bool) -> Replay:
    """Decode every request's output as the engine would with these settings (after its first
    token, which its prefill draws)."""
    total = Replay()
    indexes = AdapterIndexes(
        settings.max_adapter_indexes, settings.adapter_index_tokens, settings.adapter_max_ngram
    )
    for request in requests:
        key = (request["adapter"], "")
        if suffix and indexes.get(key) is None:
            indexes.add(key, [])
        drafter = RequestDrafter(settings, indexes.get(key) if suffix else None)
        prompt, output = request["prompt"], request["output"]
        done = 1
        while done < len(output):
            limit = len(output) - done - 1
            drafts = drafter.propose(prompt + output[:done], limit) if limit > 0 else ()
            accepted = next((j for j, d in enumerate(drafts) if d != output[done + j]), len(drafts))
            if drafts:
                drafter.verified(len(drafts), accepted)
            total.steps += 1
            total.rows += len(drafts)
            total.accepted += accepted
            total.tokens += accepted + 1
            done += accepted + 1
        if suffix:
            indexes.add(key, output)
    return total


VARIANTS = {
    "current (k<=5)": {},
    "k<=8": {"max_draft_tokens": 8},
    "k<=3": {"max_draft_tokens": 3},
    "ngram 4": {"max_ngram": 4},
    "stop after 2 misses": {"stop_after_misses": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--trace-requests", type=int, default=32)
    parser.add_argument("--row-cost", type=float, default=ROW_COST)
    parser.add_argument("--cache", type=Path, default=Path("bench/out/speculative_outputs.json"))
    args = parser.parse_args()
    if args.cache.exists():
        outputs = json.loads(args.cache.read_text())
    else:
        outputs = {
            "repetitive": generate_outputs(repetitive(args.tokens)),
            "non-repetitive": generate_outputs(non_repetitive(args.trace_requests)),
        }
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        args.cache.write_text(json.dumps(outputs))
    for workload, requests in outputs.items():
        print(f"{workload}: {len(requests)} requests, {sum(len(r['output']) for r in requests)} tokens")
        for mode in ("ngram", "suffix"):
            for label, changes in VARIANTS.items():
                result = replay(requests, replace(DraftSettings(), **changes), suffix=mode == "suffix")
                print(
                    f"  {mode:6} {label:22} tokens/step {result.tokens / result.steps:.2f}  "
                    f"rows/step {result.rows / result.steps:.2f}  "
                    f"accepted {result.accepted / max(result.rows, 1):.0%}  "
                    f"est. speed-up {result.speedup(args.row_cost):.2f}x"
                )


if __name__ == "__main__":
    main()
