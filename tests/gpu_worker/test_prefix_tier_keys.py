"""The prefix keys a worker caches and announces to the cluster tier are, byte for byte, the keys
the gateway puts in a placement for the scheduler's prefix-aware policy: for the base model, an
activated LoRA (aLoRA) and a standard LoRA, each written by PEFT (``LoraConfig``, the aLoRA with
``alora_invocation_tokens``) and seen as the store's ``AdapterInfo`` by both sides, as the gateway
resolves it and the worker fetches it. A tiny random Llama, fp32, 16-token blocks: ~1 s.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from mesh_api.v1 import types_pb2
from services.gateway.adapter_reference import ResolvedAdapter
from services.gateway.prefix_blocks import placement_prefix_blocks
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.lora.host_adapter import parse_peft_adapter
from services.gpu_worker.memory.prefix_journal import PrefixJournal
from services.gpu_worker.model.llama import LlamaModel

BLOCK = 16
NAMESPACE = "tenant:acme"
INVOCATION = [201, 202, 203]
PROMPT = list(range(10, 60)) + INVOCATION + list(range(60, 90))
"""53 tokens before the aLoRA's invocation ends: blocks 0-2 are the base model's, 3-4 its own."""


Adapter = tuple[types_pb2.AdapterInfo, bytes]
"""The store's info of an adapter, and its safetensors bytes."""


def peft_adapter(tiny_llama, directory: Path, invocation: list[int] | None, seed: int) -> Adapter:
    """A rank-4 attention adapter PEFT writes (random weights), as the store's info and bytes."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
        alora_invocation_tokens=invocation,
    )
    get_peft_model(LlamaForCausalLM(LlamaConfig(**tiny_llama.hf_config)), lora).save_pretrained(
        str(directory)
    )
    config = (directory / "adapter_config.json").read_text()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    assert json.loads(config).get("alora_invocation_tokens") == invocation
    info = types_pb2.AdapterInfo(
        id=directory.name, name=directory.name, owner="acme", sha256=hashlib.sha256(weights).hexdigest(),
        config_json=config,
    )  # fmt: skip
    return info, weights


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Adapter]:
    root = tmp_path_factory.mktemp("prefix-keys")
    return {
        "checker": peft_adapter(tiny_llama, root / "checker", INVOCATION, 1),
        "rewriter": peft_adapter(tiny_llama, root / "rewriter", None, 2),
    }


def announced(tiny_llama, adapters: dict[str, Adapter], adapter_id: str | None) -> list[bytes]:
    """The keys a fresh worker caches and announces after serving ``PROMPT`` with ``adapter_id``."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine: Engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK, prefix_cache=True))
    engine.prefix_cache.journal = journal = PrefixJournal()
    for info, weights in adapters.values():
        # What the worker's store source hands the parser: the info's config and sha256.
        config = info.config_json.encode()
        engine.add_adapter(parse_peft_adapter(info.id, config, weights, torch.float32, info.sha256))
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    request = GenerationRequest("r", tuple(PROMPT), sampling, adapter_id, prefix_cache_namespace=NAMESPACE)
    engine.submit(request, lambda event: None)
    while engine.has_work():
        engine.step()
    return journal.drain().added


def placed(adapters: dict[str, Adapter], adapter_id: str | None) -> tuple[bytes, ...]:
    """The keys the gateway puts in the request's placement."""
    adapter = None if adapter_id is None else ResolvedAdapter.of(adapters[adapter_id][0])
    return placement_prefix_blocks(PROMPT, NAMESPACE, adapter, BLOCK)


@pytest.mark.parametrize("adapter_id", [None, "checker", "rewriter"])
def test_announced_keys_are_the_placements(tiny_llama, adapters, adapter_id):
    keys = placed(adapters, adapter_id)
    assert len(keys) == len(PROMPT) // BLOCK == 5
    assert set(announced(tiny_llama, adapters, adapter_id)) == set(keys)


def test_the_keys_tell_the_adapters_apart(adapters):
    """The aLoRA's blocks before its invocation are the base model's, the rest its own; the
    standard LoRA's are all its own."""
    base, checker, rewriter = (placed(adapters, name) for name in (None, "checker", "rewriter"))
    assert checker[:3] == base[:3] and not set(checker[3:]) & set(base)
    assert not set(rewriter) & (set(base) | set(checker))
