"""loramesh as a user runs it, served over HTTP like llama-server: ``loramesh up --detach`` on a
scratch state directory, the bench's adapters uploaded through the gateway, the trace replayed
against the gateway's OpenAI API by the HTTP client llama-server gets
(:mod:`bench.systems.http_replay`), then ``loramesh down``.

Memory is ``up``'s own defaults, as a user gets them (a 512 MiB pool per worker, a 1 GiB store
RAM tier, a 4 GiB worker host cache): llama-server, its peer here, holds every adapter in RAM
too, so the profile's small adapter budget (S-LoRA's memory-pressure setting, which the other
systems keep) would handicap only loramesh. Like every system: at most ``max_batch`` requests
running together and an unbounded scheduler queue (the other systems queue every request of a
saturating trace too), set through the services' documented ``LORAMESH_*`` environment
variables, which ``up``'s processes inherit; every core (``up``'s one worker gets them all).
Extra ``up`` flags (``--dtype``, ``--quantization``, ``--pool-mib``) come last, so they override these.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.systems.base import RequestRecord, RunContext
from bench.systems.completion_protocols import OpenAICompletion
from bench.systems.gateway_system import upload_adapters
from bench.systems.http_replay import replay_over_http
from loramesh.async_client import AsyncClient
from loramesh_cli.mesh_file import MeshFile

UNBOUNDED_QUEUE = 1_000_000
COMMAND_TIMEOUT_S = 900
"""``up`` waits for nine processes to be ready: minutes on a busy 2-core machine."""
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class LoraMeshUpSystemOptions:
    name: str = "loramesh-up"
    """Label in tables and plots."""
    up_args: tuple[str, ...] = ()
    """Extra ``loramesh up`` flags, after the system's own (so they win), e.g.
    ``("--dtype", "bfloat16")``."""


@dataclass
class LoraMeshUpRun:
    """How the last run's mesh was started, for the results."""

    up_flags: list[str] = field(default_factory=list)
    """``loramesh up``'s flags after ``up``."""
    environment: dict[str, str] = field(default_factory=dict)
    """The ``LORAMESH_*`` variables set for it."""


class LoraMeshUpSystem:
    def __init__(self, options: LoraMeshUpSystemOptions = LoraMeshUpSystemOptions()):
        self.options = options
        self.name = options.name
        self.last_run = LoraMeshUpRun()

    def stats(self) -> dict:
        return dict(vars(self.last_run))

    def run(self, context: RunContext) -> list[RequestRecord]:
        flags = [
            "--detach", *(["--model", context.model_path] if context.model_path else []), *self.options.up_args,
        ]  # fmt: skip
        environment = {
            "LORAMESH_MAX_RUNNING": str(context.max_batch),
            "LORAMESH_MAX_RUNNING_HINT": str(context.max_batch),
            "LORAMESH_MAX_QUEUE_PER_WORKER": str(UNBOUNDED_QUEUE),
        }
        self.last_run = LoraMeshUpRun(up_flags=flags, environment=environment)
        with tempfile.TemporaryDirectory(prefix="loramesh-bench-up-") as state_dir:
            _loramesh(Path(state_dir), "up", *flags, env={**os.environ, **environment})
            try:
                mesh = MeshFile.read(Path(state_dir))
                if mesh is None:
                    raise RuntimeError(f"`loramesh up` left no mesh.json in {state_dir}")
                return asyncio.run(_serve(context, mesh))
            finally:
                _loramesh(Path(state_dir), "down")


def _loramesh(state_dir: Path, *argv: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state_dir), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-LOG_TAIL_LINES:])
        raise RuntimeError(f"`loramesh {argv[0]}` failed (exit {done.returncode}):\n{tail}")


async def _serve(context: RunContext, mesh: MeshFile) -> list[RequestRecord]:
    gateway = mesh.services["gateway"]
    async with AsyncClient(gateway.address, mesh.admin_api_key, timeout=None, retries=0) as client:
        await upload_adapters(client, context)
    names = tuple(context.adapters.name(i) for i in range(context.adapters.count))
    return await replay_over_http(
        context,
        f"http://{gateway.openai_address}",
        OpenAICompletion(model_names=names),
        headers={"Authorization": f"Bearer {mesh.admin_api_key}"},
    )
