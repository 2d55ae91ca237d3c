"""activation_start finds an aLoRA's invocation where PEFT's calculate_alora_offsets does (the
start of its last occurrence; none: never active), and a step's LoRA segments split an aLoRA
request there."""

from __future__ import annotations

import random

import pytest
import torch

from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest
from services.gpu_worker.executor.step_builder import _segments
from services.gpu_worker.lora.activation import activation_start
from services.runtime.sampling.sampling_params import SamplingParams


def peft_start(prompt: list[int], invocation: list[int]) -> int | None:
    """PEFT's answer: its offset counts back from the end of the prompt."""
    from peft import LoraConfig
    from peft.tuners.lora.variants import calculate_alora_offsets

    config = {"a": LoraConfig(alora_invocation_tokens=invocation, task_type="CAUSAL_LM")}
    (offset,) = calculate_alora_offsets(config, "a", torch.tensor([prompt]))
    return None if offset is None else len(prompt) - offset


def test_standard_lora_applies_everywhere():
    assert activation_start([5, 6, 7], None) == 0


@pytest.mark.parametrize(
    "prompt, invocation, start",
    [
        ([1, 2, 3, 4], [2, 3], 1),
        ([2, 3, 9, 2, 3, 9], [2, 3], 3),  # the last occurrence
        ([1, 2, 3], [1, 2, 3], 0),
        ([1, 2, 3], [3], 2),
        ([1, 2, 3], [3, 4], None),  # cut off by the prompt's end
        ([1, 2, 3], [2, 3, 4, 5], None),
        ([7, 7, 7], [7, 7], 1),  # overlapping occurrences
    ],
)
def test_examples_agree_with_peft(prompt, invocation, start):
    assert activation_start(prompt, invocation) == start == peft_start(prompt, invocation)


def test_random_prompts_agree_with_peft():
    rng = random.Random(54)
    for _ in range(300):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
        invocation = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        assert activation_start(prompt, invocation) == peft_start(prompt, invocation), (prompt, invocation)


def planned(start: int, tokens: int, adapter: AdapterSlot | None, adapter_from: int) -> PlannedRequest:
    return PlannedRequest(
        request_id=f"r{start}-{tokens}",
        token_ids=tuple(range(tokens)),
        start_position=start,
        kv_blocks=(),
        adapter=adapter,
        sampling=SamplingParams(),
        adapter_from=adapter_from,
    )


def test_segments_split_an_activated_request_at_its_invocation():
    slot = AdapterSlot("a", 0)
    requests = (
        planned(0, 10, slot, 0),  # a standard LoRA: one segment
        planned(0, 10, slot, 6),  # prefill across the invocation: split
        planned(16, 8, slot, 20),  # prefill after a cached prefix, split
        planned(0, 5, slot, 9),  # wholly before its invocation (a prefix of its prompt)
        planned(12, 1, slot, 9),  # decode after the invocation
        planned(0, 4, None, 2),  # the base model
    )
    slots, counts = _segments(requests)
    assert counts == [10, 6, 4, 4, 4, 5, 1, 4]
    assert slots == [slot, None, slot, None, slot, None, slot, None]
