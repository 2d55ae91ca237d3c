"""Activated LoRA (aLoRA) adapters at registration: a config PEFT writes with
``alora_invocation_tokens`` is accepted and its invocation reaches the worker in the config it
fetches; invocation tokens that are not a non-empty list of ids in the vocabulary, or an aLoRA
PEFT would never activate, are refused naming the field."""

from __future__ import annotations

import json

import grpc
import pytest
import torch
from support.adapter_bytes import with_config
from support.polling import HANG_GUARD_S

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import ref_by_name, upload_requests
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import types_pb2
from services.adapter_store.validation import ValidationLimits, validate_adapter
from services.gpu_worker.lora.host_adapter import parse_peft_adapter
from services.runtime.errors import InvalidArgument

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
INVOCATION = [49152 - 1, 28, 1001]


@pytest.fixture(scope="module")
def files(base_spec, tmp_path_factory) -> dict[str, bytes]:
    """A rank-8 attention adapter whose config PEFT's own ``LoraConfig`` wrote, as an aLoRA."""
    from peft import LoraConfig

    directory = write_peft_adapter(tmp_path_factory.mktemp("alora"), base_spec, SampleAdapterSpec(rank=8))
    LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
        alora_invocation_tokens=INVOCATION,
    ).save_pretrained(str(directory))
    return adapter_files(directory)


def test_a_peft_alora_config_is_accepted(files, base_spec):
    assert base_spec.vocab_size == 49152
    validated = validate_adapter(files[CONFIG], files[WEIGHTS], base_spec, ValidationLimits())
    assert validated.config.invocation_tokens == tuple(INVOCATION)
    plain = with_config(files[CONFIG], alora_invocation_tokens=None)
    assert (
        validate_adapter(plain, files[WEIGHTS], base_spec, ValidationLimits()).config.invocation_tokens
        is None
    )


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"alora_invocation_tokens": []}, ["alora_invocation_tokens", "non-empty list"]),
        ({"alora_invocation_tokens": "<check>"}, ["alora_invocation_tokens", "'<check>'"]),
        ({"alora_invocation_tokens": [5, 1.5]}, ["alora_invocation_tokens", "1.5"]),
        ({"alora_invocation_tokens": [True]}, ["alora_invocation_tokens", "True"]),
        ({"alora_invocation_tokens": [-1]}, ["alora_invocation_tokens", "-1"]),
        ({"alora_invocation_tokens": [7, 49152]}, ["alora_invocation_tokens", "49152", "vocabulary"]),
        ({"task_type": None}, ["task_type", "alora_invocation_tokens", "CAUSAL_LM"]),
        ({"task_type": ...}, ["task_type", "alora_invocation_tokens", "CAUSAL_LM"]),
        ({"use_dora": True}, ["use_dora", "DoRA"]),
    ],
)
def test_a_bad_invocation_is_refused_naming_the_field(files, base_spec, changes, needles):
    config = with_config(files[CONFIG], **changes)
    with pytest.raises(InvalidArgument) as info:
        validate_adapter(config, files[WEIGHTS], base_spec, ValidationLimits())
    assert "\n" not in info.value.message
    for needle in needles:
        assert needle in info.value.message, info.value.message


def test_the_invocation_reaches_the_worker_through_the_store(store_stub, files):
    registered = store_stub.RegisterAdapter(
        upload_requests(files, "checker", "alice", types_pb2.VISIBILITY_PRIVATE), timeout=HANG_GUARD_S
    ).adapter
    messages = list(store_stub.FetchAdapter(pb.FetchAdapterRequest(ref=ref_by_name("alice", "checker"))))
    header = messages[0].header
    assert header.adapter.id == registered.id
    assert json.loads(header.adapter.config_json)["alora_invocation_tokens"] == INVOCATION
    weights = b"".join(m.chunk for m in messages[1:])
    adapter = parse_peft_adapter(registered.id, header.adapter.config_json, weights, torch.float32)
    assert adapter.invocation_tokens == tuple(INVOCATION)

    bad = {CONFIG: with_config(files[CONFIG], alora_invocation_tokens=[]), WEIGHTS: files[WEIGHTS]}
    with pytest.raises(grpc.RpcError) as err:
        store_stub.RegisterAdapter(
            upload_requests(bad, "bad", "alice", types_pb2.VISIBILITY_PRIVATE), timeout=HANG_GUARD_S
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "alora_invocation_tokens" in err.value.details()
