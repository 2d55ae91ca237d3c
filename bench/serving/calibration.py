"""How much batching can buy on this machine: the base model's decode throughput at batch 1 and
at the profile's batch size, measured with the loramesh engine (no adapters) before the runs.

A server that runs one adapter's requests at a time (PEFT, merged-swap) decodes with small
batches; loramesh batches across adapters. Neither can beat the other by more than the ratio of
decode throughput at full batch to decode throughput at batch 1, whatever else they do. On a GPU
that ratio is large (decode is memory-bound until big batches); on a few CPU cores the step is
compute-bound early and the ratio is small, which caps any batching system's advantage.
"""

from __future__ import annotations

import time

import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.service import resolve_dtype

PROMPT_TOKENS = 32
DECODE_STEPS = 12


def decode_tokens_per_s(engine: Engine, batch: int, tag: str) -> float:
    """Decode throughput of ``batch`` requests: prefill first, then time ``DECODE_STEPS`` steps."""
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, ignore_eos=True)
    for i in range(batch):
        prompt = tuple(100 + (i * 7 + j * 13) % 20000 for j in range(PROMPT_TOKENS))
        engine.submit(GenerationRequest(f"{tag}-{i}", prompt, params), lambda event: None)
    engine.step()  # prefill
    engine.step()  # first decode, untimed (warm-up)
    began = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    elapsed = time.perf_counter() - began
    while engine.has_work():
        engine.step()
    return batch * DECODE_STEPS / elapsed


def batching_ceiling(model_path: str | None, max_batch: int) -> dict:
    loaded = load_model(model_path)
    dtype = resolve_dtype("auto", torch.device("cpu"))
    model = LlamaModel(loaded.config, loaded.weights, dtype)
    engine = local_engine(model, EngineConfig(pool_mib=256, max_running=max_batch))
    decode_tokens_per_s(engine, 1, "warmup")
    single = decode_tokens_per_s(engine, 1, "single")
    full = decode_tokens_per_s(engine, max_batch, "full")
    return {"batch_1_tok_s": single, f"batch_{max_batch}_tok_s": full, "ratio": full / single}
