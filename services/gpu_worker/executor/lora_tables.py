"""LoRA metadata of a decode batch in device tables, built on the device (vLLM's punica wrapper).

The step builder's segments (``kernels/lora_segments.py``) are made on the host from each
adapter's row objects, once per projection and layer: 210 objects on SmolLM2, rebuilt whenever a
request joins, leaves or changes adapter (40-47 ms at batch 256 with 32-128 adapters on a 2-core
CPU, ``bench/step_host_time.py``). Here each adapter load gets a *slot* once: its row offsets,
ranks and scales for every (layer, projection) written into ``[slots, layers x projections, max
rank]`` tables. Each decode row holds a slot number; a step's segment tables (rank starts, packed
A and Bᵀ offsets, scales) are gathered from them by a fixed handful of tensor operations, with
no host work per request or per layer, and the segment objects the kernels read are made once per
batch size and keep pointing at the same buffers.

The result is what MBGMV reads (``kernels/triton_lora.py``): one segment per row, ranks as table
contents (``max_rank`` is the tables' width, not the batch's), so a CUDA graph captured over
these buffers replays for any mix of adapters. The host fields of the segments (rank starts as
ints, groups) stay empty: the CPU backends keep the step builder's segments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.gpu_worker.engine.step_plan import AdapterSlot
from services.gpu_worker.executor.persistent_batch import host_ints
from services.gpu_worker.kernels.dispatch import StepLora
from services.gpu_worker.kernels.lora_segments import LoraSegments
from services.gpu_worker.memory.adapter_residency import ResidentAdapter
from services.model_files.peft_format import LORA_TARGETS

KEPT_SLOTS = 512
"""Slots the tables grow to before reclaiming those no row names: an adapter load keeps its slot
(written once) while it comes and goes with its requests; 54 KiB each on SmolLM2 at rank 16."""

SlotKey = tuple[str, int]
"""``(adapter id, placement)``: one load of an adapter (a reload gets a new placement)."""


class LoraTables:
    """Per adapter load, its rows in every (layer, projection); per decode row, its slot."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, int]],
        num_layers: int,
        device: torch.device | str,
        max_rank: int = 16,
    ):
        """``shapes``: each projection's ``(in, out)`` widths; ``max_rank``: the tables' first
        width (grown to the largest rank placed)."""
        self.shapes = shapes
        self.modules = tuple(m for m in LORA_TARGETS if m in shapes)
        self.num_layers = num_layers
        self.device = torch.device(device)
        width = num_layers * len(self.modules)
        self.a = torch.zeros(1, width, max_rank, dtype=torch.int64, device=self.device)
        """int64 [slots, layers x projections, max rank]: A row offsets (slot 0: no adapter)."""
        self.b = torch.zeros_like(self.a)
        """The Bᵀ row offsets."""
        self.rank = torch.zeros(1, width, dtype=torch.int64, device=self.device)
        """int64 [slots, layers x projections]: the rank (0: not adapted)."""
        self.scale = torch.zeros(1, width, dtype=torch.float32, device=self.device)
        """float32 [slots, layers x projections]."""
        self._slots: dict[SlotKey, int] = {}
        self._free: list[int] = []
        self.targeted: set[str] = set()
        """Projections some placed slot adapts: the only ones a step's LoRA covers."""
        self.row_slots: list[int] = []
        """Each decode row's slot, in plan order."""
        self._rows = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._adapted = False
        """Whether some row has an adapter (kept, not recounted each step)."""
        self._packed: tuple[int, StepLora, tuple[torch.Tensor, ...]] | None = None
        self.slot_writes = 0
        """Adapter loads written into the tables since start."""

    @property
    def max_rank(self) -> int:
        return self.a.shape[2]

    def set_rows(
        self, slots: list[AdapterSlot | None], resident: Callable[[str], ResidentAdapter | None]
    ) -> None:
        """Make the decode rows' adapters ``slots`` (None: no adapter), writing each adapter load
        not in the tables yet (``resident`` finds it)."""
        row_slots = [0 if s is None else self._slot_of(s, resident) for s in slots]
        if row_slots == self.row_slots:
            return
        self.row_slots = row_slots
        self._rows = host_ints(row_slots, self.device)
        self._changed()

    def set_row(
        self, row: int, slot: AdapterSlot | None, resident: Callable[[str], ResidentAdapter | None]
    ) -> None:
        """Make decode row ``row``'s adapter ``slot`` (the other rows kept): one row's write."""
        index = 0 if slot is None else self._slot_of(slot, resident)
        if self.row_slots[row] == index:
            return
        self.row_slots[row] = index
        self._rows[row] = index
        self._changed()

    def _changed(self) -> None:
        """The rows' slots changed: the packed buffers refilled (when their row count holds)."""
        self._adapted = any(self.row_slots)
        if self._packed is not None and self._packed[0] == len(self.row_slots):
            self._pack(self._packed[2])

    def _slot_of(self, slot: AdapterSlot, resident: Callable[[str], ResidentAdapter | None]) -> int:
        key = (slot.adapter_id, slot.placement)
        index = self._slots.get(key)
        if index is None:
            placed = resident(slot.adapter_id)
            if placed is None or placed.placement != slot.placement:
                raise KeyError(f"adapter {slot.adapter_id!r} placement {slot.placement} is not resident")
            index = self._slots[key] = self._take_slot()
            self._write_slot(index, placed)
        return index

    def _take_slot(self) -> int:
        if not self._free and self.rank.shape[0] >= KEPT_SLOTS:
            # Loads no row names any more (evicted, or reloaded elsewhere) give their slots back.
            used = set(self.row_slots)
            for key, index in list(self._slots.items()):
                if index not in used:
                    del self._slots[key]
                    self._free.append(index)
        if not self._free:
            count = self.rank.shape[0]
            self._grow(2 * count, self.max_rank)
            self._free.extend(range(count, 2 * count))
        return self._free.pop()

    def _write_slot(self, index: int, placed: ResidentAdapter) -> None:
        """One adapter load's rows: a host table of every (layer, projection), one copy each."""
        modules = placed.modules
        width = self.rank.shape[1]
        ranks, scales, a_rows, b_rows = [0] * width, [0.0] * width, [()] * width, [()] * width
        column = 0
        for layer in range(self.num_layers):
            for module in self.modules:
                found = modules.get((layer, module))
                if found is not None:
                    ranks[column], scales[column] = found.rows.rank, found.scale
                    a_rows[column], b_rows[column] = found.a_offsets, found.b_offsets
                    if module not in self.targeted:
                        self.targeted.add(module)
                        self._packed = None  # its segments leave this projection out
                column += 1
        if max(ranks) > self.max_rank:
            self._grow(self.rank.shape[0], max(ranks))
        width_r = self.max_rank
        pad = [(*rows, *([0] * (width_r - len(rows)))) for rows in a_rows]
        self.a[index] = torch.tensor(pad, dtype=torch.int64, device=self.device)
        pad = [(*rows, *([0] * (width_r - len(rows)))) for rows in b_rows]
        self.b[index] = torch.tensor(pad, dtype=torch.int64, device=self.device)
        self.rank[index] = torch.tensor(ranks, dtype=torch.int64, device=self.device)
        self.scale[index] = torch.tensor(scales, dtype=torch.float32, device=self.device)
        self.slot_writes += 1

    def _grow(self, slots: int, max_rank: int) -> None:
        old = self.rank.shape[0], self.max_rank
        for name in ("a", "b"):
            grown = torch.zeros(slots, self.rank.shape[1], max_rank, dtype=torch.int64, device=self.device)
            grown[: old[0], :, : old[1]] = getattr(self, name)
            setattr(self, name, grown)
        for name in ("rank", "scale"):
            table = getattr(self, name)
            grown = torch.zeros(slots, table.shape[1], dtype=table.dtype, device=self.device)
            grown[: old[0]] = table
            setattr(self, name, grown)
        if max_rank != old[1]:
            self._packed = None  # its buffers were sized by the old rank

    def step_lora(self) -> StepLora | None:
        """The rows' LoRA as segments over device buffers (one per row), or None when no row has
        an adapter. The same object while the number of rows stays the same: its buffers are
        refilled in place when the rows' slots change."""
        n = len(self.row_slots)
        if not self._adapted:
            return None
        if self._packed is None or self._packed[0] != n:
            buffers = self._buffers(n)
            self._pack(buffers)
            self._packed = (n, self._segments(n, buffers), buffers)
        return self._packed[1]

    def _buffers(self, n: int) -> tuple[torch.Tensor, ...]:
        width, device = self.rank.shape[1], self.device
        packed = n * self.max_rank + 1  # the last column takes the padding's writes
        return (
            torch.zeros(width, n + 1, dtype=torch.int32, device=device),  # rank starts
            torch.zeros(width, packed, dtype=torch.int64, device=device),  # A offsets
            torch.zeros(width, packed, dtype=torch.int64, device=device),  # Bᵀ offsets
            torch.zeros(width, n, dtype=torch.float32, device=device),  # scales
        )

    def _pack(self, buffers: tuple[torch.Tensor, ...]) -> None:
        """Fill ``buffers`` for the current rows: each (layer, projection)'s rank starts, its
        rows' A and Bᵀ offsets packed segment after segment, and its scales."""
        rank_starts, a_packed, b_packed, scales = buffers
        rows, max_rank = self._rows, self.max_rank
        n = rows.shape[0]
        ranks = self.rank.index_select(0, rows)  # [n, W]
        ends = ranks.cumsum(0)
        rank_starts[:, 1:] = ends.T
        k = torch.arange(max_rank, device=self.device)
        # Row j of segment s goes to starts[s] + j; the rows past its rank to the padding column.
        target = torch.where(k < ranks[:, :, None], (ends - ranks)[:, :, None] + k, n * max_rank)
        target = target.permute(1, 0, 2).reshape(ranks.shape[1], -1)
        a_packed.scatter_(1, target, self.a.index_select(0, rows).permute(1, 0, 2).reshape(target.shape))
        b_packed.scatter_(1, target, self.b.index_select(0, rows).permute(1, 0, 2).reshape(target.shape))
        scales.copy_(self.scale.index_select(0, rows).T)

    def _segments(self, n: int, buffers: tuple[torch.Tensor, ...]) -> StepLora:
        rank_starts, a_packed, b_packed, scales = buffers
        seg_starts = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        seg_starts_host = tuple(range(n + 1))
        layers = []
        column = 0
        for _ in range(self.num_layers):
            per_module = {}
            for module in self.modules:
                if module in self.targeted:
                    in_features, out_features = self.shapes[module]
                    per_module[module] = LoraSegments.on_device(
                        seg_starts,
                        seg_starts_host,
                        rank_starts[column],
                        a_packed[column],
                        b_packed[column],
                        scales[column],
                        self.max_rank,
                        in_features,
                        out_features,
                    )
                column += 1
            layers.append(per_module)
        return StepLora(layers)
