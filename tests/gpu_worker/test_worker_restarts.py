"""A worker takes back what it lent a peer once that peer is gone: its lease expired, or a new
process registered under its id (a pod restarted in place keeps its name, and the new key can
replace the old before that lease expires). Found by the nemesis over the overlay pods: a killed
worker back under its name left its creditor's 18 blocks lent for good."""

from __future__ import annotations

import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.service import WorkerService
from services.runtime.etcd.membership import MemberInfo


def _member(instance_id: str, started_at: float) -> MemberInfo:
    return MemberInfo("gpu_worker", instance_id, "10.0.0.2:50052", "10.0.0.2:9100", "test", started_at)


def test_blocks_lent_to_a_peer_come_back_when_a_new_process_takes_its_id(tiny_llama):
    service = WorkerService(WorkerConfig(instance_id="gpu_worker-a", lend_cap_blocks=5))
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    service.engine = local_engine(
        model, EngineConfig(pool_mib=1, worker_id="gpu_worker-a", max_lent_blocks=5)
    )
    service._set_workers({"gpu_worker-b": _member("gpu_worker-b", 100.0)})
    service.engine.lending.allocate("gpu_worker-b", 3, service.engine.pool.layout)

    service._set_workers({"gpu_worker-b": _member("gpu_worker-b", 100.0)})  # the same process: kept
    assert service.load_report()["lent_blocks"] == {"gpu_worker-b": 3}

    service._set_workers({"gpu_worker-b": _member("gpu_worker-b", 200.0)})  # restarted in place
    assert service.load_report()["lent_blocks"] == {}

    service.engine.lending.allocate("gpu_worker-b", 2, service.engine.pool.layout)
    service._set_workers({})  # its lease expired
    assert service.load_report()["lent_blocks"] == {}
