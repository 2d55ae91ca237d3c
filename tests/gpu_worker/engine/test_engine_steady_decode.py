"""Decode steps handed to the executor as deltas (``engine/steady_decode.py``) give the tokens and
logits of full plans, while requests of different adapters join, grow KV blocks and finish; run
through the real model with the Triton LoRA kernels in the CPU interpreter (the backend whose
decode steps come from the persistent batch).

``TRITON_INTERPRET`` is set before anything imports ``triton_lora`` (as test_lora_kernels does).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.model_files.peft_format import LORA_TARGETS

SAMPLES = {
    "a8": SampleAdapterSpec(rank=8, scale=0.2, seed=1),
    "a16": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.2, seed=2),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory):
    from services.gpu_worker.kernels import triton_lora

    if not triton_lora.INTERPRETED:
        pytest.skip("triton_lora was imported before TRITON_INTERPRET=1 was set")
    root = tmp_path_factory.mktemp("steady-adapters")
    return {name: write_peft_adapter(root / name, tiny_llama.spec, s) for name, s in SAMPLES.items()}


def _engine(tiny_llama, adapter_dirs, backend: str) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    # Plain decode steps are what the deltas apply to; a step verifying drafts is built whole.
    config = EngineConfig(pool_mib=4, kv_block_tokens=4, lora_backend=backend, speculative="off")
    engine = local_engine(model, config)
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    return engine


def _run(engine: Engine) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Three requests, a fourth joining after five steps; max_tokens differ, so they finish apart."""
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    engine.on_logits = lambda rid, row: logits.setdefault(rid, []).append(row.clone())

    def submit(i: int, adapter: str | None, prompt_len: int, max_tokens: int) -> None:
        prompt = tuple((7 * i + 3 * j) % 250 + 1 for j in range(prompt_len))
        request = GenerationRequest(
            f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter
        )
        engine.submit(request, lambda e: tokens.setdefault(e.request_id, []).append(e.token_id))

    for i, (adapter, prompt_len, max_tokens) in enumerate([("a8", 5, 14), (None, 3, 9), ("a16", 6, 16)]):
        submit(i, adapter, prompt_len, max_tokens)
    for _ in range(5):
        engine.step()
    submit(3, "a16", 2, 7)
    while engine.has_work():
        engine.step()
    return tokens, logits


def test_deltas_give_the_tokens_and_logits_of_full_plans(tiny_llama, adapter_dirs):
    steady = _engine(tiny_llama, adapter_dirs, "triton")
    got_tokens, got_logits = _run(steady)
    assert steady.steady.deltas >= 5  # the decode steps between joins, leaves and prefills
    planned = _engine(tiny_llama, adapter_dirs, "torch")  # the host path: plans only
    want_tokens, want_logits = _run(planned)
    assert planned.steady.deltas == 0
    assert got_tokens == want_tokens
    for request_id, rows in want_logits.items():
        torch.testing.assert_close(
            torch.stack(got_logits[request_id]), torch.stack(rows), rtol=1e-5, atol=1e-5
        )
