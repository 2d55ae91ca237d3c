"""The worker's channels to the kv_manager replicas carry the service channels' keepalive and
reconnect options (a replica back from an outage is asked again within seconds)."""

from __future__ import annotations

from services.gpu_worker.distkv.transport import kv_manager_directory
from services.gpu_worker.distkv.transport.kv_manager_directory import KvManagerDirectory
from services.runtime.errors import Unavailable
from services.runtime.process.ports import free_port
from services.runtime.rpc import keepalive
from services.runtime.security.tls import sync_channel


def test_the_channels_to_the_kv_managers_ping_and_reconnect_as_the_service_channels_do(monkeypatch):
    opened = []

    def record(address, tls, options=()):
        opened.append(dict(options))
        return sync_channel(address, tls, options)

    monkeypatch.setattr(kv_manager_directory, "sync_channel", record)
    directory = KvManagerDirectory((f"127.0.0.1:{free_port()}",), deadline_s=2.0)
    try:
        directory.suggest("debtor", 1)
    except Unavailable:
        pass  # nobody listens there: only the channel's options matter
    finally:
        directory.close()
    assert opened == [dict(keepalive.CHANNEL_OPTIONS)]
