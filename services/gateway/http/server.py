"""uvicorn serving the gateway's HTTP app (:mod:`.app`) inside its own event loop, beside its gRPC server.

``uvicorn.Server.serve()`` would install its own SIGTERM/SIGINT handlers over the service's;
driving ``startup`` / ``main_loop`` / ``shutdown`` ourselves leaves signals to the service
bootstrap, which stops this server from the gateway's ``stop()``.

With the gateway's TLS on, the port speaks HTTPS only, with the gateway's certificate (reloaded
when its files change, services.runtime.security.certificate_reload): a plain HTTP request fails the
handshake. A client certificate is optional (tenants authenticate with their API key); one that
is presented must be the mesh CA's and unexpired.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from starlette.applications import Starlette

from services.runtime.security.certificate_reload import server_ssl_context
from services.runtime.security.tls import NO_TLS, TLSConfig

log = logging.getLogger("loramesh.gateway.openai")

#: How long an idle keep-alive connection stays open. Longer than clients keep idle pooled
#: connections (httpx, hence the ``openai`` package: 5 s), so the client, not the server, closes
#: them: with uvicorn's default of 5 s too, a request sent on a pooled connection as the server
#: drops it fails with a read error (seen in bench/openai_throughput.py with retries off).
KEEP_ALIVE_S = 75


class OpenAIHttpServer:
    def __init__(self, grace_s: float, tls: TLSConfig = NO_TLS):
        self._grace_s = grace_s
        self._tls = tls
        self._server: uvicorn.Server | None = None
        self._loop_task: asyncio.Task | None = None
        self._socket: socket.socket | None = None
        self.port = 0

    async def start(self, app: Starlette, host: str, port: int) -> int:
        """Bind ``host:port`` (0: a free port) and serve ``app``; returns the bound port."""
        # IPPROTO_TCP, not 0: asyncio's own loop sets TCP_NODELAY only on sockets that say TCP
        # (without it, each keep-alive answer waited ~40 ms for a delayed ACK; uvloop sets it anyway).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
        self._socket = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            lifespan="off",
            access_log=False,
            log_config=None,  # the service's logging configuration stays in charge
            timeout_graceful_shutdown=max(1, round(self._grace_s)),
            timeout_keep_alive=KEEP_ALIVE_S,
            ssl_context_factory=self._ssl_context if self._tls.enabled else None,
        )
        self._server = uvicorn.Server(config)
        config.load()
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup(sockets=[sock])
        self._loop_task = asyncio.create_task(self._server.main_loop())
        log.info("OpenAI API on %s://%s:%d/v1", self.scheme, host, self.port)
        return self.port

    @property
    def scheme(self) -> str:
        return "https" if self._tls.enabled else "http"

    def _ssl_context(self, config: uvicorn.Config, default_factory):
        tls = self._tls
        return server_ssl_context(tls.ca_file, tls.cert_file, tls.key_file, alpn=("http/1.1",))

    async def stop(self) -> None:
        """Stop accepting, let running requests finish within the grace period, then close."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._loop_task is not None:
            await self._loop_task
        await self._server.shutdown(sockets=[self._socket] if self._socket else None)
        self._server = None
