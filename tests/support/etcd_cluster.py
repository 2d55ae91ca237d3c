"""A real three-member etcd cluster on loopback (Debian's ``etcd``), each member a child process
stopped by PID: what a test needs to kill or stop one member while the others keep a quorum."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.process.ports import free_port


class EtcdCluster:
    """``size`` members named ``m0``, ``m1``...; :attr:`endpoints` lists them in that order, the
    order every client tries them in."""

    def __init__(self, root: Path, size: int = 3):
        hosts = [(free_port("127.0.0.1"), free_port("127.0.0.1")) for _ in range(size)]
        initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(hosts))
        self.members = [
            EtcdServer(
                root / f"m{i}",
                client_port=client,
                peer_port=peer,
                name=f"m{i}",
                # etcd takes the last of a repeated flag: the whole cluster, not the member alone.
                extra_args=("--initial-cluster", initial, "--initial-cluster-token", root.name),
            )
            for i, (client, peer) in enumerate(hosts)
        ]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        """Start every member at once: none is healthy before a quorum has elected a leader."""
        with ThreadPoolExecutor(len(self.members)) as pool:
            for started in [pool.submit(m.start) for m in self.members]:
                started.result()

    def leader(self) -> int:
        """The index of the member that leads now (read from a running member's status)."""
        for member in self.members:
            if not member.running:
                continue
            status = _status(member)
            for index, other in enumerate(self.members):
                if other.running and _status(other)["header"]["member_id"] == status["leader"]:
                    return index
        raise RuntimeError("no running member names a running leader")

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def _status(member: EtcdServer) -> dict:
    request = urllib.request.Request(f"{member.client_url}/v3/maintenance/status", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())


@contextlib.contextmanager
def etcd_cluster(root: Path, size: int = 3) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(root, size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
