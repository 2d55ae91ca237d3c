"""Shared fixtures: a real etcd per test (DESIGN §9: never mock etcd)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.model_files.base_model import load_base_model_spec
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MembershipConfig


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh single-member etcd in ``tmp_path/etcd`` on free loopback ports, stopped by PID.

    Tests using it should be marked ``@pytest.mark.integration``. The server can be stopped,
    killed, restarted (``restart(wipe=True)`` for a brand-new cluster) from the test.
    """
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def membership_config(etcd: EtcdServer) -> MembershipConfig:
    """Membership settings for the ``etcd`` fixture, with a short TTL (2 s, the smallest etcd
    grants with its default election timeout) so dead members vanish quickly in tests."""
    return MembershipConfig(etcd_endpoints=etcd.endpoint, ttl_s=2, load_interval_s=0.5)


@pytest.fixture(scope="session")
def base_spec():
    """Dimensions of the real default model, SmolLM2-135M-Instruct (read from its GGUF header)."""
    return load_base_model_spec()
