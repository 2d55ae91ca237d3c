"""System (c), "PEFT": HuggingFace transformers + peft behind a one-adapter-per-batch server.

S-LoRA (§7) built this baseline as "a server that batches single-adapter requests and swaps
adapter weights between batches"; it has no continuous batching and no paged memory. Here:

* the base model is transformers' ``*ForCausalLM`` built from ``load_model(context.model_path)``
  (the same fp32 weights the loramesh engine serves), wrapped in a ``PeftModel``;
* policy, FCFS: the oldest waiting request's adapter goes next; its batch takes that adapter's
  waiting requests in arrival order, up to ``context.max_batch``;
* a batch runs as one ``generate`` call: prompts left-padded, greedy, ``max_new_tokens`` =
  ``min_new_tokens`` = the longest ``output_len`` of the batch (EOS suppressed, so every request
  gets at least its ``output_len`` tokens; shorter requests ride along until the batch ends,
  as static batching does);
* before the clock, each slot runs one short ``generate`` (a warm-up: oneDNN's primitives and
  transformers' first-call paths), as the engine's set-up is outside the window too;
* arrivals are checked between batches: a request whose trace time has passed joins the queue
  (requests arriving during a batch wait for the next one, as in a real batch server);
* at ``context.window_s`` the running ``generate`` stops after its current step; requests not
  completed keep ``finish_s = None`` with the tokens produced so far.

Generous to the baseline, on purpose:

* **Adapter swap by copying weights into a resident slot.** One PEFT adapter "slot" is created
  before the clock for each distinct adapter configuration (rank, alpha, targets...; the bench's
  adapters need one per rank); swapping copies the next adapter's tensors (read from disk, OS
  page cache) into its slot's LoRA parameters and activates the slot. This is S-LoRA's "swap
  adapter weights between batches" at its cheapest. Measured on SmolLM2-135M, 100 adapters of
  rank 8/16 on q/k/v/o, on the shared 2-CPU dev machine (±2×): slot swap ≈ 16 ms (read 6, copy 1, ``set_adapter`` among the
  slots 9); ``load_adapter`` + ``set_adapter`` + ``delete_adapter`` per batch ≈ 215 ms; and
  preloading all adapters into the ``PeftModel`` is worse still: ``load_adapter`` slows down as
  adapters accumulate (≈ 190 s to load 100) and ``set_adapter`` toggles ``requires_grad`` on
  every loaded adapter (≈ 200 ms per switch with 100 loaded). Slots give the same outputs as
  peft's own loading (logits bit-identical).
* **No swap when the slot already holds the adapter.**
* **No memory limits**: HF's KV cache grows as the batch needs (``context.pool_mib`` does not
  apply) and adapters are read from disk at each swap through the OS page cache
  (``context.host_cache_mib`` does not apply).
* **Per-request times are taken at the decoding step** where the request's first /
  ``output_len``-th token is produced (a stopping criterion that reads the clock after every
  step), not when the batch's ``generate`` returns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.systems.base import AdapterSet, RequestRecord, RunContext
from services.gpu_worker.model.loading import load_model

WARM_UP_PROMPT = tuple(range(100, 116))
"""Token ids of the warm-up's prompt (ordinary word pieces)."""
WARM_UP_TOKENS = 2
"""Tokens each slot's warm-up generates: a prefill and a decode step."""
_CONFIG_FIELDS_IGNORED = ("base_model_name_or_path", "revision", "inference_mode")
"""Fields of ``adapter_config.json`` that do not change the LoRA modules, so two adapters that
differ only there can share a slot."""


@dataclass(frozen=True)
class PeftBaselineOptions:
    """How the PEFT baseline is labelled (it has no tuning knobs: the policy is fixed FCFS)."""

    name: str = "peft"
    """Label in tables and plots."""


class PeftBaselineSystem:
    """HF transformers + peft, batches of one adapter, FCFS (see the module docstring)."""

    def __init__(self, options: PeftBaselineOptions = PeftBaselineOptions()):
        self.options = options
        self.name = options.name
        self.switches = 0
        """Adapter swaps (weights copied into a slot) during the last run."""
        self.switch_s = 0.0
        """Seconds the last run spent making adapters active (swaps and slot changes), within
        the window."""
        self.outputs: dict[str, list[int]] = {}
        """Each request's generated token ids in the last run (tests compare them with peft's)."""

    def stats(self) -> dict:
        """What the last run did besides serving, for the results file."""
        return {"switches": self.switches, "switch_s": round(self.switch_s, 3)}

    def run(self, context: RunContext) -> list[RequestRecord]:
        self.switches, self.switch_s, self.outputs = 0, 0.0, {}
        trace = context.trace
        model = _PeftServer(context.model_path, context.adapters, sorted({r.adapter for r in trace}))
        # Before the clock, as the engine's set-up: the first generate of each slot creates
        # oneDNN primitives and takes transformers' first-call paths.
        model.warm_up()
        records = [RequestRecord(r.request_id, r.adapter, r.time_s, r.input_len, r.output_len) for r in trace]
        start = context.clock.now()
        arrived, queue = 0, []
        while (now := context.clock.now() - start) < context.window_s:
            while arrived < len(trace) and trace[arrived].time_s <= now:
                queue.append(arrived)
                arrived += 1
            if not queue:
                if arrived == len(trace):
                    break
                context.clock.sleep(min(trace[arrived].time_s, context.window_s) - now)
                continue
            adapter = trace[queue[0]].adapter
            batch = [i for i in queue if trace[i].adapter == adapter][: context.max_batch]
            chosen = set(batch)
            queue = [i for i in queue if i not in chosen]
            swap_start = context.clock.now()
            self.switches += model.activate(adapter)
            self.switch_s += context.clock.now() - swap_start
            self._generate(model, context, batch, records, start)
        unfinished = sum(not record.completed for record in records)
        if unfinished:
            context.on_progress(unfinished)
        return records

    def _generate(
        self,
        model: _PeftServer,
        context: RunContext,
        batch: list[int],
        records: list[RequestRecord],
        start: float,
    ) -> None:
        """Run the requests at trace positions ``batch`` as one ``generate``; fill their records
        step by step."""
        rows = [records[i] for i in batch]

        def on_step(step: int) -> bool:
            now = context.clock.now() - start
            for record in rows:
                if step == 1:
                    record.first_token_s = now
                if step <= record.output_len:
                    record.output_tokens = step
                if step == record.output_len:
                    record.finish_s = now
                    context.on_progress(1)
            return now >= context.window_s

        prompts = [context.prompt(context.trace[i]) for i in batch]
        tokens = model.generate(prompts, max(r.output_len for r in rows), on_step)
        for record, output in zip(rows, tokens):
            self.outputs[record.request_id] = output[: record.output_tokens]


class _PeftServer:
    """The ``PeftModel`` with one LoRA slot per distinct adapter configuration."""

    def __init__(self, model_path: str | None, adapters: AdapterSet, used: list[int]):
        from peft import PeftModel
        from transformers import AutoConfig, AutoModelForCausalLM

        loaded = load_model(model_path)
        hf_config = loaded.config.to_hf_config()
        base = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(hf_config.pop("model_type"), **hf_config), dtype=torch.float32
        )
        base.load_state_dict(loaded.weights, strict=not loaded.config.tie_word_embeddings)
        base.tie_weights()
        self.eos_token_ids = list(loaded.config.eos_token_ids)
        self.adapters = adapters
        self.slot_of: dict[int, str] = {}
        """Adapter index -> name of the slot whose configuration it has."""
        self.holds: dict[str, int] = {}
        """Slot name -> adapter index whose weights it holds now."""
        model = None
        slots: dict[str, str] = {}
        for index in used:
            key = _config_key(adapters.directory(index))
            if key not in slots:
                slots[key] = slot = f"slot-{len(slots)}"
                directory = str(adapters.directory(index))
                if model is None:
                    model = PeftModel.from_pretrained(base, directory, adapter_name=slot)
                else:
                    model.load_adapter(directory, adapter_name=slot)
                self.holds[slot] = index
            self.slot_of[index] = slots[key]
        # load_adapter leaves the new modules in training mode (dropout active, 3x slower here).
        self.model = (model if model is not None else base).eval()
        self.params = dict(self.model.named_parameters())
        self.active: str | None = None

    def warm_up(self) -> None:
        """One short greedy generate through each slot (as it holds its adapter now)."""
        for slot in sorted(set(self.slot_of.values())):
            self.activate(self.holds[slot])
            self.generate([WARM_UP_PROMPT], WARM_UP_TOKENS, lambda step: False)

    def activate(self, adapter: int) -> bool:
        """Make ``adapter`` the one applied; True if weights had to be copied (a swap)."""
        from safetensors.torch import load_file

        slot = self.slot_of[adapter]
        swapped = self.holds[slot] != adapter
        if swapped:
            tensors = load_file(str(self.adapters.directory(adapter) / "adapter_model.safetensors"))
            with torch.no_grad():
                for name, tensor in tensors.items():
                    # base_model...q_proj.lora_A.weight -> base_model...q_proj.lora_A.<slot>.weight
                    self.params[f"{name.removesuffix('.weight')}.{slot}.weight"].copy_(tensor)
            self.holds[slot] = adapter
        if self.active != slot:
            self.model.set_adapter(slot)
            self.active = slot
        return swapped

    def generate(
        self, prompts: list[tuple[int, ...]], new_tokens: int, on_step: Callable[[int], bool]
    ) -> list[list[int]]:
        """Greedy ``new_tokens`` tokens for each prompt (left-padded batch, EOS suppressed), or
        fewer when ``on_step(tokens so far)``, called after every step, returns True."""
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        width = max(len(p) for p in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1

        class StepClock(StoppingCriteria):
            def __call__(self, ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
                return torch.full((ids.shape[0],), on_step(ids.shape[1] - width), dtype=torch.bool)

        config = GenerationConfig(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,  # masked out; any id will do
            eos_token_id=self.eos_token_ids or None,
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([StepClock()]),
            )
        return out[:, width:].tolist()


def _config_key(directory: Path) -> str:
    """What decides an adapter's LoRA module shapes and scales: its config minus bookkeeping."""
    config = json.loads((directory / "adapter_config.json").read_text())
    for name in _CONFIG_FIELDS_IGNORED:
        config.pop(name, None)
    return json.dumps(config, sort_keys=True)
