"""What a rank's ``LlamaModel`` does differently under tensor parallelism: S-LoRA's LoRA on its
shards, and the base's one all-reduce per column/row-parallel pair.

The model calls :meth:`TensorParallelContext.lora` where the single-device model calls its LoRA
kernels, and :meth:`TensorParallelContext.all_reduce_base` on its o and down outputs after their
LoRA. Per (layer, call):

- column-parallel (q/k/v together, gate/up together): each token's ``x @ A_kᵀ`` (``[t, r_pad/N]``,
  rank ``k``'s slice of the intermediate) for every module the call's adapters target is packed
  into one flat fp32 buffer (segment group after group, module after module: its length is
  ``Σ_t r_pad(t) / N`` summed over the modules, the same on every rank thanks to padding); one
  all-gather gives every rank every slice; each group's ``[t, r_pad]`` is reassembled in rank
  order (= A's row order) and expanded with the rank's ``B1ᵀ`` output columns into its slice.
- row-parallel (o, down): each token's partial ``x_k @ A2_kᵀ`` (``[t, r]``) is packed the same
  way, all-reduced (``Σ_t r(t)`` elements), scaled, expanded with the rank's ``B2ᵀ`` columns and
  added into the rank's hidden-column slice of its o/down *partial* output, which the base
  all-reduce then completes (the LoRA output's all-gather fused into it).

Fusing the modules of one call into one collective moves the same bytes as one collective per
module (both costs are linear in the elements) with fewer latency-bound round trips.

Shrink and expand are plain torch matmuls per segment group reading the pool rows run by run
(exact, like ``kernels/torch_reference``). A fused kernel (MBGMM/MBGMV or the native CPU kernel)
would need two entry points instead of one: *shrink* writing the scaled ``[T, r]`` intermediate
to a caller buffer at a per-group offset, and *expand* reading a ``[T, r]`` intermediate that is
not contiguous per group (or after a gather-permute), adding into a column slice of ``out``.
"""

from __future__ import annotations

import torch

from services.gpu_worker.tp.collectives import Collectives
from services.gpu_worker.tp.sharding import COLUMN_PARALLEL, TensorParallelLayout


def _read_rows(pool: torch.Tensor, runs, width: int, rows: int, row_width: int) -> torch.Tensor:
    """The ``[rows, row_width]`` fp32 matrix stored as pool rows of ``width`` (a view if one run)."""
    if len(runs) == 1:
        o, n = runs[0]
        return pool[o : o + n * width].view(rows, row_width).float()
    return torch.cat([pool[o : o + n * width] for o, n in runs]).view(rows, row_width).float()


class _Item:
    """One segment group of one module: its tokens and its rows."""

    __slots__ = ("a", "b", "n_tokens", "out", "rows", "scale", "tokens")

    def __init__(self, out, tokens, rows, a, b, scale, n_tokens):
        self.out, self.tokens, self.rows = out, tokens, rows
        self.a, self.b, self.scale, self.n_tokens = a, b, scale, n_tokens


class TensorParallelContext:
    """One rank's view of its group: its layout and the collectives to its peers."""

    def __init__(self, layout: TensorParallelLayout, collectives: Collectives):
        if collectives.size != layout.size or collectives.rank != layout.rank:
            raise ValueError(
                f"layout is rank {layout.rank} of {layout.size}, collectives rank "
                f"{collectives.rank} of {collectives.size}"
            )
        self.layout = layout
        self.collectives = collectives

    def check_batch(self, batch) -> None:
        if batch.batch_invariant:
            raise ValueError("deterministic (batch-invariant) serving is not supported with --tp > 1")
        if batch.remote is not None:
            raise ValueError("borrowed (remote) KV blocks are not supported with --tp > 1")

    def all_reduce_base(self, partial: torch.Tensor) -> None:
        """Complete a row-parallel output (o or down) in place."""
        self.collectives.all_reduce(partial, "base")

    def lora(self, batch, layer: int, names: tuple[str, ...], x: torch.Tensor, pool, *outs) -> None:
        """Add the LoRA of projections ``names`` (which all read ``x``) into ``outs`` (the
        rank's output slices, or for o/down the partial outputs)."""
        if batch.lora is None:
            return
        per_module = batch.lora.layers[layer]
        segments = [per_module.get(name) for name in names]
        if all(seg is None for seg in segments):
            return
        items = self._items(names, segments, outs)
        if not items:
            return
        buffer = pool.buffer
        if names[0] in COLUMN_PARALLEL:
            self._column(items, x, buffer)
        else:
            self._row(items, x, buffer)

    def _items(self, names, segments, outs) -> list[_Item]:
        layout = self.layout
        items = []
        for name, seg, out in zip(names, segments, outs):
            if seg is None:
                continue
            key = ("tp", layout.size, layout.rank, name)
            cached = seg.derived.get(key)
            if cached is None:
                a_width, b_width = layout.shard_widths(name)
                cached = []
                for group in seg.groups:
                    rows = group.rows.rank  # r_pad (column) or r (row)
                    if len(group.token_ranges) == 1:
                        tokens = slice(*group.token_ranges[0])
                        n_tokens = tokens.stop - tokens.start
                    else:
                        tokens = torch.cat(
                            [torch.arange(s, e, device=seg.seg_starts.device) for s, e in group.token_ranges]
                        )
                        n_tokens = tokens.numel()
                    a = (group.rows.runs("a", a_width), a_width)
                    b = (group.rows.runs("b", b_width), b_width)
                    cached.append((tokens, rows, a, b, group.scale, n_tokens))
                seg.derived[key] = cached
            items.extend(_Item(out, t, r, a, b, s, n) for t, r, a, b, s, n in cached)
        return items

    def _gather_rows(self, x: torch.Tensor, tokens) -> torch.Tensor:
        return x[tokens].float() if isinstance(tokens, slice) else x.index_select(0, tokens).float()

    def _add(self, out: torch.Tensor, tokens, delta: torch.Tensor, columns: slice | None) -> None:
        """``out[tokens, columns] += delta`` (fp32 added in place, rounded once)."""
        cols = slice(None) if columns is None else columns
        if isinstance(tokens, slice):
            out[tokens, cols].add_(delta)
            return
        block = out.index_select(0, tokens)
        block[:, cols].add_(delta)
        out.index_copy_(0, tokens, block)

    def _column(self, items: list[_Item], x: torch.Tensor, pool: torch.Tensor) -> None:
        n = self.layout.size
        hidden = self.layout.hidden_size
        pieces, offsets, offset = [], [], 0
        for item in items:
            local = item.rows // n
            (a_runs, a_width) = item.a
            a = _read_rows(pool, a_runs, a_width, local, hidden)  # [r_pad/N, hidden]
            piece = self._gather_rows(x, item.tokens) @ a.T  # [t, r_pad/N]
            pieces.append(piece.reshape(-1))
            offsets.append(offset)
            offset += piece.numel()
        gathered = self.collectives.all_gather(torch.cat(pieces), "lora").view(n, -1)
        for item, start in zip(items, offsets):
            local, t = item.rows // n, item.n_tokens
            full = gathered[:, start : start + t * local].view(n, t, local).permute(1, 0, 2).reshape(t, -1)
            (b_runs, b_width) = item.b
            b = _read_rows(pool, b_runs, b_width, item.rows, b_width)  # [r_pad, out/N]
            self._add(item.out, item.tokens, (full.mul_(item.scale)) @ b, None)

    def _row(self, items: list[_Item], x: torch.Tensor, pool: torch.Tensor) -> None:
        pieces, offsets, offset = [], [], 0
        for item in items:
            (a_runs, a_width) = item.a
            a = _read_rows(pool, a_runs, a_width, item.rows, a_width)  # [r, in/N]
            piece = self._gather_rows(x, item.tokens) @ a.T  # [t, r], a partial sum
            pieces.append(piece.reshape(-1))
            offsets.append(offset)
            offset += piece.numel()
        reduced = self.collectives.all_reduce(torch.cat(pieces), "lora")
        columns = self.layout.slice("hidden")
        for item, start in zip(items, offsets):
            t = item.n_tokens
            s = reduced[start : start + t * item.rows].view(t, item.rows).mul(item.scale)
            (b_runs, b_width) = item.b
            b = _read_rows(pool, b_runs, b_width, item.rows, b_width)  # [r, hidden/N]
            self._add(item.out, item.tokens, s @ b, columns)
