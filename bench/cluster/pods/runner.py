"""The overlay, run pod by pod: :class:`OverlayRun` puts it up and takes every trace of it down.

Start: render the overlay (plus the run's own components and patches), deal the pods onto the
nodes, make the network (network.py), each pod's hosts file, NetworkPolicy and Service rules
(netpolicy.py, cluster_dns.py), the Secrets' material (mesh_secrets.py), the stand-in API server
(kube_api.py) and the volumes, then hand every container to the kubelet (kubelet.py), whose
asyncio loop runs in a thread of its own. Nothing waits for readiness here: callers poll
:meth:`OverlayRun.status` (and :meth:`OverlayRun.check`, which fails the run as soon as a
NetworkPolicy drops a connection a mesh pod tried).

Stop (:meth:`OverlayRun.close`, also run at exit): every container SIGTERM, SIGKILL after
``stop_grace_s``, the namespaces (their links, bridges and nftables tables go with them), the
host link, /etc/netns entries, the buildah container, the run's folder. A run whose process was
killed before it could clean up is cleaned by the next run (its record under
``/run/loramesh-pods`` names a dead process).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from bench.cluster.pods import cluster_dns, netpolicy
from bench.cluster.pods.commands import run
from bench.cluster.pods.container import ContainerLaunch, identity
from bench.cluster.pods.delayed_fabric import DelayedFabric
from bench.cluster.pods.environment import command_line, container_env, service_links
from bench.cluster.pods.images import ImageRoot, resolve_image
from bench.cluster.pods.interconnect import BridgeFabric
from bench.cluster.pods.kube_api import KubeApi
from bench.cluster.pods.kubelet import Container
from bench.cluster.pods.mesh_secrets import MeshSecrets, make_secrets, pod_certificate
from bench.cluster.pods.network import ClusterNetwork, remove_leftovers
from bench.cluster.pods.placement import PodPlan, plan_pods
from bench.cluster.pods.probes import ProbeTarget, netns_executor
from bench.cluster.pods.render import BLOB_VOLUME, SECRET_TEMPLATES, Manifests, RunOverlay, kustomize, render
from bench.cluster.pods.volumes import VolumeSources, container_mounts, prepare_volumes

RECORDS = Path("/run/loramesh-pods")
"""One file per live run: its id, holding the pid of the process that owns it."""


class RunFailed(RuntimeError):
    """The overlay does not run as a cluster would run it."""


@dataclass(frozen=True)
class ClientPod:
    """A pod with no container of the overlay: a place to run a client from, as a user's pod
    in the cluster would (``OverlayRun.exec_in``)."""

    name: str
    namespace: str = "default"
    labels: Mapping[str, str] = field(default_factory=dict)
    node: int = 0


CPU_WITH_BLOB_VOLUME = RunOverlay(components=(BLOB_VOLUME,))
"""The CPU overlay with k8s/components/blob-volume: the overlay's own bucket is a placeholder,
and a run reaches nothing outside the machine."""


@dataclass(frozen=True)
class RunConfig:
    """One run of an overlay."""

    overlay: RunOverlay = CPU_WITH_BLOB_VOLUME
    """What is rendered."""
    nodes: int = 3
    """Nodes the pods are dealt onto (a bridge each)."""
    latency_ms: float = 0.0
    """Added one way between nodes (and between the host and a node); 0: a kernel bridge."""
    clients: tuple[ClientPod, ...] = ()
    """Pods of the caller's, outside the overlay."""
    use_built_image: bool = True
    """Run the loramesh image's own root filesystem where it is built (buildah), else the host's
    root with the project's venv; False: the host's always (the working tree's code, not the
    code the image was built from)."""
    backoff_s: float = 10.0
    """The kubelet's first restart back-off (doubling to 300 s)."""
    stop_grace_s: float = 10.0
    """At the end, how long containers have after SIGTERM before SIGKILL (the manifests'
    terminationGracePeriodSeconds is for a rollout, not for taking the run down)."""
    work_dir: Path | None = None
    """The run's files (logs, volumes, certificates); None: a temporary folder, removed after."""


@dataclass
class PodStatus:
    """One pod, as ``kubectl get pods -o wide`` shows it."""

    name: str
    owner: str
    node: int
    ip: str
    ready: bool
    running: bool
    restarts: int


class OverlayRun:
    """The overlay's pods, up between :meth:`start` and :meth:`close` (a context manager)."""

    def __init__(self, config: RunConfig = RunConfig()):
        self.config = config
        self.run_id = secrets.token_hex(2)
        self.pods: list[PodPlan] = []
        self.clients: dict[str, PodPlan] = {}
        self.services: list[cluster_dns.ServicePlan] = []
        self.containers: dict[str, list[Container]] = {}
        self.secrets: MeshSecrets | None = None
        self.network: ClusterNetwork | None = None
        self.events: list[str] = []
        self._images: dict[str, ImageRoot] = {}
        self._kube_api: KubeApi | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Task] = []
        self._executors: list = []
        self._temp = config.work_dir is None
        self.work = config.work_dir or Path(tempfile.mkdtemp(prefix="loramesh-pods-"))
        self._closed = False
        self._started_at = time.monotonic()
        self._log_lock = threading.Lock()

    # -- log ---------------------------------------------------------------------------------

    def log(self, message: str) -> None:
        """One line of the run's log (``<work>/run.log``, and :attr:`events`); any thread."""
        line = f"[{time.monotonic() - self._started_at:7.2f}s] {message}"
        with self._log_lock:
            self.events.append(line)
            with (self.work / "run.log").open("a") as out:
                out.write(line + "\n")

    # -- start -------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        atexit.register(self.close)
        self.work.mkdir(parents=True, exist_ok=True)
        clean_dead_runs()
        RECORDS.mkdir(parents=True, exist_ok=True)
        (RECORDS / self.run_id).write_text(str(os.getpid()))
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        manifests = Manifests(tuple(render(self.config.overlay, self.work / "overlay")))
        self.log(f"run {self.run_id}: {self.config.overlay.overlay} "
                 f"+ {[str(c) for c in self.config.overlay.components]}, {len(manifests.objects)} objects")  # fmt: skip
        fabric = DelayedFabric(self.config.latency_ms) if self.config.latency_ms > 0 else BridgeFabric()
        self.network = network = ClusterNetwork(self.run_id, self.config.nodes, fabric)
        network.create()
        assert network.plan is not None
        self.log(f"network {network.plan.cidr}: {self.config.nodes} nodes, {type(fabric).__name__}, "
                 f"latency {self.config.latency_ms} ms")  # fmt: skip
        self.pods = plan_pods(manifests.workloads(), self.config.nodes)
        clients = [
            PodPlan(c.name, c.namespace, dict(c.labels), {}, "client", c.node) for c in self.config.clients
        ]
        for pod in [*self.pods, *clients]:
            pod.ip = network.add_pod(pod.name, pod.node).ip
            self.log(f"pod {pod.name} ({pod.owner}) on node {pod.node} at {pod.ip}")
        self.clients = {c.name: c for c in clients}
        self.services = cluster_dns.plan_services(
            manifests.of_kind("Service"), self.pods, network.plan.service_ip
        )
        for service in self.services:
            self.log(
                f"service {service.name}: {service.vip or 'headless'} -> {[p.name for p in service.endpoints]}"
            )
        self._network_rules(manifests, [*self.pods, *clients])
        namespace = self.pods[0].namespace
        self.secrets = make_secrets(self.work / "certs", kustomize(SECRET_TEMPLATES), namespace)
        rbac = [
            o
            for o in manifests.objects
            if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
        ]
        self._kube_api = KubeApi(
            self.work / "kube-api", network.plan.host_address, rbac, self._pod_rows, self.log
        )
        self._kube_api.start()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kubelet", daemon=True)
        self._thread.start()
        for pod in self.pods:
            self._start_pod(pod, manifests)

    def _network_rules(self, manifests: Manifests, pods: list[PodPlan]) -> None:
        assert self.network is not None and self.network.plan is not None
        ns_labels = {o["metadata"]["name"]: {**o["metadata"].get("labels", {}),
                                             "kubernetes.io/metadata.name": o["metadata"]["name"]}
                     for o in manifests.of_kind("Namespace")}  # fmt: skip
        for pod in pods:
            ns_labels.setdefault(pod.namespace, {"kubernetes.io/metadata.name": pod.namespace})
        peers = [netpolicy.Peer(p.ip, p.namespace, p.labels) for p in pods]
        nodes = [self.network.plan.node_gateway(n) for n in range(self.config.nodes)]
        policies = manifests.of_kind("NetworkPolicy")
        nat = cluster_dns.nat_ruleset(self.services)
        for index, pod in enumerate(pods):
            netns = self.network.pods[pod.name].netns
            hosts = cluster_dns.hosts_file(
                pod, index, self.services, self.pods, self.network.plan.host_address
            )
            (self.network.etc_dir(netns) / "hosts").write_text(hosts)
            rules = netpolicy.ingress_rules(pod, policies, peers, ns_labels)
            netpolicy.apply(netns, netpolicy.ruleset(rules, nodes) + nat)
            self.log(
                f"pod {pod.name}: {'isolated, ' + str(len(rules)) + ' ingress rules' if rules is not None else 'not isolated'}"
            )

    def _image(self, name: str) -> ImageRoot:
        if name not in self._images:
            self._images[name] = resolve_image(name, self.config.use_built_image)
            self.log(f"image {self._images[name].description}")
        return self._images[name]

    def _start_pod(self, pod: PodPlan, manifests: Manifests) -> None:
        assert self.network is not None and self.network.plan is not None and self.secrets is not None
        assert self._kube_api is not None and self._loop is not None
        mesh, kube_api, plan = self.secrets, self._kube_api, self.network.plan
        config_maps = {c["metadata"]["name"]: c.get("data", {}) for c in manifests.of_kind("ConfigMap")}
        sources = VolumeSources(
            config_maps, mesh.data, self.work / "claims",
            csi=lambda p, attributes: pod_certificate(mesh, attributes, p.name, p.namespace),
            service_account=lambda p: {
                "token": kube_api.token(p.namespace, p.spec.get("serviceAccountName", "default")).encode(),
                "ca.crt": kube_api.ca_file.read_bytes(), "namespace": p.namespace.encode()},
        )  # fmt: skip
        if pod.spec.get("initContainers"):
            raise RunFailed(f"pod {pod.name}: init containers are not run by this runner")
        pod_dir = self.work / "pods" / pod.name
        volumes = prepare_volumes(pod, pod_dir, sources)
        net = self.network.pods[pod.name]
        node_ns = self.network.node_netns(pod.node)
        executor = netns_executor(node_ns)
        self._executors.append(executor)
        links = service_links(pod.namespace, self.services, plan.host_address)
        ports = {name: port for name, (port, _) in pod.container_ports().items()}
        for container in pod.spec["containers"]:
            image = self._image(container["image"])
            env = container_env(
                pod, container, image.env, links, config_maps, mesh.data, plan.node_gateway(pod.node)
            )
            argv = command_line(container, image.entrypoint, env)
            launch = ContainerLaunch(
                f"{pod.name}/{container['name']}", net.netns, pod.hostname or pod.name, pod.namespace, image,
                container_mounts(container, volumes), env, argv, identity(pod.spec, container),
                container.get("workingDir") or image.workdir, pod_dir / "containers" / container["name"],
                self.network.etc_dir(net.netns),
            )  # fmt: skip

            def target(pid: int, image=image) -> ProbeTarget:
                return ProbeTarget(pod.ip, ports, node_ns, pid, path_rewrites=image.probe_paths)

            supervised = Container(
                launch, container, pod_dir / f"{container['name']}.log", executor, target,
                float(pod.spec.get("terminationGracePeriodSeconds", 30)), self.config.backoff_s, self.log,
            )  # fmt: skip
            self.containers.setdefault(pod.name, []).append(supervised)
            self.log(f"start {launch.name}: {' '.join(argv)}")
            future = asyncio.run_coroutine_threadsafe(self._supervise(supervised), self._loop)
            self._tasks.append(future)

    async def _supervise(self, container: Container) -> None:
        try:
            await container.supervise()
        except Exception as error:  # the kubelet's own failure: the run must say so, not hang
            self.log(f"{container.launch.name}: kubelet error {type(error).__name__}: {error}")
            raise

    def _pod_rows(self) -> list[dict]:
        return [
            {"name": p.name, "namespace": p.namespace, "labels": p.labels, "ip": p.ip,
             "running": all(c.state.running for c in self.containers.get(p.name, []))}
            for p in self.pods
        ]  # fmt: skip

    # -- while it runs -----------------------------------------------------------------------

    def status(self) -> list[PodStatus]:
        return [
            PodStatus(p.name, p.owner, p.node, p.ip,
                      ready=bool(cs := self.containers.get(p.name)) and all(c.state.ready for c in cs),
                      running=bool(cs) and all(c.state.running for c in cs),
                      restarts=sum(c.state.restarts for c in cs or []))
            for p in self.pods
        ]  # fmt: skip

    def all_ready(self) -> bool:
        """Every pod ready; raises :class:`RunFailed` first if :meth:`check` finds a fault."""
        self.check()
        return all(s.ready for s in self.status())

    def check(self) -> None:
        """Fail if a NetworkPolicy dropped a connection that a pod of the overlay tried (a
        policy blocking needed traffic), or the kubelet itself failed."""
        assert self.network is not None
        by_ip = {p.ip: p.name for p in self.pods}
        blocked = []
        for pod in self.pods:
            for source, port in netpolicy.blocked_flows(self.network.pods[pod.name].netns):
                if source in by_ip:
                    blocked.append(f"{by_ip[source]} ({source}) -> {pod.name}:{port}")
        if blocked:
            raise RunFailed("NetworkPolicies drop traffic the mesh needs: " + "; ".join(sorted(blocked)))
        for future in self._tasks:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise RunFailed(f"the kubelet failed: {future.exception()!r}")

    def blocked_flows(self, pod: str) -> set[tuple[str, int]]:
        """(source, port) of what pod ``pod``'s policy has dropped."""
        assert self.network is not None
        return netpolicy.blocked_flows(self.network.pods[pod].netns)

    def pods_of(self, owner: str) -> list[PodPlan]:
        """The pods of ``Deployment/<name>`` or ``StatefulSet/<name>``."""
        return [p for p in self.pods if p.owner == owner]

    def service(self, name: str) -> cluster_dns.ServicePlan:
        return next(s for s in self.services if s.name == name)

    def kill_pod(self, pod: str, hold: bool = False) -> None:
        """SIGKILL every container of ``pod`` (the kubelet restarts them); ``hold``: not until
        :meth:`release_pod` (its node is down)."""
        assert self._loop is not None
        containers = self.containers[pod]
        if hold:

            async def hold_all() -> None:
                for container in containers:
                    container.hold()

            asyncio.run_coroutine_threadsafe(hold_all(), self._loop).result(30)
        for container in containers:
            container.kill_group()
        self.log(f"pod {pod}: killed{' (held down)' if hold else ''}")

    def release_pod(self, pod: str) -> None:
        """The kubelet starts ``pod``'s containers again (after :meth:`kill_pod` with ``hold``)."""
        assert self._loop is not None
        for container in self.containers[pod]:
            self._loop.call_soon_threadsafe(container.release)
        self.log(f"pod {pod}: released")

    def netns_of(self, pod: str) -> str:
        assert self.network is not None
        return self.network.pods[pod].netns

    def diagnosis(self, tail_lines: int = 15) -> str:
        """Events, and the end of the log of every pod not ready: what a failure message needs."""
        lines = ["events:", *self.events[-40:]]
        for status in self.status():
            if status.ready:
                continue
            for container in self.containers.get(status.name, []):
                text = (
                    container.log.read_text(errors="replace").splitlines() if container.log.exists() else []
                )
                lines += [
                    f"--- {container.launch.name} (restarts {status.restarts}, not ready):",
                    *text[-tail_lines:],
                ]
        return "\n".join(lines)

    # -- stop --------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_containers()
        finally:
            if self._loop is not None:
                self._stop_loop()
            for executor in self._executors:
                executor.shutdown(wait=False, cancel_futures=True)
            if self._kube_api is not None:
                self._kube_api.close()
            if self.network is not None:
                self.network.close()
            for image in self._images.values():
                image.close()
            (RECORDS / self.run_id).unlink(missing_ok=True)
            if self._temp:
                shutil.rmtree(self.work, ignore_errors=True)
            atexit.unregister(self.close)

    def _stop_loop(self) -> None:
        """Cancel what still runs on the kubelet's loop (probe loops), then stop and close it."""
        assert self._loop is not None

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not self._loop.is_running():
            self._loop.close()

    def _stop_containers(self) -> None:
        containers = [c for cs in self.containers.values() for c in cs]
        if self._loop is not None and self._loop.is_running() and containers:

            async def stop_all() -> None:
                for future in self._tasks:
                    future.cancel()
                await asyncio.wait_for(asyncio.gather(*(c.stop() for c in containers), return_exceptions=True),
                                       self.config.stop_grace_s)  # fmt: skip

            try:
                asyncio.run_coroutine_threadsafe(stop_all(), self._loop).result(self.config.stop_grace_s + 5)
            except (TimeoutError, asyncio.CancelledError, RuntimeError) as error:  # SIGKILL below ends them
                self.log(f"stop: {type(error).__name__}: {error}; killing what is left")
        for container in containers:
            container.kill_now()


def clean_dead_runs() -> None:
    """Take down what runs whose process is gone left behind (killed before their cleanup)."""
    if not RECORDS.is_dir():
        return
    for record in RECORDS.iterdir():
        try:
            os.kill(int(record.read_text().strip()), 0)
            continue
        except (ProcessLookupError, ValueError):
            pass
        except PermissionError:
            continue
        remove_leftovers(record.name)
        record.unlink(missing_ok=True)


def gateway_addresses(overlay_run: OverlayRun) -> list[str]:
    """``ip:port`` of each gateway pod's gRPC port."""
    return [f"{p.ip}:{p.container_ports()['grpc'][0]}" for p in overlay_run.pods_of("Deployment/gateway")]


def exec_in(overlay_run: OverlayRun, pod: str, *argv: str, check: bool = True) -> str:
    """``argv`` in pod ``pod``'s network namespace (with its hosts file), on the host's root."""
    return run("ip", "netns", "exec", overlay_run.netns_of(pod), *argv, check=check)
