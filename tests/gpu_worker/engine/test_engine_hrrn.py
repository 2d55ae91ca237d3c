"""HRRN on the real engine (tiny random Llama): the predicted lengths carried on the requests
reach the policy, and the queue is served shortest predicted first."""

from __future__ import annotations

import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.policies.hrrn import Hrrn
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel


def test_one_slot_serves_the_queue_shortest_predicted_first(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(
        model, EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=1), batch_policy=Hrrn()
    )
    finished: list[str] = []
    for rid, predicted in (("long", 40), ("short", 2), ("middle", 12)):
        engine.submit(
            GenerationRequest(
                rid,
                (1, 2, 3, 4),
                SamplingParams(max_tokens=3, ignore_eos=True),
                predicted_output_tokens=predicted,
            ),
            lambda e: finished.append(e.request_id) if e.finish_reason is not None else None,
        )
    for _ in range(1_000):
        if not engine.has_work():
            break
        engine.step()
    assert finished == ["short", "middle", "long"]
