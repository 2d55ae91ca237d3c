"""The benchmark's adapters on disk, written once and reused across runs.

Adapter ``i`` is a PEFT directory with rank ``ranks[i % len(ranks)]`` (round-robin, as S-LoRA
assigns ranks) on q/k/v/o of every layer (S-LoRA's setting), float16, seed ``i``. A set of ``n``
adapters is a prefix of a larger one, so one directory serves every ``n`` of a sweep.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from bench.systems.base import AdapterSet
from services.model_files.base_model import BaseModelSpec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MANIFEST = "bench-adapters.json"


def ensure_adapter_set(root: Path, spec: BaseModelSpec, count: int, ranks: tuple[int, ...]) -> AdapterSet:
    """At least ``count`` adapters under ``root`` (written if missing), viewed as ``count``."""
    root.mkdir(parents=True, exist_ok=True)
    manifest_path = root / MANIFEST
    identity = {"model": spec.name, "ranks": list(ranks), "targets": list(TARGETS), "dtype": "float16"}
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    written = manifest.get("count", 0) if manifest.get("identity") == identity else 0
    for index in range(written, count):
        sample = SampleAdapterSpec(rank=ranks[index % len(ranks)], target_modules=TARGETS, seed=index)
        write_peft_adapter(root / AdapterSet.name(index), spec, sample)
    if count > written:
        manifest_path.write_text(json.dumps({"identity": identity, "count": count}))
    return AdapterSet(root, tuple(ranks[i % len(ranks)] for i in range(count)))


def evict_from_page_cache(adapters: AdapterSet) -> None:
    """Ask the kernel to drop the adapters' file pages so a run reads them from the disk again
    (``posix_fadvise(DONTNEED)`` needs no privileges; dirty pages are flushed first)."""
    for index in range(adapters.count):
        for path in adapters.directory(index).iterdir():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def adapter_bytes(adapters: AdapterSet) -> int:
    """Bytes of the adapters' weight files."""
    return sum(
        (adapters.directory(i) / "adapter_model.safetensors").stat().st_size for i in range(adapters.count)
    )
