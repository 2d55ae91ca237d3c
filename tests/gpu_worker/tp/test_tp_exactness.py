"""A 3-rank gloo group (S-LoRA §6 sharding) equals the single-process model, and its collectives
move exactly the analytic bytes.

A batch mixes 5 PEFT adapters (ranks 8/16/32/64, none a multiple of 3 so every column-parallel
shard is padded; one rsLoRA; attention-only, attention + MLP, and a rank/alpha pattern) and the
base model; prefill, then a step mixing decodes with new prefills, then decodes. fp32 logits must
be within 1e-4 of ``LlamaModel`` at every step and greedy tokens identical; every step's counted
bytes must equal the ring-model formula (docs in ``services/gpu_worker/tp/sharding.py``):

- base: per layer two all-reduces of ``[T, h]``: ``2 · 2(N−1)/N · T·h`` elements' bytes;
- LoRA, per layer: column-parallel modules (q, k, v, gate, up) all-gather ``Σ_t r_pad(t)``
  elements (``r_pad`` = r rounded up to a multiple of N): ``(N−1)/N · Σ_m Σ_t r_pad_m(t)``;
  row-parallel ones (o, down) all-reduce ``Σ_t r_m(t)``: ``2(N−1)/N · Σ_m Σ_t r_m(t)``
  (sums over the tokens whose adapter targets the module, each with its own rank).
  With q, k, v, o targeted at a rank r that N divides this is S-LoRA's ``5(N−1)·T·r/N``.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from bench.tp_rank_group import GroupSpec, LocalRunner, RankGroup
from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest, StepPlan
from services.gpu_worker.tp.sharding import COLUMN_PARALLEL, TensorParallelLayout
from services.model_files.base_model import BaseModelSpec
from services.model_files.model_config import ModelConfig
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.sampling.sampling_params import SamplingParams

N = 3
ATOL = 1e-4
MLP = ("gate_proj", "up_proj", "down_proj")


def adapter_specs(pattern_layer: int) -> dict[str, SampleAdapterSpec]:
    common = {"dtype": "float32", "scale": 0.05}
    return {
        "r8-attn": SampleAdapterSpec(rank=8, seed=11, **common),
        "r16-all": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=12, **common),
        "r32-rslora": SampleAdapterSpec(rank=32, use_rslora=True, lora_alpha=8.0, seed=13, **common),
        "r64-mlp": SampleAdapterSpec(rank=64, target_modules=("q_proj", "v_proj", *MLP), lora_alpha=32.0,
                                     seed=14, **common),
        "r8-pattern": SampleAdapterSpec(
            rank=8, target_modules=LORA_TARGETS, seed=15,
            rank_pattern={"down_proj": 32, f"layers.{pattern_layer}.self_attn.q_proj": 16},
            alpha_pattern={"v_proj": 32.0}, **common,
        ),
    }  # fmt: skip


REQUESTS = [  # (prompt length, adapter); the last two arrive at the second step
    (7, "r8-attn"), (19, "r16-all"), (3, "r32-rslora"), (12, "r64-mlp"), (5, None), (9, "r8-pattern"),
]  # fmt: skip


def analytic_bytes(adapters, plan: StepPlan, config: ModelConfig, elem: int = 4) -> dict:
    layout = TensorParallelLayout.for_config(config, N)
    tokens = sum(len(r.token_ids) for r in plan.requests)
    base = config.num_layers * 2 * Fraction(2 * (N - 1) * tokens * config.hidden_size * elem, N)
    gathered = reduced = 0
    for r in plan.requests:
        if r.adapter is None:
            continue
        for (_, module), factors in adapters[r.adapter.adapter_id].modules.items():
            if module in COLUMN_PARALLEL:
                gathered += len(r.token_ids) * layout.padded_rank(factors.rank)
            else:
                reduced += len(r.token_ids) * factors.rank
    lora = Fraction((N - 1) * gathered * elem, N) + Fraction(2 * (N - 1) * reduced * elem, N)
    return {"base": base, "lora": lora}


def counted(traffic: dict, tag: str) -> Fraction:
    return sum((v["bytes"] for k, v in traffic.items() if k.startswith(tag + "/")), Fraction(0))


def run_scenario(config, weights, adapters, prompts: list[list[int]], decode_steps: int, num_pages: int):
    """Drive the group and the reference in lockstep; returns (max |diff|, steps, byte checks)."""
    spec = GroupSpec(config=config, weights=weights, size=N, num_pages=num_pages)
    reference = LocalRunner(GroupSpec(config=config, weights=weights, size=1, num_pages=num_pages))
    worst, checks = 0.0, []
    slots: dict[str, AdapterSlot] = {}
    with RankGroup(spec) as group:
        for adapter in adapters.values():
            fingerprints = group.load_adapter(adapter)
            assert all(f == fingerprints[0] for f in fingerprints), "placement differs between ranks"
            placement = fingerprints[0][2]
            assert reference.load_adapter(adapter)[0][2] == placement
            slots[adapter.adapter_id] = AdapterSlot(adapter.adapter_id, placement)
        loaded = tuple(adapters)
        assert all(ids == loaded for _, ids, _ in fingerprints), "an adapter was evicted: give more pages"
        assert reference.load_adapter(adapters[loaded[-1]])[0][1] == loaded
        last: dict[str, int] = {}
        computed: dict[str, int] = {}

        def step(requests: list[PlannedRequest]) -> None:
            nonlocal worst
            plan = StepPlan(tuple(requests), lora_backend="torch", batch_invariant=False)
            ours, theirs = group.step(plan), reference.step(plan)
            diff = (ours.logits - theirs.logits).abs().max().item()
            worst = max(worst, diff)
            assert diff <= ATOL, f"step {len(checks)}: logits differ by {diff:.2e}"
            tokens, expected = ours.logits.argmax(-1).tolist(), theirs.logits.argmax(-1).tolist()
            assert tokens == expected
            for r, t in zip(requests, tokens):
                last[r.request_id] = t
                computed[r.request_id] = r.end_position
            analytic = analytic_bytes(adapters, plan, config)
            for tag in ("base", "lora"):
                assert counted(ours.traffic, tag) == analytic[tag], (tag, ours.traffic, analytic)
            assert ours.traffic["base/all_reduce"]["calls"] == 2 * config.num_layers
            checks.append((sum(len(r.token_ids) for r in requests), analytic))

        def planned(i: int, token_ids: tuple[int, ...]) -> PlannedRequest:
            rid, adapter = f"r{i}", REQUESTS[i][1]
            slot = slots[adapter] if adapter is not None else None
            return PlannedRequest(rid, token_ids, computed.get(rid, 0), (), slot, SamplingParams())

        def request(i: int) -> PlannedRequest:
            return planned(i, tuple(prompts[i]))

        def decode(ids) -> list[PlannedRequest]:
            return [planned(i, (last[f"r{i}"],)) for i in ids]

        step([request(i) for i in range(4)])
        step(decode(range(4)) + [request(4), request(5)])  # decodes and prefills in one batch
        for _ in range(decode_steps):
            step(decode(range(6)))
        group.finish([f"r{i}" for i in range(6)])
    return worst, checks


def tiny_model():
    """A random Llama whose heads (6 query, 3 KV), intermediate and hidden size 3 divides."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    weights = {k: v.detach().clone() for k, v in LlamaForCausalLM(hf).state_dict().items()}
    config = ModelConfig.from_hf_config(hf.to_dict(), default_name="tiny-llama-6h")
    spec = BaseModelSpec(
        name="tiny-llama-6h", hidden_size=96, intermediate_size=192, num_layers=2, num_heads=6,
        num_kv_heads=3, head_dim=16, vocab_size=256,
    )  # fmt: skip
    return config, weights, spec


def load_adapters(spec: BaseModelSpec, root, pattern_layer: int) -> dict:
    return {
        name: read_peft_directory(name, write_peft_adapter(root / name, spec, sample), torch.float32)
        for name, sample in adapter_specs(pattern_layer).items()
    }


def test_tiny_llama_tp3_equals_single_process(tmp_path):
    config, weights, spec = tiny_model()
    adapters = load_adapters(spec, tmp_path, pattern_layer=1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n, _ in REQUESTS]
    worst, checks = run_scenario(config, weights, adapters, prompts, decode_steps=3, num_pages=256)
    assert len(checks) == 5
    print(f"tiny tp3: max |logit diff| {worst:.3e}; bytes per step {checks}")


@pytest.mark.model
def test_smollm2_tp3_equals_single_process(tmp_path, base_spec):
    from services.gpu_worker.model.loading import load_model

    loaded = load_model()
    adapters = load_adapters(base_spec, tmp_path, pattern_layer=2)
    text = "In the beginning the universe was created. This has made a lot of people very angry."
    ids = loaded.tokenizer.encode(text)
    prompts = [ids[i : i + n] for i, (n, _) in enumerate(REQUESTS)]
    worst, checks = run_scenario(loaded.config, loaded.weights, adapters, prompts, decode_steps=2,
                                 num_pages=12000)  # fmt: skip
    print(f"SmolLM2 tp3: max |logit diff| {worst:.3e}; bytes per step {checks}")
