"""uvicorn serving the OpenAI app inside the gateway's own event loop, beside its gRPC server.

``uvicorn.Server.serve()`` would install its own SIGTERM/SIGINT handlers over the service's;
driving ``startup`` / ``main_loop`` / ``shutdown`` ourselves leaves signals to the service
bootstrap, which stops this server from the gateway's ``stop()``.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from starlette.applications import Starlette

log = logging.getLogger("loramesh.gateway.openai")

#: How long an idle keep-alive connection stays open. Longer than clients keep idle pooled
#: connections (httpx, hence the ``openai`` package: 5 s), so the client, not the server, closes
#: them: with uvicorn's default of 5 s too, a request sent on a pooled connection as the server
#: drops it fails with a read error (seen in bench/openai_throughput.py with retries off).
KEEP_ALIVE_S = 75


class OpenAIHttpServer:
    def __init__(self, grace_s: float):
        self._grace_s = grace_s
        self._server: uvicorn.Server | None = None
        self._loop_task: asyncio.Task | None = None
        self._socket: socket.socket | None = None
        self.port = 0

    async def start(self, app: Starlette, host: str, port: int) -> int:
        """Bind ``host:port`` (0: a free port) and serve ``app``; returns the bound port."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
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
        )
        self._server = uvicorn.Server(config)
        config.load()
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup(sockets=[sock])
        self._loop_task = asyncio.create_task(self._server.main_loop())
        log.info("OpenAI API on http://%s:%d/v1", host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let running requests finish within the grace period, then close."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._loop_task is not None:
            await self._loop_task
        await self._server.shutdown(sockets=[self._socket] if self._socket else None)
        self._server = None
