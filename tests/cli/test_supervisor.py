"""The supervisor with real processes: etcd killed -9 comes back on the same endpoint and data,
after the backoff of an injected clock."""

from __future__ import annotations

import os
import signal

import aetcd
import pytest
from support.polling import poll_until

from loramesh_cli.restart_policy import RestartPolicy
from loramesh_cli.supervisor import EtcdUnit, Supervisor, describe_exit

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def read_key(endpoint: str, key: bytes) -> bytes | None:
    host, port = endpoint.rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=30) as client:
        found = await client.get(key)
        return found.value if found else None


async def test_killed_etcd_is_restarted_on_its_data_after_the_backoff(etcd):
    host, port = etcd.endpoint.rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=30) as client:
        await client.put(b"/survives", b"yes")
    clock = Clock()
    changes = []
    unit = EtcdUnit("etcd", etcd)
    supervisor = Supervisor(
        [unit],
        RestartPolicy(initial_backoff_s=5.0),
        on_change=lambda: changes.append(unit.pid()),
        clock=clock,
    )
    supervisor.launched(unit)
    first_pid = unit.pid()
    await supervisor.check()
    assert changes == []  # alive: nothing to do

    os.kill(first_pid, signal.SIGKILL)
    tracker = supervisor.trackers["etcd"]
    await poll_until(supervisor.check, lambda _: tracker.last_exit_code is not None, "the exit seen")
    assert describe_exit(tracker.last_exit_code) == "killed by signal 9" and tracker.restart_at == 1005.0
    clock.now = 1004.9
    await supervisor.check()
    assert not etcd.running  # still backing off

    clock.now = 1005.0
    await supervisor.check()
    assert etcd.running and unit.pid() != first_pid and tracker.restarts == 1
    assert await read_key(etcd.endpoint, b"/survives") == b"yes"
    assert changes == [0, unit.pid()]  # one write for the exit, one for the restart
