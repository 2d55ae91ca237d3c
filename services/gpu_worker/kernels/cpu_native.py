"""The native CPU LoRA kernel (``cpu_lora.c``): built with the system C compiler at first use.

The torch path issues several torch calls per adapter group, layer and projection; on a 2-core
CPU that call overhead, not the bytes of the adapters, bounded the decode step (issue 3). This
backend does the whole (layer, projection) in one call: the C source is compiled once per
source/compiler/CPU into ``~/.cache/loramesh/kernels/`` (``cc -O3 -march=native -fopenmp``, which
takes about a second; without ``-fopenmp`` when that fails) and loaded with ``ctypes``, so no torch
C++ extension toolchain is involved. When no compiler works, :func:`native_error` says why and
the dispatcher keeps using the torch path.

OpenMP: the library links ``libgomp.so.1`` by soname; torch (imported first) has already loaded
its own copy under that soname, so the kernel and torch share one thread pool instead of two
pools spinning against each other on few cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.gpu_worker.kernels.lora_segments import LoraSegments

log = logging.getLogger("loramesh.kernels")

SOURCE = Path(__file__).with_name("cpu_lora.c")
CACHE_DIR = Path.home() / ".cache" / "loramesh" / "kernels"
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"),
    ("-O3", "-march=native", "-shared", "-fPIC"),
)
"""Compiler flags tried in order: with OpenMP, then single-threaded."""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Storage dtypes the kernel reads and writes, with the codes ``cpu_lora.c`` uses."""


@dataclass(frozen=True)
class _Library:
    """The loaded kernel, or why there is none."""

    function: ctypes._CFuncPtr | None
    """``lora_delta`` from the compiled library; None when it could not be built."""
    error: str
    """Why the build failed (compiler output, shortened); empty when it worked."""
    path: Path | None
    """The shared library loaded."""


_lock = threading.Lock()
_library: _Library | None = None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(wanted)


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=30)
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else ""


def _build(compiler: str = "cc") -> _Library:
    """Compile (or find in the cache) and load the library; never raises."""
    try:
        source = SOURCE.read_bytes()
        version = _compiler_version(compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        return _Library(None, f"no usable C compiler {compiler!r}: {exc}", None)
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(
            b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_signature().encode()])
        ).hexdigest()[:24]
        path = CACHE_DIR / f"cpu_lora-{key}.so"
        if not path.exists():
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            # Build under a temporary name, then rename: concurrent processes never load a half file.
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=CACHE_DIR)
            os.close(fd)
            result = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", tmp],
                check=False,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{compiler} {' '.join(flags)}: {result.stderr.strip()[-400:]}")
                continue
            os.replace(tmp, path)
        try:
            function = ctypes.CDLL(str(path)).lora_delta
        except OSError as exc:
            errors.append(f"loading {path}: {exc}")
            continue
        function.restype = ctypes.c_int
        function.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # x, dtype, stride, rows, in
            ctypes.c_void_p, ctypes.c_int,  # pool, dtype
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int,  # problems (lora_problem *[]), count, threads
        ]  # fmt: skip
        return _Library(function, "", path)
    return _Library(None, "; ".join(errors), None)


def _load() -> _Library:
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                _library = _build()
                if _library.function is None:
                    log.warning(
                        "native CPU LoRA kernel unavailable, using the torch path: %s", _library.error
                    )
    return _library


def native_available() -> bool:
    """Whether the kernel compiled and loaded (compiles it on the first call)."""
    return _load().function is not None


def native_error() -> str:
    """Why the kernel is unavailable (empty when it is available)."""
    return _load().error


class _Problem(ctypes.Structure):
    """Mirror of ``lora_problem`` in ``cpu_lora.c``: one (segments, out) pair of a call."""

    _fields_ = [
        ("out", ctypes.c_void_p),
        ("out_dtype", ctypes.c_int64),
        ("out_stride", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("a_offsets", ctypes.c_void_p),
        ("b_offsets", ctypes.c_void_p),
        ("num_groups", ctypes.c_int64),
        ("plan", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class NativePlan:
    """A batch's groups as the flat arrays ``cpu_lora.c`` reads; built once per LoraSegments."""

    plan: torch.Tensor
    """int64 [3G+1]: rank-row start of each group, then rank-row ends, then token-list starts (G+1)."""
    tokens: torch.Tensor
    """int64: token rows of group 0, then of group 1, ... (a group's segments need not be adjacent)."""
    scales: torch.Tensor
    """float32 [G]: the scale of each group."""
    problem: _Problem
    """The C view of these arrays and of the segments' offsets; a call fills in its ``out``."""

    @property
    def num_groups(self) -> int:
        return self.scales.numel()

    @classmethod
    def of(cls, seg: LoraSegments) -> NativePlan:
        cached = seg.derived.get("native_plan")
        if cached is None:
            if seg.a_offsets.device.type != "cpu":
                raise ValueError("cpu_native: the segments' row offsets must be CPU tensors")
            groups = seg.groups
            tokens = [t for g in groups for start, end in g.token_ranges for t in range(start, end)]
            token_starts = [0]
            for g in groups:
                token_starts.append(token_starts[-1] + sum(end - start for start, end in g.token_ranges))
            plan = torch.tensor(
                [g.rank_start for g in groups] + [g.rank_end for g in groups] + token_starts,
                dtype=torch.int64,
            )
            token_tensor = torch.tensor(tokens, dtype=torch.int64)
            scales = torch.tensor([g.scale for g in groups], dtype=torch.float32)
            problem = _Problem(
                out_features=seg.out_features,
                a_offsets=seg.a_offsets.data_ptr(),
                b_offsets=seg.b_offsets.data_ptr(),
                num_groups=len(groups),
                plan=plan.data_ptr(),
                tokens=token_tensor.data_ptr(),
                scales=scales.data_ptr(),
            )
            cached = seg.derived["native_plan"] = cls(plan, token_tensor, scales, problem)
        return cached


def _dtype_code(name: str, t: torch.Tensor) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None or not t.is_cpu:
        raise ValueError(f"cpu_native: {name} must be a CPU float32/bfloat16/float16 tensor, got {t.dtype}")
    return code


def lora_deltas_cpu_native(
    x: torch.Tensor, pool: torch.Tensor, problems: Sequence[tuple[LoraSegments, torch.Tensor]]
) -> None:
    """:func:`lora_delta_cpu_native` for several (segments, out) pairs that share ``x`` (q, k and
    v of one layer), in one call: one ctypes call and one OpenMP region instead of one each.

    It runs once per layer and projection group of every step, so it is kept lean: checks that
    depend only on the segments are made once, in :meth:`NativePlan.of`. Not for concurrent calls
    with the same segments: a call writes its ``out`` into the segments' cached C struct."""
    function = _load().function
    if function is None:
        raise RuntimeError(f"the native CPU LoRA kernel is unavailable: {native_error()}")
    if not problems:
        return
    x_code, pool_code = _dtype_code("x", x), _dtype_code("pool", pool)
    if not pool.is_contiguous():
        raise ValueError("cpu_native: the pool must be one contiguous CPU buffer")
    in_features = problems[0][0].in_features
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"cpu_native: x must be [tokens, {in_features}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    pointers = (ctypes.c_void_p * len(problems))()
    count, copies = 0, []
    for seg, out in problems:
        if seg.in_features != in_features:
            raise ValueError("cpu_native: every problem of one call must read the same x")
        if not seg.groups:
            continue
        out_code = _dtype_code("out", out)
        target = out if out.stride(-1) == 1 else out.contiguous()
        if target is not out:
            copies.append((out, target))
        problem = NativePlan.of(seg).problem
        problem.out, problem.out_dtype, problem.out_stride = target.data_ptr(), out_code, target.stride(0)
        pointers[count] = ctypes.addressof(problem)
        count += 1
    if count == 0:
        return
    status = function(
        x.data_ptr(), x_code, x.stride(0), x.shape[0], in_features,
        pool.data_ptr(), pool_code, pointers, count, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("cpu_native: the kernel could not allocate its scratch buffers")
    for out, target in copies:
        out.copy_(target)


def lora_delta_cpu_native(x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor) -> None:
    """Same contract as :func:`~services.gpu_worker.kernels.torch_reference.lora_delta_torch`, on
    CPU tensors of float32/bfloat16/float16; raises RuntimeError when the kernel is unavailable."""
    lora_deltas_cpu_native(x, pool, ((seg, out),))
