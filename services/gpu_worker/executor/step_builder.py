"""Turn a :class:`StepPlan` into the model's :class:`StepBatch`: flattened tokens, KV rows to
write and to attend over, and per-layer LoRA segments gathered from resident adapters."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from services.gpu_worker.distkv import DistributedKv, DistributedSpan, RManager
from services.gpu_worker.engine.executor import BorrowedLookup
from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest, StepPlan
from services.gpu_worker.kernels.dispatch import StepLora
from services.gpu_worker.kernels.lora_segments import LoraSegments
from services.gpu_worker.memory.adapter_residency import NOT_TARGETED, ResidentAdapter
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.step_batch import DecodeGroup, PrefillSpan, StepBatch
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.recently_used import RecentlyUsed

LORA_SEGMENTS_KEPT = 16
"""The most recently used steps' LoRA segments kept for reuse. A request verifying drafts changes
its segment's token count from step to step (1 + k, k from 0 to ``max_draft_tokens``), and
building the segments of every layer and projection again, with the native kernel's plan, took
~2.7-7.9 ms a step at batch 1 against ~0.3 ms for a step that reused them (2 EPYC cores, loaded):
kept, a batch-1 request's 1 + k variants are each built once."""

PROJECTION_LAYOUTS_KEPT = 16
"""The most recently used adapter sequences' projection layouts kept (:func:`_uniform_projections`:
every layer's row offsets gathered in segment order). A batch whose requests verify drafts keeps
its adapters in the same order while their token counts change from step to step, so its LoRA
segments are built anew nearly every step at batch 8; gathering the offsets was the largest part
of that, and it depends on the adapters alone."""

ResidentLookup = Callable[[str], ResidentAdapter | None]
"""Adapter id -> its load in force (the placement a plan's :class:`AdapterSlot` names)."""
"""Request id -> the block table of a request whose KV is borrowed."""


class StepBuilder:
    def __init__(
        self,
        model: LlamaModel,
        pool: UnifiedPool,
        rm: RManager | None = None,
        shapes: dict[str, tuple[int, int]] | None = None,
    ):
        """``rm``: the rManager the requests with borrowed blocks go through. ``shapes``: the
        ``(in, out)`` widths of each projection's pool rows, when not the model's own (a
        tensor-parallel rank's shard rows: ``TensorParallelLayout.shard_widths``)."""
        self.model = model
        self.pool = pool
        self.rm = rm
        cfg = model.config
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.shapes = shapes or {
            "q_proj": (hidden, q_dim),
            "k_proj": (hidden, kv_dim),
            "v_proj": (hidden, kv_dim),
            "o_proj": (q_dim, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        # Steps whose batch has the LoRA segments of a recent step reuse them (lora_segments),
        # and those with a recent step's adapters in the same order its gathered row offsets.
        # Keys: per segment, (adapter id or None, placement, ...).
        self._loras: RecentlyUsed[tuple, StepLora] = RecentlyUsed(LORA_SEGMENTS_KEPT)
        self._layouts: RecentlyUsed[tuple, ProjectionLayouts] = RecentlyUsed(PROJECTION_LAYOUTS_KEPT)
        # Each request's page table as a tensor, rebuilt only when its pages change.
        self._tables: dict[str, tuple[tuple[tuple[int, ...], ...], torch.Tensor]] = {}

    def build(
        self,
        plan: StepPlan,
        resident: ResidentLookup,
        borrowed: BorrowedLookup | None = None,
    ) -> StepBatch:
        """The step's inputs for ``plan`` (its requests' KV pages reserved). ``resident`` finds
        the adapters the plan's slots name, ``borrowed`` the block tables of borrowed requests.

        Tensor work is batched over requests: one gather from the requests' padded page tables
        gives every new token's KV rows, one more every decoding request's context blocks; only
        prefilling requests (a few per step) get tensors of their own.
        """
        requests = plan.requests
        device = self.pool.device
        block = self.pool.layout.kv_block_tokens
        token_ids: list[int] = []
        positions: list[int] = []
        counts: list[int] = []
        ends: list[int] = []
        decoding: list[int] = []
        for index, request in enumerate(requests):
            start, end = request.start_position, request.end_position
            if end - start == 1 and not request.borrowed:
                decoding.append(index)
            token_ids.extend(request.token_ids)
            positions.extend(range(start, end))
            counts.append(end - start)
            ends.append(end)
        tables = self._page_tables(requests)
        padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)  # [R, blocks, L]
        position = torch.tensor(positions, dtype=torch.int64, device=device)
        count = torch.tensor(counts, dtype=torch.int64, device=device)
        owner = torch.repeat_interleave(torch.arange(len(requests), device=device), count)
        pages = padded[owner, position // block]  # [T, L]
        write_keys = (pages * (2 * block) + (position % block)[:, None]).T.contiguous()
        first_rows = list(itertools.accumulate(counts, initial=0))
        prefills = [
            self._prefill_span(first_rows[i], first_rows[i + 1], tables[i], ends[i], position)
            for i in range(len(requests))
            if counts[i] > 1 and not requests[i].borrowed
        ]
        distributed = [
            DistributedSpan(
                first_rows[i],
                first_rows[i + 1],
                borrowed(r.request_id),
                position[first_rows[i] : first_rows[i + 1]],
            )
            for i, r in enumerate(requests)
            if r.borrowed
        ]
        local_rows = None
        if distributed:
            local = torch.ones(len(token_ids), dtype=torch.bool, device=device)
            for span in distributed:
                local[span.token_start : span.token_end] = False
            local_rows = local.nonzero().squeeze(1)
            write_keys = write_keys[:, local_rows]
        return StepBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=position,
            write_key_rows=write_keys,
            write_value_rows=write_keys + block,
            local_token_rows=local_rows,
            remote=DistributedKv(self.rm, distributed) if distributed else None,
            decode=self._decode_group(decoding, padded, ends, first_rows) if decoding else None,
            prefills=prefills,
            logits_rows=_logits_rows(requests, first_rows, device),
            lora=self.lora_segments(requests, resident),
            lora_backend=plan.lora_backend,
            batch_invariant=plan.batch_invariant,
        )

    def _page_tables(self, requests: tuple[PlannedRequest, ...]) -> list[torch.Tensor]:
        """Each request's ``[blocks, layers]`` page ids. A borrowed request gets a placeholder of
        page 0 rows, never written (its rows are left out of the writes) nor attended."""
        device, layout = self.pool.device, self.pool.layout
        tables, kept = [], {}
        for request in requests:
            if request.borrowed:
                blocks = -(-request.end_position // layout.kv_block_tokens)
                tables.append(torch.zeros(blocks, layout.num_layers, dtype=torch.int64, device=device))
                continue
            cached = self._tables.get(request.request_id)
            # Identity first: a local plan hands over the request's own cached tuple.
            if cached is None or (cached[0] is not request.kv_blocks and cached[0] != request.kv_blocks):
                table = torch.tensor(request.kv_blocks, dtype=torch.int64, device=device)
                cached = (request.kv_blocks, table.reshape(len(request.kv_blocks), layout.num_layers))
            kept[request.request_id] = cached
            tables.append(cached[1])
        self._tables = kept  # requests not in this step drop theirs
        return tables

    def _decode_group(
        self, decoding: list[int], padded: torch.Tensor, ends: list[int], first_rows: list[int]
    ) -> DecodeGroup:
        device = self.pool.device
        block = self.pool.layout.kv_block_tokens
        lengths = torch.tensor([ends[i] for i in decoding], dtype=torch.int64, device=device)
        num_blocks = -(-max(ends[i] for i in decoding) // block)
        # Padded table rows past a request's own blocks hold page 0: real memory, masked below.
        pages = padded[torch.tensor(decoding, device=device), :num_blocks]  # [R, N, L]
        key_blocks = (2 * pages).permute(2, 0, 1).reshape(pages.shape[2], -1)
        mask = torch.arange(num_blocks * block, device=device)[None, :] < lengths[:, None]
        return DecodeGroup(
            token_rows=torch.tensor([first_rows[i] for i in decoding], dtype=torch.int64, device=device),
            key_blocks=key_blocks,
            value_blocks=key_blocks + 1,
            mask=mask[:, None, None, :],
        )

    def _prefill_span(
        self, row_start: int, row_end: int, table: torch.Tensor, end: int, position: torch.Tensor
    ) -> PrefillSpan:
        block = self.pool.layout.kv_block_tokens
        num_blocks = -(-end // block)
        key_blocks = (2 * table[:num_blocks]).T.contiguous()  # [L, N]
        context = torch.arange(num_blocks * block, device=self.pool.device)
        mask = context[None, :] <= position[row_start:row_end, None]
        return PrefillSpan(row_start, row_end, key_blocks, key_blocks + 1, mask)

    def forget_adapter(self, adapter_id: str) -> None:
        """Drop the kept LoRA segments of steps naming ``adapter_id`` (evicted): they hold its
        rows' offsets and index tensors, which would otherwise stay until newer steps pushed
        them out, and its pages may be reused by the next adapter."""

        def names_it(key: tuple) -> bool:
            return any(part[0] == adapter_id for part in key)

        self._loras.drop(names_it)
        self._layouts.drop(names_it)

    def lora_segments(
        self, requests: tuple[PlannedRequest, ...], resident: ResidentLookup
    ) -> StepLora | None:
        slots, counts = _segments(requests)
        if all(slot is None for slot in slots):
            return None
        # A placement fixes the adapter's row offsets, so (adapter, placement) per segment
        # identifies the rows, and with the token counts the work; comparing page lists instead
        # cost ~0.3 ms a step at k = 8.
        placements = tuple((s.adapter_id, s.placement) if s is not None else (None, -1) for s in slots)
        key = tuple((*placement, n) for placement, n in zip(placements, counts))
        cached = self._loras.get(key)
        if cached is not None:
            return cached
        placed_adapters = [resident(s.adapter_id) if s is not None else None for s in slots]
        modules = [r.modules if r is not None else None for r in placed_adapters]
        num_layers = self.model.config.num_layers
        layouts = self._layouts.get(placements)
        if layouts is None:
            layouts = self._layouts.put(placements, _uniform_projections(placed_adapters, num_layers))
        uniform, layer_offsets = layouts
        # A projection's work has the same structure in every layer where its adapters have the
        # same ranks and scales (all of them, but for rank_pattern/alpha_pattern or
        # layers_to_transform): built once (``template``), then given each layer's rows (gathered
        # for all layers at once where ``uniform`` says every layer is alike).
        templates: dict[str, tuple[tuple, LoraSegments]] = {}
        layers = []
        for layer in range(num_layers):
            per_module = {}
            for module in LORA_TARGETS:
                module_key = (layer, module)
                signature = uniform.get(module)
                if signature is not None:
                    if not any(signature):
                        continue
                    rows = [
                        m[module_key].rows if sig is not None else None for m, sig in zip(modules, signature)
                    ]
                else:
                    placed = [m.get(module_key) if m is not None else None for m in modules]
                    if all(p is None for p in placed):
                        continue
                    rows = [p.rows if p is not None else None for p in placed]
                    signature = tuple((p.rows.rank, p.scale) if p is not None else None for p in placed)
                template = templates.get(module)
                if template is not None and template[0] == signature:
                    gathered = layer_offsets.get(module)
                    offsets = None if gathered is None else (gathered[0][layer], gathered[1][layer])
                    per_module[module] = template[1].with_rows(rows, offsets)
                    continue
                in_features, out_features = self.shapes[module]
                per_module[module] = LoraSegments.build(
                    counts,
                    rows,
                    [sig[1] if sig is not None else 0.0 for sig in signature],
                    in_features,
                    out_features,
                    self.pool.device,
                )
                templates[module] = (signature, per_module[module])
            layers.append(per_module)
        return self._loras.put(key, StepLora(layers))


def _logits_rows(requests: tuple[PlannedRequest, ...], first_rows: list[int], device) -> torch.Tensor:
    """Each request's last token's row, and with drafts the rows before: the rows verifying them."""
    if not any(r.draft_tokens for r in requests):
        return torch.tensor(first_rows[1:], dtype=torch.int64, device=device) - 1
    return torch.tensor(
        [row for r, end in zip(requests, first_rows[1:]) for row in range(end - r.logits_rows, end)],
        dtype=torch.int64,
        device=device,
    )


GatheredOffsets = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
"""Per layer, a projection's A and Bᵀ row offsets of a batch, segment after segment."""
ProjectionLayouts = tuple[dict[str, tuple], dict[str, GatheredOffsets]]
"""What :func:`_uniform_projections` returns."""


def _uniform_projections(placed_adapters: list[ResidentAdapter | None], num_layers: int) -> ProjectionLayouts:
    """The projections that each adapter of a batch (one per segment, None: base model) adapts
    with one rank and scale in every layer, or in none: such a projection has the same structure
    in every layer, checked once per adapter, not per layer and segment. For each: the segments'
    ``(rank, scale)`` signature (None where no adapter), and the row offsets of every layer,
    gathered in one ``cat`` per factor instead of two per layer."""
    signatures_by_module: dict[str, tuple] = {}
    offsets_by_module: dict[str, GatheredOffsets] = {}
    for module in LORA_TARGETS:
        signatures = [NOT_TARGETED if r is None else r.signature(module, num_layers) for r in placed_adapters]
        if any(sig is None for sig in signatures):
            continue  # ranks or scales differ by layer: compared layer by layer
        signatures_by_module[module] = tuple(None if sig is NOT_TARGETED else sig for sig in signatures)
        present = [
            r.layer_offsets(module, num_layers)
            for r, sig in zip(placed_adapters, signatures)
            if sig is not NOT_TARGETED
        ]
        if present:
            offsets_by_module[module] = (
                torch.cat([a for a, _ in present], dim=1).unbind(0),
                torch.cat([b for _, b in present], dim=1).unbind(0),
            )
    return signatures_by_module, offsets_by_module


def _segments(requests: tuple[PlannedRequest, ...]) -> tuple[list[AdapterSlot | None], list[int]]:
    """The step's LoRA segments, slot and token count each: a request's tokens with its adapter,
    those of an activated LoRA's request before its invocation start with none (they are the
    base model's), the rest with its adapter."""
    slots: list[AdapterSlot | None] = []
    counts: list[int] = []
    for request in requests:
        start, end, active = request.start_position, request.end_position, request.adapter_from
        if request.adapter is not None and start < active:
            slots.append(None)
            counts.append(min(active, end) - start)
            if end > active:
                slots.append(request.adapter)
                counts.append(end - active)
        else:
            slots.append(request.adapter)
            counts.append(end - start)
    return slots, counts
