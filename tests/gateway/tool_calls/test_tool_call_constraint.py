"""The schema a constrained reply follows: valid calls of the right function validate, anything
else does not (checked with ``jsonschema``), and the worker's grammar (llguidance, with the
worker's compact JSON options) accepts exactly the calls the parser reads back."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from services.gateway.tool_calls import call_schema, parse_reply, parse_tool_request
from services.gpu_worker.engine.structured_output import JSON_OPTIONS
from services.model_files.tokenizer_loading import load_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
# Pydantic-style parameters: nested models in $defs, referred to from the root.
ORDER = {
    "type": "function",
    "function": {
        "name": "place_order",
        "parameters": {
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "count": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "count"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 3}},
            "required": ["items"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK, ORDER]


def named(name: str):
    return parse_tool_request(TOOLS, {"type": "function", "function": {"name": name}})


def valid(schema: dict, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_auto_is_not_constrained():
    assert call_schema(parse_tool_request(TOOLS, "auto")) is None


def test_a_named_function_allows_only_its_calls():
    schema = call_schema(named("get_weather"))
    jsonschema.Draft202012Validator.check_schema(schema)
    assert valid(schema, {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}})
    assert not valid(schema, {"name": "get_weather", "arguments": {"unit": "c"}})
    assert not valid(schema, {"name": "get_weather", "arguments": {"city": "x" * 41}})
    assert not valid(schema, {"name": "get_time", "arguments": {}})
    assert not valid(schema, {"name": "get_weather", "arguments": {"city": "P"}, "extra": 1})
    assert not valid(schema, {"name": "get_weather"})


def test_required_allows_a_call_of_any_function_with_its_own_arguments():
    schema = call_schema(parse_tool_request(TOOLS, "required"))
    jsonschema.Draft202012Validator.check_schema(schema)
    assert valid(schema, {"name": "get_time", "arguments": {}})
    assert valid(schema, {"name": "get_weather", "arguments": {"city": "Oslo"}})
    assert valid(schema, {"name": "place_order", "arguments": {"items": [{"sku": "a1", "count": 2}]}})
    assert not valid(schema, {"name": "place_order", "arguments": {"city": "Oslo"}})
    assert not valid(schema, {"name": "nope", "arguments": {}})


def test_references_still_resolve_once_the_parameters_are_moved_into_the_call():
    order = {"name": "place_order", "arguments": {"items": [{"sku": "a1", "count": 2}]}}
    bad_item = {"name": "place_order", "arguments": {"items": [{"sku": "a1", "count": 0}]}}
    for schema in (call_schema(named("place_order")), call_schema(parse_tool_request(TOOLS, "required"))):
        assert valid(schema, order) and not valid(schema, bad_item)
    # The tool's own definition is untouched.
    assert ORDER["function"]["parameters"]["properties"]["items"]["items"] == {"$ref": "#/$defs/Item"}


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer().tokenizer


def follows_the_grammar(smollm2, schema: dict, text: str) -> bool:
    """``text`` then EOS, token by token, through the grammar the worker compiles for ``schema``."""
    lltokenizer = llguidance.LLTokenizer(
        smollm2.backend.to_str(), n_vocab=smollm2.vocab_size, eos_token=list(smollm2.eos_token_ids)
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    assert not llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    ids = smollm2.encode(text) + [smollm2.eos_token_ids[0]]
    return all(matcher.consume_token(t) for t in ids) and not matcher.is_error()


@pytest.mark.parametrize(
    ("choice", "call"),
    [
        ("get_weather", {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}),
        ("required", {"name": "get_time", "arguments": {}}),
        ("required", {"name": "place_order", "arguments": {"items": [{"sku": "b7", "count": 1}]}}),
    ],
)
def test_the_worker_grammar_takes_the_compact_call_and_the_parser_reads_it_back(smollm2, choice, call):
    request = parse_tool_request(TOOLS, "required") if choice == "required" else named(choice)
    text = json.dumps(call)  # ", " and ": ": how the worker writes JSON under a grammar
    assert follows_the_grammar(smollm2, call_schema(request), text)
    (parsed,) = parse_reply(text, request).tool_calls
    assert (parsed.name, json.loads(parsed.arguments)) == (call["name"], call["arguments"])


def test_the_worker_grammar_refuses_arguments_first_or_another_function(smollm2):
    schema = call_schema(named("get_weather"))
    assert not follows_the_grammar(smollm2, schema, '{"arguments": {"city": "Paris"}, "name": "get_weather"}')
    assert not follows_the_grammar(smollm2, schema, '{"name": "get_time", "arguments": {}}')
