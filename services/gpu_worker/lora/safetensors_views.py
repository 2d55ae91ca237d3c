"""The tensors of a safetensors file as views of its bytes, copying nothing.

A fetched adapter's factors are converted into the worker's dtype and gathered into one buffer
(``host_adapter.with_rows``) right after they are read: that conversion is the one copy they
need. ``safetensors.torch.load`` copies every tensor out of the bytes first, and on a 9.8 MB
rank-16 adapter that copy (and its page faults) cost as much as the conversion itself.
"""

from __future__ import annotations

import json
import warnings

import torch
from safetensors.torch import load as load_safetensors

from services.runtime.errors import InvalidArgument

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""The dtypes read in place; a file holding any other is read by ``safetensors`` (copied)."""


def tensor_views(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Every tensor of ``data`` (a safetensors file), read-only views of it where their dtypes
    allow (:data:`DTYPES`): they live as long as ``data`` and must not be written.
    InvalidArgument when ``data`` is not a well-formed safetensors file."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise InvalidArgument("adapter weights: shorter than a safetensors header")
    header_len = int.from_bytes(view[:8], "little")
    start = 8 + header_len
    if start > len(view):
        raise InvalidArgument("adapter weights: the safetensors header runs past the end")
    try:
        header = json.loads(bytes(view[8:start]))
    except ValueError:
        raise InvalidArgument("adapter weights: the safetensors header is not JSON") from None
    header.pop("__metadata__", None)
    if any(entry.get("dtype") not in DTYPES for entry in header.values()):
        return load_safetensors(bytes(view))
    tensors = {}
    with warnings.catch_warnings():
        # Read-only bytes: torch warns that writing to the tensors would be undefined; they are
        # only ever read (converted into the adapter's rows).
        warnings.simplefilter("ignore", UserWarning)
        for name, entry in header.items():
            tensors[name] = _view(view, start, name, entry)
    return tensors


def _view(data: memoryview, start: int, name: str, entry: dict) -> torch.Tensor:
    """Tensor ``name`` of the file ``data``, whose tensors' bytes begin at ``start``."""
    dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
    begin, end = entry["data_offsets"]
    count = 1
    for size in shape:
        count *= size
    if not 0 <= begin <= end <= len(data) - start or end - begin != count * dtype.itemsize:
        raise InvalidArgument(f"adapter weights: tensor {name!r} has bad data offsets")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin).view(shape)
