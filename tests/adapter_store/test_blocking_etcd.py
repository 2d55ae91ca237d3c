"""The catalog's blocking etcd client, against a real etcd: closing it ends every watch."""

from __future__ import annotations

import threading

import pytest

from services.adapter_store.blocking_etcd import BlockingEtcd
from services.runtime.etcd.membership import EtcdUnreachable, MembershipConfig

pytestmark = pytest.mark.integration

HANG_GUARD_S = 60.0
"""Only a hang reaches this: a cancelled watch ends at once."""


def test_a_watch_started_after_close_ends_at_once(etcd):
    """The catalog's watch thread may reconnect just as the store shuts down: a watch it starts
    after ``close()`` swept the open ones must still end, or the shutdown waits on it forever."""
    client = BlockingEtcd(MembershipConfig(etcd_endpoints=etcd.endpoint))
    client.close()
    ended: list[BaseException] = []

    def follow() -> None:
        try:
            for _ in client.watch(b"/rows/", b"/rows0", 1, "watch the test's rows"):
                pass
        except EtcdUnreachable as error:
            ended.append(error)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    client.close()
    assert not thread.is_alive(), "a watch started after close() never ended"
    assert len(ended) == 1
