"""The gateway and a worker refuse the same bad request with the same words: both run the shared
checks (services.runtime.sampling.request_validation) before anything is placed or queued. The worker is
its real servicer over a real engine (tiny model); the gateway is its real core, given a
tokenizer bundle with the same context length and no relay (nothing valid reaches one here)."""

from __future__ import annotations

import pytest
import torch

from mesh_api.v1 import types_pb2, worker_pb2
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.servicer import WorkerServicer
from services.model_files.tokenizer_loading import TokenizerBundle, load_tokenizer
from services.runtime.sampling.request_validation import InvalidField


@pytest.fixture(scope="module")
def worker(tiny_llama):
    engine = local_engine(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), EngineConfig(pool_mib=1)
    )
    servicer = WorkerServicer()
    servicer.attach(engine, None, {"model": "tiny", "dtype": "float32"})
    return servicer


@pytest.fixture(scope="module")
def gateway(tiny_llama):
    smollm2 = load_tokenizer()
    core = GatewayCore(GatewayConfig(max_prompt_tokens=100_000), ApiKeys.from_config("k=t", ""))
    text = TokenizerBundle(smollm2.tokenizer, "tiny", tiny_llama.config.max_position_embeddings, "test")
    core.attach(text, relay=None)
    return core


async def worker_refusal(worker, prompt: list[int], sampling: types_pb2.SamplingParams) -> InvalidField:
    request = worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    with pytest.raises(InvalidField) as caught:
        await worker.Generate(request, None).__anext__()
    return caught.value


async def gateway_refusal(gateway, prompt: list[int], sampling: types_pb2.SamplingParams) -> InvalidField:
    with pytest.raises(InvalidField) as caught:
        await gateway.generate("t", prompt, "", sampling).__anext__()
    return caught.value


BAD = {
    "temperature": types_pb2.SamplingParams(max_tokens=4, temperature=500.0),
    "top_p": types_pb2.SamplingParams(max_tokens=4, top_p=1.5),
    "repetition_penalty": types_pb2.SamplingParams(max_tokens=4, repetition_penalty=20.0),
    "empty stop string": types_pb2.SamplingParams(max_tokens=4, stop_strings=["ok", ""]),
    "too many stop strings": types_pb2.SamplingParams(max_tokens=4, stop_strings=list("abcdefghijklmnopq")),
    "stop string too long": types_pb2.SamplingParams(max_tokens=4, stop_strings=["x" * 300]),
}


@pytest.mark.parametrize("case", BAD)
async def test_bad_sampling_gets_the_same_refusal_from_gateway_and_worker(worker, gateway, case):
    from_worker = await worker_refusal(worker, [1, 2, 3], BAD[case])
    from_gateway = await gateway_refusal(gateway, [1, 2, 3], BAD[case])
    assert (from_gateway.field, from_gateway.message) == (from_worker.field, from_worker.message)


async def test_prompts_over_the_context_or_empty_get_the_same_refusal(worker, gateway, tiny_llama):
    sampling = types_pb2.SamplingParams(max_tokens=4)
    context = tiny_llama.config.max_position_embeddings
    for prompt in ([], [1] * context):
        from_worker = await worker_refusal(worker, prompt, sampling)
        from_gateway = await gateway_refusal(gateway, prompt, sampling)
        assert from_gateway.message == from_worker.message
    assert from_worker.message == f"prompt has {context} tokens; the model's context is {context}"


async def test_ids_outside_each_side_s_vocabulary_are_named_with_its_size(worker, gateway, tiny_llama):
    """The worker checks against its embedding rows, the gateway against its tokenizer's ids
    (it must detokenize them): the same message, each with its own bound."""
    sampling = types_pb2.SamplingParams(max_tokens=4, stop_token_ids=[60_000])
    worker_vocab, gateway_vocab = tiny_llama.config.vocab_size, gateway.tokenizer.vocab_size
    assert (await worker_refusal(worker, [worker_vocab], sampling)).message == (
        f"prompt token ids must be within [0, {worker_vocab})"
    )
    assert (await gateway_refusal(gateway, [gateway_vocab], sampling)).message == (
        f"prompt token ids must be within [0, {gateway_vocab})"
    )
    assert (await gateway_refusal(gateway, [1], sampling)).message == (
        f"stop_token_ids must be within [0, {gateway_vocab})"
    )
    assert (await worker_refusal(worker, [1], sampling)).message == (
        f"stop_token_ids must be within [0, {worker_vocab})"
    )


def test_the_engine_itself_refuses_with_the_same_checks(tiny_llama):
    """Engine.submit (in-process callers, no servicer in front) runs the shared checks too."""
    engine = local_engine(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), EngineConfig(pool_mib=1)
    )
    vocab, context = tiny_llama.config.vocab_size, tiny_llama.config.max_position_embeddings
    cases = {
        (): "prompt is empty: give at least one token",
        (1,) * context: f"prompt has {context} tokens; the model's context is {context}",
        (vocab,): f"prompt token ids must be within [0, {vocab})",
    }
    for prompt, message in cases.items():
        with pytest.raises(InvalidField) as caught:
            engine.submit(GenerationRequest("r", prompt, SamplingParams(max_tokens=4)), lambda _: None)
        assert caught.value.message == message
    with pytest.raises(InvalidField, match="stop_token_ids must be within"):
        engine.submit(
            GenerationRequest("r", (1,), SamplingParams(max_tokens=4, stop_token_ids=(vocab,))), print
        )
