"""Tensor parallelism (S-LoRA §6) side by side with one process: decode step time, LoRA's time
overhead, the LoRA collectives' share and bytes, at TP = 1 and TP = N, in one run.

    PYTHONPATH=. .venv/bin/python bench/tp_bench.py                   # SmolLM2 at N = 3, random at N = 2
    PYTHONPATH=. .venv/bin/python bench/tp_bench.py --models random --steps 4

Models: SmolLM2-135M (9/3 heads: N = 3) and a random Llama with even heads (N = 2, SmolLM2's
widths with 8/4 heads of 64, ``--random-layers`` layers). For each: TP = 1 (the plain
``LlamaModel`` in this process) and TP = N (a gloo ``RankGroup``), every rank with
``--threads`` torch threads. Batches of 1 and 32 decoding requests (8-token prompts), with no
adapter and with k adapters of rank r (attention q/k/v/o, as in S-LoRA's analysis), requests
spread round-robin. After ``--warmup`` steps, the median of ``--steps`` decode steps (rank 0's
forward). Reported: step ms, tokens/s, LoRA overhead = t(lora)/t(base) − 1, the LoRA collectives'
seconds and their share of LoRA's extra time, bytes per step (base / LoRA, counted by the ring
model) and LoRA/base bytes per attention block against S-LoRA's analytic 5r/(2h) (padded: a
column-parallel rank is rounded up to a multiple of N, so at N = 3 the analytic is
(3·r_pad + 2·r)/(2h)). Ratios only: on a CPU with gloo the collectives are latency-bound and N
ranks share the machine's cores, so no TP speedup is expected here.

Raw results: ``bench/out/tp_bench/results.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from fractions import Fraction
from pathlib import Path

import torch

from bench.out_dir import default_out
from bench.tp_rank_group import GroupSpec, LocalRunner, RankGroup
from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest, StepPlan
from services.gpu_worker.lora.host_adapter import HostAdapter, LoraFactors
from services.gpu_worker.tp.sharding import TensorParallelLayout
from services.model_files.model_config import ModelConfig
from services.runtime.sampling.sampling_params import SamplingParams

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def random_model(layers: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = ModelConfig(
        architecture="llama", vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=layers,
        num_heads=8, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=2048, tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
        eos_token_ids=(), name="random-8h",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_kv_heads * config.head_dim
    weights = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h, generator=g) * 0.02,
               "model.norm.weight": torch.ones(h)}  # fmt: skip
    for n in range(layers):
        p = f"model.layers.{n}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, h)),
                            ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i))):  # fmt: skip
            weights[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.02
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return config, weights


def random_adapter(name: str, config: ModelConfig, rank: int, seed: int) -> HostAdapter:
    g = torch.Generator().manual_seed(seed)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q_proj": (config.hidden_size, q), "k_proj": (config.hidden_size, kv),
              "v_proj": (config.hidden_size, kv), "o_proj": (q, config.hidden_size)}  # fmt: skip
    modules = {
        (layer, m): LoraFactors(
            torch.randn(rank, i, generator=g) * 0.02, torch.randn(rank, o, generator=g) * 0.02, 2.0
        )
        for layer in range(config.num_layers)
        for m, (i, o) in shapes.items()
    }
    return HostAdapter(name, modules)


def step_plan(requests) -> StepPlan:
    return StepPlan(tuple(requests), lora_backend="torch", batch_invariant=False)


def measure(
    runner, batch: int, adapters: list[AdapterSlot | None], warmup: int, steps: int, tag: str
) -> dict:
    ids = [f"{tag}-{i}" for i in range(batch)]
    plan = step_plan(
        PlannedRequest(rid, tuple(range(3, 11)), 0, (), adapters[i % len(adapters)], SamplingParams())
        for i, rid in enumerate(ids)
    )
    result = runner.step(plan)
    times, traffic = [], None
    for n in range(warmup + steps):
        tokens = result.logits.argmax(-1).tolist()
        plan = step_plan(
            PlannedRequest(r.request_id, (t,), r.end_position, (), r.adapter, r.sampling)
            for r, t in zip(plan.requests, tokens)
        )
        result = runner.step(plan)
        if n >= warmup:
            times.append(result.seconds)
            traffic = result.traffic
    runner.finish(ids)

    def tagged(t: str, what: str):
        return sum((v[what] for k, v in (traffic or {}).items() if k.startswith(t + "/")), Fraction(0))

    return {
        "step_ms": statistics.median(times) * 1e3,
        "tokens_per_s": batch / statistics.median(times),
        "base_bytes": float(tagged("base", "bytes")),
        "lora_bytes": float(tagged("lora", "bytes")),
        "base_coll_ms": float(tagged("base", "seconds")) * 1e3,
        "lora_coll_ms": float(tagged("lora", "seconds")) * 1e3,
    }


def run_model(name: str, config, weights, n: int, args) -> list[dict]:
    rows = []
    pages = args.pages
    for size in (1, n):
        spec = GroupSpec(config=config, weights=weights, size=size, num_pages=pages, threads=args.threads)
        if size == 1:
            torch.set_num_threads(args.threads)
        with LocalRunner(spec) if size == 1 else RankGroup(spec) as runner:
            adapters: dict[int, list[AdapterSlot]] = {}
            for r in args.ranks:
                for j in range(args.k):
                    adapter_id = f"r{r}-{j}"
                    placement = runner.load_adapter(random_adapter(adapter_id, config, r, seed=100 * r + j))[
                        0
                    ][2]
                    adapters.setdefault(r, []).append(AdapterSlot(adapter_id, placement))
            for batch in args.batches:
                base = measure(runner, batch, [None], args.warmup, args.steps, f"b{batch}")
                rows.append({"model": name, "tp": size, "batch": batch, "rank": 0, **base})
                for r, slots in adapters.items():
                    m = measure(runner, batch, slots, args.warmup, args.steps, f"b{batch}r{r}")
                    m["lora_overhead"] = m["step_ms"] / base["step_ms"] - 1
                    extra = m["step_ms"] - base["step_ms"]
                    m["lora_coll_share_of_lora_time"] = m["lora_coll_ms"] / extra if extra > 0 else None
                    if size > 1:
                        layout = TensorParallelLayout.for_config(config, size)
                        h = config.hidden_size
                        m["lora_over_base_bytes_per_attention_block"] = m["lora_bytes"] / (
                            m["base_bytes"] / 2
                        )
                        m["analytic_5r_over_2h"] = 5 * r / (2 * h)
                        m["analytic_padded"] = (3 * layout.padded_rank(r) + 2 * r) / (2 * h)
                    rows.append({"model": name, "tp": size, "batch": batch, "rank": r, **m})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["smollm2", "random"], choices=["smollm2", "random"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--k", type=int, default=4, help="adapters per rank, requests round-robin")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (and at TP = 1)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--random-layers", type=int, default=8)
    parser.add_argument("--pages", type=int, default=16000)
    parser.add_argument("--out", type=Path, default=default_out("tp_bench"))
    args = parser.parse_args()
    rows = []
    for model in args.models:
        if model == "smollm2":
            from services.gpu_worker.model.loading import load_model

            loaded = load_model()
            rows += run_model("SmolLM2-135M", loaded.config, loaded.weights, 3, args)
        else:
            config, weights = random_model(args.random_layers)
            rows += run_model("random-8h", config, weights, 2, args)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu, "cores": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{cpu}; {args.threads} thread(s) per rank")
    print(f"{'model':14} {'tp':>2} {'B':>3} {'r':>3} {'step ms':>8} {'tok/s':>8} {'LoRA ovh':>8} "
          f"{'LoRA coll ms':>12} {'coll share':>10} {'base B/step':>12} {'LoRA B/step':>12} {'ratio':>7} {'5r/2h':>7}")  # fmt: skip
    for r in rows:

        def f(key, fmt, r=r):
            v = r.get(key)
            return format(v, fmt) if v is not None else "-"

        print(f"{r['model']:14} {r['tp']:>2} {r['batch']:>3} {r['rank']:>3} {r['step_ms']:8.1f} "
              f"{r['tokens_per_s']:8.1f} {f('lora_overhead', '8.1%'):>8} {r['lora_coll_ms']:12.2f} "
              f"{f('lora_coll_share_of_lora_time', '10.1%'):>10} {r['base_bytes']:12.0f} {r['lora_bytes']:12.0f} "
              f"{f('lora_over_base_bytes_per_attention_block', '7.4f'):>7} {f('analytic_padded', '7.4f'):>7}")  # fmt: skip
    print(f"raw: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
