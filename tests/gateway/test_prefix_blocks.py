"""The prompt blocks a placement carries: base-model blocks (and an activated LoRA's before its
invocation) named exactly as a worker's prefix cache names them; an adapter's own blocks per
version and namespace, so two adapters of one name never share a key."""

from __future__ import annotations

import json

from mesh_api.v1 import types_pb2
from services.gateway.adapter_reference import ResolvedAdapter
from services.gateway.prefix_blocks import placement_prefix_blocks
from services.gpu_worker.memory.prefix_cache import BASE_MODEL_KEY_SPACE, block_keys, namespaced_key_space
from services.runtime.prefix_keys import prompt_block_keys
from tests.gateway.test_first_token_deadline import gateway, generate, run, text  # noqa: F401 (fixtures)

PROMPT = list(range(100, 150))  # 3 whole blocks of 16 and 2 tokens more
INVOCATION = [7, 8, 9]


def adapter(adapter_id: str, sha256: str, invocation: list[int] | None = None) -> ResolvedAdapter:
    config = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj"],
        "task_type": "CAUSAL_LM",
    }
    if invocation is not None:
        config["alora_invocation_tokens"] = invocation
    info = types_pb2.AdapterInfo(id=adapter_id, name="checker", owner="acme", sha256=sha256,
                                 config_json=json.dumps(config))  # fmt: skip
    return ResolvedAdapter.of(info)


def test_base_blocks_are_the_workers_keys():
    worker = block_keys(namespaced_key_space(BASE_MODEL_KEY_SPACE, "tenant:acme"), PROMPT, 16)
    assert list(placement_prefix_blocks(PROMPT, "tenant:acme", None, 16)) == worker
    assert len(worker) == 3
    assert placement_prefix_blocks(PROMPT, "tenant:acme", None, 0) == ()


def test_an_activated_lora_shares_the_base_blocks_before_its_invocation():
    prompt = PROMPT[:40] + INVOCATION + PROMPT[40:]  # invocation at 40: blocks 0 and 1 are base
    base = placement_prefix_blocks(prompt, "tenant:acme", None, 16)
    alora = adapter("id-1", "a" * 64, INVOCATION)
    assert alora.invocation_tokens == tuple(INVOCATION)
    one = placement_prefix_blocks(prompt, "tenant:acme", alora, 16)
    other = placement_prefix_blocks(prompt, "tenant:acme", adapter("id-2", "b" * 64, INVOCATION), 16)
    assert one[:2] == base[:2] == other[:2]
    assert one[2] not in (base[2], other[2])
    # Without its invocation the prompt runs as the base model: every block is the base's.
    assert placement_prefix_blocks(PROMPT, "tenant:acme", alora, 16) == placement_prefix_blocks(
        PROMPT, "tenant:acme", None, 16
    )


def test_same_name_different_weights_and_tenants_share_no_block():
    one = placement_prefix_blocks(PROMPT, "tenant:acme", adapter("id-1", "a" * 64), 16)
    # The same name and id, other weights (the vLLM/LMCache adversarial case); another version.
    reweighted = placement_prefix_blocks(PROMPT, "tenant:acme", adapter("id-1", "c" * 64), 16)
    version = placement_prefix_blocks(PROMPT, "tenant:acme", adapter("id-9", "a" * 64), 16)
    tenant = placement_prefix_blocks(PROMPT, "tenant:other", adapter("id-1", "a" * 64), 16)
    base = placement_prefix_blocks(PROMPT, "tenant:acme", None, 16)
    keys = [set(k) for k in (one, reweighted, version, tenant, base)]
    assert sum(len(k) for k in keys) == len(set().union(*keys)) == 15


async def test_a_placement_carries_the_blocks_the_worker_will_key(gateway):  # noqa: F811
    """Through the gateway's gRPC API: the placement names the prompt's blocks exactly as the
    worker it goes to keys them (its prompt, in the namespace the gateway sends it)."""
    request = generate(0)
    request.prompt = "Say hello to the whole wide world, politely and at length. " * 6
    await run(gateway, request)
    placed, sent = gateway.places[0], gateway.worker.requests[0]
    assert (
        placed.prefix_block_tokens == 16
        and len(placed.prefix_blocks) == len(sent.prompt_token_ids) // 16 >= 3
    )
    keys = prompt_block_keys(sent.prefix_cache_namespace, list(sent.prompt_token_ids), 16)
    assert list(placed.prefix_blocks) == keys
