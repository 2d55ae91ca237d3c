"""The prompt blocks a request sends with its placement, for the scheduler's prefix-aware policy.

The scheduler never sees the prompt: it gets the chain hashes of its whole blocks, named by the
very function a worker's prefix cache keys and announces them with
(:func:`services.runtime.prefix_keys.request_block_keys`), and remembers where it sent which, so
it can tell how much of a new prompt a worker likely holds. An adapter's blocks are named by its
id and the sha256 of its config and weights, which the gateway computes from the store's
``AdapterInfo`` as a worker does from the adapter it fetched: one key per adapter version and
namespace, so an adapter's prefix never counts as a hit for another adapter, nor for another
version or tenant of the same name, and an activated LoRA's blocks before its invocation are the
base model's.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.adapter_reference import ResolvedAdapter
from services.runtime.prefix_keys import request_block_keys


def placement_prefix_blocks(
    prompt_ids: Sequence[int], namespace: str, adapter: ResolvedAdapter | None, block_tokens: int
) -> tuple[bytes, ...]:
    """The chain hashes of ``prompt_ids``' whole blocks of ``block_tokens`` tokens for a request
    of ``adapter`` (None: the base model) in ``namespace``; () when ``block_tokens`` is 0 or the
    adapter's content is unknown (placement then goes by residency and load alone)."""
    if block_tokens <= 0:
        return ()
    identity = None if adapter is None else adapter.identity
    return tuple(request_block_keys(namespace, prompt_ids, block_tokens, identity) or ())
