"""Assembling a worker: the executor that runs plans, and the engine that plans over it.

The engine names no executor implementation (``engine/executor.py`` is its contract); this module
is the one place that picks one: :func:`build_engine` for the service (from its
``WorkerConfig``), :func:`local_engine` for the benchmarks and tests that hold a model already.
"""

from __future__ import annotations

from typing import Any

import torch

from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.distkv import CreditorDirectory, TransportFactory
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.executor import Executor
from services.gpu_worker.engine.structured_output import GrammarCompiler
from services.gpu_worker.executor.local import LocalExecutor
from services.gpu_worker.executor.tp_group import start_group
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import LoadedModel
from services.runtime.sampling.stop_window import StopStringTail


def local_engine(model: LlamaModel, config: EngineConfig | None = None, **options: Any) -> Engine:
    """An engine over one device's ``model`` (a :class:`LocalExecutor` with a pool sized by
    ``config``); ``options`` are :class:`Engine`'s keyword arguments."""
    config = config or EngineConfig()
    return Engine(LocalExecutor(model, config), config, **options)


def build_engine(
    config: WorkerConfig,
    loaded: LoadedModel,
    *,
    device: torch.device,
    dtype: torch.dtype,
    shared_pool: bool,
    creditors: CreditorDirectory | None = None,
    connect: TransportFactory | None = None,
) -> Engine:
    """A serving worker's engine: ``config``'s executor over ``loaded`` (one device, or rank 0 of
    a tensor-parallel group) and an engine with the model's stop tokens, stop-string tail and
    structured-output grammars. ``shared_pool``: the pool's buffer in shared memory (the
    same-host lending lane). Blocking (weights copied, processes started)."""
    engine_config = config.engine_config(shared_pool=shared_pool)
    executor = build_executor(
        loaded, engine_config,
        tp=config.tp, dtype=dtype, device=device, model_path=config.model, threads=config.threads,
    )  # fmt: skip
    return Engine(
        executor,
        engine_config,
        eos_token_ids=loaded.config.eos_token_ids,
        # The engine only looks for stop strings in this text: a bounded tail, not the whole output.
        detokenize=StopStringTail(loaded.tokenizer.id_to_bytes),
        creditors=creditors,
        connect=connect,
        grammars=GrammarCompiler(
            loaded.tokenizer.backend.to_str(), loaded.config.vocab_size, loaded.config.eos_token_ids
        ),
    )


def build_executor(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    model_path: str = "",
    threads: int = 0,
) -> Executor:
    """The executor of a worker of ``tp`` ranks: one device's model, or rank 0 of a
    tensor-parallel group whose followers it starts (refusing a degree the model does not
    divide). Blocking: model weights are copied, processes started."""
    if tp > 1:
        return start_group(
            loaded.config, loaded.weights, config, tp,
            model_path=model_path, dtype=dtype, device=str(device), threads=threads,
        )  # fmt: skip
    return LocalExecutor(LlamaModel(loaded.config, loaded.weights, dtype, device), config)
