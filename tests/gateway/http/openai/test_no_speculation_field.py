"""``no_speculation``, loramesh's OpenAI extension, reaches the worker's sampling params: true
turns speculative decoding off for that request; absent, the worker's setting holds."""

from __future__ import annotations

import pytest

from services.gateway.http.openai.requests import ChatCompletionBody, CompletionBody
from services.runtime.sampling.sampling_proto import sampling_from_proto


@pytest.mark.parametrize(
    "body",
    [
        lambda **extra: CompletionBody.model_validate({"model": "m", "prompt": "Hi", **extra}),
        lambda **extra: ChatCompletionBody.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **extra}
        ),
    ],
)
def test_no_speculation_travels_to_the_sampling_params(body):
    assert sampling_from_proto(body(no_speculation=True).sampling()).no_speculation is True
    assert sampling_from_proto(body().sampling()).no_speculation is False
