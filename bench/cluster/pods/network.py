"""The run's network: a namespace per pod, a bridge per node, nodes joined by a fabric.

Addresses come from one private /16 (``10.244.0.0/16`` unless the host already routes it; then
the next free one of ``10.244``-``10.254``): node ``n``'s pods are on ``<p>.<n+1>.0/24`` behind
the node's bridge at ``<p>.<n+1>.1``; the nodes' uplinks and the host are on ``<p>.250.0/24``
(host ``.1``, node ``n`` ``.<n+10>``); Service virtual IPs are ``<p>.200.<k+1>``. A pod's only
route is the /16 through its node: no default route, nothing outside is reachable from a pod.

Each node is a network namespace holding its bridge and forwarding between its pods and the
fabric (ip_forward on in the node's namespace only; the host's settings are not touched). The
host gets one link into the fabric and one route, the /16, so that a human (and the fake API
server, :mod:`bench.cluster.pods.kube_api`) can reach the pods.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import shutil
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.cluster.pods.commands import in_netns, run
from bench.cluster.pods.interconnect import BridgeFabric, Fabric

NETNS_ETC = Path("/etc/netns")
LOCK_FILE = Path("/run/lock/loramesh-pods.lock")
PREFIXES = tuple(f"10.{b}" for b in range(244, 255))
"""Candidate /16s, first free wins."""
NAME_PREFIX = "lmp"
"""Every namespace and host link a run makes starts with ``lmp<run id>``."""


@dataclass(frozen=True)
class AddressPlan:
    """The run's addresses, all inside ``<prefix>.0.0/16``."""

    prefix: str
    """``10.244``: the /16's first two octets."""

    @property
    def cidr(self) -> str:
        return f"{self.prefix}.0.0/16"

    def node_subnet(self, node: int) -> str:
        return f"{self.prefix}.{node + 1}.0/24"

    def node_gateway(self, node: int) -> str:
        return f"{self.prefix}.{node + 1}.1"

    def pod_address(self, node: int, index: int) -> str:
        if index > 250:
            raise ValueError(f"node {node} is full: more than 251 pods")
        return f"{self.prefix}.{node + 1}.{index + 2}"

    @property
    def host_address(self) -> str:
        return f"{self.prefix}.250.1"

    def uplink_address(self, node: int) -> str:
        return f"{self.prefix}.250.{node + 10}"

    def service_ip(self, index: int) -> str:
        return f"{self.prefix}.200.{index + 1}"


def _routed_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for route in json.loads(run("ip", "-4", "-j", "route", "show", "table", "all") or "[]"):
        try:
            nets.append(ipaddress.ip_network(route.get("dst", ""), strict=False))
        except ValueError:
            continue  # "default" (the host's own way out, not a network a run could take)
    for link in json.loads(run("ip", "-4", "-j", "addr") or "[]"):
        for addr in link.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{addr['local']}/{addr['prefixlen']}", strict=False))
    return nets


def free_prefix() -> str:
    """The first candidate /16 that no route or address of the host overlaps."""
    taken = _routed_networks()
    for prefix in PREFIXES:
        net = ipaddress.ip_network(f"{prefix}.0.0/16")
        if not any(net.overlaps(t) for t in taken):
            return prefix
    raise RuntimeError(f"every candidate /16 ({PREFIXES[0]} to {PREFIXES[-1]}) is in use on this host")


@contextmanager
def host_lock():
    """Serialises choosing a /16 and taking it between runs started at once."""
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with LOCK_FILE.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass
class PodNetwork:
    """One pod's namespace and address."""

    netns: str
    ip: str
    node: int


@dataclass
class ClusterNetwork:
    """Namespaces, bridges and links of one run; :meth:`close` removes every one of them."""

    run_id: str
    nodes: int
    fabric: Fabric = field(default_factory=BridgeFabric)
    plan: AddressPlan | None = None
    pods: dict[str, PodNetwork] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    _per_node: list[int] = field(default_factory=list)

    @property
    def name_prefix(self) -> str:
        return f"{NAME_PREFIX}{self.run_id}"

    def node_netns(self, node: int) -> str:
        return f"{self.name_prefix}-node{node}"

    def _add_netns(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self.namespaces.append(name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def create(self) -> None:
        """The nodes, the fabric and the host's link and route."""
        with host_lock():
            self.plan = AddressPlan(free_prefix())
            host_link = self.fabric.create(self.name_prefix, self._add_netns)
            run("ip", "addr", "add", f"{self.plan.host_address}/24", "dev", host_link)
            run("ip", "link", "set", host_link, "up")
            for node in range(self.nodes):
                netns = self.node_netns(node)
                self._add_netns(netns)
                uplink = self.fabric.attach(node, netns)
                run("ip", "-n", netns, "addr", "add", f"{self.plan.uplink_address(node)}/24", "dev", uplink)
                run("ip", "-n", netns, "link", "set", uplink, "up")
                run("ip", "-n", netns, "link", "add", "br0", "type", "bridge")
                run("ip", "-n", netns, "addr", "add", f"{self.plan.node_gateway(node)}/24", "dev", "br0")
                run("ip", "-n", netns, "link", "set", "br0", "up")
                in_netns(netns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
                run("ip", "route", "add", self.plan.node_subnet(node), "via", self.plan.uplink_address(node))
            self.fabric.finish()
            for node in range(self.nodes):
                for other in range(self.nodes):
                    if other != node:
                        run("ip", "-n", self.node_netns(node), "route", "add", self.plan.node_subnet(other),
                            "via", self.plan.uplink_address(other))  # fmt: skip
        self._per_node = [0] * self.nodes

    def add_pod(self, pod: str, node: int) -> PodNetwork:
        """A namespace for ``pod`` on ``node``: ``eth0`` on the node's bridge, one route."""
        assert self.plan is not None, "create() first"
        netns = f"{self.name_prefix}-{pod}"
        index = self._per_node[node]
        self._per_node[node] += 1
        ip = self.plan.pod_address(node, index)
        node_ns = self.node_netns(node)
        self._add_netns(netns)
        port = f"p{index}"
        run(
            "ip",
            "link",
            "add",
            "eth0",
            "netns",
            netns,
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            node_ns,
        )
        run("ip", "-n", node_ns, "link", "set", port, "master", "br0", "up")
        run("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        run("ip", "-n", netns, "link", "set", "eth0", "up")
        run("ip", "-n", netns, "route", "add", self.plan.cidr, "via", self.plan.node_gateway(node))
        net = PodNetwork(netns, ip, node)
        self.pods[pod] = net
        return net

    def etc_dir(self, netns: str) -> Path:
        """``/etc/netns/<netns>``: what ``ip netns exec`` binds over /etc (the pod's hosts)."""
        path = NETNS_ETC / netns
        path.mkdir(parents=True, exist_ok=True)
        return path

    def close(self) -> None:
        """Every namespace (with its links), the host link, the /etc/netns entries."""
        for netns in reversed(self.namespaces):
            run("ip", "netns", "del", netns, check=False)
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        self.namespaces.clear()
        self.fabric.close()


def remove_leftovers(run_id: str) -> None:
    """Whatever a run that could not clean up left (its process was killed): namespaces, the
    host link, /etc/netns entries with its prefix."""
    prefix = f"{NAME_PREFIX}{run_id}"
    for name in os.listdir("/run/netns") if os.path.isdir("/run/netns") else []:
        if name.startswith(prefix + "-"):
            for pid in run("ip", "netns", "pids", name, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run("ip", "netns", "del", name, check=False)
    for path in NETNS_ETC.glob(f"{prefix}-*") if NETNS_ETC.is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)
    for link in json.loads(run("ip", "-j", "link", check=False) or "[]"):
        if link.get("ifname", "").startswith(prefix):
            run("ip", "link", "del", link["ifname"], check=False)
