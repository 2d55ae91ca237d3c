"""Structured outputs in the engine, on SmolLM2-135M in fp32 with real PEFT adapters: requests with
different schemas, on different adapters, batched with unconstrained ones, each write JSON that
validates and ends with EOS; the unconstrained ones are untouched; a request resumed with the
tokens it had generated continues exactly as it would have; a bad schema is refused by field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.engine.structured_output import GrammarCompiler
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.errors import InvalidArgument
from services.runtime.sampling.sampling_params import SamplingParams, StructuredOutput

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"enum": [1, 2, 3]}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
    "additionalProperties": False,
}
MAX_TOKENS = 120
"""Longer than any document the two schemas allow."""


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def model(loaded):
    return LlamaModel(loaded.config, loaded.weights, torch.float32)


@pytest.fixture(scope="module")
def adapters(base_spec, tmp_path_factory, loaded):
    root = tmp_path_factory.mktemp("structured-adapters")
    samples = {
        "a": SampleAdapterSpec(rank=8, scale=0.2, seed=41),
        "b": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.2, seed=42),
    }
    return [
        read_peft_directory(name, write_peft_adapter(root / name, base_spec, s), torch.float32)
        for name, s in samples.items()
    ]


def make_engine(model, loaded, adapters) -> Engine:
    grammars = GrammarCompiler(
        loaded.tokenizer.backend.to_str(), loaded.config.vocab_size, loaded.config.eos_token_ids
    )
    engine = local_engine(
        model, EngineConfig(pool_mib=64), eos_token_ids=loaded.config.eos_token_ids, grammars=grammars
    )
    for adapter in adapters:
        engine.add_adapter(adapter)
    return engine


def run(
    engine: Engine, requests: list[GenerationRequest]
) -> dict[str, tuple[list[int], FinishReason | None]]:
    out: dict[str, tuple[list[int], list]] = {r.request_id: ([], []) for r in requests}

    def sink(event):
        tokens, reason = out[event.request_id]
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            reason.append(event.finish_reason)

    for request in requests:
        engine.submit(request, sink)
    while engine.has_work():
        engine.step()
    return {rid: (tokens, reason[0]) for rid, (tokens, reason) in out.items()}


def constrained(schema: dict | None) -> SamplingParams:
    if schema is None:
        return SamplingParams(max_tokens=MAX_TOKENS, structured_output=StructuredOutput("json_object"))
    return SamplingParams(
        max_tokens=MAX_TOKENS, structured_output=StructuredOutput("json_schema", json.dumps(schema))
    )


def chat(loaded, text: str) -> tuple[int, ...]:
    rendered = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return tuple(loaded.tokenizer.encode(rendered))


def test_mixed_schemas_and_adapters_in_one_batch(model, loaded, adapters):
    prompts = {
        "person-a": ("Describe a user of a website as JSON.", PERSON, "a"),
        "order-b": ("Write a shop order as JSON.", ORDER, "b"),
        "person-base": ("Describe a user of a website as JSON.", PERSON, None),
    }
    free = GenerationRequest("free", chat(loaded, "Tell me about cats."), SamplingParams(max_tokens=12), "a")
    requests = [
        GenerationRequest(rid, chat(loaded, text), constrained(schema), adapter)
        for rid, (text, schema, adapter) in prompts.items()
    ]
    any_object = GenerationRequest(
        "object-base", chat(loaded, "Give me a JSON object about cats."), constrained(None)
    )
    engine = make_engine(model, loaded, adapters)
    got = run(engine, [*requests, any_object, free])
    for rid, (_, schema, _) in prompts.items():
        tokens, reason = got[rid]
        assert reason is FinishReason.STOP, (rid, loaded.tokenizer.decode(tokens))
        jsonschema.validate(json.loads(loaded.tokenizer.decode(tokens, skip_special_tokens=True)), schema)
    # Any JSON object is unbounded: a small model may repeat itself to max_tokens, but it writes JSON.
    tokens, _ = got["object-base"]
    assert loaded.tokenizer.decode(tokens).startswith("{")
    alone = run(make_engine(model, loaded, adapters), [free])
    assert got["free"] == alone["free"]  # batched with grammars, an unconstrained request is untouched


def test_a_resumed_request_continues_as_it_would_have(model, loaded, adapters):
    prompt = chat(loaded, "Describe a user of a website as JSON.")
    whole = run(
        make_engine(model, loaded, adapters), [GenerationRequest("whole", prompt, constrained(PERSON), "a")]
    )["whole"][0]
    cut = len(whole) // 2
    resumed = GenerationRequest(
        "rest",
        prompt + tuple(whole[:cut]),
        constrained(PERSON).__class__(
            max_tokens=MAX_TOKENS - cut, structured_output=constrained(PERSON).structured_output
        ),
        "a",
        resumed_output_tokens=cut,
    )
    assert run(make_engine(model, loaded, adapters), [resumed])["rest"][0] == whole[cut:]


def test_a_bad_schema_is_refused_at_submit_by_field(model, loaded, adapters):
    engine = make_engine(model, loaded, adapters)
    bad = SamplingParams(structured_output=StructuredOutput("json_schema", '{"type": "no-such-type"}'))
    with pytest.raises(InvalidArgument, match="structured_output"):
        engine.submit(GenerationRequest("bad", chat(loaded, "hi"), bad), lambda event: None)
    assert not engine.has_work()
