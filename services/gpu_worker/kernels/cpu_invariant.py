"""The batch-invariant CPU kernels (``cpu_invariant_*.c``), built with the system C compiler at
first use like the LoRA kernel (``native_build``), loaded with ``ctypes``.

Deterministic serving runs the model's base matmuls, RMSNorm, SwiGLU activation and attention
through these instead of torch: each value is computed by one fixed sequence of operations that
depends only on its own inputs (see ``cpu_invariant.h``), so a request's logits do not depend on
what else is in its batch, nor on whether its KV came from prefill or decode. Compiled with
``-ffp-contract=off`` so that no expression is fused differently in two places.

Calls check what the C code indexes by hand (devices, dtypes, shapes, unit strides) and pass
pointers; a call's Python side is a few microseconds (the model makes ~250 a step).
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from pathlib import Path

import torch

from services.gpu_worker.kernels import native_build

log = logging.getLogger("loramesh.kernels")

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_invariant_matmul.c", "cpu_invariant_attention.c", "cpu_invariant_rowwise.c")
)
HEADER = Path(__file__).with_name("cpu_invariant.h")
FLAG_SETS = (
    ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"),
    ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"),
)
"""Compiler flags tried in order: with OpenMP, then single-threaded."""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Dtypes the kernels read and write, with the codes ``cpu_invariant.h`` uses."""

_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double


def call_struct(name: str, fields: str) -> type[ctypes.Structure]:
    """A ctypes mirror of a C call struct: ``fields`` as "name:type ..." (p pointer, i int64, d double)."""
    kinds = {"p": _PTR, "i": _I64, "d": _F64}
    return type(
        name,
        (ctypes.Structure,),
        {"_fields_": [(f.split(":")[0], kinds[f.split(":")[1]]) for f in fields.split()]},
    )


_LinearCall = call_struct(
    "_LinearCall",
    "x:p x_dtype:i x_stride:i rows:i in_features:i w:p w_dtype:i out_features:i bias:p bias_dtype:i "
    "y:p y_dtype:i y_stride:i num_threads:i",
)
_AttentionCall = call_struct(
    "_AttentionCall",
    "q:p q_dtype:i q_stride:i out:p out_dtype:i out_stride:i pool:p pool_dtype:i num_heads:i "
    "num_kv_heads:i head_dim:i block_tokens:i num_rows:i rows:p positions:p tables:p table_stride:i "
    "table_of_row:p scale:d num_threads:i",
)
_PartialsCall = call_struct(
    "_PartialsCall",
    "q:p q_dtype:i num_queries:i positions:p pool:p pool_dtype:i num_heads:i num_kv_heads:i head_dim:i "
    "block_tokens:i num_blocks:i key_blocks:p first_positions:p out:p lse:p scale:d num_threads:i",
)
_CombineCall = call_struct(
    "_CombineCall",
    "partials:p lse:p num_queries:i num_blocks:i num_heads:i head_dim:i out:p out_lse:p num_threads:i",
)
_RmsNormCall = call_struct(
    "_RmsNormCall",
    "x:p x_dtype:i x_stride:i weight:p weight_dtype:i y:p y_dtype:i y_stride:i rows:i width:i eps:d "
    "num_threads:i",
)
_SiluMulCall = call_struct(
    "_SiluMulCall", "gate:p up:p stride:i y:p y_stride:i dtype:i rows:i width:i num_threads:i"
)
_AddRmsNormCall = call_struct(
    "_AddRmsNormCall",
    "x:p x_stride:i delta:p delta_stride:i dtype:i weight:p weight_dtype:i y:p y_stride:i rows:i width:i "
    "eps:d num_threads:i",
)
_RopeKvCall = call_struct(
    "_RopeKvCall",
    "qkv:p qkv_stride:i dtype:i rows:i positions:p cos:p sin:p num_heads:i num_kv_heads:i head_dim:i "
    "q_out:p kv:p kv_dtype:i key_rows:p value_rows:p num_threads:i",
)

_lock = threading.Lock()
_build: native_build.NativeBuild | None = None


def _library() -> ctypes.CDLL | None:
    global _build
    if _build is None:
        with _lock:
            if _build is None:
                _build = native_build.build_native(
                    "cpu_invariant", SOURCES, FLAG_SETS, native_build.CACHE_DIR, headers=(HEADER,)
                )
                if _build.library is None:
                    log.warning("batch-invariant CPU kernels unavailable: %s", _build.error)
                else:
                    for name in (
                        "invariant_linear",
                        "invariant_attention",
                        "invariant_block_partials",
                        "invariant_combine_partials",
                        "invariant_rms_norm",
                        "invariant_silu_mul",
                        "invariant_add_rms_norm",
                        "invariant_rope_kv",
                    ):
                        function = getattr(_build.library, name)
                        function.restype = ctypes.c_int
                        function.argtypes = [ctypes.c_void_p]
    return _build.library


def invariant_available() -> bool:
    """Whether the kernels compiled and loaded (compiles them on the first call)."""
    return _library() is not None


def invariant_error() -> str:
    """Why the kernels are unavailable (empty when they are available)."""
    _library()
    return _build.error


def _lib() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError(f"the batch-invariant CPU kernels are unavailable: {invariant_error()}")
    return library


def dtype_code(name: str, t: torch.Tensor) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None or not t.is_cpu:
        raise ValueError(
            f"cpu_invariant: {name} must be a CPU float32/bfloat16/float16 tensor, got {t.dtype}"
        )
    return code


def row_stride(name: str, t: torch.Tensor, width: int) -> int:
    """The row stride of a 2-D ``t`` of ``width`` columns with unit column stride."""
    if t.dim() != 2 or t.shape[1] != width or (t.stride(1) != 1 and t.shape[1] > 1):
        raise ValueError(f"cpu_invariant: {name} must be [rows, {width}] with unit column stride")
    return t.stride(0)


def _index(name: str, t: torch.Tensor) -> int:
    if t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"cpu_invariant: {name} must be a contiguous CPU int64 tensor")
    return t.data_ptr()


def _check_status(function_name: str, status: int) -> None:
    if status == -1:
        raise MemoryError(f"cpu_invariant: {function_name} could not allocate its scratch")
    if status == -2:
        raise ValueError(f"cpu_invariant: {function_name} does not handle this shape (head_dim % 8, group)")


def _run(function_name: str, call: ctypes.Structure) -> None:
    _check_status(function_name, getattr(_lib(), function_name)(ctypes.byref(call)))


class PreparedCall:
    """A kernel call checked and filled once, then run many times with new pointers.

    The model makes the same calls in each of its layers, only the tensors changing (a layer's
    weights, a fresh output): a checked call's Python side costs ~10 µs, as much as the kernel at
    batch 1, and ~270 of them run per step. :meth:`run` only sets the fields it is given. The
    caller keeps every tensor it passes alive and of the shape and dtype the call was prepared for.
    """

    __slots__ = ("_address", "_check", "_function", "_name", "call")

    def __init__(self, library: ctypes.CDLL, function_name: str, call: ctypes.Structure, check=None):
        self.call = call
        self._function = getattr(library, function_name)
        self._address = ctypes.addressof(call)
        self._name = function_name
        self._check = check or _check_status

    def run(self, **fields: int) -> None:
        """Set ``fields`` (pointers: ``tensor.data_ptr()``) and run the kernel."""
        call = self.call
        for name, value in fields.items():
            setattr(call, name, value)
        status = self._function(self._address)
        if status:
            self._check(self._name, status)


def prepared(function_name: str, call: ctypes.Structure) -> PreparedCall:
    """``call`` to ``function_name`` of these kernels, as a :class:`PreparedCall`."""
    return PreparedCall(_lib(), function_name, call)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = x @ weight^T (+ bias)``: ``x`` [M, K], ``weight`` [N, K] contiguous (any dtype the
    kernels read), ``out`` [M, N]; each value in one fixed order, math in fp32."""
    n, k = weight.shape
    if not weight.is_contiguous():
        raise ValueError("cpu_invariant: the weight must be contiguous")
    call = linear_call(_LinearCall, x, k, weight.data_ptr(), dtype_code("weight", weight), n, bias, out)
    _run("invariant_linear", call)


def linear_call(
    struct: type[ctypes.Structure],
    x: torch.Tensor,
    in_features: int,
    weight: int,
    weight_code: int,
    out_features: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> ctypes.Structure:
    """A call to a kernel computing ``out = x @ W^T (+ bias)`` whose struct is laid out as
    ``_LinearCall`` (x, W, bias, out): ``x`` [M, in_features], ``bias`` and ``out`` [M,
    out_features] checked here; W, the pointer ``weight`` with ``weight_code`` (its dtype or
    block-format code), checked by the caller."""
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"cpu_invariant: x has {x.shape[0]} rows, out {out.shape[0]}")
    if bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()):
        raise ValueError(f"cpu_invariant: bias must be a contiguous [{out_features}]")
    return struct(
        x.data_ptr(), dtype_code("x", x), row_stride("x", x, in_features), x.shape[0], in_features,
        weight, weight_code, out_features,
        None if bias is None else bias.data_ptr(), 0 if bias is None else dtype_code("bias", bias),
        out.data_ptr(), dtype_code("out", out), row_stride("out", out, out_features), torch.get_num_threads(),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``out = round(x * rsqrt(mean(x^2) + eps)) * round(weight)`` row by row, rounded to
    ``out``'s dtype (``round``: to that dtype), as HF's LlamaRMSNorm computes it."""
    prepare_rms_norm(x, weight, eps, out).run()


def prepare_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> PreparedCall:
    """:func:`rms_norm` checked and prepared (fields ``x``, ``weight``, ``y``)."""
    width = x.shape[1]
    if weight.shape != (width,) or not weight.is_contiguous() or out.shape != x.shape:
        raise ValueError(
            f"cpu_invariant: rms_norm of x {list(x.shape)} needs weight [{width}] and out like x"
        )
    call = _RmsNormCall(
        x.data_ptr(), dtype_code("x", x), row_stride("x", x, width), weight.data_ptr(), dtype_code("weight", weight),
        out.data_ptr(), dtype_code("out", out), row_stride("out", out, width), x.shape[0], width, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return prepared("invariant_rms_norm", call)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """``out = round(silu(gate)) * up``, all three [M, I] of one dtype, ``gate``/``up`` sharing a
    row stride (the halves of one gate_up matmul)."""
    prepare_silu_mul(gate, up, out).run()


def prepare_silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> PreparedCall:
    """:func:`silu_mul` checked and prepared (fields ``gate``, ``up``, ``y``)."""
    width = gate.shape[1]
    stride = row_stride("gate", gate, width)
    if up.shape != gate.shape or row_stride("up", up, width) != stride or out.shape != gate.shape:
        raise ValueError(
            "cpu_invariant: silu_mul needs gate, up and out of one shape, gate and up one stride"
        )
    if not gate.dtype == up.dtype == out.dtype:
        raise ValueError("cpu_invariant: silu_mul needs gate, up and out of one dtype")
    call = _SiluMulCall(
        gate.data_ptr(), up.data_ptr(), stride, out.data_ptr(), row_stride("out", out, width), dtype_code("out", out),
        gate.shape[0], width, torch.get_num_threads(),
    )  # fmt: skip
    return prepared("invariant_silu_mul", call)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    """``x += delta`` in place (rounded to ``x``'s dtype, as torch's ``x + delta``), then
    :func:`rms_norm` of the new ``x`` into ``out``: a residual add and the norm after it in one
    call. ``x``, ``delta`` and ``out``: [M, W] of one dtype."""
    prepare_add_rms_norm(x, delta, weight, eps, out).run()


def prepare_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> PreparedCall:
    """:func:`add_rms_norm` checked and prepared (fields ``x``, ``delta``, ``weight``, ``y``)."""
    width = x.shape[1]
    if (
        delta.shape != x.shape
        or out.shape != x.shape
        or weight.shape != (width,)
        or not weight.is_contiguous()
    ):
        raise ValueError(
            f"cpu_invariant: add_rms_norm of x {list(x.shape)} needs delta and out like x, weight [{width}]"
        )
    if not x.dtype == delta.dtype == out.dtype:
        raise ValueError("cpu_invariant: add_rms_norm needs x, delta and out of one dtype")
    call = _AddRmsNormCall(
        x.data_ptr(), row_stride("x", x, width), delta.data_ptr(), row_stride("delta", delta, width),
        dtype_code("x", x), weight.data_ptr(), dtype_code("weight", weight), out.data_ptr(),
        row_stride("out", out, width), x.shape[0], width, eps, torch.get_num_threads(),
    )  # fmt: skip
    return prepared("invariant_add_rms_norm", call)


def prepare_rope_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_out: torch.Tensor,
    kv_rows: torch.Tensor,
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
) -> PreparedCall:
    """Rotary embedding of the q and k of each row of ``qkv`` [T, (heads + 2 kv_heads) * head_dim]
    at ``positions`` [T] (``cos``/``sin`` [P, head_dim], HF's rotation in ``qkv``'s dtype): q into
    ``q_out`` [T, heads * head_dim], k rotated and v as it is into the rows ``key_rows[t]`` /
    ``value_rows[t]`` of the KV cache ``kv_rows`` [rows, kv_heads * head_dim], in its dtype.

    Prepared: a layer sets ``qkv``, ``q_out``, ``key_rows`` and ``value_rows``."""
    tokens, width = qkv.shape
    head_dim = cos.shape[1]
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    if width != q_dim + 2 * kv_dim or head_dim % 16:
        raise ValueError(f"cpu_invariant: rope_kv needs qkv [T, {q_dim + 2 * kv_dim}] and head_dim % 16 == 0")
    if q_out.shape != (tokens, q_dim) or not q_out.is_contiguous() or q_out.dtype != qkv.dtype:
        raise ValueError(
            f"cpu_invariant: rope_kv needs a contiguous q_out [{tokens}, {q_dim}] of qkv's dtype"
        )
    if not (cos.dtype == sin.dtype == qkv.dtype and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cpu_invariant: rope_kv needs contiguous cos and sin of qkv's dtype")
    if kv_rows.dim() != 2 or kv_rows.shape[1] != kv_dim or not kv_rows.is_contiguous():
        raise ValueError(f"cpu_invariant: the KV cache must be contiguous rows of {kv_dim}")
    if not tokens == positions.numel() == key_rows.numel() == value_rows.numel():
        raise ValueError("cpu_invariant: rope_kv needs one position, key row and value row per token")
    call = _RopeKvCall(
        qkv.data_ptr(), row_stride("qkv", qkv, width), dtype_code("qkv", qkv), tokens, _index("positions", positions),
        cos.data_ptr(), sin.data_ptr(), num_heads, num_kv_heads, head_dim, q_out.data_ptr(), kv_rows.data_ptr(),
        dtype_code("kv_rows", kv_rows), _index("key_rows", key_rows), _index("value_rows", value_rows),
        torch.get_num_threads(),
    )  # fmt: skip
    return prepared("invariant_rope_kv", call)


def default_scale(head_dim: int) -> float:
    """Attention's score scale, ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)


def prepare_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    pool: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    block_tokens: int,
    rows: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    table_of_row: torch.Tensor,
) -> PreparedCall:
    """Causal attention of the queries in ``rows`` of ``q`` [T, heads * head_dim] into the same
    rows of ``out``, checked and prepared (``.run()`` computes it): query ``rows[i]`` at
    ``positions[rows[i]]`` attends over the KV blocks ``tables[table_of_row[i], 0 ..= position //
    block_tokens]`` (key block ids of the pool viewed as blocks of ``block_tokens`` rows; the value
    block is the next one). Fields ``q``, ``out``, ``tables`` take another layer's tables of the
    same shape."""
    width = q.shape[1]
    if width % head_dim or out.shape[1] != width:
        raise ValueError(f"cpu_invariant: q and out must be [T, heads * {head_dim}]")
    if pool.dim() != 1 or not pool.is_contiguous():
        raise ValueError("cpu_invariant: the pool must be one contiguous 1-D buffer")
    if tables.dim() != 2 or rows.shape != table_of_row.shape:
        raise ValueError("cpu_invariant: tables must be 2-D and rows / table_of_row of one length")
    call = _AttentionCall(
        q.data_ptr(), dtype_code("q", q), row_stride("q", q, width), out.data_ptr(), dtype_code("out", out),
        row_stride("out", out, width), pool.data_ptr(), dtype_code("pool", pool), width // head_dim, num_kv_heads,
        head_dim, block_tokens, rows.numel(), _index("rows", rows), _index("positions", positions),
        _index("tables", tables), tables.shape[1], _index("table_of_row", table_of_row),
        default_scale(head_dim), torch.get_num_threads(),
    )  # fmt: skip
    return prepared("invariant_attention", call)


def block_partials(
    queries: torch.Tensor,
    positions: torch.Tensor,
    pool: torch.Tensor,
    key_blocks: torch.Tensor,
    first_positions: torch.Tensor,
    num_kv_heads: int,
    block_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's partial attention over each block: ``queries`` [n, heads, head_dim] at
    ``positions`` [n] over key blocks ``key_blocks`` [B] whose first token is at
    ``first_positions`` [B]; returns float32 outputs [n, B, heads, head_dim] and log-sum-exps
    [n, B, heads] (0 and -inf where a query sees none of a block)."""
    n, heads, head_dim = queries.shape
    if not queries.is_contiguous() or pool.dim() != 1 or not pool.is_contiguous():
        raise ValueError("cpu_invariant: queries and the pool must be contiguous")
    blocks = key_blocks.numel()
    out = torch.empty(n, blocks, heads, head_dim, dtype=torch.float32)
    lse = torch.empty(n, blocks, heads, dtype=torch.float32)
    call = _PartialsCall(
        queries.data_ptr(), dtype_code("queries", queries), n, _index("positions", positions), pool.data_ptr(),
        dtype_code("pool", pool), heads, num_kv_heads, head_dim, block_tokens, blocks,
        _index("key_blocks", key_blocks), _index("first_positions", first_positions), out.data_ptr(),
        lse.data_ptr(), default_scale(head_dim), torch.get_num_threads(),
    )  # fmt: skip
    _run("invariant_block_partials", call)
    return out, lse


def combine_partials(outputs: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial of each query over all its blocks from their partials ``outputs``
    [n, B, heads, head_dim] and ``lse`` [n, B, heads] (float32, block ``b`` = logical block ``b``
    of the context), combined along the same tree as :func:`prepare_attention`: float32 outputs
    [n, heads, head_dim] and log-sum-exps [n, heads]."""
    n, blocks, heads, head_dim = outputs.shape
    if outputs.dtype != torch.float32 or lse.dtype != torch.float32 or lse.shape != (n, blocks, heads):
        raise ValueError(
            "cpu_invariant: combine_partials needs float32 outputs [n, B, H, D] and lse [n, B, H]"
        )
    outputs, lse = outputs.contiguous(), lse.contiguous()
    out = torch.empty(n, heads, head_dim, dtype=torch.float32)
    out_lse = torch.empty(n, heads, dtype=torch.float32)
    call = _CombineCall(
        outputs.data_ptr(), lse.data_ptr(), n, blocks, heads, head_dim, out.data_ptr(), out_lse.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    _run("invariant_combine_partials", call)
    return out, out_lse
