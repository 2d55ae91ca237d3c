"""Open-loop replay of a trace against a streaming HTTP completion server.

The one client every HTTP-served system shares (llama.cpp's llama-server, loramesh's OpenAI API),
so their figures differ only by the server: request ``r`` is sent at ``start + r.time_s`` whether
or not earlier ones have finished (open loop), with the prompt's token ids
(:meth:`RunContext.prompt`), asking for exactly ``r.output_len`` tokens (end of sequence ignored),
streamed so the first token's time is seen; at ``start + window_s`` every open stream is closed
and counts as not completed. What differs between servers (URL, body, how a streamed chunk reads)
is a :class:`CompletionProtocol`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Protocol

import httpx

from bench.systems.base import RequestRecord, RunContext
from bench.systems.clock import time_left
from bench.workload import TraceRequest

SSE_DATA = "data:"
SSE_DONE = "[DONE]"
ERROR_BODY_CHARS = 300
"""How much of a refused request's body its record keeps."""


@dataclass(frozen=True)
class ChunkProgress:
    """What one streamed chunk says about its request."""

    output_tokens: int
    """Tokens produced so far (cumulative, the chunk's own included)."""
    finished: bool
    """The server ended the generation with this chunk."""


class CompletionProtocol(Protocol):
    """How one server's streaming completion endpoint is spoken."""

    path: str
    """Endpoint under the base URL, e.g. ``/completion``."""

    def body(self, request: TraceRequest, prompt: tuple[int, ...]) -> dict:
        """The JSON body asking for ``request.output_len`` tokens after ``prompt``, streamed,
        end of sequence ignored."""
        ...

    def progress(self, chunk: dict, output_tokens: int) -> ChunkProgress:
        """Read one streamed JSON chunk, given the tokens counted before it."""
        ...


class ServerError(Exception):
    """The server answered a request with an error (HTTP status or an error chunk)."""


async def replay_over_http(
    context: RunContext,
    base_url: str,
    protocol: CompletionProtocol,
    headers: dict[str, str] | None = None,
) -> list[RequestRecord]:
    """Replay ``context.trace`` against ``base_url``; one record per request, in trace order."""
    records = [
        RequestRecord(r.request_id, r.adapter, r.time_s, r.input_len, r.output_len) for r in context.trace
    ]
    # Every request of a saturating trace is in flight at once: no pool limit, no timeout but
    # the window's.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=None) as client:
        start = time.monotonic()
        deadline = start + context.window_s

        async def serve(request: TraceRequest, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, start + request.time_s - time.monotonic()))
            try:
                await asyncio.wait_for(
                    _stream(client, protocol, context, request, record, start),
                    timeout=time_left(deadline, time.monotonic()),
                )
            except TimeoutError:
                pass
            except (ServerError, httpx.HTTPError) as error:  # recorded; the run goes on
                record.error = f"{type(error).__name__}: {error}"
            finally:
                context.on_progress(1)

        await asyncio.gather(*(serve(r, rec) for r, rec in zip(context.trace, records)))
    return records


async def _stream(
    client: httpx.AsyncClient,
    protocol: CompletionProtocol,
    context: RunContext,
    request: TraceRequest,
    record: RequestRecord,
    start: float,
) -> None:
    body = protocol.body(request, context.prompt(request))
    async with client.stream("POST", protocol.path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:ERROR_BODY_CHARS]
            raise ServerError(f"HTTP {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith(SSE_DATA):
                continue  # blank separators, comments (pings)
            data = line[len(SSE_DATA) :].strip()
            if data == SSE_DONE:
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(json.dumps(chunk["error"])[:ERROR_BODY_CHARS])
            progress = protocol.progress(chunk, record.output_tokens)
            now = time.monotonic() - start
            if progress.output_tokens > record.output_tokens:
                record.output_tokens = progress.output_tokens
                if record.first_token_s is None:
                    record.first_token_s = now
            if progress.finished:
                if record.output_tokens < record.output_len:
                    raise ServerError(f"ended after {record.output_tokens} of {record.output_len} tokens")
                # Read on to the stream's end, so the connection is reused rather than reset.
                record.finish_s = now
