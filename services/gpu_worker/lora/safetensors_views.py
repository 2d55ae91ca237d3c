"""The tensors of a safetensors file as views of its bytes, copying nothing.

A fetched adapter's factors are converted into the worker's dtype and gathered into one buffer
right after they are read (``paired_rows``, or tensor by tensor ``host_adapter.with_rows``):
that conversion is the one copy they need. ``safetensors.torch.load`` copies every tensor out of the bytes first, and on a 9.8 MB
rank-16 adapter that copy (and its page faults) cost as much as the conversion itself.

The file may arrive as the chunks it was fetched in (the store sends 1 MiB messages): each
tensor is then a view of its chunk, and only one that straddles two chunks is copied out (a few
of an adapter's hundreds), so a fetch need not join the chunks into one fresh buffer first (for
9.8 MB, about 5 ms of zeroing and page faults on the worker's event loop).
"""

from __future__ import annotations

import bisect
import itertools
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from services.runtime.errors import InvalidArgument

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""The dtypes read in place; a file holding any other is read by ``safetensors`` (copied)."""

SafetensorsBytes = bytes | bytearray | memoryview | Sequence[bytes]
"""A safetensors file: its bytes, or the chunks it arrived in (a list or tuple of them)."""


class _Pieces:
    """The file's bytes as one or more pieces, read by absolute offsets."""

    def __init__(self, data: SafetensorsBytes):
        chunks = data if isinstance(data, list | tuple) else (data,)
        self.pieces = [memoryview(chunk).cast("B") for chunk in chunks if len(chunk)]
        self.starts = [0, *itertools.accumulate(len(piece) for piece in self.pieces)]
        self.size = self.starts[-1]

    def span(self, begin: int, end: int) -> memoryview:
        """Bytes ``[begin, end)`` (within the file, ``begin < end``): a view of the piece holding
        them, or a copy when they straddle pieces."""
        index = bisect.bisect_right(self.starts, begin) - 1
        offset = self.starts[index]
        if end - offset <= len(self.pieces[index]):
            return self.pieces[index][begin - offset : end - offset]
        parts = []
        while begin < end:
            piece_end = min(end, self.starts[index + 1])
            parts.append(self.pieces[index][begin - self.starts[index] : piece_end - self.starts[index]])
            begin, index = piece_end, index + 1
        return memoryview(b"".join(parts))

    def whole(self) -> bytes:
        return b"".join(self.pieces)


@dataclass(frozen=True)
class SafetensorsFile:
    """A safetensors file's header, read; its tensors' bytes are not."""

    pieces: _Pieces
    start: int
    """Where the tensors' bytes begin in the file (after the header)."""
    header: dict[str, dict]
    """Each tensor's header entry (``dtype``, ``shape``, ``data_offsets``), metadata left out."""

    def view(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (its dtype among :data:`DTYPES`): a read-only view of the bytes, or a
        copy when they straddle pieces."""
        return _view(self.pieces, self.start, name, self.header[name])

    def data_pieces(self, end: int) -> list[memoryview]:
        """The tensors' bytes ``[0, end)`` (counted from :attr:`start`, within the file) as views
        of the pieces they lie in, in order."""
        begin, end = self.start, self.start + end
        spans = []
        for piece, piece_start in zip(self.pieces.pieces, self.pieces.starts):
            lo, hi = max(begin, piece_start), min(end, piece_start + len(piece))
            if lo < hi:
                spans.append(piece[lo - piece_start : hi - piece_start])
        return spans


def read_header(data: SafetensorsBytes) -> SafetensorsFile:
    """``data``'s header (a safetensors file, whole or in chunks). InvalidArgument when it is not
    a well-formed one."""
    pieces = _Pieces(data)
    if pieces.size < 8:
        raise InvalidArgument("adapter weights: shorter than a safetensors header")
    header_len = int.from_bytes(pieces.span(0, 8), "little")
    start = 8 + header_len
    if start > pieces.size:
        raise InvalidArgument("adapter weights: the safetensors header runs past the end")
    try:
        header = json.loads(bytes(pieces.span(8, start)) if header_len else b"")
    except ValueError:
        raise InvalidArgument("adapter weights: the safetensors header is not JSON") from None
    header.pop("__metadata__", None)
    return SafetensorsFile(pieces, start, header)


def tensor_views(data: SafetensorsBytes) -> dict[str, torch.Tensor]:
    """Every tensor of ``data`` (a safetensors file, whole or in chunks), read-only views of it
    where their dtypes allow (:data:`DTYPES`): they live as long as ``data`` and must not be
    written. InvalidArgument when ``data`` is not a well-formed safetensors file."""
    file = read_header(data)
    if any(entry.get("dtype") not in DTYPES for entry in file.header.values()):
        return load_safetensors(file.pieces.whole())
    with warnings.catch_warnings():
        # Read-only bytes: torch warns that writing to the tensors would be undefined; they are
        # only ever read (converted into the adapter's rows).
        warnings.simplefilter("ignore", UserWarning)
        return {name: file.view(name) for name in file.header}


def _view(pieces: _Pieces, start: int, name: str, entry: dict) -> torch.Tensor:
    """Tensor ``name`` of the file, whose tensors' bytes begin at ``start``."""
    dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
    begin, end = entry["data_offsets"]
    count = 1
    for size in shape:
        count *= size
    if not 0 <= begin <= end <= pieces.size - start or end - begin != count * dtype.itemsize:
        raise InvalidArgument(f"adapter weights: tensor {name!r} has bad data offsets")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(pieces.span(start + begin, start + end), dtype=dtype, count=count).view(shape)
