"""Fixtures for the whole mesh."""

from __future__ import annotations

import pytest
from support.mesh import start_mesh, wait_for_workers


@pytest.fixture
async def mesh(tmp_path):
    """The mesh with mutual TLS on everywhere (etcd included): the e2e tests run as a production
    deployment would; tests/e2e/test_mesh.py's overload test starts a plaintext one."""
    mesh = await start_mesh(tmp_path, tls=True)
    await wait_for_workers(mesh, len(mesh.workers))
    yield mesh
    mesh.stop()
