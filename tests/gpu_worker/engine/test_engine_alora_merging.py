"""dLoRA's merged mode never merges an activated LoRA (aLoRA): its weights apply to part of each
request's positions only (PEFT refuses to merge one too). A policy that would merge the only
adapter in use leaves the base weights unmerged and the tokens those of FCFS (tiny Llama, fp32)."""

from __future__ import annotations

import torch
from support.alora_adapters import write_alora_adapter

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.policies.batch_policy import UNMERGED
from services.gpu_worker.engine.policies.dlora import DloraConfig, DynamicBatching
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel

INVOCATION = [7, 9]


def run(tiny_llama, directory, policy=None) -> tuple[Engine, dict[str, list[int]]]:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=4), batch_policy=policy)
    engine.add_adapter(read_peft_directory("check", directory, torch.float32))
    tokens: dict[str, list[int]] = {}
    for i in range(4):
        prompt = (3 + i, 11, *INVOCATION, 20 + i, 30)
        engine.submit(
            GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True), "check"),
            lambda e: e.token_id is not None and tokens.setdefault(e.request_id, []).append(e.token_id),
        )
    while engine.has_work():
        engine.step()
    return engine, tokens


def always_merge() -> DynamicBatching:
    return DynamicBatching(DloraConfig(alpha=0.05, beta=0.05, min_threshold=0.05, merge_must_pay=False))


def test_an_alora_adapter_is_never_merged(tiny_llama, tmp_path):
    sample = SampleAdapterSpec(rank=8, scale=0.3, seed=21)
    directory = write_alora_adapter(tmp_path / "check", tiny_llama.spec, sample, INVOCATION)
    merging, merged_tokens = run(tiny_llama, directory, always_merge())
    assert merging.adapters.mode == UNMERGED and merging.adapters.mode_switches == 0
    assert merged_tokens == run(tiny_llama, directory)[1]
    # The control: the same weights as a standard LoRA are merged by that policy.
    standard = write_alora_adapter(tmp_path / "standard", tiny_llama.spec, sample, None)
    assert run(tiny_llama, standard, always_merge())[0].adapters.mode_switches >= 1
