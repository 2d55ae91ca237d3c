"""CUDA graphs for decode steps with LoRA: one replay per step instead of hundreds of launches.

A graph is captured per shape: the batch padded up to a bucket (:data:`BATCH_BUCKETS`), the
context up to a power-of-two number of KV blocks, the LoRA tables' width (their ``max_rank``)
and the projections they cover. Which adapter each row uses, its rank and scale are *contents*
of the LoRA buffers (``lora_tables.py``), not shapes, so one graph serves any mix of adapters.
Each step copies its inputs (built by :class:`~services.gpu_worker.executor.step_inputs.StepInputs`)
into the graph's static buffers and replays it; prefill, mixed and batch-invariant steps stay eager.

Padding rows compute garbage nobody reads: they write their KV into a scratch page kept past the
engine's pages (:func:`~services.gpu_worker.executor.pool_buffer.pool_buffer` with ``spare_page``),
attend to their first position only, and have no adapter (rank 0: MBGMV returns at once).

Capture happens at a shape's first step, timed and logged (``capture_s``); a capture that fails
leaves that shape eager. Unmeasured on a GPU so far: ``--cuda-graphs`` is off by default.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.kernels.dispatch import StepLora
from services.gpu_worker.kernels.lora_segments import LoraSegments
from services.gpu_worker.model.step_batch import DecodeGroup, StepBatch

log = logging.getLogger("loramesh.decode_graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
"""Decode batch sizes a graph is captured for (vLLM's spacing): a batch runs in the smallest
bucket that holds it, padding at most a quarter of it past 16; larger batches run eager."""


def batch_bucket(rows: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket holding ``rows`` rows; None beyond the largest."""
    at = bisect.bisect_left(buckets, rows)
    return buckets[at] if at < len(buckets) else None


def block_bucket(blocks: int) -> int:
    """The power of two of KV blocks a graph's context is padded to."""
    return 1 << max(0, blocks - 1).bit_length()


@dataclass(frozen=True)
class GraphShape:
    """What a captured graph is fixed to."""

    rows: int
    """The batch bucket."""
    blocks: int
    """KV blocks of context each row attends over (padded, masked)."""
    max_rank: int
    """The LoRA tables' width (0: no LoRA)."""
    modules: tuple[tuple[str, ...], ...]
    """Per layer, the projections with LoRA segments."""


def shape_of(
    batch: StepBatch, block_tokens: int, buckets: tuple[int, ...] = BATCH_BUCKETS
) -> GraphShape | None:
    """The graph shape a decode batch (from the persistent batch) runs in; None: eager."""
    decode = batch.decode
    if decode is None or batch.prefills or batch.remote is not None or batch.batch_invariant:
        return None
    rows = batch_bucket(decode.token_rows.shape[0], buckets)
    if rows is None:
        return None
    blocks = decode.mask.shape[-1] // block_tokens
    lora = batch.lora
    if lora is None:
        return GraphShape(rows, block_bucket(blocks), 0, ())
    first = next((s for per_module in lora.layers for s in per_module.values()), None)
    if first is None or first.rank_starts_host:
        return None  # host-built segments (another backend): their shapes follow the batch
    return GraphShape(rows, block_bucket(blocks), first.max_rank, tuple(tuple(m) for m in lora.layers))


class GraphInputs:
    """A graph's static inputs: a :class:`StepBatch` of ``shape.rows`` rows whose tensors each
    step's batch is copied into, padding rows filled as described above."""

    def __init__(self, shape: GraphShape, batch: StepBatch, spare_rows: torch.Tensor, block_tokens: int):
        """``batch``: a step of this shape (for the dtypes, layers and widths); ``spare_rows``:
        int64 [block_tokens], the scratch page's key rows."""
        self.shape = shape
        self.block_tokens = block_tokens
        self.spare_rows = spare_rows
        rows, device = shape.rows, batch.token_ids.device
        layers = batch.write_key_rows.shape[0]
        span = shape.blocks * block_tokens
        arange = torch.arange(rows, dtype=torch.int64, device=device)
        self.key_blocks = torch.zeros(layers, rows, shape.blocks, dtype=torch.int64, device=device)
        self.value_blocks = self.key_blocks.view(layers, -1) + 1  # refilled by each fill
        self.mask = torch.zeros(rows, 1, 1, span, dtype=torch.bool, device=device)
        self.lora_buffers = self._lora_buffers(batch.lora, rows) if batch.lora is not None else None
        self.batch = StepBatch(
            token_ids=torch.zeros(rows, dtype=torch.int64, device=device),
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
            write_key_rows=torch.zeros(layers, rows, dtype=torch.int64, device=device),
            write_value_rows=torch.zeros(layers, rows, dtype=torch.int64, device=device),
            decode=DecodeGroup(arange, self.key_blocks.view(layers, -1), self.value_blocks, self.mask),
            prefills=[],
            logits_rows=arange,
            lora=self._lora(batch.lora, rows, device) if batch.lora is not None else None,
            lora_backend=batch.lora_backend,
        )
        self.fill(None)

    def _lora_buffers(self, lora: StepLora, rows: int) -> dict[tuple[int, str], tuple[torch.Tensor, ...]]:
        out = {}
        for layer, per_module in enumerate(lora.layers):
            for module, seg in per_module.items():
                device = seg.a_offsets.device
                out[(layer, module)] = (
                    torch.zeros(rows + 1, dtype=torch.int32, device=device),
                    torch.zeros(rows * seg.max_rank + 1, dtype=torch.int64, device=device),
                    torch.zeros(rows * seg.max_rank + 1, dtype=torch.int64, device=device),
                    torch.zeros(rows, dtype=torch.float32, device=device),
                )
        return out

    def _lora(self, lora: StepLora, rows: int, device: torch.device) -> StepLora:
        seg_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        seg_starts_host = tuple(range(rows + 1))
        layers = []
        for layer, per_module in enumerate(lora.layers):
            static = {}
            for module, seg in per_module.items():
                rank_starts, a, b, scales = self.lora_buffers[(layer, module)]
                static[module] = LoraSegments.on_device(
                    seg_starts,
                    seg_starts_host,
                    rank_starts,
                    a,
                    b,
                    scales,
                    seg.max_rank,
                    seg.in_features,
                    seg.out_features,
                )
            layers.append(static)
        return StepLora(layers)

    def fill(self, batch: StepBatch | None) -> None:
        """Copy ``batch`` (of this shape; None: none, every row padding) into the static inputs."""
        static, block = self.batch, self.block_tokens
        n = 0 if batch is None else batch.token_ids.shape[0]
        rows = self.shape.rows
        pad = torch.arange(rows - n, device=static.token_ids.device) % block
        static.token_ids[n:] = 0
        static.positions[n:] = 0
        static.write_key_rows[:, n:] = self.spare_rows[pad]
        self.key_blocks[:, n:] = 0
        self.mask[n:] = False
        self.mask[n:, ..., 0] = True  # a padding row attends to one key: no empty softmax
        if batch is not None:
            decode = batch.decode
            static.token_ids[:n] = batch.token_ids
            static.positions[:n] = batch.positions
            static.write_key_rows[:, :n] = batch.write_key_rows
            blocks = decode.key_blocks.shape[1] // n
            self.key_blocks[:, :n, :blocks] = decode.key_blocks.view(-1, n, blocks)
            self.key_blocks[:, :n, blocks:] = 0
            self.mask[:n, ..., : decode.mask.shape[-1]] = decode.mask
            self.mask[:n, ..., decode.mask.shape[-1] :] = False
        static.write_value_rows.copy_(static.write_key_rows + block)
        torch.add(self.key_blocks.view(self.value_blocks.shape), 1, out=self.value_blocks)
        if self.lora_buffers is not None:
            self._fill_lora(None if batch is None else batch.lora, n)

    def _fill_lora(self, lora: StepLora | None, n: int) -> None:
        for (layer, module), (rank_starts, a, b, scales) in self.lora_buffers.items():
            seg = None if lora is None else lora.layers[layer].get(module)
            if seg is None:
                rank_starts.zero_()
                scales.zero_()
                continue
            used = n * seg.max_rank
            rank_starts[: n + 1] = seg.rank_starts
            rank_starts[n + 1 :] = seg.rank_starts[n]  # padding rows: rank 0
            a[:used] = seg.a_offsets[:used]
            b[:used] = seg.b_offsets[:used]
            scales[:n] = seg.scales
            scales[n:] = 0


@dataclass
class Captured:
    graph: object
    """The ``torch.cuda.CUDAGraph``."""
    inputs: GraphInputs
    logits: torch.Tensor
    """The graph's output buffer: ``[rows, vocab]`` float32."""


class DecodeGraphs:
    """Captures and replays decode graphs for one model over one pool."""

    def __init__(
        self, model, view: PoolView, spare_rows: torch.Tensor, buckets: tuple[int, ...] = BATCH_BUCKETS
    ):
        """``view``: the pool with its scratch page (the model runs the graphs over it);
        ``spare_rows``: that page's key rows (int64 [kv_block_tokens])."""
        self.model = model
        self.view = view
        self.spare_rows = spare_rows
        self.buckets = buckets
        self.block_tokens = view.layout.kv_block_tokens
        self._graphs: dict[GraphShape, Captured | None] = {}
        self._pool = None
        self.capture_s = 0.0
        """Seconds spent capturing since start."""
        self.replays = 0

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's logits by one replay; None when the step runs eager (not a decode shape,
        or its capture failed)."""
        shape = shape_of(batch, self.block_tokens, self.buckets)
        if shape is None:
            return None
        if shape not in self._graphs:
            self._graphs[shape] = self._capture(shape, batch)
        captured = self._graphs[shape]
        if captured is None:
            return None
        captured.inputs.fill(batch)
        captured.graph.replay()
        self.replays += 1
        return captured.logits[: batch.token_ids.shape[0]].clone()

    def _capture(self, shape: GraphShape, batch: StepBatch) -> Captured | None:
        started = time.monotonic()
        inputs = GraphInputs(shape, batch, self.spare_rows, self.block_tokens)  # all padding
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: kernels compiled, workspaces allocated
                self.model.forward(inputs.batch, self.view)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.model.forward(inputs.batch, self.view)
        except RuntimeError:
            log.exception("capturing the decode graph for %s failed: that shape runs eager", shape)
            return None
        elapsed = time.monotonic() - started
        self.capture_s += elapsed
        log.info("captured the decode graph for %s in %.3f s (%.3f s in all)", shape, elapsed, self.capture_s)
        return Captured(graph, inputs, logits)
