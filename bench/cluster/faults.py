"""The nemesis's faults, done to a running overlay (:class:`~bench.cluster.pods.runner.OverlayRun`)
and undone at their heal, every one inside the namespaces the run made:

- partition: nftables in each isolated pod's namespace drops what it sends to, and receives from,
  the pods it is cut off from (every other pod, clients included, when the fault names none); the
  nodes' own addresses stay reachable, as a kubelet reaches its pods across a cluster's partition;
- loss: nftables in both nodes' namespaces drops ``numgen random mod 100 < N`` of the packets
  their pods send to the other node's pods;
- latency: the delaying fabric (delayed_fabric.py) holds the frames between the two nodes longer;
  a run on a plain bridge has no way to delay (this kernel has no netem), so the fault is skipped
  and says so;
- kill-pod: SIGKILL to the pod's containers; the kubelet restarts them (no heal needed);
- kill-node: every pod of the node SIGKILLed and held down until the heal, then started again.

The schedule's symbolic targets are resolved when the fault starts: ``@etcd-leader`` by each
member's ``etcd_server_is_leader`` metric (its plain-HTTP metrics port, from its node, as
Prometheus reads it), ``@lending-creditor`` from the workers' latest load reports in etcd.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from bench.cluster.pods.commands import in_netns
from bench.cluster.pods.probes import netns_executor
from bench.cluster.pods.runner import OverlayRun
from bench.cluster.schedule import ETCD_LEADER, LENDING_CREDITOR, Fault, NemesisKind

ETCD_METRICS_PORT = 2381


@dataclass(frozen=True)
class Applied:
    """A fault as it was done: its targets resolved, or why it was not done."""

    fault: Fault
    skipped: str = ""
    """Why it was not done ("" when it was)."""


def node_index(node: str) -> int:
    """``node2`` -> 2 (the schedule's node names are the run's nodes)."""
    return int(node.removeprefix("node"))


class FaultExecutor:
    """Does and undoes faults on one overlay run."""

    def __init__(
        self,
        run: OverlayRun,
        lenders: Callable[[], Mapping[str, int]],
        names: Mapping[str, str] | None = None,
    ):
        """``lenders``: worker -> blocks it lends now, from the latest load reports; ``names``:
        the schedule's pod names -> the run's (None: the same)."""
        self.run = run
        self._lenders = lenders
        self._names = dict(names or {})

    # -- targets ------------------------------------------------------------------------------

    def etcd_leader(self) -> str | None:
        """The etcd member whose metrics say it leads (None: none answers as leader)."""
        for pod in self.run.pods_of("StatefulSet/etcd"):
            executor = netns_executor(self.run.network.node_netns(pod.node), workers=1)  # type: ignore[union-attr]
            try:
                metrics = executor.submit(_metrics, pod.ip).result(timeout=10)
            except (OSError, TimeoutError):
                continue
            finally:
                executor.shutdown(wait=False)
            if "\netcd_server_is_leader 1" in metrics:
                return pod.name
        return None

    def lending_creditor(self) -> str | None:
        lenders = {w: n for w, n in self._lenders().items() if n > 0}
        return max(sorted(lenders), key=lenders.__getitem__) if lenders else None

    def resolve(self, fault: Fault) -> Applied:
        """The fault on the run's pods: symbols resolved now, the schedule's names translated."""
        isolate = []
        for target in fault.isolate:
            target = self._names.get(target, target)
            if target == ETCD_LEADER:
                target = self.etcd_leader() or ""
            elif target == LENDING_CREDITOR:
                target = self.lending_creditor() or ""
            if not target:
                return Applied(fault, skipped=f"no pod answers as {fault.isolate}")
            isolate.append(target)
        rename = lambda pods: tuple(self._names.get(p, p) for p in pods)
        return Applied(
            replace(fault, isolate=tuple(isolate), from_pods=rename(fault.from_pods), pods=rename(fault.pods))
        )

    # -- faults -------------------------------------------------------------------------------

    def start(self, fault: Fault) -> Applied:
        applied = self.resolve(fault)
        if applied.skipped:
            return applied
        fault = applied.fault
        table = _table(fault)
        if fault.kind == NemesisKind.PARTITION:
            others = self._addresses(fault.from_pods) if fault.from_pods else self._all_but(fault.isolate)
            for pod in fault.isolate:
                in_netns(self.run.netns_of(pod), "nft", "-f", "-", stdin=_partition_rules(table, others))
        elif fault.kind == NemesisKind.LOSS:
            a, b = (node_index(n) for n in fault.nodes)
            plan = self.run.network.plan  # type: ignore[union-attr]
            for source, target in ((a, b), (b, a)):
                rules = _loss_rules(
                    table, plan.node_subnet(source), plan.node_subnet(target), fault.loss_percent
                )
                in_netns(self.run.network.node_netns(source), "nft", "-f", "-", stdin=rules)  # type: ignore[union-attr]
        elif fault.kind == NemesisKind.LATENCY:
            fabric = self.run.network.fabric  # type: ignore[union-attr]
            if not hasattr(fabric, "set_delay"):
                return Applied(fault, skipped="the run's fabric is a plain bridge, which cannot delay")
            a, b = (node_index(n) for n in fault.nodes)
            fabric.set_delay(a, b, fault.delay_ms)
        elif fault.kind == NemesisKind.KILL_POD:
            for pod in fault.pods:
                self.run.kill_pod(pod)
        elif fault.kind == NemesisKind.KILL_NODE:
            for pod in fault.pods:
                self.run.kill_pod(pod, hold=True)
        self.run.log(f"nemesis: {fault.label} started: {fault}")
        return applied

    def heal(self, applied: Applied) -> None:
        if applied.skipped:
            return
        fault, table = applied.fault, _table(applied.fault)
        if fault.kind == NemesisKind.PARTITION:
            for pod in fault.isolate:
                in_netns(self.run.netns_of(pod), "nft", "delete", "table", "inet", table, check=False)
        elif fault.kind == NemesisKind.LOSS:
            for node in fault.nodes:
                netns = self.run.network.node_netns(node_index(node))  # type: ignore[union-attr]
                in_netns(netns, "nft", "delete", "table", "inet", table, check=False)
        elif fault.kind == NemesisKind.LATENCY:
            a, b = (node_index(n) for n in fault.nodes)
            self.run.network.fabric.set_delay(a, b, None)  # type: ignore[union-attr]
        elif fault.kind == NemesisKind.KILL_NODE:
            for pod in fault.pods:
                self.run.release_pod(pod)
        self.run.log(f"nemesis: {fault.label} healed")

    def _addresses(self, pods) -> list[str]:
        by_name = {p.name: p.ip for p in [*self.run.pods, *self.run.clients.values()]}
        return [by_name[p] for p in pods]

    def _all_but(self, pods) -> list[str]:
        return [p.ip for p in [*self.run.pods, *self.run.clients.values()] if p.name not in pods]


def _table(fault: Fault) -> str:
    return f"nemesis_{fault.id}"


def _partition_rules(table: str, others: list[str]) -> str:
    peers = ", ".join(others)
    return (
        f"table inet {table} {{\n"
        f"  chain cut_in {{ type filter hook input priority -10; ip saddr {{ {peers} }} drop; }}\n"
        f"  chain cut_out {{ type filter hook output priority -10; ip daddr {{ {peers} }} drop; }}\n"
        "}\n"
    )


def _loss_rules(table: str, source: str, target: str, percent: float) -> str:
    return (
        f"table inet {table} {{\n"
        f"  chain lossy {{ type filter hook forward priority -10; "
        f"ip saddr {source} ip daddr {target} numgen random mod 100 < {round(percent)} drop; }}\n"
        "}\n"
    )


def _metrics(ip: str) -> str:
    connection = http.client.HTTPConnection(ip, ETCD_METRICS_PORT, timeout=5)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().read().decode(errors="replace")
    finally:
        connection.close()
