"""Fixtures of the tests that start real service processes."""

from __future__ import annotations

import pytest

from services.gpu_worker.model.loading import load_model


@pytest.fixture(scope="module")
def loaded():
    """The default model (SmolLM2-135M-Instruct), unquantized, for in-process reference runs."""
    return load_model()
