"""The checks the gateway and the workers share: each refusal names its field and value."""

from __future__ import annotations

import pytest

from services.runtime.sampling.request_validation import (
    MAX_CHOICES,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    InvalidField,
    check_choices,
    check_prompt,
    check_request,
    check_sampling,
)
from services.runtime.sampling.sampling_params import SamplingParams

GOOD = {
    "max_tokens": 16,
    "temperature": 0.7,
    "top_k": 40,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "seed": 7,
    "stop_strings": ["\n\n", "END"],
}


def refusal(**changes) -> InvalidField:
    with pytest.raises(InvalidField) as caught:
        check_sampling(**{**GOOD, **changes})
    return caught.value


def test_values_in_range_pass_and_an_unset_max_tokens_means_the_default():
    check_sampling(**GOOD)
    check_sampling(**{**GOOD, "max_tokens": None, "temperature": 0.0, "top_p": 1.0, "seed": None})
    check_sampling(**{**GOOD, "temperature": 100.0, "repetition_penalty": 10.0, "seed": 2**64 - 1})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
        ("max_tokens", -5, "max_tokens must be at least 1, got -5"),
        ("temperature", -0.1, "temperature must be within [0, 100], got -0.1"),
        ("temperature", 500.0, "temperature must be within [0, 100], got 500.0"),
        ("top_k", -1, "top_k must be ≥ 0, got -1"),
        ("top_p", 0.0, "top_p must be within (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must be within (0, 1], got 1.5"),
        ("repetition_penalty", 0.0, "repetition_penalty must be within (0, 10], got 0.0"),
        ("repetition_penalty", 11.0, "repetition_penalty must be within (0, 10], got 11.0"),
        ("seed", -1, "seed must be within [0, 2^64), got -1"),
        ("seed", 2**64, f"seed must be within [0, 2^64), got {2**64}"),
    ],
)
def test_each_out_of_range_value_is_named(field, value, message):
    error = refusal(**{field: value})
    assert (error.field, error.message, error.code_name) == (field, message, "INVALID_ARGUMENT")


def test_stop_strings_are_bounded_in_number_and_length_and_never_empty():
    assert refusal(stop_strings=["a", ""]).message == "stop string 1 is empty"
    many = refusal(stop_strings=[str(i) for i in range(MAX_STOP_STRINGS + 1)])
    assert (many.field, many.message) == ("stop", f"at most {MAX_STOP_STRINGS} stop strings, got 17")
    check_sampling(**{**GOOD, "stop_strings": ["é" * (MAX_STOP_STRING_BYTES // 2)]})
    long = refusal(stop_strings=["é" * (MAX_STOP_STRING_BYTES // 2 + 1)])  # counted in UTF-8 bytes
    assert long.message == f"stop string 0 is 258 bytes; the limit is {MAX_STOP_STRING_BYTES}"


def test_choices():
    check_choices(1)
    check_choices(MAX_CHOICES)
    for n in (0, MAX_CHOICES + 1):
        with pytest.raises(InvalidField, match=rf"n must be within \[1, 16\], got {n}"):
            check_choices(n)


def test_prompts_against_vocabulary_and_context():
    check_prompt([0, 5, 99], vocab_size=100, context_length=4)
    for ids, message in [
        ([], "prompt is empty: give at least one token"),
        ([1, 2, 3, 4], "prompt has 4 tokens; the model's context is 4"),
        ([1, 100], r"prompt token ids must be within \[0, 100\)"),
        ([-1], r"prompt token ids must be within \[0, 100\)"),
    ]:
        with pytest.raises(InvalidField, match=message) as caught:
            check_prompt(ids, vocab_size=100, context_length=4)
        assert caught.value.field == "prompt"


def test_a_whole_request_checks_prompt_sampling_and_stop_token_ids():
    check_request([1, 2], SamplingParams(stop_token_ids=(99,)), vocab_size=100, context_length=8)
    with pytest.raises(InvalidField, match=r"stop_token_ids must be within \[0, 100\)"):
        check_request([1, 2], SamplingParams(stop_token_ids=(100,)), vocab_size=100, context_length=8)
    with pytest.raises(InvalidField, match="top_p"):
        check_request([1, 2], SamplingParams(top_p=2.0), vocab_size=100, context_length=8)


@pytest.mark.parametrize("top_logprobs", [-1, 21])
def test_top_logprobs_is_bounded(top_logprobs):
    with pytest.raises(InvalidField, match=r"top_logprobs must be within \[0, 20\]"):
        SamplingParams(top_logprobs=top_logprobs).validate()
    SamplingParams(top_logprobs=20).validate()
