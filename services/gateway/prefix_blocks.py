"""The prompt blocks a request sends with its placement, for the scheduler's prefix-aware policy.

The scheduler never sees the prompt: it gets the chain hashes of its whole blocks, named as a
worker's prefix cache names them (:mod:`services.runtime.prefix_keys`), and remembers where it
sent which, so it can tell how much of a new prompt a worker likely holds. Base-model blocks
(and an activated LoRA's blocks before its invocation) are the very keys the workers use. An
adapter's own blocks are keyed by its id and the store's sha256 of its weights: the worker's key
space hashes the config with the weights, which the gateway does not hold, so those keys are the
scheduler's alone — still one per adapter version and namespace, so an adapter's prefix never
counts as a hit for another adapter, nor for another version or tenant of the same name.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.adapter_reference import ResolvedAdapter
from services.runtime.prefix_keys import adapter_key_space, prompt_block_keys


def placement_prefix_blocks(
    prompt_ids: Sequence[int], namespace: str, adapter: ResolvedAdapter | None, block_tokens: int
) -> tuple[bytes, ...]:
    """The chain hashes of ``prompt_ids``' whole blocks of ``block_tokens`` tokens for a request
    of ``adapter`` (None: the base model) in ``namespace``; () when ``block_tokens`` is 0."""
    if block_tokens <= 0:
        return ()
    space = None if adapter is None else adapter_key_space(adapter.id, adapter.sha256)
    invocation = None if adapter is None else adapter.invocation_tokens
    return tuple(prompt_block_keys(namespace, prompt_ids, block_tokens, space, invocation))
