"""The adapter store's scale bench (issue 30): its "work alone" figures do the work they name.
No timing verdict: only that the checks run, on the bytes named, and leave nothing behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.adapter_store_scale import (
    WEIGHTS,
    real_size_templates,
    variant,
    work_alone_mb_per_s,
    write_file_sources,
)
from services.runtime.errors import InvalidArgument


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> list[dict[str, bytes]]:
    return real_size_templates(tmp_path_factory.mktemp("templates"))


def _with_nan(weights: bytes) -> bytes:
    """The safetensors bytes with their last float16 value made NaN."""
    data = bytearray(weights)
    data[-2:] = np.array([np.nan], dtype=np.float16).tobytes()
    return bytes(data)


def test_both_figures_write_every_adapter_and_leave_no_blob(templates, tmp_path: Path):
    rates = work_alone_mb_per_s(tmp_path, templates, 4, 2)
    assert set(rates) == {"bare", "with_checks"} and all(rate > 0 for rate in rates.values())
    assert not (tmp_path / "blob-path").exists()


def test_with_checks_validates_what_it_reads_from_the_sources(templates, tmp_path: Path):
    sources = tmp_path / "sources"
    write_file_sources(sources, templates, 3)
    assert work_alone_mb_per_s(tmp_path, templates, 3, 2, sources)["with_checks"] > 0
    bad = sources / "real-00001" / WEIGHTS
    bad.write_bytes(_with_nan(variant(templates[1], 1)[WEIGHTS]))
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        work_alone_mb_per_s(tmp_path, templates, 3, 2, sources)
    assert not (tmp_path / "blob-path").exists()
