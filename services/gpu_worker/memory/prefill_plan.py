"""Prefill write planning (DistKV-LLM §4.6): a prompt's KV size is known before it runs, so
which of its blocks are local and which go to which creditor block is decided up front, and the
prefill writes each remote block's KV straight to its creditor.

Local blocks come first: the earliest tokens stay local and the tail goes remote, in grant order.
Granted blocks the prompt does not need are reported as surplus for the debtor to free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.gpu_worker.memory.block_table import RemoteBlock
from services.runtime.errors import InvalidArgument, ResourceExhausted


@dataclass(frozen=True)
class RemoteGrant:
    """Blocks one creditor agreed to lend."""

    creditor: str
    """The creditor's worker id."""
    block_ids: tuple[int, ...]
    """The creditor's ids of the lent blocks, in the order they are to be filled."""


@dataclass(frozen=True)
class PlannedBlock:
    """One logical block of the prompt and where its tokens go."""

    index: int
    """Logical block index in the request's block table."""
    token_start: int
    """First token position it holds."""
    token_end: int
    """End (exclusive) of the prompt tokens it holds; < ``token_start + block_tokens`` only for
    the last block."""
    remote: RemoteBlock | None
    """The creditor block, or None for a block of the local pool."""


@dataclass(frozen=True)
class PrefillPlan:
    """Where each block of a prompt goes."""

    blocks: tuple[PlannedBlock, ...]
    """Every logical block of the prompt, in order."""
    local_blocks: int
    """How many of the first ``blocks`` are local (to allocate from the local pool)."""
    surplus: tuple[RemoteGrant, ...]
    """Granted blocks not needed: free them back to their creditors."""

    def ranges_on(self, creditor: str) -> list[PlannedBlock]:
        """The blocks (with their token ranges) whose KV the prefill writes to ``creditor``."""
        return [b for b in self.blocks if b.remote is not None and b.remote.creditor == creditor]


def plan_prefill(
    prompt_len: int, block_tokens: int, free_local_blocks: int, grants: Sequence[RemoteGrant]
) -> PrefillPlan:
    """Place ``prompt_len`` tokens (pass one more to leave room for the first generated token)
    in blocks of ``block_tokens``: up to ``free_local_blocks`` local ones, then the granted
    remote ones in order. ``ResourceExhausted`` when they cannot hold the prompt."""
    if prompt_len < 0 or block_tokens <= 0 or free_local_blocks < 0:
        raise InvalidArgument(
            f"bad prefill plan inputs: prompt_len {prompt_len}, block_tokens {block_tokens}, "
            f"free_local_blocks {free_local_blocks}"
        )
    needed = -(-prompt_len // block_tokens)
    remote = [RemoteBlock(g.creditor, block_id) for g in grants for block_id in g.block_ids]
    if len(set(remote)) != len(remote):
        raise InvalidArgument("a remote block is granted twice")
    local = min(needed, free_local_blocks)
    if local + len(remote) < needed:
        raise ResourceExhausted(
            f"a prompt of {prompt_len} tokens needs {needed} blocks of {block_tokens}; "
            f"{free_local_blocks} local and {len(remote)} granted"
        )
    used_remote = needed - local
    blocks = tuple(
        PlannedBlock(
            index=i,
            token_start=i * block_tokens,
            token_end=min(prompt_len, (i + 1) * block_tokens),
            remote=None if i < local else remote[i - local],
        )
        for i in range(needed)
    )
    surplus, used = [], used_remote
    for grant in grants:
        taken = min(used, len(grant.block_ids))
        used -= taken
        if taken < len(grant.block_ids):
            surplus.append(RemoteGrant(grant.creditor, grant.block_ids[taken:]))
    return PrefillPlan(blocks=blocks, local_blocks=local, surplus=tuple(surplus))
