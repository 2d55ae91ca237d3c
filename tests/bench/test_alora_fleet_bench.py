"""The served aLoRA fleet bench's premise, checked on its own prompts: two fleet adapters'
requests name the shared system prompt's whole blocks alike (base-model KV before the invocation,
which ends each prompt as the tokenizer encodes it alone), a prompt of its own shares none, and a
standard LoRA of the same prompt shares none either."""

from __future__ import annotations

import random

from bench.alora_fleet_bench import INVOCATION, fleet_prompt, words
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.prefix_keys import AdapterIdentity, request_block_keys


def test_fleet_prompts_share_the_system_prompts_blocks():
    tokenizer = load_tokenizer().tokenizer
    invocation = tuple(tokenizer.encode(INVOCATION))
    system = words(random.Random(0), tokenizer, 200)
    one, two = (tokenizer.encode(fleet_prompt(system, n)) for n in (1, 2))
    assert tuple(one[-len(invocation) :]) == invocation == tuple(two[-len(invocation) :])

    def keys(name: str, prompt: list[int], alora: bool = True) -> list[bytes]:
        adapter = AdapterIdentity(name, name * 8, invocation if alora else None)
        return request_block_keys("tenant:admin", prompt, 16, adapter)

    shared = len(tokenizer.encode(system)) // 16 - 1  # the system prompt's last block may merge
    assert shared >= 11
    assert keys("a1", one)[:shared] == keys("a2", two)[:shared]
    own = tokenizer.encode(fleet_prompt(words(random.Random("cold-1"), tokenizer, 200), 1))
    assert not set(keys("a1", own)) & set(keys("a1", one))
    assert not set(keys("s1", one, alora=False)) & set(keys("a1", one))
