"""How much batching can buy on this machine: the base model's decode throughput at batch 1 and
at the profile's batch size, measured before the runs on the configuration ``loramesh up`` runs
its worker with, and on the in-process engine's configuration (the ``loramesh`` system's).

A server that runs one adapter's requests at a time (PEFT, merged-swap) decodes with small
batches; loramesh batches across adapters. Neither can beat the other by more than the ratio of
decode throughput at full batch to decode throughput at batch 1, whatever else they do. On a GPU
that ratio is large (decode is memory-bound until big batches); on a few CPU cores the step is
compute-bound early and the ratio is small, which caps any batching system's advantage.

``up``'s configuration is the worker's own: ``WorkerConfig``'s defaults with ``up``'s pool, the
weights' format (``--quantization auto``) and the activation dtype (``--dtype auto``) resolved as
the worker resolves them, and its engine built by the worker's ``build_engine``; the thread
count is the process's (the bench's :class:`~bench.serving.isolated_run.RunThreads`, one per CPU
as ``up`` gives its one worker). Only this process's main thread runs torch, as only the
worker's engine thread does (services/gpu_worker/engine/side_threads.py). The in-process
engine's configuration is the bench's ``EngineSystem``: weights dequantized, ``--dtype auto``.
"""

from __future__ import annotations

import time

import torch

from loramesh_cli.up_arguments import WORKER_SETTINGS
from services.gpu_worker.build import build_engine, local_engine
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.quantization_setting import resolve_quantization
from services.gpu_worker.service import resolve_dtype

PROMPT_TOKENS = 32
DECODE_STEPS = 12
CPU = torch.device("cpu")


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


def ceiling_of(engine: Engine, max_batch: int) -> dict:
    """Batch-1 and full-batch decode throughput of ``engine`` (warmed up first) and their ratio."""
    decode_tokens_per_s(engine, 1, "warmup")
    single = decode_tokens_per_s(engine, 1, "single")
    full = decode_tokens_per_s(engine, max_batch, "full")
    return {"batch_1_tok_s": single, f"batch_{max_batch}_tok_s": full, "ratio": full / single}


def up_worker_config(model_path: str | None, max_batch: int) -> WorkerConfig:
    """The worker settings ``loramesh up`` starts its worker with (its own defaults included),
    running at most ``max_batch`` requests."""
    return WorkerConfig(**{**WORKER_SETTINGS.defaults, "model": model_path or "", "max_running": max_batch})


def batching_ceiling(model_path: str | None, max_batch: int) -> dict:
    """The ceiling on ``up``'s configuration (the figure quoted), its settings, and the ceiling
    on the in-process engine's configuration under ``bench_engine``."""
    config = up_worker_config(model_path, max_batch)
    dtype = resolve_dtype(config.dtype, CPU)
    quantization = resolve_quantization(config.quantization, CPU.type, config.tp, config.model or None)
    loaded = load_model(config.model or None, quantization=quantization)
    up = ceiling_of(build_engine(config, loaded, device=CPU, dtype=dtype, shared_pool=False), max_batch)
    plain = load_model(model_path)
    bench_dtype = resolve_dtype("auto", CPU)
    engine = local_engine(
        LlamaModel(plain.config, plain.weights, bench_dtype),
        EngineConfig(pool_mib=256, max_running=max_batch),
    )
    return {
        **up,
        "configuration": {
            "of": "loramesh up's worker",
            "quantization": quantization,
            "dtype": str(dtype).removeprefix("torch."),
            "pool_mib": config.pool_mib,
            "torch_threads": torch.get_num_threads(),
        },
        "bench_engine": {
            **ceiling_of(engine, max_batch),
            "configuration": {"quantization": "none", "dtype": str(bench_dtype).removeprefix("torch.")},
        },
    }
