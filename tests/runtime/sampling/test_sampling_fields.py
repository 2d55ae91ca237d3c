"""The sampling fields of issue 31 (presence and frequency penalties, min_p, logit_bias, structured
output): range checks that name the field, and the wire translation both ways."""

from __future__ import annotations

import json
import math

import pytest

from mesh_api.v1 import types_pb2
from services.runtime.field_copy import message_of
from services.runtime.sampling.request_validation import (
    MAX_LOGIT_BIAS_ENTRIES,
    InvalidField,
    check_request,
    check_sampling,
)
from services.runtime.sampling.sampling_params import SamplingParams, StructuredOutput
from services.runtime.sampling.sampling_proto import sampling_from_proto

BASE = {
    "max_tokens": 16,
    "temperature": 0.7,
    "top_k": 0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "seed": None,
    "stop_strings": [],
}
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}})


# What a sender writes (the services only read these messages): the inverse of
# sampling_from_proto, so a round trip checks the reader field by field.
def sampling_to_proto(params: SamplingParams) -> types_pb2.SamplingParams:
    """The wire message of ``params``; :func:`sampling_from_proto` reads it back equal. A field
    left None (``seed``, ``top_logprobs``, ``structured_output``) is left unset."""
    structured = params.structured_output
    return message_of(
        types_pb2.SamplingParams,
        params,
        logit_bias=dict(params.logit_bias),
        structured_output=None if structured is None else structured_to_proto(structured),
    )


def structured_to_proto(structured: StructuredOutput) -> types_pb2.StructuredOutput:
    if structured.kind == "json_object":
        return types_pb2.StructuredOutput(json_object=True)
    return types_pb2.StructuredOutput(json_schema=structured.schema)


def refusal(**changes) -> InvalidField:
    with pytest.raises(InvalidField) as caught:
        check_sampling(**{**BASE, **changes})
    assert caught.value.code_name == "INVALID_ARGUMENT"
    return caught.value


def test_values_in_range_pass():
    for penalty in (-2.0, 0.0, 1.3, 2.0):
        check_sampling(**BASE, presence_penalty=penalty, frequency_penalty=penalty)
    for min_p in (0.0, 0.05, 1.0):
        check_sampling(**BASE, min_p=min_p)
    check_sampling(**BASE, logit_bias=[(i, -100.0 + i * 0.5) for i in range(MAX_LOGIT_BIAS_ENTRIES)])
    check_sampling(**BASE, logit_bias=[(0, 100.0), (7, -100.0)])
    check_sampling(**BASE, structured_output=StructuredOutput("json_schema", SCHEMA))
    check_sampling(**BASE, structured_output=StructuredOutput("json_object"))


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be within [-2, 2], got 2.5"),
        (
            {"presence_penalty": -2.01},
            "presence_penalty",
            "presence_penalty must be within [-2, 2], got -2.01",
        ),
        (
            {"presence_penalty": math.nan},
            "presence_penalty",
            "presence_penalty must be within [-2, 2], got nan",
        ),
        (
            {"frequency_penalty": 3.0},
            "frequency_penalty",
            "frequency_penalty must be within [-2, 2], got 3.0",
        ),
        (
            {"frequency_penalty": -math.inf},
            "frequency_penalty",
            "frequency_penalty must be within [-2, 2], got -inf",
        ),
        ({"min_p": -0.1}, "min_p", "min_p must be within [0, 1], got -0.1"),
        ({"min_p": 1.5}, "min_p", "min_p must be within [0, 1], got 1.5"),
        (
            {"logit_bias": [(i, 1.0) for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)]},
            "logit_bias",
            "logit_bias has 301 entries; at most 300",
        ),
        (
            {"logit_bias": [(5, 100.5)]},
            "logit_bias",
            "logit_bias of token 5 must be within [-100, 100], got 100.5",
        ),
        (
            {"logit_bias": [(5, math.nan)]},
            "logit_bias",
            "logit_bias of token 5 must be within [-100, 100], got nan",
        ),
        ({"logit_bias": [(-1, 1.0)]}, "logit_bias", "logit_bias token id -1 is negative"),
        ({"logit_bias": [(4, 1.0), (4, 2.0)]}, "logit_bias", "logit_bias names a token id more than once"),
        (
            {"structured_output": StructuredOutput("regex", "a+")},  # type: ignore[arg-type]
            "response_format",
            "response_format must be json_schema or json_object, got 'regex'",
        ),
        (
            {"structured_output": StructuredOutput("json_schema")},
            "response_format",
            "response_format json_schema is empty: give a JSON Schema",
        ),
        (
            {"structured_output": StructuredOutput("json_schema", "[1, 2]")},
            "response_format",
            "response_format json_schema must be a JSON object, got list",
        ),
        (
            {"structured_output": StructuredOutput("json_object", SCHEMA)},
            "response_format",
            "response_format json_object takes no schema",
        ),
    ],
)
def test_each_out_of_range_value_is_named(changes, field, message):
    error = refusal(**changes)
    assert (error.field, error.message) == (field, message)


def test_a_schema_that_is_not_json_is_refused_with_the_parser_s_reason():
    error = refusal(structured_output=StructuredOutput("json_schema", '{"type": "object"'))
    assert error.field == "response_format"
    assert error.message.startswith("response_format json_schema is not valid JSON: ")


def test_sampling_params_validate_the_new_fields():
    with pytest.raises(InvalidField, match="min_p") as caught:
        SamplingParams(temperature=1.0, min_p=2.0).validate()
    assert caught.value.field == "min_p"
    with pytest.raises(InvalidField) as caught:
        SamplingParams(frequency_penalty=-5.0).validate()
    assert caught.value.field == "frequency_penalty"


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    check_request([1, 2], SamplingParams(logit_bias=((99, 5.0),)), vocab_size=100, context_length=8)
    with pytest.raises(InvalidField, match=r"logit_bias token ids must be within \[0, 100\)") as caught:
        check_request(
            [1, 2], SamplingParams(logit_bias=((3, 1.0), (100, 5.0))), vocab_size=100, context_length=8
        )
    assert caught.value.field == "logit_bias"


def test_the_params_stay_frozen_and_hashable():
    params = SamplingParams(
        logit_bias=((3, 1.5),), structured_output=StructuredOutput("json_schema", SCHEMA), min_p=0.1
    )
    assert hash(params) == hash(
        SamplingParams(
            logit_bias=((3, 1.5),), structured_output=StructuredOutput("json_schema", SCHEMA), min_p=0.1
        )
    )
    with pytest.raises(AttributeError):
        params.min_p = 0.2  # type: ignore[misc]


# -- the wire ---------------------------------------------------------------------------------

FULL = SamplingParams(
    max_tokens=64,
    temperature=0.5,
    top_k=40,
    top_p=0.75,
    repetition_penalty=1.25,
    seed=2**64 - 1,
    stop_token_ids=(2, 9),
    stop_strings=("END",),
    ignore_eos=True,
    top_logprobs=3,
    presence_penalty=-1.5,
    frequency_penalty=0.25,
    min_p=0.125,
    logit_bias=((0, -100.0), (17, 2.5), (4_000_000_000, 100.0)),
    structured_output=StructuredOutput("json_schema", SCHEMA),
    no_speculation=True,
)
"""Every field set, floats exactly representable in float32 (the wire's ``float``)."""


@pytest.mark.parametrize(
    "params",
    [
        FULL,
        SamplingParams(structured_output=StructuredOutput("json_object")),
        SamplingParams(logit_bias=((5, 1.0),)),
        SamplingParams(),
    ],
)
def test_params_survive_the_wire(params):
    message = sampling_to_proto(params)
    decoded = types_pb2.SamplingParams.FromString(message.SerializeToString())
    assert sampling_from_proto(decoded) == params


def test_every_new_field_reads_off_the_wire():
    message = types_pb2.SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-0.75,
        min_p=0.25,
        logit_bias={30: -100.0, 7: 12.5},
        structured_output=types_pb2.StructuredOutput(json_schema=SCHEMA),
    )
    params = sampling_from_proto(types_pb2.SamplingParams.FromString(message.SerializeToString()))
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (0.5, -0.75, 0.25)
    assert params.logit_bias == ((7, 12.5), (30, -100.0)), "sorted by token id"
    assert params.structured_output == StructuredOutput("json_schema", SCHEMA)
    json_object = types_pb2.SamplingParams(structured_output=types_pb2.StructuredOutput(json_object=True))
    assert sampling_from_proto(json_object).structured_output == StructuredOutput("json_object")


def test_zero_values_mean_off():
    params = sampling_from_proto(types_pb2.SamplingParams())
    assert params == SamplingParams()
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (0.0, 0.0, 0.0)
    assert params.logit_bias == () and params.structured_output is None and not params.penalizes_output


def test_a_proto_round_trip_keeps_every_new_field():
    message = sampling_to_proto(FULL)
    assert message.presence_penalty == -1.5 and message.frequency_penalty == 0.25 and message.min_p == 0.125
    assert dict(message.logit_bias) == {0: -100.0, 17: 2.5, 4_000_000_000: 100.0}
    assert message.structured_output.WhichOneof("kind") == "json_schema"
    assert message.structured_output.json_schema == SCHEMA
    assert sampling_to_proto(sampling_from_proto(message)) == message
