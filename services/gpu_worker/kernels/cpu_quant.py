"""The quantized-weight CPU kernels (``cpu_quant_matmul.c``): base matmuls over GGUF Q4_1/Q8_0
blocks, built with the system C compiler at first use like the other native kernels
(``native_build``, ``-march=native``: the AVX-512 path on CPUs that have it, else AVX2;
``kernels().isa`` says which) and loaded with ``ctypes``.

Same numerics contract as the batch-invariant kernels (``cpu_invariant.h``, ``-ffp-contract=off``):
each output is one dot product in one fixed order, so quantized serving is batch-invariant too.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from services.gpu_worker.kernels import native_build
from services.gpu_worker.kernels.cpu_invariant import HEADER, PreparedCall, call_struct, linear_call

log = logging.getLogger("loramesh.kernels")

SOURCE = Path(__file__).with_name("cpu_quant_matmul.c")
FLAG_SETS = (
    ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"),
    ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"),
)
"""Compiler flags tried in order: with OpenMP, then single-threaded."""
FORMAT_CODES = {"q4_1": 0, "q8_0": 1}
"""Block formats the kernels read, with the codes ``cpu_quant_matmul.c`` uses."""

_QuantLinearCall = call_struct(
    "_QuantLinearCall",
    "x:p x_dtype:i x_stride:i rows:i in_features:i w:p format:i out_features:i bias:p bias_dtype:i "
    "y:p y_dtype:i y_stride:i num_threads:i",
)
_QuantRowsCall = call_struct("_QuantRowsCall", "w:p format:i in_features:i indices:p count:i out:p")

ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}
"""Vector paths that can be asked for: the CPU's best (``native``), or AVX2 on an AVX-512 CPU
(tests run both paths on one machine)."""


class QuantKernels:
    """One build of the kernels: compiled (or found in the cache) and loaded; never raises.

    ``source``: another version of ``cpu_quant_matmul.c`` (benchmarks compare builds; it
    includes this directory's ``cpu_invariant.h``).
    """

    def __init__(self, isa: str = "native", source: Path = SOURCE):
        extra = ISA_FLAGS[isa]
        if source != SOURCE:
            extra = (*extra, f"-I{HEADER.parent}")
        flag_sets = [(*flags[:2], *extra, *flags[2:]) for flags in FLAG_SETS]
        self._build = native_build.build_native(
            f"cpu_quant_{isa}", [source], flag_sets, native_build.CACHE_DIR, headers=(HEADER,)
        )
        library = self._build.library
        if library is None:
            log.warning("quantized CPU kernels (%s) unavailable: %s", isa, self._build.error)
            return
        for name in ("quant_linear", "quant_rows"):
            function = getattr(library, name)
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_void_p]
        library.quant_isa.restype = ctypes.c_char_p

    @property
    def available(self) -> bool:
        return self._build.library is not None

    @property
    def error(self) -> str:
        """Why the kernels are unavailable (empty when they are available)."""
        return self._build.error

    @property
    def isa(self) -> str:
        """The vector path this build runs: ``avx512`` or ``avx2``."""
        return self._lib().quant_isa().decode()

    def _lib(self) -> ctypes.CDLL:
        if self._build.library is None:
            raise RuntimeError(f"the quantized CPU kernels are unavailable: {self.error}")
        return self._build.library

    def run(self, function_name: str, call: ctypes.Structure) -> None:
        self.check(function_name, getattr(self._lib(), function_name)(ctypes.byref(call)))

    def prepared(self, function_name: str, call: ctypes.Structure) -> PreparedCall:
        return PreparedCall(self._lib(), function_name, call, self.check)

    @staticmethod
    def check(function_name: str, status: int) -> None:
        if status == -1:
            raise MemoryError(f"cpu_quant: {function_name} could not allocate its scratch")
        if status == -2:
            raise ValueError(f"cpu_quant: {function_name} needs in_features to be a multiple of 32")


_lock = threading.Lock()
_kernels: dict[str, QuantKernels] = {}


def kernels(isa: str = "native") -> QuantKernels:
    """The build for ``isa`` (compiled on first use)."""
    with _lock:
        if isa not in _kernels:
            _kernels[isa] = QuantKernels(isa)
        return _kernels[isa]


@contextmanager
def using(build: QuantKernels, isa: str = "native") -> Iterator[None]:
    """Calls prepared inside run ``build`` in place of ``isa``'s own (a prepared call keeps the
    build it was prepared with)."""
    own = kernels(isa)
    with _lock:
        _kernels[isa] = build
    try:
        yield
    finally:
        with _lock:
            _kernels[isa] = own


def _blocks(blocks: torch.Tensor, rows: int) -> int:
    if (
        blocks.dtype != torch.uint8
        or not blocks.is_cpu
        or not blocks.is_contiguous()
        or blocks.shape[0] != rows
    ):
        raise ValueError(f"cpu_quant: weight blocks must be a contiguous CPU uint8 tensor of {rows} rows")
    return blocks.data_ptr()


def prepare_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    format: str,
    out_features: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    isa: str = "native",
) -> PreparedCall:
    """``out = x @ dequant(W)^T (+ bias)``, checked and prepared (``.run()`` computes it): ``x``
    [M, K] float, ``blocks`` the [N, K/32 * block bytes] uint8 rows of W in ``format``, ``out``
    [M, N]; math in fp32. Fields ``x``, ``w``, ``bias``, ``y`` take another weight of the same
    shape and format, other tensors like these."""
    weight = _blocks(blocks, out_features)
    call = linear_call(_QuantLinearCall, x, x.shape[1], weight, FORMAT_CODES[format], out_features, bias, out)
    return kernels(isa).prepared("quant_linear", call)


def rows(
    blocks: torch.Tensor, format: str, in_features: int, indices: torch.Tensor, isa: str = "native"
) -> torch.Tensor:
    """The fp32 rows ``indices`` of W (an embedding lookup)."""
    indices = indices.to(torch.int64).contiguous()
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= blocks.shape[0]):
        raise IndexError(f"cpu_quant: row index outside [0, {blocks.shape[0]})")
    out = torch.empty(indices.numel(), in_features, dtype=torch.float32)
    call = _QuantRowsCall(
        _blocks(blocks, blocks.shape[0]), FORMAT_CODES[format], in_features, indices.data_ptr(),
        indices.numel(), out.data_ptr(),
    )  # fmt: skip
    kernels(isa).run("quant_rows", call)
    return out
