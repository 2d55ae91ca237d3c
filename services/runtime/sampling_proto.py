"""``loramesh.v1.SamplingParams`` (proto) -> the engine's :class:`SamplingParams`.

One translation, used by the worker and by the gateway (which validates a request before it
places it), so both read zero values and ranges the same way.
"""

from __future__ import annotations

from mesh_api.v1 import types_pb2
from services.runtime.sampling_params import SamplingParams

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
    )
