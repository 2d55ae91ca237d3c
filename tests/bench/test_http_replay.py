"""The shared open-loop HTTP client against a fake llama-server: what it sends, and how each way a
request can end (completed, refused, stopped short, cut by the window) lands in its record."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from bench.systems.base import AdapterSet, RunContext
from bench.systems.completion_protocols import LlamaServerCompletion, OpenAICompletion
from bench.systems.http_replay import replay_over_http
from bench.workload import TraceRequest

REFUSED = 7
"""A request asking for this many tokens gets HTTP 503."""
STOPS_SHORT = 5
"""... this many: the server stops after 2 tokens."""
SLOW = 50
"""... this many: one token, then nothing ever again, so only the window can end it."""
WINDOW_S = 10.0
"""The cut test's window: only a never-ending request meets it; far longer than the one loopback
chunk sent before it (a guard, not a timing claim)."""


class FakeLlamaServer:
    """``POST /completion`` streaming one chunk per token, as llama-server does."""

    def __init__(self):
        self.bodies: list[dict] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next(
            int(line.split(":")[1])
            for line in head.split("\r\n")
            if line.lower().startswith("content-length")
        )
        body = json.loads(await reader.readexactly(length))
        self.bodies.append(body)
        wanted = body["n_predict"]
        try:
            if wanted == REFUSED:
                writer.write(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy"
                )
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            produced = 2 if wanted == STOPS_SHORT else wanted
            for k in range(1, produced + 1):
                if wanted == SLOW and k == 2:
                    await asyncio.Event().wait()  # never answers again: the client's window ends it
                writer.write(f"data: {json.dumps({'tokens_predicted': k, 'stop': False})}\n\n".encode())
                await writer.drain()
            writer.write(f"data: {json.dumps({'tokens_predicted': produced, 'stop': True})}\n\n".encode())
        finally:
            await writer.drain()
            writer.close()


@pytest.fixture
async def fake_server():
    fake = FakeLlamaServer()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield fake, f"http://127.0.0.1:{port}"
    server.close()
    await server.wait_closed()


def request(index: int, time_s: float, output_len: int) -> TraceRequest:
    return TraceRequest(time_s, adapter=index % 2, rank=8, input_len=4, output_len=output_len,
                        request_id=f"req-{index}")  # fmt: skip


async def test_records_tokens_first_token_and_each_way_a_request_ends(fake_server, tmp_path):
    """No window (``math.inf``): every request ends on its own, whatever the machine's speed."""
    fake, url = fake_server
    trace = [request(0, 0.0, 3), request(1, 0.05, REFUSED), request(2, 0.1, STOPS_SHORT)]
    progress: list[int] = []
    context = RunContext(
        trace=trace, adapters=AdapterSet(tmp_path, (8, 8)), window_s=math.inf, on_progress=progress.append
    )
    done, refused, short = await replay_over_http(context, url, LlamaServerCompletion())

    assert done.completed and done.output_tokens == 3
    assert done.arrival_s <= done.first_token_s <= done.finish_s
    assert "503" in refused.error and refused.output_tokens == 0 and refused.first_token_s is None
    assert "ended after 2 of 5 tokens" in short.error and not short.completed
    assert sum(progress) == len(trace)

    sent = {b["n_predict"]: b for b in fake.bodies}
    assert sent[3]["prompt"] == list(context.prompt(trace[0]))
    assert sent[3]["lora"] == [{"id": 0, "scale": 1.0}] and sent[REFUSED]["lora"] == [{"id": 1, "scale": 1.0}]
    assert all(b["ignore_eos"] and b["stream"] and b["cache_prompt"] is False for b in fake.bodies)


async def test_a_request_the_window_cuts_keeps_its_tokens_and_is_not_completed(fake_server, tmp_path):
    """The server sends one token and then nothing: only the window can end the request."""
    _, url = fake_server
    context = RunContext(
        trace=[request(3, 0.0, SLOW)], adapters=AdapterSet(tmp_path, (8, 8)), window_s=WINDOW_S
    )
    (cut,) = await replay_over_http(context, url, LlamaServerCompletion())
    assert cut.output_tokens == 1 and cut.finish_s is None and not cut.error and not cut.completed


def test_the_base_server_is_sent_no_adapter():
    body = LlamaServerCompletion(adapter_ids=False).body(request(0, 0.0, 3), (1, 2, 3))
    assert "lora" not in body and body["prompt"] == [1, 2, 3]


def test_openai_chunks_count_their_token_ids_and_end_at_the_finish_reason():
    protocol = OpenAICompletion(model_names=("a0", "a1"))
    body = protocol.body(request(1, 0.0, 4), (5, 6))
    assert body["model"] == "a1" and body["prompt"] == [5, 6] and body["max_tokens"] == 4
    assert body["ignore_eos"] and body["return_token_ids"]
    first = protocol.progress({"choices": [{"token_ids": [9, 9], "finish_reason": None}]}, 0)
    last = protocol.progress(
        {"choices": [{"token_ids": [9], "finish_reason": "length"}]}, first.output_tokens
    )
    assert (first.output_tokens, first.finished, last.output_tokens, last.finished) == (2, False, 3, True)
