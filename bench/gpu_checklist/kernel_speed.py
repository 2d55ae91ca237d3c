"""Part 2, kernel speed: MBGMV (decode) and MBGMM (prefill) against padded bmm and a per-adapter
loop of ``torch.mm``, bf16, as a share of the measured device-to-device copy bandwidth."""

from __future__ import annotations

import traceback

import torch

from bench.gpu_checklist.context import Ctx, bench_ms
from bench.gpu_checklist.helpers import RANKS
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments
from services.gpu_worker.kernels.padded_bmm import lora_delta_padded_bmm


def speed_pool(ctx: Ctx, h: int, n: int, dtype: torch.dtype):
    """A pool with ``n`` adapters (ranks 8/16/32/64 round-robin) of an h x h projection, each
    adapter's A rows then B^T rows back to back, and the dense factors for the loop baseline."""
    ranks = [RANKS[i % len(RANKS)] for i in range(n)]
    total = sum(2 * r * h for r in ranks)
    pool = (torch.randn(total, device=ctx.device) * 0.02).to(dtype)
    rows, dense, offset = [], [], 0
    for r in ranks:
        a = offset + h * torch.arange(r)
        b = offset + r * h + h * torch.arange(r)
        rows.append(AdapterRows(a.to(ctx.device), b.to(ctx.device)))
        dense.append(
            (
                pool[offset : offset + r * h].view(r, h).t().contiguous(),
                pool[offset + r * h : offset + 2 * r * h].view(r, h).clone(),
            )
        )
        offset += 2 * r * h
    return pool, ranks, rows, dense


def _speed_row(
    ctx: Ctx, speed, h: int, mode: str, tokens_each: int, batch: int, k: int, triton_lora, bw
) -> dict:
    """One (h, mode, batch, k) row: each backend's median time on ``speed`` (``speed_pool``'s
    pool, ranks, rows and dense factors), ``batch`` requests over ``k`` distinct adapters."""
    pool, ranks, rows, dense = speed
    dtype = pool.dtype
    adapter_of = sorted(i % k for i in range(batch))  # round-robin, grouped by adapter
    seg = LoraSegments.build(
        [tokens_each] * batch, [rows[a] for a in adapter_of], [0.5] * batch, h, h, ctx.device
    )
    tokens = batch * tokens_each
    x = torch.randn(tokens, h, device=ctx.device).to(dtype)
    out = torch.zeros(tokens, h, device=ctx.device, dtype=dtype)
    groups = []  # (start, end, adapter) token ranges
    for a in range(k):
        idx = [i for i, b in enumerate(adapter_of) if b == a]
        if idx:
            groups.append((idx[0] * tokens_each, (idx[-1] + 1) * tokens_each, a))

    def loop():
        for s, e, a in groups:
            a_t, b_t = dense[a]
            out[s:e].addmm_(x[s:e] @ a_t, b_t, alpha=0.5)

    fns = {"padded_bmm": lambda: lora_delta_padded_bmm(x, pool, seg, out), "torch_mm_loop": loop}
    if triton_lora is not None:
        if mode == "decode":
            fns["mbgmv"] = lambda: triton_lora.mbgmv(x, pool, seg, out)
        else:
            fns["mbgmm"] = lambda: triton_lora.mbgmm(x, pool, seg, out)
    nbytes = sum(2 * ranks[a] * h * pool.element_size() for a in set(adapter_of))
    flops = 2 * sum(tokens_each * 2 * ranks[a] * h for a in adapter_of)
    row = {"h": h, "mode": mode, "batch": batch, "distinct": k, "tokens": tokens, "adapter_bytes": nbytes}
    for name, fn in fns.items():
        try:
            ms = bench_ms(ctx, fn)
            gb_s = nbytes / (ms * 1e-3) / 1e9
            row[name] = {
                "ms": ms, "gb_s": gb_s, "share_of_copy_bw": gb_s / bw["gb_s"],
                "tflop_s": flops / (ms * 1e-3) / 1e12,
            }  # fmt: skip
        except Exception:  # noqa: BLE001 (recorded; the other parts still run)
            row[name] = {"error": traceback.format_exc(limit=3)}
    return row


def part2(ctx: Ctx) -> dict:
    bw = ctx.copy_bandwidth()
    try:
        triton_lora = ctx.triton()
        triton_note = "interpreted" if triton_lora.INTERPRETED else "compiled"
    except RuntimeError as exc:
        triton_lora, triton_note = None, str(exc)
    dtype = torch.bfloat16
    hs = (64,) if ctx.quick else (576, 4096)
    pairs = [
        (b, k) for b in ((1, 4) if ctx.quick else (1, 16, 64, 256)) for k in (1, 4, 16, 64, 256) if k <= b
    ]
    if not ctx.quick:
        pairs = [(b, k) for b, k in pairs if k in (1, 16, 64, 256)]
    prefill_len = 4 if ctx.quick else 16
    rows_out = []
    for h in hs:
        n_max = max(k for _, k in pairs)
        speed = speed_pool(ctx, h, n_max, dtype)
        for mode in ("decode", "prefill"):
            tokens_each = 1 if mode == "decode" else prefill_len
            for batch, k in pairs:
                rows_out.append(_speed_row(ctx, speed, h, mode, tokens_each, batch, k, triton_lora, bw))
            ctx.log(f"part 2: h={h} {mode} done")
    return {
        "dtype": "bfloat16",
        "triton": triton_note,
        "copy_bandwidth": bw,
        "prefill_tokens_per_request": prefill_len,
        "rows": rows_out,
    }
