"""Turn the running requests into the model's :class:`StepBatch`: flattened tokens, KV rows to
write and to attend over, and per-layer LoRA segments gathered from resident adapters."""

from __future__ import annotations

import torch

from services.gpu_worker.engine.request import EngineRequest
from services.gpu_worker.kernels.lora_segments import LoraSegments
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.step_batch import DecodeGroup, PrefillSpan, StepBatch
from services.runtime.base_model import LORA_TARGETS


class StepBuilder:
    def __init__(self, model: LlamaModel, pool: UnifiedPool, lora_backend: str = "auto"):
        self.model = model
        self.pool = pool
        self.lora_backend = lora_backend
        cfg = model.config
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.shapes = {
            "q_proj": (hidden, q_dim),
            "k_proj": (hidden, kv_dim),
            "v_proj": (hidden, kv_dim),
            "o_proj": (q_dim, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        # Decode steps with an unchanged batch reuse the LoRA segments of the previous step.
        self._lora_key: tuple | None = None
        self._lora: list[dict[str, LoraSegments]] | None = None

    def build(self, requests: list[EngineRequest], residency: AdapterResidency) -> StepBatch:
        device = self.pool.device
        token_ids: list[int] = []
        position_ranges: list[torch.Tensor] = []
        write_keys, write_values = [], []
        decode_rows, decode_keys, decode_values = [], [], []
        prefills: list[PrefillSpan] = []
        logits_rows: list[int] = []
        row = 0
        for request in requests:
            start, end = request.num_computed, request.total_len
            token_ids.extend(request.all_ids[start:end])
            positions = torch.arange(start, end, device=device)
            position_ranges.append(positions)
            keys, values = request.kv.rows(positions)
            write_keys.append(keys)
            write_values.append(values)
            context_keys, context_values = request.kv.rows(torch.arange(end, device=device))
            n = end - start
            if n == 1:
                decode_rows.append(row)
                decode_keys.append(context_keys)
                decode_values.append(context_values)
            else:
                mask = torch.arange(end, device=device)[None, :] <= positions[:, None]
                prefills.append(PrefillSpan(row, row + n, context_keys, context_values, mask))
            row += n
            logits_rows.append(row - 1)
        return StepBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=torch.cat(position_ranges),
            write_key_rows=torch.cat(write_keys),
            write_value_rows=torch.cat(write_values),
            decode=self._decode_group(decode_rows, decode_keys, decode_values),
            prefills=prefills,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64, device=device),
            lora=self._lora_segments(requests, residency),
            lora_backend=self.lora_backend,
        )

    def _decode_group(self, rows, keys, values) -> DecodeGroup | None:
        if not rows:
            return None
        device = self.pool.device
        lengths = torch.tensor([k.shape[0] for k in keys], device=device)
        padded_keys = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)
        padded_values = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
        mask = torch.arange(padded_keys.shape[1], device=device)[None, :] < lengths[:, None]
        return DecodeGroup(
            token_rows=torch.tensor(rows, dtype=torch.int64, device=device),
            key_rows=padded_keys,
            value_rows=padded_values,
            mask=mask[:, None, None, :],
        )

    def _lora_segments(
        self, requests: list[EngineRequest], residency: AdapterResidency
    ) -> list[dict[str, LoraSegments]] | None:
        adapter_ids = [r.spec.adapter_id for r in requests]
        if all(a is None for a in adapter_ids):
            return None
        counts = [r.new_tokens for r in requests]
        resident = [residency.get(a) if a is not None else None for a in adapter_ids]
        # An adapter's pages fix its rows' offsets, so (adapter, pages, tokens) identifies the work.
        key = tuple((a, tuple(r.pages) if r else (), n) for a, r, n in zip(adapter_ids, resident, counts))
        if key == self._lora_key:
            return self._lora
        layers = []
        for layer in range(self.model.config.num_layers):
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
        self._lora_key, self._lora = key, layers
        return layers
