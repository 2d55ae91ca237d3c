"""Bootstrap shared by every service: one grpc.aio server with health, reflection, the
interceptor, the HTTP side port and etcd membership, and a graceful SIGTERM.

A service implements :class:`Service` (domain start/stop, how to add its servicer, its load
report) and calls :func:`run_service` from its ``__main__``. Lifecycle:

1. the server starts with health ``""`` SERVING (alive) and the service's own name NOT_SERVING;
1a. a service whose ``public_port`` is true (the gateway) serves its gRPC port, under TLS, to
   callers without a client certificate (tenants, who authenticate by API key): each call there
   is authorized as a tenant's (services/runtime/security/authorization.py);
2. ``Service.start()`` loads state; then readiness flips to SERVING and the member registers
   in etcd, so only ready members are ever listed;
2a. a service that defines ``fence_by_lease(fence)`` is handed its registration's
   :class:`~services.runtime.etcd.lease_fence.LeaseFence` to refuse new work by, and its
   readiness (health and ``/readyz``) follows the fence too: NOT_SERVING while its etcd
   keepalives go unanswered, SERVING again once it is registered again;
3. SIGTERM/SIGINT: health NOT_SERVING, lease revoked (gone from the mesh at once),
   ``server.stop(grace)`` lets in-flight RPCs finish, ``Service.stop()``, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mesh_api.version import VERSION
from services.runtime.config import ServiceConfig, parse_config
from services.runtime.etcd.lease_fence import LeaseFence
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig
from services.runtime.logs import configure_logging
from services.runtime.metrics import HttpSidePort, ServiceMetrics
from services.runtime.process.allocator import retain_freed_memory
from services.runtime.process.garbage_collection import freeze_startup_objects
from services.runtime.rpc import keepalive
from services.runtime.rpc.interceptors import ServiceInterceptor
from services.runtime.security.certificate_reload import server_ssl_context
from services.runtime.security.tls import NO_TLS, TLSConfig, add_server_port, aio_channel

log = logging.getLogger("loramesh.server")

#: Largest message any service accepts or sends (upload chunks are far smaller).
MAX_MESSAGE_BYTES = 64 * 2**20


class Service(Protocol):
    """What a service plugs into the shared bootstrap."""

    name: str
    """Short name used in etcd keys and logs, e.g. ``adapter_store``."""
    grpc_service_name: str
    """Full proto service name, e.g. ``loramesh.v1.AdapterStore`` (its readiness health key)."""

    def add_to_server(self, server: aio.Server) -> None: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def load_report(self) -> dict: ...


class ServiceHost:
    """One service in its server: addresses, health, membership, and the handles to stop it.

    :meth:`listen` binds and answers health (not ready yet); :meth:`become_ready` starts the
    domain, flips readiness and joins the mesh; :meth:`shutdown` undoes both gracefully.
    """

    def __init__(self, service: Service, config: ServiceConfig, clock: Callable[[], float] = time.monotonic):
        """``clock``: monotonic seconds the lease fence reads (injected in tests)."""
        self.service = service
        self.config = config
        self.instance_id = config.resolved_instance_id(service.name)
        self.metrics = ServiceMetrics(service.name)
        self.health = health.aio.HealthServicer()
        # With TLS on the side port serves HTTPS only, with this process's certificate (reloaded
        # when its files change); a client certificate is optional there (Kubernetes' probes
        # present none, and do not check the server's either).
        tls = config.tls()
        side_ssl = server_ssl_context(tls.ca_file, tls.cert_file, tls.key_file) if tls.enabled else None
        self.http = HttpSidePort(
            self.metrics, self.not_ready, ssl=side_ssl, degraded=getattr(service, "degraded", lambda: "")
        )
        self.public_port = bool(getattr(service, "public_port", False))
        """Whether the gRPC port is the public API's: under TLS it asks for no client certificate."""
        self.server = aio.server(
            # With TLS on, every call is authorized by the caller's identity, or as a tenant's on
            # the public port (services/runtime/security/authorization.py); in plaintext there is
            # nobody to check.
            interceptors=[
                ServiceInterceptor(
                    self.metrics, enforce_authorization=config.tls().enabled, public=self.public_port
                )
            ],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                *keepalive.SERVER_OPTIONS,
            ],
        )
        self.metrics.export_service(service)
        self.registration: MemberRegistration | None = None
        self.address = ""
        self.http_address = ""
        self.ready = False
        self._clock = clock
        self._fence_by_lease: Callable[[LeaseFence], None] | None = getattr(service, "fence_by_lease", None)
        self._lease_fence: LeaseFence | None = None
        """The fence handed to the service, once it is registered (a fenced service only)."""
        self._stopped = False

    def not_ready(self) -> str:
        """ "" while ready; else why not: starting, draining, or (a fenced service) cut off from
        etcd. The fence is read when asked, so this is never behind it."""
        if not self.ready:
            return "starting" if not self._stopped else "shutting down"
        return self._lease_fence.problem() if self._lease_fence is not None else ""

    async def _fence_changed(self, problem: str) -> None:
        """The registration's fence went up (``problem``) or down: readiness follows it."""
        if self.ready:
            status = (
                health_pb2.HealthCheckResponse.NOT_SERVING
                if problem
                else health_pb2.HealthCheckResponse.SERVING
            )
            await self.health.set(self.service.grpc_service_name, status)

    async def listen(self) -> None:
        """Bind gRPC and HTTP; liveness SERVING, readiness NOT_SERVING."""
        config, service = self.config, self.service
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        service.add_to_server(self.server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (service.grpc_service_name, health_name, reflection.SERVICE_NAME), self.server
        )
        port = add_server_port(
            self.server,
            f"{config.host}:{config.port}",
            config.tls(),
            client_certificates=not self.public_port,
        )
        if port == 0:
            raise OSError(f"cannot bind gRPC port {config.host}:{config.port}")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(service.grpc_service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        advertise = config.advertise_host or config.host
        self.address = f"{advertise}:{port}"
        http_port = await self.http.start(config.host, config.http_port)
        self.http_address = f"{advertise}:{http_port}"
        log.info("%s listening on %s (http %s)", service.name, self.address, self.http_address)

    async def become_ready(self) -> None:
        """Start the domain, then readiness SERVING, then register in etcd (when configured)."""
        await self.service.start()
        self.ready = True
        await self.health.set(self.service.grpc_service_name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.etcd_endpoints:
            self.registration = MemberRegistration(
                MembershipConfig(
                    etcd_endpoints=self.config.etcd_endpoints,
                    ttl_s=self.config.lease_ttl_s,
                    tls=self.config.tls(),
                ),
                MemberInfo(
                    service=self.service.name,
                    instance_id=self.instance_id,
                    address=self.address,
                    http_address=self.http_address,
                    version=VERSION,
                    started_at=time.time(),
                ),
                load_fn=self.service.load_report,
                clock=self._clock,
                on_fence=self._fence_changed if self._fence_by_lease is not None else None,
            )
            await self.registration.start()
            # Handed over once registered: a caller that saw the service ready before it was
            # listed is served, as before there was a fence.
            if self._fence_by_lease is not None:
                self._lease_fence = self.registration.fence
                self._fence_by_lease(self._lease_fence)
        log.info("%s ready as %s", self.service.name, self.instance_id)

    async def shutdown(self) -> None:
        """Graceful stop: NOT_SERVING, leave the mesh, drain RPCs, stop the domain (once)."""
        if self._stopped:
            return
        self._stopped = True
        log.info("shutting down (grace %.1fs)", self.config.grace_s)
        self.ready = False
        await self.health.enter_graceful_shutdown()
        if self.registration is not None:
            await self.registration.stop()
        # Streams that never end by themselves (the store's WatchAdapters) end now: the drain
        # below would otherwise wait the whole grace for them.
        end_streams = getattr(self.service, "end_streams", None)
        if end_streams is not None:
            await end_streams()
        await self.server.stop(self.config.grace_s)
        await self.service.stop()
        await self.http.stop()
        log.info("stopped")


async def start_service(service: Service, config: ServiceConfig) -> ServiceHost:
    """Start the server, make the service ready and register it. Returns once ready."""
    host = ServiceHost(service, config)
    await host.listen()
    await host.become_ready()
    return host


async def serve(service: Service, config: ServiceConfig) -> int:
    """Run until SIGTERM or SIGINT, then shut down gracefully. Returns the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start_service(service, config)
    if config.freeze_startup_objects:
        freeze_startup_objects()
    await stop.wait()
    await running.shutdown()
    return 0


C = TypeVar("C", bound=ServiceConfig)


def run_service(
    config_cls: type[C],
    build: Callable[[C], Service],
    service_name: str,
    argv: Sequence[str] | None = None,
) -> None:
    """Entry point body of ``python -m services.<name>``: parse config, log, serve on uvloop."""
    import uvloop

    config = parse_config(config_cls, argv, prog=f"python -m services.{service_name}")
    configure_logging(config.log_format, config.log_level, service_name)
    if config.retain_freed_memory and not retain_freed_memory():
        log.warning(
            "--retain-freed-memory: the C library did not take the setting (not glibc?); nothing changed"
        )
    service = build(config)
    sys.exit(uvloop.run(serve(service, config)))


def health_status_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


async def check_health(address: str, service: str = "", timeout: float = 2.0, tls: TLSConfig = NO_TLS) -> str:
    """Ask ``address`` for its grpc.health.v1 status; ``UNREACHABLE`` when it does not answer."""
    async with aio_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return "UNREACHABLE"
        return health_status_name(reply.status)
