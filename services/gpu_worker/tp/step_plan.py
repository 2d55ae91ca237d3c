"""A device-free description of one step and how a rank turns it into its ``StepBatch``.

Every rank of a group holds the same requests in the same order, reserves their KV pages in the
same order from a pool with the same number of pages, and pages the same adapter shards (same
shapes on every rank) in the same order: its page tables and adapter row offsets are then the
same as every other rank's, so one plan — these :class:`RequestStep` lists — addresses them all.
Only the rows' widths differ (the rank's ``kv_dim``, its shard widths).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from services.gpu_worker.kernels.dispatch import StepLora
from services.gpu_worker.kernels.lora_segments import LoraSegments
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.kv_cache import KvTable
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.step_batch import DecodeGroup, PrefillSpan, StepBatch
from services.gpu_worker.tp.sharding import TensorParallelLayout
from services.model_files.model_config import ModelConfig
from services.model_files.peft_format import LORA_TARGETS


@dataclass(frozen=True)
class RequestStep:
    """One request's part of a step: the tokens it adds (its prompt, or its last sampled token)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    adapter_id: str | None = None


def lora_shapes(config: ModelConfig, layout: TensorParallelLayout | None) -> dict[str, tuple[int, int]]:
    """``(in, out)`` widths of each projection's pool rows: the model's without TP, the shard
    rows' (``TensorParallelLayout.shard_widths``) with it."""
    if layout is not None and layout.size > 1:
        return {m: layout.shard_widths(m) for m in LORA_TARGETS}
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),
        "o_proj": (q_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


class RankRequests:
    """The requests' KV tables on one rank, and the step batches built from plans."""

    def __init__(
        self,
        pool: UnifiedPool,
        residency: AdapterResidency,
        shapes: dict[str, tuple[int, int]],
        lora_backend: str = "torch",
    ):
        self.pool = pool
        self.residency = residency
        self.shapes = shapes
        self.lora_backend = lora_backend
        self.tables: dict[str, KvTable] = {}
        self.lengths: dict[str, int] = {}
        self._lora_key: tuple | None = None
        self._lora: StepLora | None = None

    def finish(self, request_ids) -> None:
        for request_id in request_ids:
            self.tables.pop(request_id).release()
            del self.lengths[request_id]

    def build(self, steps: list[RequestStep]) -> StepBatch:
        pool, device = self.pool, self.pool.device
        block = pool.layout.kv_block_tokens
        token_ids, positions, counts, ends, tables = [], [], [], [], []
        for step in steps:
            table = self.tables.get(step.request_id)
            if table is None:
                table = self.tables[step.request_id] = KvTable(pool)
                self.lengths[step.request_id] = 0
            start = self.lengths[step.request_id]
            end = start + len(step.new_token_ids)
            table.reserve(end)
            self.lengths[step.request_id] = end
            token_ids.extend(step.new_token_ids)
            positions.extend(range(start, end))
            counts.append(end - start)
            ends.append(end)
            tables.append(table.table())
        position = torch.tensor(positions, dtype=torch.int64, device=device)
        padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)  # [R, blocks, L]
        owner = torch.repeat_interleave(
            torch.arange(len(steps), device=device), torch.tensor(counts, device=device)
        )
        pages = padded[owner, position // block]  # [T, L]
        write_keys = (pages * (2 * block) + (position % block)[:, None]).T.contiguous()
        first = list(itertools.accumulate(counts, initial=0))
        decoding = [i for i, n in enumerate(counts) if n == 1]
        prefills = []
        for i, n in enumerate(counts):
            if n > 1:
                num_blocks = -(-ends[i] // block)
                key_blocks = (2 * tables[i][:num_blocks]).T.contiguous()
                context = torch.arange(num_blocks * block, device=device)
                mask = context[None, :] <= position[first[i] : first[i + 1], None]
                prefills.append(PrefillSpan(first[i], first[i + 1], key_blocks, key_blocks + 1, mask))
        decode = None
        if decoding:
            lengths = torch.tensor([ends[i] for i in decoding], dtype=torch.int64, device=device)
            num_blocks = -(-max(ends[i] for i in decoding) // block)
            dpages = padded[torch.tensor(decoding, device=device), :num_blocks]  # [R, N, L]
            key_blocks = (2 * dpages).permute(2, 0, 1).reshape(dpages.shape[2], -1)
            mask = torch.arange(num_blocks * block, device=device)[None, :] < lengths[:, None]
            decode = DecodeGroup(
                token_rows=torch.tensor([first[i] for i in decoding], dtype=torch.int64, device=device),
                key_blocks=key_blocks,
                value_blocks=key_blocks + 1,
                mask=mask[:, None, None, :],
            )
        return StepBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=position,
            write_key_rows=write_keys,
            write_value_rows=write_keys + block,
            decode=decode,
            prefills=prefills,
            logits_rows=torch.tensor(first[1:], dtype=torch.int64, device=device) - 1,
            lora=self._step_lora([s.adapter_id for s in steps], counts),
            lora_backend=self.lora_backend,
        )

    def _step_lora(self, adapter_ids: list[str | None], counts: list[int]) -> StepLora | None:
        if all(a is None for a in adapter_ids):
            return None
        resident = [self.residency.get(a) if a is not None else None for a in adapter_ids]
        key = tuple((a, r.placement if r else -1, n) for a, r, n in zip(adapter_ids, resident, counts))
        if key == self._lora_key:
            return self._lora
        layers = []
        for layer in range(self.pool.layout.num_layers):
            per_module = {}
            for module in LORA_TARGETS:
                placed = [r.modules.get((layer, module)) if r is not None else None for r in resident]
                if all(p is None for p in placed):
                    continue
                in_features, out_features = self.shapes[module]
                per_module[module] = LoraSegments.build(
                    counts,
                    [p.rows if p is not None else None for p in placed],
                    [p.scale if p is not None else 0.0 for p in placed],
                    in_features,
                    out_features,
                    self.pool.device,
                )
            layers.append(per_module)
        self._lora_key, self._lora = key, StepLora(layers)
        return self._lora
