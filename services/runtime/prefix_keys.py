"""How a prompt's KV blocks are named, shared by the gpu_worker's prefix cache (which keys the
blocks it holds) and the gateway (which names the blocks a request would hit, for the scheduler's
prefix-aware placement): one implementation, so the two never drift apart.

A block is named by a chain hash: the sha256 of the previous block's key and this block's token
ids, the first block's "previous key" being the request's key space — the adapter id and the
sha256 of its content, or the base model — salted with the request's namespace (who may share
its blocks). So a block matches only when every token before it, the adapter (this exact version
of it) and the namespace match. An activated LoRA (aLoRA) is the base model before its
invocation: the blocks wholly before its activation position are keyed in the base model's key
space, the rest in its adapter's, joined with that position. ``services/gpu_worker/memory/
prefix_cache.py`` says why, and what the cache does with the keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

BlockKey = bytes
"""A cached block's chain hash (sha256 digest)."""

BASE_MODEL_KEY_SPACE: BlockKey = hashlib.sha256(b"loramesh/base-model").digest()
"""The key space of requests without an adapter."""


def content_sha256(config_json: bytes | str, weights_sha256: str) -> str:
    """sha256 of an adapter's config and its weights' sha256 (the store's, which a fetch
    verifies), each length-prefixed (so no two different pairs hash alike by moving bytes across
    the boundary): the weights are hashed once per fetch, not twice. A worker hashes the config
    it fetched, the gateway the same ``config_json`` of the store's ``AdapterInfo``."""
    config = config_json.encode() if isinstance(config_json, str) else bytes(config_json)
    digest = hashlib.sha256()
    for part in (config, bytes.fromhex(weights_sha256)):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class AdapterIdentity:
    """What names an adapter version's prefix blocks, as a worker (from the adapter it holds) and
    the gateway (from the store's ``AdapterInfo``) both know it."""

    adapter_id: str
    """The store's id."""
    content_sha256: str
    """:func:`content_sha256` of its config and weights; "": unknown (its blocks are not named)."""
    invocation_tokens: tuple[int, ...] | None = None
    """An activated LoRA's invocation sequence; None: a standard LoRA."""


def adapter_key_space(adapter_id: str, content_sha256: str) -> BlockKey:
    """The key space of an adapter's requests: its id and the sha256 of its content, so a new
    version of the same id shares nothing with the old one."""
    return hashlib.sha256(f"loramesh/adapter\0{adapter_id}\0{content_sha256}".encode()).digest()


def namespaced_key_space(key_space: BlockKey, namespace: str) -> BlockKey:
    """``key_space`` within ``namespace`` (who may share its blocks: ``tenant:<id>`` or
    ``salt:<cache_salt>``, as the gateway names them); the empty namespace leaves it as it is.
    ``key_space`` has a fixed length after the namespace, so two namespaces never make one key."""
    if not namespace:
        return key_space
    named = namespace.encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"loramesh/prefix-namespace\0" + named + b"\0" + key_space).digest()


def block_keys(key_space: BlockKey, token_ids: Sequence[int], block_tokens: int) -> list[BlockKey]:
    """The chain keys of the whole blocks of ``token_ids`` (a partial last block has none)."""
    keys, previous = [], key_space
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = token_ids[start : start + block_tokens]
        previous = hashlib.sha256(previous + b"".join(t.to_bytes(4, "little") for t in block)).digest()
        keys.append(previous)
    return keys


def activated_block_keys(
    base_space: BlockKey,
    adapter_space: BlockKey,
    token_ids: Sequence[int],
    block_tokens: int,
    adapter_from: int,
) -> list[BlockKey]:
    """The chain keys of an activated LoRA's prompt whose adapter applies from ``adapter_from``:
    the blocks wholly before it in ``base_space`` (their KV is the base model's), then the rest
    chained on from the last of those in ``adapter_space`` joined with ``adapter_from`` (their KV
    depends on where the adapter starts, not only on the tokens: a later occurrence of the
    invocation moves it)."""
    split = adapter_from // block_tokens * block_tokens
    keys = block_keys(base_space, token_ids[:split], block_tokens)
    joined = hashlib.sha256(
        b"loramesh/activated\0"
        + adapter_space
        + (keys[-1] if keys else base_space)
        + adapter_from.to_bytes(8, "little")
    ).digest()
    return keys + block_keys(joined, token_ids[split:], block_tokens)


def activation_start(prompt_ids: Sequence[int], invocation_tokens: Sequence[int] | None) -> int | None:
    """The first position an adapter's weights apply to: 0 for a standard LoRA
    (``invocation_tokens`` None), the start of the last occurrence of ``invocation_tokens`` in
    ``prompt_ids`` for an aLoRA, None when the prompt does not hold them (never applied)."""
    if invocation_tokens is None:
        return 0
    invocation = tuple(invocation_tokens)
    width = len(invocation)
    first = invocation[0]
    prompt = tuple(prompt_ids)
    for start in range(len(prompt) - width, -1, -1):
        if prompt[start] == first and prompt[start : start + width] == invocation:
            return start
    return None


def prompt_block_keys(
    namespace: str,
    token_ids: Sequence[int],
    block_tokens: int,
    adapter_space: BlockKey | None = None,
    invocation_tokens: Sequence[int] | None = None,
    searched: Sequence[int] | None = None,
) -> list[BlockKey]:
    """The chain keys of a prompt's whole blocks as a worker's prefix cache keys them:
    ``adapter_space`` None for the base model; with ``invocation_tokens`` the adapter is an aLoRA
    (its blocks before the invocation in the base model's key space; the whole prompt there when
    ``searched``, default ``token_ids``, lacks the invocation). Both key spaces are salted with
    ``namespace``."""
    base = namespaced_key_space(BASE_MODEL_KEY_SPACE, namespace)
    adapter_from = activation_start(token_ids if searched is None else searched, invocation_tokens)
    if adapter_space is None or adapter_from is None:
        return block_keys(base, token_ids, block_tokens)
    space = namespaced_key_space(adapter_space, namespace)
    if invocation_tokens is None:
        return block_keys(space, token_ids, block_tokens)
    return activated_block_keys(base, space, token_ids, block_tokens, adapter_from)


def request_block_keys(
    namespace: str,
    token_ids: Sequence[int],
    block_tokens: int,
    adapter: AdapterIdentity | None = None,
    original_tokens: int | None = None,
) -> list[BlockKey] | None:
    """The chain keys of a request's whole prompt blocks, the one function both a worker's prefix
    cache (what it keys and announces) and the gateway (what a placement names) call, so the
    scheduler scores exactly the blocks the workers hold: ``adapter`` None for the base model.
    ``original_tokens``: how many of ``token_ids`` are the prompt as first sent, where an aLoRA's
    invocation is looked for (a resumed request's generated tokens never move it; default all).
    None when the adapter's content is unknown: its blocks have no name."""
    if adapter is None:
        return prompt_block_keys(namespace, token_ids, block_tokens)
    if not adapter.content_sha256:
        return None
    space = adapter_key_space(adapter.adapter_id, adapter.content_sha256)
    invocation = adapter.invocation_tokens
    searched = token_ids if original_tokens is None else token_ids[:original_tokens]
    return prompt_block_keys(namespace, token_ids, block_tokens, space, invocation, searched)
