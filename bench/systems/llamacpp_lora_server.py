"""llama-server at batch 1 with named LoRA adapters: the peer of the served speculative bench
(``bench.speculative_served_bench``) on the same GGUF base, adapters and prompt token ids.

One slot (``-np 1``), every core, the PEFT adapters converted to GGUF LoRA files
(:func:`bench.systems.llamacpp_adapters.gguf_lora_files`) and loaded unapplied
(``--lora-init-without-apply``); each request applies its own adapter at scale 1 (the converter
keeps ``lora_alpha``, so scale 1 is PEFT's scaling) or none for the base model. Requests are
greedy (temperature 0, no repetition penalty), end of sequence ignored, prompt cache off, and
streamed with their token ids (``return_tokens``), one token a chunk.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.systems.llamacpp_adapters import find_converter, gguf_lora_files
from services.model_files.base_model import load_base_model_spec
from services.runtime.process.ports import free_port

HOST = "127.0.0.1"
SSE_DATA = "data:"
STARTUP_TIMEOUT_S = 300.0
POLL_S = 0.25
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 20


class LlamaLoraServer:
    """A running ``llama-server -np 1`` with ``adapters`` (name -> PEFT directory) loaded."""

    def __init__(self, binary: Path, gguf: Path, adapters: dict[str, Path], context: int = 2048):
        spec = load_base_model_spec(str(gguf))
        files = gguf_lora_files(list(adapters.values()), spec, find_converter(binary)) if adapters else []
        self.lora_ids = {name: index for index, name in enumerate(adapters)}
        """Adapter name -> its id in the requests' ``lora`` lists."""
        version = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
        self.version = " ".join((version.stdout + version.stderr).split())
        """``llama-server --version``."""
        port = free_port(HOST)
        self.url = f"http://{HOST}:{port}"
        self.flags = [
            "-m", str(gguf), "--host", HOST, "--port", str(port), "-t", str(os.cpu_count() or 1),
            "-np", "1", "-c", str(context), "--no-webui", *(["--lora-init-without-apply"] if files else []),
        ]  # fmt: skip
        """Its command line without the binary and the ``--lora`` files."""
        self._scratch = tempfile.TemporaryDirectory(prefix="loramesh-bench-llama-lora-")
        self._log = Path(self._scratch.name) / "llama-server.log"
        with open(self._log, "wb") as log:
            self._process = subprocess.Popen(
                [str(binary), *self.flags, *(f for path in files for f in ("--lora", str(path)))],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self._process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(POLL_S)
        raise TimeoutError(f"llama-server not healthy within {STARTUP_TIMEOUT_S:g} s:\n{self.log_tail()}")

    def body(self, prompt_ids: list[int], adapter: str, max_tokens: int) -> dict:
        """The ``/completion`` request of ``prompt_ids`` on ``adapter`` ("" or None: the base model)."""
        return {
            "prompt": prompt_ids,
            "n_predict": max_tokens,
            "ignore_eos": True,
            "cache_prompt": False,
            "temperature": 0.0,
            "repeat_penalty": 1.0,
            "return_tokens": True,
            "stream": True,
            "lora": [{"id": self.lora_ids[adapter], "scale": 1.0}] if adapter else [],
        }

    def stream(self, client: httpx.Client, prompt_ids: list[int], adapter: str, max_tokens: int) -> dict:
        """One streamed request: its token ids and when it was sent and its first and last
        chunks came (the shape of ``bench.speculative_served_bench.request``'s answer)."""
        start = time.perf_counter()
        tokens: list[int] = []
        stamps: list[float] = []
        # A connection per request: llama-server drops kept-alive ones between requests.
        with client.stream(
            "POST", self.url + "/completion", json=self.body(prompt_ids, adapter, max_tokens),
            headers={"Connection": "close"},
        ) as response:  # fmt: skip
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(SSE_DATA):
                    continue
                ids = json.loads(line[len(SSE_DATA) :]).get("tokens") or ()
                if ids:
                    tokens.extend(ids)
                    stamps.append(time.perf_counter())
        if len(tokens) < 2:
            raise RuntimeError(f"llama-server streamed {len(tokens)} tokens")
        return {"tokens": tokens, "start": start, "first": stamps[0], "last": stamps[-1]}

    def log_tail(self) -> str:
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])

    def close(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._scratch.cleanup()
