"""Fixtures for the whole mesh."""

from __future__ import annotations

import pytest
from support.mesh import start_mesh, wait_for_workers


@pytest.fixture
async def mesh(tmp_path):
    mesh = await start_mesh(tmp_path)
    await wait_for_workers(mesh, len(mesh.workers))
    yield mesh
    mesh.stop()
