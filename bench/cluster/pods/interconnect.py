"""How the nodes are joined: the fabric between their uplinks (and the host's link).

:class:`BridgeFabric` is a Linux bridge in a namespace of its own: no added latency.
:class:`bench.cluster.pods.delayed_fabric.DelayedFabric` forwards the same frames through a
userspace switch that holds each one for the configured latency (this kernel has no netem).
Another mechanism (a delaying TCP proxy, say) fits behind the same two calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from bench.cluster.pods.commands import run


class Fabric(Protocol):
    """Joins nodes' uplinks at layer 2."""

    def create(self, name_prefix: str, add_netns: Callable[[str], None]) -> str:
        """Make the fabric; the name of the host's link into it (in the host's namespace)."""
        ...

    def attach(self, node: int, node_netns: str) -> str:
        """Give node ``node`` an uplink into the fabric; the uplink's name in ``node_netns``."""
        ...

    def finish(self) -> None:
        """Every node is attached: start forwarding."""
        ...

    def close(self) -> None:
        """Remove what :meth:`create` made outside the namespaces (which go on their own)."""
        ...


class BridgeFabric:
    """A bridge ``br0`` in namespace ``<prefix>-fabric``; veth pairs to the nodes and the host."""

    def __init__(self) -> None:
        self._netns = ""
        self._host_link = ""

    def create(self, name_prefix: str, add_netns: Callable[[str], None]) -> str:
        self._netns = f"{name_prefix}-fabric"
        add_netns(self._netns)
        run("ip", "-n", self._netns, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self._netns, "link", "set", "br0", "up")
        self._host_link = f"{name_prefix}h"
        run(
            "ip", "link", "add", self._host_link, "type", "veth", "peer", "name", "host", "netns", self._netns
        )
        run("ip", "-n", self._netns, "link", "set", "host", "master", "br0", "up")
        return self._host_link

    def attach(self, node: int, node_netns: str) -> str:
        port = f"node{node}"
        run("ip", "link", "add", "uplink", "netns", node_netns, "type", "veth", "peer", "name", port,
            "netns", self._netns)  # fmt: skip
        run("ip", "-n", self._netns, "link", "set", port, "master", "br0", "up")
        return "uplink"

    def finish(self) -> None:
        return  # the bridge forwards from the start

    def close(self) -> None:
        if self._host_link:
            run("ip", "link", "del", self._host_link, check=False)
