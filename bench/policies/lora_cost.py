"""dLoRA's two numbers measured on this machine (SEED-SPECS §2): what the unmerged LoRA delta
costs beside the base GEMMs (BAx/Wx; dLoRA measures 38.9% on its GPU) and what one merge plus
unmerge of a rank-8 adapter takes (t_M). Merging pays when the delta is costly and t_M is small
against the steps it saves.

BAx/Wx is taken at the step level, where it decides a policy: decode steps of ``batch`` requests
without an adapter, with one adapter for all, and with one adapter each, interleaved round by
round (the host is shared and drifts), medians reported; the extra over the base step is the
LoRA share.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.sample_adapters import read_peft_directory
from bench.systems.base import AdapterSet
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.lora.merged_weights import MergedWeights
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model

PROMPT_TOKENS = 24
TIMED_STEPS = 8


def _decode_step_s(engine: Engine, adapter_ids: list[str | None], tag: str) -> float:
    """Median seconds of a decode step of one request per entry of ``adapter_ids``."""
    params = SamplingParams(max_tokens=TIMED_STEPS + 2, ignore_eos=True)
    for i, adapter_id in enumerate(adapter_ids):
        prompt = tuple(100 + (i * 7 + j * 13) % 20000 for j in range(PROMPT_TOKENS))
        engine.submit(GenerationRequest(f"{tag}-{i}", prompt, params, adapter_id), lambda event: None)
    engine.step()  # prefill
    engine.step()  # first decode, untimed
    times = []
    for _ in range(TIMED_STEPS):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    while engine.has_work():
        engine.step()
    return statistics.median(times)


def measure(adapters: AdapterSet, batch: int, rounds: int) -> dict:
    """BAx/Wx for one shared adapter and for ``batch`` distinct ones, and t_M (medians)."""
    loaded = load_model(None)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=256, max_running=batch))
    hosts = [
        read_peft_directory(adapters.name(i), adapters.directory(i), torch.float32) for i in range(batch)
    ]
    for host in hosts:
        engine.add_adapter(host)
    variants = {
        "base": [None] * batch,
        "one_adapter": [hosts[0].adapter_id] * batch,
        "distinct_adapters": [h.adapter_id for h in hosts],
    }
    _decode_step_s(engine, variants["distinct_adapters"], "warmup")
    steps: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds):
        for name, ids in variants.items():
            steps[name].append(_decode_step_s(engine, ids, f"{name}-{round_index}"))
    medians = {name: statistics.median(values) for name, values in steps.items()}
    merged = MergedWeights(model)
    merged.merge(hosts[0])  # untimed: the first merge also copies the pristine base rows
    merged.unmerge()
    merge_times = []
    for _ in range(rounds):
        began = time.perf_counter()
        merged.merge(hosts[0])
        merged.unmerge()
        merge_times.append(time.perf_counter() - began)
    return {
        "batch": batch,
        "decode_step_s": {k: round(v, 5) for k, v in medians.items()},
        "bax_over_wx_one_adapter": round(medians["one_adapter"] / medians["base"] - 1, 4),
        "bax_over_wx_distinct_adapters": round(medians["distinct_adapters"] / medians["base"] - 1, 4),
        "merge_unmerge_s": round(statistics.median(merge_times), 5),
    }
