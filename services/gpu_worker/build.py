"""Assembling a worker: the executor that runs plans, and the engine that plans over it.

The engine names no executor implementation (``engine/executor.py`` is its contract); this module
is the one place that picks one, for the service, the benchmarks and the tests alike.
"""

from __future__ import annotations

from typing import Any

import torch

from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.executor import Executor
from services.gpu_worker.executor.local import LocalExecutor
from services.gpu_worker.executor.tp_group import start_group
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import LoadedModel


def local_engine(model: LlamaModel, config: EngineConfig | None = None, **options: Any) -> Engine:
    """An engine over one device's ``model`` (a :class:`LocalExecutor` with a pool sized by
    ``config``); ``options`` are :class:`Engine`'s keyword arguments."""
    config = config or EngineConfig()
    return Engine(LocalExecutor(model, config), config, **options)


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
