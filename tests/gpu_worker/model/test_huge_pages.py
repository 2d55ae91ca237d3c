"""The base weights in one region advised for huge pages (``memory/huge_pages.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.gpu_worker.model.huge_pages import (
    ALIGNMENT,
    HUGE_PAGE_BYTES,
    gather_in_huge_pages,
    huge_page_bytes,
)
from services.gpu_worker.model.llama import LlamaModel

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            if inside:
                break
            inside = start <= address < end
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def test_gathered_copies_are_equal_aligned_and_in_one_region():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.uint8), torch.randn(4, 9).to(torch.bfloat16)]
    copies = gather_in_huge_pages(tensors)
    for original, copy in zip(tensors, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original)
        assert copy.data_ptr() % ALIGNMENT == 0
    storages = {copy.untyped_storage().data_ptr() for copy in copies}
    assert len(storages) == 1
    assert copies[0].data_ptr() % HUGE_PAGE_BYTES == 0


@pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
    reason="transparent huge pages are off on this kernel: the advice is ignored",
)
def test_the_region_is_advised_for_huge_pages():
    region = huge_page_bytes(4 * HUGE_PAGE_BYTES)
    assert _mapping_of(region.data_ptr()).get("THPeligible") == "1"


def test_a_cpu_model_streams_its_projections_and_head_from_one_region(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    matrices = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    matrices.append(model.lm_head)
    storages = {w.untyped_storage().data_ptr() for w in matrices}
    assert len(storages) == 1
