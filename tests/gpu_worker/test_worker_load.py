"""The gpu_worker heartbeat is a WorkerLoad: the scheduler's keys as before, and the KV block
fields the kv_manager's ledger reads, from a real engine lending real blocks."""

from __future__ import annotations

import json

import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.service import WorkerService
from services.kv_manager.heartbeats import ledger_rows
from services.runtime.etcd.worker_load import worker_load_from_report
from services.scheduler.cluster_view import worker_state


def test_load_report_is_a_worker_load_with_kv_blocks(tiny_llama):
    config = WorkerConfig(instance_id="gpu_worker-a", lend_cap_blocks=5, topology="rack-1")
    service = WorkerService(config)
    assert service.load_report() == {"ready": False}  # before the model is loaded
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=1, worker_id="gpu_worker-a", max_lent_blocks=5))
    service.engine = engine
    engine.lending.allocate("gpu_worker-b", 3, engine.pool.layout)
    engine.lending.allocate("gpu_worker-c", 1, engine.pool.layout)

    report = service.load_report()
    json.dumps(report)  # etcd gets it as JSON
    load = worker_load_from_report(report)
    layout = engine.pool.layout
    total = layout.num_pages // layout.num_layers
    assert load.total_blocks == total
    assert load.free_blocks == total - 4
    assert dict(load.lent_blocks) == {"gpu_worker-b": 3, "gpu_worker-c": 1}
    assert dict(load.borrowed_blocks) == {}
    assert load.lend_cap_blocks == 5 and load.topology == "rack-1"
    assert report["kv_overflow"] == "preempt"  # the policy in force, for `loramesh status`
    assert report["free_pages"] == layout.num_pages - 4 * layout.num_layers

    state = worker_state("gpu_worker-a", "127.0.0.1:1", report)  # the scheduler reads it as before
    assert (state.free_pages, state.total_pages, state.queue, state.running) == (
        report["free_pages"], layout.num_pages, 0, 0,
    )  # fmt: skip
    (row,) = ledger_rows({"gpu_worker-a": "127.0.0.1:1"}, {"gpu_worker-a": report})
    assert row.free_blocks == total - 4 and row.lent == {"gpu_worker-b": 3, "gpu_worker-c": 1}
