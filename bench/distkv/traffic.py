"""Bytes a borrowing decode step sends, counted from the real lending messages, against the bytes
of the KV it leaves where it is.

Per decode step and layer, the debtor sends each creditor one ``AttendRemoteRequest`` (the new
token's query, its position, the block ids) and gets back one ``AttendRemoteResponse`` (partial
output + log-sum-exp); the creditor holding the last block also gets the new token's keys and
values (``WriteKvRequest``). The messages are built with the real protos and zero tensors of the
real shapes, and measured with ``ByteSize()``: protobuf payload only, gRPC/HTTP/2 framing left out.
Moving the KV instead (a migration, or pulling it to attend locally) sends every remote block:
``num_layers × 2 (K, V) × block_tokens × kv_dim × itemsize`` bytes each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mesh_api.v1 import worker_pb2


@dataclass(frozen=True)
class ModelShape:
    """What the message sizes depend on (defaults: SmolLM2-135M in fp32, 16-token blocks)."""

    num_layers: int = 30
    """Decoder layers: one remote call per layer and creditor."""
    num_heads: int = 9
    """Query heads."""
    num_kv_heads: int = 3
    """Key/value heads."""
    head_dim: int = 64
    """Size of one head."""
    dtype: str = "float32"
    """KV and query dtype (partial outputs are float32 whatever it is)."""
    block_tokens: int = 16
    """Tokens per KV block."""

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """KV of one block, every layer."""
        return self.num_layers * 2 * self.block_tokens * self.kv_dim * self.itemsize


@dataclass(frozen=True)
class StepTraffic:
    """One decode step of one request, all layers."""

    sent: int
    """Debtor → creditors: queries and the new token's KV."""
    received: int
    """Creditors → debtor: partial outputs and log-sum-exps."""
    kv_bytes: int
    """The remote blocks' KV: what moving it would send."""

    @property
    def moved(self) -> int:
        return self.sent + self.received

    @property
    def kv_over_moved(self) -> float:
        return self.kv_bytes / self.moved if self.moved else 0.0


def _zeros(shape: list[int], dtype: str) -> worker_pb2.Tensor:
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    count = 1
    for size in shape:
        count *= size
    return worker_pb2.Tensor(data=bytes(count * itemsize), dtype=dtype, shape=shape)


def decode_step_traffic(shape: ModelShape, remote_blocks: dict[str, int], context_tokens: int) -> StepTraffic:
    """One decode step of a request with ``context_tokens`` of context, ``remote_blocks[c]`` of
    its blocks on creditor ``c`` (its local blocks first, as the engine lays them out; the last
    creditor listed holds the tail block and receives the new token's KV)."""
    remote_total = sum(remote_blocks.values())
    first_remote = max(0, -(-context_tokens // shape.block_tokens) - remote_total)
    sent = received = 0
    next_block = first_remote
    for count in remote_blocks.values():
        block_ids = list(range(next_block, next_block + count))
        next_block += count
        segment = worker_pb2.RemoteAttendSegment(
            queries=_zeros([1, shape.num_heads, shape.head_dim], shape.dtype),
            query_positions=_zeros([1], "int64"),
            block_ids=block_ids,
            block_first_positions=[b * shape.block_tokens for b in block_ids],
        )
        request = worker_pb2.AttendRemoteRequest(
            debtor="gpu_worker-debtor", layer=shape.num_layers - 1, segments=[segment]
        )
        response = worker_pb2.AttendRemoteResponse(
            partials=[
                worker_pb2.RemotePartialAttention(
                    output=_zeros([1, shape.num_heads, shape.head_dim], "float32"),
                    lse=_zeros([1, shape.num_heads], "float32"),
                )
            ]
        )
        sent += request.ByteSize() * shape.num_layers
        received += response.ByteSize() * shape.num_layers
    if remote_blocks:
        write = worker_pb2.WriteKvRequest(
            debtor="gpu_worker-debtor",
            layer=shape.num_layers - 1,
            block_ids=[next_block - 1],
            slots=_zeros([1], "int64"),
            keys=_zeros([1, shape.kv_dim], shape.dtype),
            values=_zeros([1, shape.kv_dim], shape.dtype),
        )
        sent += write.ByteSize() * shape.num_layers
    return StepTraffic(sent=sent, received=received, kv_bytes=remote_total * shape.block_bytes)
