"""Probe handlers run as the kubelet runs them: from the pod's node.

httpGet and tcpSocket are made from threads that have entered the node's network namespace
(``setns``; a socket belongs to the namespace of the thread that made it), so they come from
the node's bridge address, as a kubelet's do. httpGet: success is a status from 200 to 399;
HTTPS does not verify the server's certificate (the kubelet does not) and presents none.
exec runs the command inside the container (``nsenter`` into its namespaces and root, as its
user). grpc: ``grpc.health.v1.Health/Check``, plaintext as the kubelet's, from a short-lived
process in the node's namespace (grpc's own threads make its sockets).
"""

from __future__ import annotations

import ctypes
import http.client
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def enter_netns(netns: str) -> None:
    """Move the calling thread into network namespace ``netns`` (for good)."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {netns}: {os.strerror(error)}")
    finally:
        os.close(fd)


def netns_executor(netns: str, workers: int = 4) -> ThreadPoolExecutor:
    """Threads living in ``netns``: what they connect to, they connect to from there."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=f"in-{netns}", initializer=enter_netns, initargs=(netns,)
    )


@dataclass(frozen=True)
class ProbeTarget:
    """What a probe of one container needs to know."""

    pod_ip: str
    ports: Mapping[str, int]
    """The container's named ports."""
    node_netns: str
    pid: int
    """The container's process (for exec)."""
    exec_prefix: tuple[str, ...] = ()
    """``setpriv ... env -i ...`` to run an exec probe as the container's user with its env."""
    path_rewrites: Mapping[str, str] | None = None


def _port(value, target: ProbeTarget) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    if value not in target.ports:
        raise ValueError(f"probe port {value!r} is not a named port of the container")
    return target.ports[value]


def _http_get(spec: Mapping, target: ProbeTarget, timeout: float) -> tuple[bool, str]:
    host, port = spec.get("host") or target.pod_ip, _port(spec["port"], target)
    path = spec.get("path", "/")
    path = (target.path_rewrites or {}).get(path, path)
    if spec.get("scheme", "HTTP").upper() == "HTTPS":
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=context
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {
        "User-Agent": "kube-probe/1.37",
        **{h["name"]: h["value"] for h in spec.get("httpHeaders", [])},
    }
    try:
        conn.request("GET", path, headers=headers)
        status = conn.getresponse().status
    finally:
        conn.close()
    return 200 <= status < 400, f"HTTP {status} from {path}"


def _tcp(spec: Mapping, target: ProbeTarget, timeout: float) -> tuple[bool, str]:
    port = _port(spec["port"], target)
    with socket.create_connection((spec.get("host") or target.pod_ip, port), timeout=timeout):
        return True, f"connected to {port}"


def _exec(spec: Mapping, target: ProbeTarget, timeout: float) -> tuple[bool, str]:
    argv = [
        "nsenter",
        "-t",
        str(target.pid),
        "-n",
        "-m",
        "-u",
        "-r",
        "-w",
        *target.exec_prefix,
        *spec["command"],
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    return done.returncode == 0, f"exit {done.returncode}: {(done.stdout + done.stderr).strip()[-200:]}"


def _grpc(spec: Mapping, target: ProbeTarget, timeout: float) -> tuple[bool, str]:
    argv = ["ip", "netns", "exec", target.node_netns, sys.executable, "-m", "bench.cluster.pods.grpc_probe",
            f"{target.pod_ip}:{_port(spec['port'], target)}", spec.get("service", ""), str(timeout)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 30, check=False)
    return done.returncode == 0, done.stdout.strip() or done.stderr.strip()[-200:]


HANDLERS = {"httpGet": _http_get, "tcpSocket": _tcp, "exec": _exec, "grpc": _grpc}


def run_probe(probe: Mapping, target: ProbeTarget) -> tuple[bool, str]:
    """One try of ``probe``; (success, what happened). Must run on a thread in the node's
    namespace (:func:`netns_executor`)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    for kind, handler in HANDLERS.items():
        if kind in probe:
            try:
                return handler(probe[kind], target, timeout)
            except (OSError, subprocess.TimeoutExpired, http.client.HTTPException) as error:
                return False, f"{kind}: {error}"
    raise ValueError(f"probe has no handler the kubelet knows: {sorted(probe)}")
