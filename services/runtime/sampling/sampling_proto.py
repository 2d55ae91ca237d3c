"""``loramesh.v1.SamplingParams`` (proto) <-> the engine's :class:`SamplingParams`.

One translation, used by the worker and by the gateway (which validates a request before it
places it), so both read zero values and ranges the same way.
"""

from __future__ import annotations

from mesh_api.v1 import types_pb2
from services.runtime.sampling.sampling_params import SamplingParams, StructuredOutput

DEFAULT_MAX_TOKENS = 128
"""``max_tokens`` of a request that leaves it 0."""


def sampling_from_proto(p: types_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        repetition_penalty=p.repetition_penalty or 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        stop_strings=tuple(p.stop_strings),
        ignore_eos=p.ignore_eos,
        top_logprobs=p.top_logprobs if p.HasField("top_logprobs") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_p=p.min_p,
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


def sampling_to_proto(params: SamplingParams) -> types_pb2.SamplingParams:
    """The wire message of ``params``; :func:`sampling_from_proto` reads it back equal."""
    message = types_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        repetition_penalty=params.repetition_penalty,
        stop_token_ids=params.stop_token_ids,
        stop_strings=params.stop_strings,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.top_logprobs is not None:
        message.top_logprobs = params.top_logprobs
    if params.structured_output is not None:
        message.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return message


def structured_to_proto(structured: StructuredOutput) -> types_pb2.StructuredOutput:
    if structured.kind == "json_object":
        return types_pb2.StructuredOutput(json_object=True)
    return types_pb2.StructuredOutput(json_schema=structured.schema)
