"""Activated LoRA (aLoRA) adapters for tests: a sample adapter in PEFT's format whose config
names an invocation (``alora_invocation_tokens``), so PEFT loads it as an aLoRA."""

from __future__ import annotations

import json
from pathlib import Path

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from services.model_files.base_model import BaseModelSpec


def write_alora_adapter(
    directory: Path, spec: BaseModelSpec, sample: SampleAdapterSpec, invocation: list[int] | None
) -> Path:
    """``sample`` written to ``directory``, an aLoRA invoked by ``invocation`` (None: a standard
    LoRA); returns the directory."""
    write_peft_adapter(directory, spec, sample)
    if invocation is not None:
        config_file = directory / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "alora_invocation_tokens": invocation}))
    return directory


def write_adapters(
    root: Path, spec: BaseModelSpec, tokenizer, adapters: dict[str, tuple[SampleAdapterSpec, str | None]]
) -> tuple[dict[str, list[int]], dict[str, Path]]:
    """``adapters`` (name -> weights and invocation text, None: a standard LoRA) written under
    ``root``: each aLoRA's invocation as ``tokenizer`` encodes it, and each adapter's directory."""
    invocations = {name: tokenizer.encode(text) for name, (_, text) in adapters.items() if text}
    dirs = {
        name: write_alora_adapter(root / name, spec, sample, invocations.get(name))
        for name, (sample, _) in adapters.items()
    }
    return invocations, dirs
