"""How drafting settings would pay, without timing anything: the bench's workloads' greedy
outputs (generated once in-process with speculation off, cached in ``--cache``) replayed through
the real drafter (``RequestDrafter``) step by step, with each step accepting the drafts that equal
the output. A greedy output is the same with and without speculation, so tokens per step and draft
rows per step are exact whatever the machine's load; the speed-up is then estimated from a step
cost linear in its rows, in units of a plain batch-1 step: ``C(B) = 1 - r + r·B`` at batch 1
(``r`` = ``--row-cost``, 0.17: the whole forward pass with the ``sql`` adapter, Q4_1 weights and
bf16 activations, took 8.45 ms with 1 row and 1.4-1.6 ms more a row up to 6 rows on 2 EPYC cores,
``bench.speculative_step_profile --adapter sql``; 0.068, the kernel's own price once used here,
left out the rest of the pass) and ``C(B) = 1 + (B - 1)·r_B`` at ``--batch`` B > 1 (``r_B`` from
``--wide-step``, a plain batch-B step in batch-1 steps: 3.5 at 8, from the served 8-concurrent
rate against batch 1). A request's share of a plain step is ``C(B)/B``, so

    speed-up = tokens per step · (C(B)/B) / (C(B)/B + r_B · draft rows per step)

Each variant runs with and without the cost-aware rule (``draft_cost.py``: a draft token only
while its chance of acceptance times ``C(B)/B`` exceeds ``r_B``, priced by this linear cost).
Requests run one after the other, so with ``--mode suffix`` a request drafts from the earlier
requests' outputs of its adapter, as on a worker.

    .venv/bin/python -m bench.speculative_policy_sim --tokens 96
    .venv/bin/python -m bench.speculative_policy_sim --per-item   # each request; drafts by match length
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from bench.sample_adapters import read_peft_directory
from bench.speculative_adapters import workload_adapter_dirs
from bench.speculative_workloads import WorkloadItem, non_repetitive, repetitive
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.engine.speculation.acceptance import DraftChances
from services.gpu_worker.engine.speculation.adapter_indexes import AdapterIndexes
from services.gpu_worker.engine.speculation.draft_budget import DraftSettings
from services.gpu_worker.engine.speculation.draft_cost import DraftPrices, draft_prices
from services.gpu_worker.engine.speculation.ngram_index import NgramIndex
from services.gpu_worker.engine.speculation.request_drafter import RequestDrafter
from services.gpu_worker.engine.speculation.speculator import ADAPTER_DECAY, MAX_ADAPTER_RATES
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model

ROW_COST = 0.17
WIDE_STEP = 3.5


def generate_outputs(items: list[WorkloadItem]) -> list[dict]:
    """Each item's prompt ids and greedy output (q4_1, fp32, speculation off)."""
    loaded = load_model(quantization="q4_1", dtype=torch.float32)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=256, prefix_cache=False))
    for name, directory in workload_adapter_dirs().items():
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

    def speedup(self, prices: DraftPrices) -> float:
        share = prices.token_s
        return (self.tokens / self.steps) * share / (share + prices.row_s * self.rows / self.steps)


def step_cost(batch: int, row_cost: float, wide_step: float) -> LinearCost:
    """The linear step cost in plain batch-1 steps (see the module's docstring)."""
    if batch == 1:
        return LinearCost.named(STEP_TERMS, fixed=1 - row_cost, per_decode_token=row_cost)
    row = (wide_step - 1) / (batch - 1)
    return LinearCost.named(STEP_TERMS, fixed=1 - row, per_decode_token=row)


def replay(
    requests: list[dict], settings: DraftSettings, suffix: bool, prices: DraftPrices | None = None
) -> Replay:
    """Decode every request's output as the engine would with these settings (after its first
    token, which its prefill draws); with ``prices``, drafting cost-aware at them."""
    total = Replay()
    indexes = AdapterIndexes(
        settings.max_adapter_indexes, settings.adapter_index_tokens, settings.adapter_max_ngram
    )
    chances = DraftChances(settings.prior_acceptance, settings.prior_weight, ADAPTER_DECAY, MAX_ADAPTER_RATES)
    for request in requests:
        key = (request["adapter"], "")
        if suffix and indexes.get(key) is None:
            indexes.add(key, [])
        drafter = RequestDrafter(settings, indexes.get(key) if suffix else None)
        prompt, output = request["prompt"], request["output"]
        done = 1
        while done < len(output):
            limit = len(output) - done - 1
            adapter = request["adapter"]
            drafts = (
                drafter.propose(prompt + output[:done], limit, prices, partial(chances.match, adapter))
                if limit > 0
                else ()
            )
            accepted = next((j for j, d in enumerate(drafts) if d != output[done + j]), len(drafts))
            if drafts:
                drafter.verified(len(drafts), accepted)
                chances.verified(adapter, drafter.match_length, len(drafts), accepted)
            total.steps += 1
            total.rows += len(drafts)
            total.accepted += accepted
            total.tokens += accepted + 1
            done += accepted + 1
        if suffix:
            indexes.add(key, output)
    return total


def by_match_length(requests: list[dict], settings: DraftSettings) -> dict[int, tuple[int, float, float]]:
    """Prompt lookup at every position of every output: per matched suffix length n, how many
    drafts, the share whose first token was the output's, and the accepted tokens per draft."""
    seen: dict[int, list[int]] = {}
    for request in requests:
        index = NgramIndex(settings.max_ngram)
        prompt, output = request["prompt"], request["output"]
        for done in range(1, len(output) - 1):
            index.sync(prompt + output[:done])
            n, drafts = index.match(min(settings.max_draft_tokens, len(output) - done))
            if drafts:
                accepted = next((j for j, d in enumerate(drafts) if d != output[done + j]), len(drafts))
                counts = seen.setdefault(n, [0, 0, 0])
                counts[0] += 1
                counts[1] += accepted > 0
                counts[2] += accepted
    return {n: (c[0], c[1] / c[0], c[2] / c[0]) for n, c in sorted(seen.items())}


def per_item(outputs: dict[str, list[dict]], prices: DraftPrices) -> None:
    """Each request replayed alone, cost-aware (tokens and draft rows per step, acceptance), and
    each workload's drafts by the length of the suffix they matched."""
    settings = DraftSettings()
    for workload, requests in outputs.items():
        print(f"{workload}:")
        for request in requests:
            result = replay([request], settings, suffix=False, prices=prices)
            print(
                f"  {request['name']:16} tokens/step {result.tokens / result.steps:.2f}  "
                f"rows/step {result.rows / result.steps:.2f}  "
                f"accepted {result.accepted / max(result.rows, 1):.0%}"
            )
        for n, (drafts, first, tokens) in by_match_length(requests, settings).items():
            print(
                f"  matched {n} tokens: {drafts} drafts, first token right {first:.0%}, {tokens:.2f} accepted a draft"
            )


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
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--wide-step", type=float, default=WIDE_STEP)
    parser.add_argument("--cache", type=Path, default=Path("bench/out/speculative_outputs.json"))
    parser.add_argument("--per-item", action="store_true", help="each request, and drafts by match length")
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
    prices = draft_prices(step_cost(args.batch, args.row_cost, args.wide_step), args.batch, 0)
    print(
        f"batch {args.batch}: a token's share {prices.token_s:.3f}, a row {prices.row_s:.3f} (plain batch-1 steps)"
    )
    if args.per_item:
        per_item(outputs, prices)
        return
    for workload, requests in outputs.items():
        print(f"{workload}: {len(requests)} requests, {sum(len(r['output']) for r in requests)} tokens")
        for mode in ("ngram", "suffix"):
            for label, changes in VARIANTS.items():
                for aware in (False, True):
                    result = replay(
                        requests,
                        replace(DraftSettings(), **changes),
                        suffix=mode == "suffix",
                        prices=prices if aware else None,
                    )
                    print(
                        f"  {mode:6} {label:22} {'cost-aware' if aware else 'always    '}  "
                        f"tokens/step {result.tokens / result.steps:.2f}  "
                        f"rows/step {result.rows / result.steps:.2f}  "
                        f"accepted {result.accepted / max(result.rows, 1):.0%}  "
                        f"est. speed-up {result.speedup(prices):.2f}x"
                    )


if __name__ == "__main__":
    main()
