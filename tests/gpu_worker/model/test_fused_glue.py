"""The CPU step's native ops (``model/native_step_ops.py``): the residual add with its RMSNorm, and
rotary embedding with the KV writes, each in one prepared native call, and LoRA deltas added into
views of the fused qkv / gate_up outputs. They must give the same bits as the torch ops they
replace (``model/step_ops.py``)."""

from __future__ import annotations

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels import cpu_invariant
from services.gpu_worker.kernels.cpu_invariant import invariant_available, invariant_error
from services.gpu_worker.model import invariant_rowwise
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.rope import RotaryTable
from services.model_files.peft_format import LORA_TARGETS

pytestmark = pytest.mark.skipif(not invariant_available(), reason=f"no native kernels: {invariant_error()}")

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),  # fp32 compute over a bf16 cache (a CPU without bf16 GEMMs)
]


@pytest.mark.parametrize("compute, storage", DTYPE_PAIRS)
def test_rope_into_cache_is_the_torch_rotation_and_index_copy(compute, storage):
    g = torch.Generator().manual_seed(0)
    tokens, q_dim, kv_dim = 7, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    table = RotaryTable(HEAD_DIM, 10000.0, None, 256, "cpu", compute)
    positions = torch.tensor([0, 5, 6, 100, 255, 3, 17])
    # qkv as the rows of a wider matrix: the kernel reads its row stride.
    wide = (4 * torch.randn(tokens, q_dim + 2 * kv_dim + 8, generator=g)).to(compute)
    qkv = wide[:, : q_dim + 2 * kv_dim]
    key_rows, value_rows = torch.tensor([3, 9, 0, 12, 7, 1, 15]), torch.tensor([20, 21, 30, 25, 27, 22, 31])
    cache = torch.randn(32, kv_dim, generator=g).to(storage)
    expected_cache = cache.clone()

    q = torch.empty(tokens, q_dim, dtype=compute)
    cpu_invariant.prepare_rope_kv(
        qkv, positions, table.cos, table.sin, HEADS, KV_HEADS, q, cache, key_rows, value_rows
    ).run()

    q_ref = table.apply(qkv[:, :q_dim].contiguous().view(-1, HEADS, HEAD_DIM), positions)
    k_ref = table.apply(qkv[:, q_dim : q_dim + kv_dim].contiguous().view(-1, KV_HEADS, HEAD_DIM), positions)
    expected_cache.index_copy_(0, key_rows, k_ref.reshape(tokens, kv_dim).to(storage))
    expected_cache.index_copy_(0, value_rows, qkv[:, q_dim + kv_dim :].to(storage))
    assert torch.equal(q, q_ref.reshape(tokens, q_dim))
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(5, 96, generator=g)).to(dtype)
    delta = torch.randn(5, 96, generator=g).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    expected_x = x + delta
    expected = invariant_rowwise.rms_norm(expected_x, weight, 1e-5, dtype)
    out = invariant_rowwise.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_x)  # updated in place
    assert torch.equal(out, expected)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_the_fused_glue_gives_the_torch_glues_logits(
    tiny_llama, tiny_spec_dir, compute, speculative, monkeypatch
):
    """A batch of requests with and without adapters, prefilled then decoded, both ways; with
    ``ngram``, the repeating prompts draft, so steps verify drafts beside plain decode rows (the
    fused glue's attention merges them into one call)."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, compute)
    assert model.native_kernels
    drafted: list[int] = []

    def run() -> dict[str, list[torch.Tensor]]:
        engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=4, speculative=speculative))
        engine.add_adapter(read_peft_directory("all", tiny_spec_dir, compute))
        logits: dict[str, list[torch.Tensor]] = {}
        engine.on_logits = lambda rid, row: logits.setdefault(rid, []).append(row.clone())
        sampling = SamplingParams(max_tokens=5 if speculative == "off" else 12, ignore_eos=True)
        for i, (length, adapter) in enumerate([(9, "all"), (3, None), (17, "all"), (6, None)]):
            prompt = tuple(range(10 + i, 10 + i + length))
            if speculative != "off" and i % 2 == 0:
                prompt = (prompt * 3)[: 2 * length]
            engine.submit(GenerationRequest(f"r{i}", prompt, sampling, adapter), lambda event: None)
        while engine.has_work():
            engine.step()
        if engine.speculator is not None:
            drafted.append(sum(engine.speculator.counts.drafted.values()))
        return logits

    fused = run()
    monkeypatch.setattr(LlamaModel, "_fused_glue", lambda self, batch, native: False)
    unfused = run()
    assert fused.keys() == unfused.keys() and len(fused) == 4
    assert speculative == "off" or drafted[0] > 0
    for rid, rows in fused.items():
        assert all(torch.equal(a, b) for a, b in zip(rows, unfused[rid], strict=True)), rid


@pytest.fixture(scope="module")
def tiny_spec_dir(tiny_llama, tmp_path_factory):
    sample = SampleAdapterSpec(rank=8, target_modules=LORA_TARGETS, seed=3, scale=0.2)
    return write_peft_adapter(tmp_path_factory.mktemp("fused") / "all", tiny_llama.spec, sample)
