"""OpenAI request bodies: parsed into the engine's sampling (penalties, ``min_p``, ``top_k``,
``logit_bias``), refused with a 400 naming the field when the engine cannot do what they ask or a
value is out of range; neutral values of refused fields accepted."""

from __future__ import annotations

import json

import pytest

from services.gateway.http.errors import OpenAIError
from services.gateway.http.openai.requests import ChatCompletionBody, CompletionBody
from services.gateway.http.reading import parse_body, read_body


def parse(model, **fields):
    body = parse_body(json.dumps({"model": "m", **fields}).encode(), model)
    body.check()
    return body


def refusal(model, **fields) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(model, **fields)
    assert caught.value.status == 400
    return caught.value


def test_openai_defaults_and_vllm_extras_become_sampling():
    sampling = parse(CompletionBody, prompt="x").sampling()
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (1.0, 1.0, 0)  # 0: gateway default
    assert not sampling.HasField("seed")
    sampling = parse(
        CompletionBody, prompt="x", temperature=0, seed=3, stop=["END", ""], top_k=5, repetition_penalty=1.1
    ).sampling()
    assert (sampling.temperature, sampling.seed, list(sampling.stop_strings), sampling.top_k) == (
        0,
        3,
        ["END"],
        5,
    )
    assert sampling.repetition_penalty == pytest.approx(1.1)
    assert list(parse(CompletionBody, prompt="x", stop="\n").sampling().stop_strings) == ["\n"]


def test_prompts_text_token_ids_or_several():
    assert parse(CompletionBody, prompt="hi").prompts() == ["hi"]
    assert parse(CompletionBody, prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert parse(CompletionBody, prompt=["a", "b"], n=2).prompts() == ["a", "b"]
    assert refusal(CompletionBody, prompt=["a"] * 9, n=2).param == "n"


@pytest.mark.parametrize(
    ("model", "fields", "param"),
    [
        (CompletionBody, {"prompt": "x", "logprobs": 6}, "logprobs"),
        (CompletionBody, {"prompt": "x", "echo": True}, "echo"),
        (CompletionBody, {"prompt": "x", "best_of": 3}, "best_of"),
        (CompletionBody, {"prompt": "x", "frequency_penalty": 2.2}, "frequency_penalty"),
        (CompletionBody, {"prompt": "x", "presence_penalty": -2.5}, "presence_penalty"),
        (CompletionBody, {"prompt": "x", "min_p": 1.5}, "min_p"),
        (CompletionBody, {"prompt": "x", "top_k": -2}, "top_k"),
        (CompletionBody, {"prompt": "x", "logit_bias": {"50": 101}}, "logit_bias"),
        (CompletionBody, {"prompt": "x", "logit_bias": {"fifty": 1}}, "logit_bias"),
        (CompletionBody, {"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
        (CompletionBody, {"prompt": "x", "logit_bias": {"4294967296": 1}}, "logit_bias"),
        (CompletionBody, {"prompt": "x", "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        (CompletionBody, {"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
        (CompletionBody, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
        (CompletionBody, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (CompletionBody, {"prompt": "x", "n": 0}, "n"),
        (CompletionBody, {"prompt": "x", "seed": -1}, "seed"),
        (CompletionBody, {"prompt": "x", "top_p": -0.5}, "top_p"),
        (ChatCompletionBody, {"messages": [], "top_logprobs": 2}, "top_logprobs"),
        (ChatCompletionBody, {"messages": [], "tools": [{"type": "function"}]}, "tools[0].function"),
        (ChatCompletionBody, {"messages": [], "tool_choice": "required"}, "tool_choice"),
        (ChatCompletionBody, {"messages": [], "functions": [{"name": "f"}]}, "functions"),
        (ChatCompletionBody, {"messages": [], "function_call": {"name": "f"}}, "function_call"),
        (ChatCompletionBody, {"messages": [], "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        (ChatCompletionBody, {"messages": [], "modalities": ["text", "audio"]}, "modalities"),
        (
            ChatCompletionBody,
            {"messages": [], "prediction": {"type": "content", "content": "x"}},
            "prediction",
        ),
        (ChatCompletionBody, {"messages": [], "reasoning_effort": "low"}, "reasoning_effort"),
        (ChatCompletionBody, {"messages": [], "verbosity": "low"}, "verbosity"),
        (ChatCompletionBody, {"messages": [], "web_search_options": {}}, "web_search_options"),
        (ChatCompletionBody, {"messages": [], "store": True}, "store"),
        (ChatCompletionBody, {"messages": [], "service_tier": "flex"}, "service_tier"),
        (
            ChatCompletionBody,
            {"messages": [], "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        (ChatCompletionBody, {"messages": "hello"}, "messages"),
        (CompletionBody, {"prompt": {"text": "x"}}, "prompt"),
    ],
)
def test_what_cannot_be_done_is_refused_naming_the_field(model, fields, param):
    error = refusal(model, **fields)
    assert error.param is not None and error.param.startswith(param)
    assert param in error.message


def test_neutral_values_of_unsupported_fields_and_fields_that_change_nothing_are_accepted():
    parse(ChatCompletionBody, messages=[], logprobs=False, tool_choice="none", function_call="auto", user="u")
    parse(
        ChatCompletionBody,
        messages=[],
        modalities=["text"],
        store=False,
        service_tier="auto",
        verbosity="medium",
    )
    parse(ChatCompletionBody, messages=[], metadata={"k": "v"}, prompt_cache_key="p", safety_identifier="s")
    body = parse(
        ChatCompletionBody,
        messages=[],
        response_format={"type": "text"},
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    assert not body.sampling().HasField("structured_output")


def test_new_sampling_fields_become_sampling():
    sampling = parse(
        CompletionBody,
        prompt="x",
        presence_penalty=0.5,
        frequency_penalty=-1,
        min_p=0.05,
        top_k=-1,  # vLLM's "off"
        logit_bias={"50": -100, "7": 2.5},
    ).sampling()
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.top_k) == (0.5, -1.0, 0)
    assert sampling.min_p == pytest.approx(0.05)
    assert dict(sampling.logit_bias) == {50: -100.0, 7: 2.5}
    defaults = parse(CompletionBody, prompt="x").sampling()
    assert (defaults.presence_penalty, defaults.frequency_penalty, defaults.min_p) == (0, 0, 0)
    assert not defaults.logit_bias and not defaults.HasField("structured_output")


def test_chat_messages():
    body = parse(
        ChatCompletionBody,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None},
        ],
        max_completion_tokens=7,
    )
    assert [(m.role, m.content) for m in body.chat_messages()] == [
        ("system", "Be brief."),
        ("user", "Hi there"),
        ("assistant", ""),
    ]
    assert body.sampling().max_tokens == 7
    image = parse(ChatCompletionBody, messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(OpenAIError, match="image_url") as caught:
        image.chat_messages()
    assert caught.value.param == "messages[0].content[0].type"


def test_bad_json():
    with pytest.raises(OpenAIError, match="not valid JSON"):
        parse_body(b"{", CompletionBody)
    with pytest.raises(OpenAIError, match="JSON object"):
        parse_body(b"[]", CompletionBody)


async def test_a_body_over_the_limit_is_refused_before_it_is_all_read():
    read = []

    async def chunks():
        for _ in range(100):
            read.append(1)
            yield b"x" * 1024

    with pytest.raises(OpenAIError) as caught:
        await read_body(chunks(), max_bytes=4096)
    assert caught.value.status == 413 and len(read) == 5
    assert await read_body(chunks(), max_bytes=10**6) == b"x" * 102400
