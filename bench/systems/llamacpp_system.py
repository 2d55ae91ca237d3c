"""llama.cpp's llama-server, the CPU peer (docs/benchmarks.md, "loramesh vs llama.cpp").

Before the clock starts: the bench's PEFT adapters are converted to GGUF LoRA files (once, cached:
:mod:`bench.systems.llamacpp_adapters`) and llama-server is started on the same GGUF base model
with all of them loaded but none applied (``--lora-init-without-apply``), one slot per request the
other systems run together (``-np max_batch``), every core. Each request then names its adapter
(``"lora": [{"id": i, "scale": 1}]``); llama-server batches only requests with the same adapters
together. Without adapters (:attr:`LlamaServerSystemOptions.with_adapters` False) the server has
no ``--lora`` and requests name none: the no-LoRA ceiling, since a request with ``"lora": []`` on
a server holding 100 adapters is far slower. The trace is replayed by the shared HTTP client
(:mod:`bench.systems.http_replay`), then the server is given time to drain (``GET /slots``:
no slot processing) and stopped.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.systems.base import RequestRecord, RunContext
from bench.systems.completion_protocols import LlamaServerCompletion
from bench.systems.http_replay import replay_over_http
from bench.systems.llamacpp_adapters import find_converter, gguf_adapters
from services.model_files.base_model import default_model_path, load_base_model_spec
from services.runtime.process.ports import free_port

HOST = "127.0.0.1"
SLOT_CONTEXT_ROUNDING = 256
"""Each slot's context is the trace's longest prompt + output, rounded up to this."""
POLL_S = 0.25
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class LlamaServerSystemOptions:
    binary: Path
    """The ``llama-server`` executable (built in its llama.cpp checkout, whose converter is used)."""
    name: str = "llamacpp"
    """Label in tables and plots."""
    with_adapters: bool = True
    """Load the bench's adapters and apply each request's; False: base model only."""
    startup_timeout_s: float = 300.0
    """How long llama-server may take to answer ``/health``."""
    drain_timeout_s: float = 120.0
    """How long the run waits for llama-server's slots to go idle after the window."""


@dataclass
class LlamaServerRun:
    """How the last run's server was started, for the results."""

    version: str = ""
    """``llama-server --version``."""
    flags: list[str] = field(default_factory=list)
    """Its command line without the binary and the ``--lora`` files."""
    lora_files: int = 0
    """Adapters it loaded."""
    drained: bool = False
    """Its slots went idle after the window (False: it was stopped while still busy)."""


class LlamaServerSystem:
    def __init__(self, options: LlamaServerSystemOptions):
        self.options = options
        self.name = options.name
        self.last_run = LlamaServerRun()

    def stats(self) -> dict:
        return dict(vars(self.last_run))

    def run(self, context: RunContext) -> list[RequestRecord]:
        model = Path(context.model_path) if context.model_path else default_model_path()
        if model.suffix != ".gguf":
            raise ValueError(f"llama-server needs a GGUF base model, not {model}")
        lora: list[Path] = []
        if self.options.with_adapters:
            converter = find_converter(self.options.binary)
            lora = gguf_adapters(context.adapters, load_base_model_spec(context.model_path), converter)
        port = free_port(HOST)
        flags = self._flags(context, model, port)
        self.last_run = LlamaServerRun(version=self._version(), flags=flags, lora_files=len(lora))
        lora_flags = ["--lora-init-without-apply", *(f for path in lora for f in ("--lora", str(path)))]
        command = [str(self.options.binary), *flags, *(lora_flags if lora else [])]
        with tempfile.TemporaryDirectory(prefix="loramesh-bench-llama-server-") as scratch:
            log_path = Path(scratch) / "llama-server.log"
            with open(log_path, "wb") as log:
                server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                return asyncio.run(self._serve(context, f"http://{HOST}:{port}", server, log_path))
            finally:
                server.terminate()
                try:
                    server.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()

    def _flags(self, context: RunContext, model: Path, port: int) -> list[str]:
        longest = max((r.input_len + r.output_len for r in context.trace), default=1)
        slot_context = -(-longest // SLOT_CONTEXT_ROUNDING) * SLOT_CONTEXT_ROUNDING
        return [
            "-m", str(model), "--host", HOST, "--port", str(port),
            "-t", str(os.cpu_count() or 1), "-np", str(context.max_batch),
            "-c", str(context.max_batch * slot_context), "--cont-batching", "--no-webui",
        ]  # fmt: skip

    def _version(self) -> str:
        done = subprocess.run(
            [str(self.options.binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
        return " ".join((done.stdout + done.stderr).split())

    async def _serve(
        self, context: RunContext, base_url: str, server: subprocess.Popen, log_path: Path
    ) -> list[RequestRecord]:
        async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as client:
            await self._wait_healthy(client, server, log_path)
            records = await replay_over_http(
                context, base_url, LlamaServerCompletion(adapter_ids=self.options.with_adapters)
            )
            self.last_run.drained = await self._drain(client)
        return records

    async def _wait_healthy(
        self, client: httpx.AsyncClient, server: subprocess.Popen, log_path: Path
    ) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited with {server.returncode}:\n{_tail(log_path)}")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            await asyncio.sleep(POLL_S)
        raise TimeoutError(
            f"llama-server not healthy within {self.options.startup_timeout_s:g} s:\n{_tail(log_path)}"
        )

    async def _drain(self, client: httpx.AsyncClient) -> bool:
        """Wait until no slot is processing (requests cut by the window are being cancelled)."""
        deadline = time.monotonic() + self.options.drain_timeout_s
        while time.monotonic() < deadline:
            slots = (await client.get("/slots")).json()
            if not any(slot.get("is_processing") for slot in slots):
                return True
            await asyncio.sleep(POLL_S)
        return False


def _tail(log_path: Path) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
