"""``loramesh.v1.SamplingParams`` (proto) <-> the engine's :class:`SamplingParams`.

One translation, used by the worker and by the gateway (which validates a request before it
places it), so both read zero values and ranges the same way.
"""

from __future__ import annotations

from mesh_api.v1 import types_pb2
from services.runtime.field_copy import dataclass_of
from services.runtime.sampling.sampling_params import SamplingParams, StructuredOutput

DEFAULT_MAX_TOKENS = 128
"""``max_tokens`` of a request that leaves it 0."""


def sampling_from_proto(p: types_pb2.SamplingParams) -> SamplingParams:
    return dataclass_of(
        SamplingParams,
        p,
        max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS,
        top_p=p.top_p or 1.0,
        repetition_penalty=p.repetition_penalty or 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        stop_strings=tuple(p.stop_strings),
        top_logprobs=p.top_logprobs if p.HasField("top_logprobs") else None,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        structured_output=structured_from_proto(p.structured_output)
        if p.HasField("structured_output")
        else None,
    )


def structured_from_proto(p: types_pb2.StructuredOutput) -> StructuredOutput:
    """A message with neither kind set reads as ``json_schema`` with an empty schema, which
    validation refuses."""
    if p.WhichOneof("kind") == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput("json_schema", p.json_schema)
