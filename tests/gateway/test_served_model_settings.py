"""vLLM's ``--served-model-name`` and ``--max-model-len`` on a gateway: the name the API knows the
base model by, and the length of one sequence, prompt and output together."""

from __future__ import annotations

import pytest
from gateway.in_memory_store import InMemoryStore, gateway_parts

from mesh_api.v1 import types_pb2
from services.gateway.config import GatewayConfig
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.config import SettingError, parse_config, read_config
from services.runtime.errors import InvalidArgument


@pytest.fixture(scope="module")
def text():
    return load_tokenizer()


def core_with(text, **settings):
    return gateway_parts("k=alice", InMemoryStore([]), text, config=GatewayConfig(**settings)).core


def test_by_default_the_models_own_name_and_length(text):
    core = core_with(text)
    assert (core.base_model, core.context_length) == (text.model_name, text.context_length)


def test_the_served_name_and_a_shorter_length(text):
    core = core_with(text, served_model_name="smol", max_model_len=64)
    assert (core.base_model, core.context_length) == ("smol", 64)
    assert core.model_tokens.context_length == 64  # where a generation stops


async def test_a_prompt_past_the_length_is_refused(text):
    core = core_with(text, max_model_len=8)
    with pytest.raises(InvalidArgument, match="context"):
        async for _ in core.generate(
            "alice", list(range(1, 9)), None, types_pb2.SamplingParams(max_tokens=1)
        ):
            pass


def test_longer_than_the_model_keeps_the_models_length(text):
    assert core_with(text, max_model_len=10**9).context_length == text.context_length


def test_the_flags_parse_and_a_negative_length_is_refused():
    config = parse_config(
        GatewayConfig, ["--served-model-name", "smol", "--max-model-len", "512"], environ={}
    )
    assert (config.served_model_name, config.max_model_len) == ("smol", 512)
    with pytest.raises(SettingError, match="max_model_len|max-model-len"):
        read_config(GatewayConfig, ["--max-model-len", "-1"], {})
