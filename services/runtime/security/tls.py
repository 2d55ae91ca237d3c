"""Mutual TLS for every server, every channel between services and every etcd client: the one
place that turns settings into gRPC credentials.

Off by default (an empty :class:`TLSConfig`): servers listen in plaintext and channels dial in
plaintext, as before. On, a server presents its certificate and requires a client certificate
signed by the mesh CA (a caller without one fails the handshake, so its call ends UNAVAILABLE),
and a channel presents its own and verifies the server's against the same CA. The one exception is
the gateway's public port (``client_certificates=False``): server-authenticated TLS, no client
certificate asked for, since its callers are tenants who authenticate by API key.

Certificates rotate without a restart (services.runtime.security.certificate_reload): servers take the
files' new certificate, key and CA at the next handshake; channels open a new connection with the
new client certificate for the calls after a change, while calls in flight finish on the old one.

The identity of a verified peer (``spiffe://loramesh/<kind>[/<instance>]`` in its certificate,
see :mod:`services.runtime.security.identity`) is what :func:`peer_identity` returns; the interceptor
authorizes the call by it (services.runtime.security.authorization) and binds it to
:data:`peer_identity_var` for the servicers.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import rpc as etcd_rpc
from aetcd import watcher as etcd_watcher
from grpc import aio

from services.runtime.security.certificate_reload import (
    CHANNEL_CHECK_INTERVAL_S,
    CertificateFiles,
    CertificateSet,
    certificate_files,
)
from services.runtime.security.identity import SPIFFE_PREFIX, MeshIdentity

log = logging.getLogger("loramesh.tls")

#: A DNS name every mesh certificate carries. In Kubernetes peers are dialled by pod IP, which no
#: certificate can name in advance; ``--tls-server-name`` set to this checks the chain and the
#: name without one.
MESH_SERVER_NAME = "mesh.loramesh"

ChannelOptions = Sequence[tuple[str, Any]]

peer_identity_var: contextvars.ContextVar[MeshIdentity | None] = contextvars.ContextVar(
    "peer_identity", default=None
)
"""The verified mesh identity of the caller of the RPC being served; None over plaintext."""


@dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS settings of one process; all three files, or none (TLS off)."""

    ca_file: str = ""
    """PEM of the mesh CA: the only issuer whose peers (servers and clients) are trusted."""
    cert_file: str = ""
    """PEM certificate of this process's identity, presented to servers and to clients alike."""
    key_file: str = ""
    """PEM private key of ``cert_file`` (0600)."""
    server_name: str = ""
    """Name the servers' certificates are checked against instead of the dialled host (e.g.
    :data:`MESH_SERVER_NAME` where peers are dialled by IP); empty: the dialled host."""

    def __post_init__(self) -> None:
        given = [bool(self.ca_file), bool(self.cert_file), bool(self.key_file)]
        if any(given) and not all(given):
            raise ValueError("TLS needs all of the CA, certificate and key files (or none of them)")

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file)

    def read(self) -> tuple[bytes, bytes, bytes]:
        """``(ca, cert, key)`` PEM bytes."""
        return (
            Path(self.ca_file).read_bytes(),
            Path(self.cert_file).read_bytes(),
            Path(self.key_file).read_bytes(),
        )

    def flags(self) -> list[str]:
        """The command-line flags that give a service these settings (see ``ServiceConfig``)."""
        if not self.enabled:
            return []
        flags = ["--tls-ca", self.ca_file, "--tls-cert", self.cert_file, "--tls-key", self.key_file]
        return flags + (["--tls-server-name", self.server_name] if self.server_name else [])

    def files(self) -> CertificateFiles:
        """The process's watcher of these files (services.runtime.security.certificate_reload)."""
        return certificate_files(self.ca_file, self.cert_file, self.key_file)


NO_TLS = TLSConfig()

#: How long calls still running on a channel replaced by a certificate change may go on before
#: that channel is closed (which cancels what is left): longer than any stream runs.
RETIRED_CHANNEL_GRACE_S = 3600.0


def _server_configuration(certificates: CertificateSet):
    return grpc.ssl_server_certificate_configuration(
        [(certificates.key, certificates.cert)], root_certificates=certificates.ca
    )


def server_credentials(tls: TLSConfig, client_certificates: bool = True) -> grpc.ServerCredentials:
    """Present our certificate; with ``client_certificates``, require and verify the client's
    against the mesh CA, else ask for none (gRPC Python cannot ask for one without requiring it).
    gRPC takes our certificate at each new connection's handshake: a change of the files is served
    from the next connection on, without a restart (connections already open keep theirs)."""
    files = tls.files()
    served = [files.current.generation]

    def fetch():
        try:
            certificates = files.poll()
            if certificates.generation == served[0]:
                return None
            served[0] = certificates.generation
            return _server_configuration(certificates)
        except Exception:  # raised into gRPC's C core, it would fail the handshake
            log.exception("cannot serve the reloaded TLS certificate; keeping the one in use")
            return None

    return grpc.dynamic_ssl_server_credentials(
        _server_configuration(files.current), fetch, require_client_authentication=client_certificates
    )


def channel_credentials(
    tls: TLSConfig, certificates: CertificateSet | None = None
) -> grpc.ChannelCredentials:
    ca, cert, key = (
        tls.read() if certificates is None else (certificates.ca, certificates.cert, certificates.key)
    )
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _options(tls: TLSConfig, options: ChannelOptions) -> list[tuple[str, Any]]:
    extra = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return [*options, *extra]


def add_server_port(
    server: aio.Server | grpc.Server, address: str, tls: TLSConfig, client_certificates: bool = True
) -> int:
    """Bind ``address`` with TLS when ``tls`` is on (mutual with ``client_certificates``, else
    server-authenticated only: the gateway's public port), in plaintext otherwise; the port."""
    if tls.enabled:
        return server.add_secure_port(address, server_credentials(tls, client_certificates))
    return server.add_insecure_port(address)


def aio_channel(address: str, tls: TLSConfig, options: ChannelOptions = ()) -> aio.Channel:
    """An asyncio channel to another mesh member (one that follows certificate rotation)."""
    return _channel(aio, _RotatingAioChannel, address, tls, options)


def sync_channel(address: str, tls: TLSConfig, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking channel to another mesh member (for code on worker threads)."""
    return _channel(grpc, _RotatingSyncChannel, address, tls, options)


def _channel(channels, rotating: type, address: str, tls: TLSConfig, options: ChannelOptions):
    """A channel from ``channels`` (the module ``grpc`` or ``grpc.aio``): plaintext, or with
    mutual TLS behind ``rotating`` (its rotating channel class), made anew for new certificates."""
    if not tls.enabled:
        return channels.insecure_channel(address, options=list(options))
    opts = _options(tls, options)
    return rotating(
        tls.files(),
        lambda certs: channels.secure_channel(address, channel_credentials(tls, certs), options=opts),
    )


class _Rotation:
    """The channel of the current certificates, made anew when they change (checked at most
    every :data:`CHANNEL_CHECK_INTERVAL_S` at a call); the channels it replaced, still finishing
    their calls."""

    def __init__(self, files: CertificateFiles, make: Callable[[CertificateSet], Any], clock=time.monotonic):
        self.files = files
        self.make = make
        self.clock = clock
        self.lock = threading.Lock()
        certificates = files.current
        self.generation = certificates.generation
        self.channel = make(certificates)
        self.retired: list[tuple[float, Any]] = []

    def current(self) -> tuple[Any, Any | None]:
        """``(channel, replaced)``: the channel to call on; the one it just replaced, if any."""
        certificates = self.files.poll(CHANNEL_CHECK_INTERVAL_S)
        if certificates.generation == self.generation:
            return self.channel, None
        with self.lock:
            if certificates.generation == self.generation:
                return self.channel, None
            replaced, self.channel = self.channel, self.make(certificates)
            self.generation = certificates.generation
            log.info("client certificate changed: new channel for new calls (serial %x)", certificates.serial)
            return self.channel, replaced


class _RotatingCallable:
    """A stub's method: each call goes to the rotation's current channel."""

    def __init__(self, owner, kind: str, method: str, kwargs: dict[str, Any]):
        self._owner = owner
        self._kind = kind
        self._method = method
        self._kwargs = kwargs
        self._bound: tuple[Any, Any] | None = None

    def _target(self) -> tuple[Any, Any]:
        channel = self._owner._channel()
        bound = self._bound
        if bound is None or bound[0] is not channel:
            bound = self._bound = (channel, getattr(channel, self._kind)(self._method, **self._kwargs))
        return bound

    def __call__(self, *args, **kwargs):
        channel, target = self._target()
        call = target(*args, **kwargs)
        self._owner._track(channel, call)
        return call

    def __getattr__(self, name: str):  # with_call, future (blocking stubs)
        return getattr(self._target()[1], name)


def _rotating_multicallable(kind: str):
    """A channel's ``kind`` method (``unary_unary``...), whose calls go to the channel of the
    certificates current at each call (both rotating channel classes share it)."""

    def multicallable(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        kwargs.update(request_serializer=request_serializer, response_deserializer=response_deserializer)
        return _RotatingCallable(self, kind, method, kwargs)

    multicallable.__name__ = kind
    return multicallable


class _RotatingAioChannel(aio.Channel):
    """An asyncio channel that moves to a new connection when the client certificate changes;
    the replaced channel closes once its calls are done (at most
    :data:`RETIRED_CHANNEL_GRACE_S`)."""

    def __init__(self, files: CertificateFiles, make: Callable[[CertificateSet], aio.Channel]):
        self._rotation = _Rotation(files, make)
        self._calls: dict[aio.Channel, weakref.WeakSet] = {}
        """The calls not done yet, by the channel they run on."""
        self._closing: dict[asyncio.Task, aio.Channel] = {}

    def _channel(self) -> aio.Channel:
        channel, replaced = self._rotation.current()
        if replaced is not None:
            self._retire(replaced)
        return channel

    def _track(self, channel: aio.Channel, call) -> None:
        calls = self._calls.setdefault(channel, weakref.WeakSet())
        calls.add(call)
        call.add_done_callback(calls.discard)

    def _retire(self, channel: aio.Channel) -> None:
        calls = [call for call in self._calls.pop(channel, ()) if not call.done()]
        try:
            task = asyncio.get_running_loop().create_task(_close_when_done(channel, calls))
        except RuntimeError:  # no loop running here: closed with this channel
            self._rotation.retired.append((0.0, channel))
            return
        self._closing[task] = channel
        task.add_done_callback(lambda done: self._closing.pop(done, None))

    unary_unary = _rotating_multicallable("unary_unary")
    unary_stream = _rotating_multicallable("unary_stream")
    stream_unary = _rotating_multicallable("stream_unary")
    stream_stream = _rotating_multicallable("stream_stream")

    async def channel_ready(self) -> None:
        await self._channel().channel_ready()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._rotation.channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._rotation.channel.wait_for_state_change(last_observed_state)

    async def close(self, grace: float | None = None) -> None:
        """Close the current channel and those still finishing calls, all with ``grace``."""
        retired = [channel for _, channel in self._rotation.retired]
        self._rotation.retired.clear()
        for task, channel in list(self._closing.items()):
            task.cancel()
            retired.append(channel)
        self._closing.clear()
        await asyncio.gather(*(c.close(grace) for c in (*retired, self._rotation.channel)))

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb) -> None:
        await self.close(None)


async def _close_when_done(channel: aio.Channel, calls: list) -> None:
    """Close ``channel`` once ``calls`` are done (at most :data:`RETIRED_CHANNEL_GRACE_S`)."""
    if calls:
        loop = asyncio.get_running_loop()
        done = []
        for call in calls:
            finished = loop.create_future()
            call.add_done_callback(lambda _, f=finished: f.done() or f.set_result(None))
            done.append(finished)
        await asyncio.wait(done, timeout=RETIRED_CHANNEL_GRACE_S)
    await channel.close()


class _RotatingSyncChannel(grpc.Channel):
    """A blocking channel that moves to a new connection when the client certificate changes;
    the replaced channel is closed :data:`RETIRED_CHANNEL_GRACE_S` later (a blocking channel
    cannot wait for its calls), or with this one."""

    def __init__(self, files: CertificateFiles, make: Callable[[CertificateSet], grpc.Channel]):
        self._rotation = _Rotation(files, make)
        self._subscriptions: list[tuple[Any, bool]] = []

    def _track(self, channel: grpc.Channel, call) -> None:
        pass  # a blocking call is over when it returns; a stream's channel closes after the grace

    def _channel(self) -> grpc.Channel:
        rotation = self._rotation
        channel, replaced = rotation.current()
        if replaced is not None or rotation.retired:
            now = rotation.clock()
            with rotation.lock:
                if replaced is not None:
                    rotation.retired.append((now, replaced))
                    for callback, try_to_connect in self._subscriptions:
                        replaced.unsubscribe(callback)
                        channel.subscribe(callback, try_to_connect)
                done = [c for at, c in rotation.retired if now - at >= RETIRED_CHANNEL_GRACE_S]
                rotation.retired = [
                    (at, c) for at, c in rotation.retired if now - at < RETIRED_CHANNEL_GRACE_S
                ]
            for old in done:
                old.close()
        return channel

    unary_unary = _rotating_multicallable("unary_unary")
    unary_stream = _rotating_multicallable("unary_stream")
    stream_unary = _rotating_multicallable("stream_unary")
    stream_stream = _rotating_multicallable("stream_stream")

    def subscribe(self, callback, try_to_connect=False) -> None:
        self._subscriptions.append((callback, try_to_connect))
        self._rotation.channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback) -> None:
        self._subscriptions = [(c, t) for c, t in self._subscriptions if c is not callback]
        self._rotation.channel.unsubscribe(callback)

    def close(self) -> None:
        with self._rotation.lock:
            retired = [channel for _, channel in self._rotation.retired]
            self._rotation.retired.clear()
        for channel in (*retired, self._rotation.channel):
            channel.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> bool:
        self.close()
        return False


class _TLSEtcdClient(aetcd.Client):
    """aetcd 1.0 dials etcd in plaintext only; this one opens a mutual-TLS channel and builds the
    same stubs on it (aetcd's ``connect`` without its user/password step, which we never use)."""

    def __init__(self, tls: TLSConfig, **kwargs: Any):
        super().__init__(**kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        target = f"{self._host}:{self._port}"
        self.channel = aio_channel(target, self._tls, tuple(self._options.items()))
        self.kvstub = etcd_rpc.KVStub(self.channel)
        self.clusterstub = etcd_rpc.ClusterStub(self.channel)
        self.leasestub = etcd_rpc.LeaseStub(self.channel)
        self.maintenancestub = etcd_rpc.MaintenanceStub(self.channel)
        self._watcher = etcd_watcher.Watcher(
            etcd_rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()


def etcd_client(host: str, port: int, tls: TLSConfig, **kwargs: Any) -> aetcd.Client:
    """An etcd client over mutual TLS when ``tls`` is on (``kwargs`` as ``aetcd.Client``)."""
    if tls.enabled:
        return _TLSEtcdClient(tls, host=host, port=port, **kwargs)
    return aetcd.Client(host=host, port=port, **kwargs)


def peer_identity(context: aio.ServicerContext) -> MeshIdentity | None:
    """The mesh identity in the caller's verified certificate: its ``spiffe://loramesh/...`` URI
    SAN, else its CN; None over plaintext, or when the certificate names no identity. gRPC fills
    the auth context only after verifying the chain against the CA, so what it holds can be
    trusted."""
    auth = context.auth_context() or {}
    names = [
        text[len(SPIFFE_PREFIX) :]
        for text in map(_text, auth.get("x509_subject_alternative_name", ()))
        if text.startswith(SPIFFE_PREFIX)
    ]
    names += [_text(name) for name in auth.get("x509_common_name", ())[:1]]
    if not names:
        return None
    try:
        return MeshIdentity.parse(names[0])
    except ValueError:
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
