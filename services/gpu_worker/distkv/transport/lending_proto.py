"""Proto <-> torch for the lending RPCs (``Worker/AllocateBlocks`` ... ``Worker/ReadBlocks``):
tensors as raw bytes + dtype + shape, block layouts, attention segments and partials.

Both sides use it: the lender's servicer decodes what a debtor sent (untrusted: a tensor whose
bytes do not match its dtype and shape is ``InvalidArgument``), the debtor's
``GrpcCreditorTransport`` encodes its calls and decodes the answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

import torch
from google.protobuf.message import Message

from mesh_api.v1 import worker_pb2
from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.gpu_worker.distkv.shared_lender import SharedLender
from services.runtime.errors import InvalidArgument

D = TypeVar("D", AttendSegment, KvRows)
M = TypeVar("M", bound=Message)

WIRE_DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "int64", "int32")}
"""The dtypes a tensor may have on the wire: KV and queries in any model dtype, indices."""


def tensor_to_proto(tensor: torch.Tensor) -> worker_pb2.Tensor:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise InvalidArgument(f"cannot send a {name} tensor; wire dtypes are {sorted(WIRE_DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return worker_pb2.Tensor(
        data=flat.view(torch.uint8).numpy().tobytes(), dtype=name, shape=list(tensor.shape)
    )


def tensor_from_proto(
    message: worker_pb2.Tensor, what: str, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The tensor ``message`` carries (``what`` names it in errors)."""
    dtype = WIRE_DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidArgument(f"{what}: dtype {message.dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    shape = list(message.shape)
    count = 1
    for size in shape:
        count *= size
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(message.data) != count * itemsize:
        raise InvalidArgument(
            f"{what}: {len(message.data)} bytes do not hold a {message.dtype} tensor of shape {shape}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    flat = torch.frombuffer(bytearray(message.data), dtype=torch.uint8).view(dtype)
    return flat.reshape(shape).to(device)


def layout_to_proto(layout: PoolLayout) -> worker_pb2.KvBlockLayout:
    return worker_pb2.KvBlockLayout(
        kv_block_tokens=layout.kv_block_tokens, num_layers=layout.num_layers, kv_dim=layout.kv_dim
    )


def layout_from_proto(message: worker_pb2.KvBlockLayout) -> PoolLayout:
    """A layout to compare blocks by (``num_pages`` does not travel: it is 0)."""
    return PoolLayout(
        num_pages=0,
        kv_block_tokens=message.kv_block_tokens,
        kv_dim=message.kv_dim,
        num_layers=message.num_layers,
    )


_WIRE_NAMES = {"blocks": "block_ids"}
"""Fields of ``AttendSegment`` and ``KvRows`` whose message field is named otherwise."""
_ID_LISTS = {"blocks", "block_first_positions"}
"""Their fields that travel as lists of integers; the others are tensors."""
_INDEX_TENSORS = {"query_positions", "slots"}
"""Their tensors of indices, which travel as int64 whatever their dtype here."""


def _fields_to_proto(value: AttendSegment[int] | KvRows[int]) -> dict[str, object]:
    """The message fields that carry ``value``."""
    fields: dict[str, object] = {}
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        if field.name in _ID_LISTS:
            item = list(item)
        else:
            item = tensor_to_proto(item.to(torch.int64) if field.name in _INDEX_TENSORS else item)
        fields[_WIRE_NAMES.get(field.name, field.name)] = item
    return fields


def _fields_from_proto(cls: type[D], message: Message, device: torch.device, what: str = "") -> D:
    """The ``cls`` (``AttendSegment`` or ``KvRows``) ``message`` carries; a tensor that does not
    decode is named ``what`` + its field."""
    fields: dict[str, object] = {}
    for field in dataclasses.fields(cls):
        item = getattr(message, _WIRE_NAMES.get(field.name, field.name))
        fields[field.name] = (
            list(item) if field.name in _ID_LISTS else tensor_from_proto(item, what + field.name, device)
        )
    return cls(**fields)


def segment_to_proto(segment: AttendSegment[int]) -> worker_pb2.RemoteAttendSegment:
    return worker_pb2.RemoteAttendSegment(**_fields_to_proto(segment))


def segment_from_proto(message: worker_pb2.RemoteAttendSegment, device: torch.device) -> AttendSegment[int]:
    return _fields_from_proto(AttendSegment, message, device)


def rows_to_proto(rows: KvRows[int], message: type[M] = worker_pb2.KvRows, **others: object) -> M:
    """``rows`` in a ``message``: a ``KvRows``, or a ``WriteKvRequest`` with its ``others``."""
    return message(**_fields_to_proto(rows), **others)


def rows_from_proto(
    message: worker_pb2.KvRows | worker_pb2.WriteKvRequest, device: torch.device, what: str = "write."
) -> KvRows[int]:
    """The rows ``message`` carries (``what``: how its tensors are named in errors)."""
    return _fields_from_proto(KvRows, message, device, what)


def partials_to_proto(partials: Sequence[PartialAttention]) -> worker_pb2.AttendRemoteResponse:
    return worker_pb2.AttendRemoteResponse(
        partials=[
            worker_pb2.RemotePartialAttention(output=tensor_to_proto(p.output), lse=tensor_to_proto(p.lse))
            for p in partials
        ]
    )


def partials_from_proto(
    message: worker_pb2.AttendRemoteResponse, device: torch.device | str = "cpu"
) -> list[PartialAttention]:
    return [
        PartialAttention(
            output=tensor_from_proto(p.output, "output", device), lse=tensor_from_proto(p.lse, "lse", device)
        )
        for p in message.partials
    ]


def answer_attend_remote(
    lending: SharedLender, debtor: str, request: worker_pb2.AttendRemoteRequest, device: torch.device
) -> worker_pb2.AttendRemoteResponse:
    """The creditor's answer to ``request`` for ``debtor`` (whoever carried it: the RPC or the
    lane): its write stored, then its segments attended over."""
    segments = [segment_from_proto(segment, device) for segment in request.segments]
    write = rows_from_proto(request.write, device) if request.HasField("write") else None
    return partials_to_proto(lending.attend(debtor, AttendCall(request.layer, segments, write)))


def apply_write_kv(
    lending: SharedLender, debtor: str, request: worker_pb2.WriteKvRequest, device: torch.device
) -> worker_pb2.WriteKvResponse:
    """``request``'s KV stored for ``debtor`` (the RPC's or the lane's)."""
    lending.write(debtor, request.layer, rows_from_proto(request, device, what=""))
    return worker_pb2.WriteKvResponse()
