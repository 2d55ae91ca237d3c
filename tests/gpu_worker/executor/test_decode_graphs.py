"""The decode graphs' CPU-side logic: the bucket a batch runs in, which steps are graphed, and
the static inputs a step is copied into (padding rows included), run eagerly here through the
real model with the Triton kernels in the CPU interpreter. Capture and replay need CUDA.

``TRITON_INTERPRET`` is set before anything imports ``triton_lora`` (as test_lora_kernels does).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest, StepPlan
from services.gpu_worker.executor.decode_graphs import (
    GraphInputs,
    batch_bucket,
    block_bucket,
    shape_of,
)
from services.gpu_worker.executor.pool_buffer import pool_with_spare_page, spare_key_rows
from services.gpu_worker.executor.step_builder import StepBuilder
from services.gpu_worker.executor.step_inputs import StepInputs
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.page_allocator import PageUse
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.llama import LlamaModel
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.sampling.sampling_params import SamplingParams

BLOCK = 4


def test_a_batch_runs_in_the_smallest_bucket_holding_it():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 17, 25, 200, 256)] == [1, 2, 4, 8, 24, 32, 224, 256]
    assert batch_bucket(257) is None  # eager
    assert batch_bucket(5, (4, 6)) == 6
    assert [block_bucket(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    from services.gpu_worker.kernels import triton_lora

    if not triton_lora.INTERPRETED:
        pytest.skip("triton_lora was imported before TRITON_INTERPRET=1 was set")
    spec = tiny_llama.spec
    root = tmp_path_factory.mktemp("graph-adapters")
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    layout = PoolLayout(512, BLOCK, spec.num_kv_heads * spec.head_dim, spec.num_layers)
    view, whole = pool_with_spare_page(layout, torch.float32, "cpu")
    pool = UnifiedPool(view)
    torch.manual_seed(0)
    view.buffer.normal_()  # the KV pages' context: any finite values (adapters written over it)
    residency = AdapterResidency(pool)
    resident = {}
    for name, sample in {
        "a8": SampleAdapterSpec(rank=8, seed=1, scale=0.2),
        "a16": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=2, scale=0.2),
    }.items():
        adapter = read_peft_directory(name, write_peft_adapter(root / name, spec, sample), torch.float32)
        placed = residency.load(adapter)
        placed.materialize()
        resident[name] = placed
    kv_pages = [tuple(pool.allocate(spec.num_layers, PageUse.KV)) for _ in range(9)]
    return SimpleNamespace(
        spec=spec, model=model, layout=layout, view=view, whole=whole, resident=resident, kv_pages=kv_pages
    )


def _plan(setup, backend: str) -> StepPlan:
    requests, free = [], iter(setup.kv_pages)
    for i, (adapter, position) in enumerate([("a8", 5), (None, 9), ("a16", 2)]):
        pages = [next(free) for _ in range(position // BLOCK + 1)]
        slot = None if adapter is None else AdapterSlot(adapter, setup.resident[adapter].placement)
        requests.append(PlannedRequest(f"r{i}", (11 + i,), position, tuple(pages), slot, SamplingParams()))
    return StepPlan(tuple(requests), backend, False)


def test_padded_static_inputs_give_the_eager_logits_and_touch_no_engine_page(setup):
    builder = StepBuilder(SimpleNamespace(config=setup.spec), setup.view)
    inputs = StepInputs(builder, device_lora=True)
    plan = _plan(setup, "triton")
    batch = inputs.build(plan, setup.resident.get)
    shape = shape_of(batch, BLOCK)
    assert shape is not None and (shape.rows, shape.blocks) == (4, 4) and shape.max_rank == 16
    # The host path (step builder, torch reference) is what the device tables must agree with.
    host = builder.build(StepPlan(plan.requests, "torch", False), setup.resident.get)
    want = setup.model.forward(host, setup.view)
    eager = setup.model.forward(batch, setup.view)
    torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-5)

    static = GraphInputs(shape, batch, spare_key_rows(setup.layout, "cpu"), BLOCK)
    static.fill(batch)
    assert torch.equal(static.batch.token_ids[:3], batch.token_ids)
    assert torch.equal(static.batch.write_key_rows[:, 3], spare_key_rows(setup.layout, "cpu")[[0, 0]])
    before = setup.whole.kv_rows.clone()
    padded = setup.model.forward(static.batch, setup.whole)
    torch.testing.assert_close(padded[:3], want, rtol=1e-5, atol=1e-5)
    written = torch.cat([batch.write_key_rows.flatten(), batch.write_value_rows.flatten()])
    changed = (setup.whole.kv_rows != before).any(dim=1).nonzero().squeeze(1)
    spare_first = 2 * setup.layout.num_pages * BLOCK
    outside = [r for r in changed.tolist() if r not in set(written.tolist()) and r < spare_first]
    assert outside == []  # padding wrote only into the spare page

    static.fill(None)  # every row padding again: no adapter, nothing of the step left
    assert not static.batch.lora.layers[0]["q_proj"].rank_starts.any()
    assert static.batch.write_key_rows.min() >= spare_first


def test_which_steps_are_graphed(setup):
    builder = StepBuilder(SimpleNamespace(config=setup.spec), setup.view)
    plan = _plan(setup, "torch")
    assert shape_of(StepInputs(builder, device_lora=False).build(plan, setup.resident.get), BLOCK) is None
    prefill = StepPlan((replace(plan.requests[0], token_ids=(1, 2), start_position=4),), "torch", False)
    assert shape_of(builder.build(prefill, setup.resident.get), BLOCK) is None
    invariant = StepPlan(plan.requests, "triton", True)
    assert shape_of(StepInputs(builder, device_lora=True).build(invariant, setup.resident.get), BLOCK) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture and replay need a CUDA device")
def test_capture_and_replay_on_cuda(tiny_llama):
    from services.gpu_worker.engine.engine_config import EngineConfig
    from services.gpu_worker.executor.local import LocalExecutor

    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32, device="cuda")
    executor = LocalExecutor(model, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK, cuda_graphs="on"))
    layers = tiny_llama.spec.num_layers
    pages = [tuple(executor.view.layout.num_pages - 1 - i for i in range(layers))]
    plan = StepPlan((PlannedRequest("r", (3,), 1, tuple(pages), None, SamplingParams()),), "auto", False)
    eager = model.forward(executor.inputs.build(plan, lambda _: None), executor.view)
    graphed = executor.execute(plan)
    assert executor.graphs.replays == 1
    torch.testing.assert_close(graphed, eager)
