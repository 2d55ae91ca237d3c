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
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.gpu_worker.kernels import native_build
from services.gpu_worker.kernels.lora_segments import LoraSegments

log = logging.getLogger("loramesh.kernels")

SOURCE = Path(__file__).with_name("cpu_lora.c")
CACHE_DIR = native_build.CACHE_DIR
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


def _build(compiler: str = "cc") -> _Library:
    """Compile (or find in the cache) and load the library; never raises."""
    built = native_build.build_native("cpu_lora", [SOURCE], FLAG_SETS, CACHE_DIR, compiler)
    if built.library is None:
        return _Library(None, built.error, None)
    function = built.library.lora_delta
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p]  # const lora_call *
    return _Library(function, "", built.path)


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
            arrays = seg.shared.get("native_plan")
            if arrays is None:  # the same for every layer of the projection
                arrays = seg.shared["native_plan"] = _plan_arrays(seg)
            plan, token_tensor, scales = arrays
            problem = _Problem(
                out_features=seg.out_features,
                a_offsets=seg.a_offsets.data_ptr(),
                b_offsets=seg.b_offsets.data_ptr(),
                num_groups=scales.numel(),
                plan=plan.data_ptr(),
                tokens=token_tensor.data_ptr(),
                scales=scales.data_ptr(),
            )
            cached = seg.derived["native_plan"] = cls(plan, token_tensor, scales, problem)
        return cached


def _plan_arrays(seg: LoraSegments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``NativePlan``'s plan, tokens and scales: they depend on the segments' structure only."""
    groups = _kernel_groups(seg)
    tokens = [t for _, _, _, group_tokens in groups for t in group_tokens]
    token_starts = [0]
    for _, _, _, group_tokens in groups:
        token_starts.append(token_starts[-1] + len(group_tokens))
    plan = torch.tensor([g[0] for g in groups] + [g[1] for g in groups] + token_starts, dtype=torch.int64)
    return (
        plan,
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor([g[2] for g in groups], dtype=torch.float32),
    )


SPLIT_TOKENS = 8
"""Decode-sized groups (at most ``SPLIT_MAX_TOKENS`` tokens) are handed to the kernel in pieces of
this many tokens: pieces of 3-16 tokens take its register-tile work items, which a single group of
many decode tokens (one adapter for a whole batch) would not."""
SPLIT_MAX_TOKENS = 64


def _kernel_groups(seg: LoraSegments) -> list[tuple[int, int, float, list[int]]]:
    """(rank start, rank end, scale, token rows) of each group the kernel gets. A token's delta is
    computed from its own row and its group's adapter alone, so pieces of a group give each token
    the same delta in fixed-order (batch-invariant) calls, and the same up to rounding otherwise."""
    pieces = []
    for g in seg.groups:
        tokens = [t for start, end in g.token_ranges for t in range(start, end)]
        size = SPLIT_TOKENS if SPLIT_TOKENS < len(tokens) <= SPLIT_MAX_TOKENS else len(tokens)
        pieces += [
            (g.rank_start, g.rank_end, g.scale, tokens[i : i + size]) for i in range(0, len(tokens), size)
        ]
    return pieces


class _Call(ctypes.Structure):
    """Mirror of ``lora_call`` in ``cpu_lora.c``: the arguments of one kernel call."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("x_dtype", ctypes.c_int64),
        ("x_stride", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("pool", ctypes.c_void_p),
        ("pool_dtype", ctypes.c_int64),
        ("problems", ctypes.c_void_p),
        ("num_problems", ctypes.c_int64),
        ("num_threads", ctypes.c_int64),
        ("fixed_order", ctypes.c_int64),
    ]


def _dtype_code(name: str, t: torch.Tensor) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None or not t.is_cpu:
        raise ValueError(f"cpu_native: {name} must be a CPU float32/bfloat16/float16 tensor, got {t.dtype}")
    return code


class NativeCall:
    """The C arguments of one call for a fixed tuple of segments, prepared once and reused by every
    call with those segments (the model makes the same 4 calls per layer in each step of a batch).

    Inside the engine a call's Python side cost ~30 µs, as much as a small kernel call: the
    interpreter runs cold between torch ops. So a call only checks x and the outs and writes their
    pointers into the prepared struct. Not for concurrent calls with the same segments."""

    def __init__(self, segments: tuple[LoraSegments | None, ...], batch_invariant: bool = False):
        """``segments[i]`` adds into the i-th out of each call; None adds nothing (no adapter
        targets that projection). ``batch_invariant``: every token's delta in one fixed order,
        whatever else is in the batch (``fixed_order`` in ``cpu_lora.c``). Raises RuntimeError
        when the kernel is unavailable."""
        function = _load().function
        if function is None:
            raise RuntimeError(f"the native CPU LoRA kernel is unavailable: {native_error()}")
        self.function = function
        present = [seg for seg in segments if seg is not None]
        if not present:
            raise ValueError("cpu_native: a call needs at least one LoraSegments")
        in_features = present[0].in_features
        if any(seg.in_features != in_features for seg in present):
            raise ValueError("cpu_native: every problem of one call must read the same x")
        num_tokens = present[0].num_tokens
        if any(seg.num_tokens != num_tokens for seg in present):
            raise ValueError("cpu_native: every problem of one call must cover the same tokens")
        self.x_shape = (num_tokens, in_features)
        self.active = tuple(
            i for i, seg in enumerate(segments) if seg is not None and seg.group_first_segments
        )
        """Indices of the segments with adapter work; the others add nothing."""
        self._segments = segments
        """Held because the C structs point into their tensors (row offsets, plans): a call must
        not outlive them, whoever else still refers to the segments."""
        self.problems = tuple(NativePlan.of(segments[i]).problem for i in self.active)
        self.out_shapes = tuple((num_tokens, segments[i].out_features) for i in self.active)
        self._pointers = (ctypes.c_void_p * max(len(self.problems), 1))(
            *(ctypes.addressof(problem) for problem in self.problems)
        )
        self.call = _Call(
            in_features=in_features,
            x_stride=in_features,
            num_tokens=num_tokens,
            problems=ctypes.addressof(self._pointers),
            num_problems=len(self.problems),
            fixed_order=int(batch_invariant),
        )
        self.address = ctypes.addressof(self.call)
        self._pool: torch.Tensor | None = None

    def _set_pool(self, pool: torch.Tensor) -> None:
        code = _dtype_code("pool", pool)
        if not pool.is_contiguous():
            raise ValueError("cpu_native: the pool must be one contiguous CPU buffer")
        self.call.pool, self.call.pool_dtype = pool.data_ptr(), code
        self._pool = pool

    def run(self, x: torch.Tensor, outs: Sequence[torch.Tensor], pool: torch.Tensor) -> None:
        """Add the deltas into ``outs`` (one per segment, in order)."""
        if not self.problems:
            return
        if pool is not self._pool:
            self._set_pool(pool)
        x_code = _dtype_code("x", x)
        if x.shape != self.x_shape:
            raise ValueError(f"cpu_native: x must be {list(self.x_shape)}, got {list(x.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        copies = []
        for i, problem, shape in zip(self.active, self.problems, self.out_shapes):
            out = outs[i]
            out_code = _dtype_code("out", out)
            if out.shape != shape:
                raise ValueError(f"cpu_native: out must be {list(shape)}, got {list(out.shape)}")
            # Rows of a wider matrix (q of a fused qkv output) are written where they are.
            target = out if out.stride(1) == 1 or shape[1] == 1 else out.contiguous()
            if target is not out:
                copies.append((out, target))
            problem.out, problem.out_dtype, problem.out_stride = target.data_ptr(), out_code, target.stride(0)
        call = self.call
        call.x, call.x_dtype = x.data_ptr(), x_code
        call.num_threads = torch.get_num_threads()
        if self.function(self.address) != 0:
            raise MemoryError("cpu_native: the kernel could not allocate its scratch buffers")
        for out, target in copies:
            out.copy_(target)


def lora_deltas_cpu_native(
    x: torch.Tensor,
    pool: torch.Tensor,
    problems: Sequence[tuple[LoraSegments, torch.Tensor]],
    batch_invariant: bool = False,
) -> None:
    """:func:`lora_delta_cpu_native` for several (segments, out) pairs that share ``x`` (q, k and
    v of one layer), in one call: one ctypes call and one OpenMP region instead of one each. The
    model's calls reuse a :class:`NativeCall` prepared once per batch instead."""
    if problems:
        NativeCall(tuple(seg for seg, _ in problems), batch_invariant).run(
            x, [out for _, out in problems], pool
        )


def lora_delta_cpu_native(
    x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor, batch_invariant: bool = False
) -> None:
    """Same contract as :func:`~services.gpu_worker.kernels.torch_reference.lora_delta_torch`, on
    CPU tensors of float32/bfloat16/float16; raises RuntimeError when the kernel is unavailable.
    ``batch_invariant``: see :class:`NativeCall`."""
    lora_deltas_cpu_native(x, pool, ((seg, out),), batch_invariant)
