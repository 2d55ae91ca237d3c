"""A PEFT safetensors file converted into an adapter's rows in a few whole-buffer operations.

PEFT's files (``safetensors`` writes tensors sorted by name) hold each projection's ``lora_A``
and then its ``lora_B``, back to back, in one dtype. That is already :attr:`HostAdapter.rows`'s
layout, module after module in the file's order, except that the rows hold ``Bᵀ`` where the
file holds ``B`` (the same number of elements). So the rows are the file's bytes converted in
one operation per piece they arrived in; then each run of one projection's ``B``s, evenly spaced
layer after layer, is written over transposed from the file's bytes in one operation. A copy per
tensor instead (420 for a rank-16 adapter on all seven projections of 30 layers) took most of a
9.8 MB adapter's parse (``bench/host_adapter_parse_ab.py``).
"""

from __future__ import annotations

import bisect
import functools
import warnings
from dataclasses import dataclass

import torch

from services.gpu_worker.lora.safetensors_views import DTYPES, SafetensorsBytes, SafetensorsFile, read_header
from services.model_files.peft_format import parse_tensor_name

ModuleKey = tuple[int, str]

_parsed_name = functools.lru_cache(maxsize=4096)(parse_tensor_name)
"""Every version of an adapter names the same tensors: each name is parsed once."""


@dataclass(frozen=True)
class PairedRows:
    """The rows and what lies where in them."""

    rows: torch.Tensor
    """1-D: each module's A (``r × in``) then Bᵀ (``r × out``), module after module."""
    modules: list[tuple[ModuleKey, torch.Size, torch.Size]]
    """Each module's key, A shape and Bᵀ shape, in the rows' order."""


def paired_rows(data: SafetensorsBytes, dtype: torch.dtype, narrow: bool = False) -> PairedRows | None:
    """``data``'s factors as rows for a pool of ``dtype`` (``narrow``: in :func:`host_dtype` of
    the file's); None when the file is not laid out as back-to-back (A, B) pairs of one dtype
    (read it tensor by tensor then). InvalidArgument when ``data`` is not a well-formed
    safetensors file."""
    file = read_header(data)
    try:
        entries = sorted(file.header.items(), key=lambda item: item[1]["data_offsets"][0])
    except (TypeError, KeyError, IndexError):
        return None  # a malformed entry: refused, naming it, tensor by tensor
    modules = _pairs(entries)
    if modules is None:
        return None
    source = DTYPES[entries[0][1]["dtype"]]
    end = entries[-1][1]["data_offsets"][1]
    if file.start + end > file.pieces.size:
        return None  # cut short: refused, naming the tensor, tensor by tensor
    pieces = file.data_pieces(end)
    if any(len(piece) % source.itemsize for piece in pieces):
        return None  # an element straddles two pieces
    rows = torch.empty(end // source.itemsize, dtype=host_dtype(source, dtype) if narrow else dtype)
    sources, offset = [], 0  # (first element, the piece's elements)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only bytes, only read
        for piece in pieces:
            elements = torch.frombuffer(piece, dtype=source)
            rows[offset : offset + elements.numel()].copy_(elements)
            sources.append((offset, elements))
            offset += elements.numel()
        for projection_run in _b_runs(modules):
            _transpose_run(rows, projection_run, sources, file, source)
    return PairedRows(rows, modules)


def host_dtype(source: torch.dtype, pool: torch.dtype) -> torch.dtype:
    """The dtype a host copy keeps factors of ``source`` in for a pool of ``pool``: ``source``
    when the page-in's conversion into ``pool`` is exact and it takes less memory (float16 or
    bfloat16 for a float32 pool), else ``pool`` (converted at the parse, once). A float32 worker's
    host copy of a float16 adapter is then half the bytes, its parse writes half as much fresh
    memory (page faults included) and its page-in copy reads half as much (the same bits reach
    the pool: the conversion to float32 is exact wherever it happens). For a pool in host memory
    only: a GPU's copy from page-locked memory would convert through a temporary on the host."""
    if pool == torch.float32 and source in (torch.float16, torch.bfloat16):
        return source
    return pool


def _pairs(entries: list[tuple[str, dict]]) -> list[tuple[ModuleKey, torch.Size, torch.Size]] | None:
    """Each module's (key, A shape, Bᵀ shape) when ``entries`` (in the order of their bytes) are
    (A, B) pairs of one module each, 2-D, of one dtype among :data:`DTYPES`, their bytes back to
    back from the first; else None."""
    if not entries or len(entries) % 2:
        return None
    dtype = entries[0][1].get("dtype")
    if dtype not in DTYPES:
        return None
    itemsize, position, modules = DTYPES[dtype].itemsize, 0, []
    for (a_name, a_entry), (b_name, b_entry) in zip(entries[::2], entries[1::2]):
        a_key, b_key = _parsed_name(a_name), _parsed_name(b_name)
        if a_key is None or b_key is None or a_key[:2] != b_key[:2] or (a_key[2], b_key[2]) != ("A", "B"):
            return None
        shapes = []
        for entry in (a_entry, b_entry):
            shape = entry.get("shape")
            if entry.get("dtype") != dtype or not isinstance(shape, list) or len(shape) != 2:
                return None
            if not all(isinstance(size, int) and size > 0 for size in shape):
                return None
            if entry.get("data_offsets") != [position, position + shape[0] * shape[1] * itemsize]:
                return None
            position = entry["data_offsets"][1]
            shapes.append(shape)
        (rank, _), (out_features, b_rank) = shapes
        if rank != b_rank:
            return None
        modules.append((a_key[:2], torch.Size(shapes[0]), torch.Size((rank, out_features))))
    return modules


def _b_runs(
    modules: list[tuple[ModuleKey, torch.Size, torch.Size]],
) -> list[tuple[torch.Size, int, int, int]]:
    """Where the modules' Bs lie in the rows, as runs of one projection's Bs evenly spaced
    (layer after layer): ``(Bᵀ shape, first element, spacing, count)``."""
    runs: dict[tuple[str, torch.Size], list[list[int]]] = {}  # -> [[first, spacing, count], ...]
    offset = 0
    for (_, projection), a_shape, b_shape in modules:
        offset += a_shape.numel()
        its_runs = runs.setdefault((projection, b_shape), [])
        run = its_runs[-1] if its_runs else None
        if run is not None and run[2] == 1:
            run[1], run[2] = offset - run[0], 2
        elif run is not None and offset == run[0] + run[1] * run[2]:
            run[2] += 1
        else:
            its_runs.append([offset, b_shape.numel(), 1])
        offset += b_shape.numel()
    return [(b_shape, *run) for (_, b_shape), its_runs in runs.items() for run in its_runs]


def _transpose_run(
    rows: torch.Tensor,
    run: tuple[torch.Size, int, int, int],
    sources: list[tuple[int, torch.Tensor]],
    file: SafetensorsFile,
    dtype: torch.dtype,
) -> None:
    """Write Bᵀ over each B of ``run`` in ``rows``, from the file's elements (``sources``: each
    piece's first element and elements): one operation for the Bs within one piece (read
    transposed from float16 they cost a third of what they do from the rows' float32), one for
    each B that straddles two pieces."""
    (rank, out_features), first, spacing, count = run
    numel, index = rank * out_features, 0
    while index < count:
        begin = first + index * spacing
        piece = bisect.bisect_right(sources, begin, key=lambda source: source[0]) - 1
        piece_first, elements = sources[piece]
        fits = (piece_first + elements.numel() - begin - numel) // spacing + 1
        if fits < 1:  # straddles: its bytes joined
            size = dtype.itemsize
            joined = file.pieces.span(file.start + begin * size, file.start + (begin + numel) * size)
            b = torch.frombuffer(joined, dtype=dtype).view(1, out_features, rank)
            fits = 1
        else:
            fits = min(fits, count - index)
            b = elements.as_strided((fits, out_features, rank), (spacing, rank, 1), begin - piece_first)
        rows.as_strided((fits, rank, out_features), (spacing, out_features, 1), begin).copy_(
            b.transpose(1, 2)
        )
        index += fits
