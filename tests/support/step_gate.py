"""Drive a real gpu_worker process by engine steps, not by time.

A worker started with :meth:`StepGate.env` loads ``step_gate_site/sitecustomize.py``, which
gates its engine: it takes exactly the steps the test allows (:meth:`StepGate.steps`) and is
held between them. A held engine still takes new requests and cancellations, runs the calls
handed to ``Engine.between_steps`` (DGFM's RecallBlocks, StageOutBlocks and StageInBlocks,
ListRequests) and serves other workers its lent blocks (those RPCs never run on the engine
thread), and its heartbeats go on; only decoding waits. So a test can build a state (who holds
whose KV blocks) one step at a time and keep it while it checks it and while the kv_manager
moves blocks, however fast or slow the machine is.
"""

from __future__ import annotations

import os
from pathlib import Path

from support.polling import poll_until

SITE_DIR = Path(__file__).parent / "step_gate_site"
ENV_VAR = "LORAMESH_TEST_STEP_GATE"


class StepGate:
    """The gate of one worker process, in the file ``path`` (held from the start: 0 steps)."""

    def __init__(self, path: Path):
        self.path = path
        self.allowed = 0
        self._write(str(self.allowed))

    def env(self) -> dict[str, str]:
        """What the worker's environment needs for the gate."""
        pythonpath = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH", "")) if p)
        return {ENV_VAR: str(self.path), "PYTHONPATH": pythonpath}

    def installed(self) -> bool:
        """The worker imported its engine with the gate on (true once it is ready)."""
        return self.path.with_name(self.path.name + ".installed").exists()

    def held_after(self) -> int | None:
        """Steps taken when the engine last reported itself held (None: not yet)."""
        try:
            return int(self.path.with_name(self.path.name + ".held").read_text())
        except FileNotFoundError:
            return None

    async def steps(self, count: int = 1) -> None:
        """Let the engine take ``count`` more steps and wait until it has, and is held again.
        It must have work (a request queued or running), or it never steps: hand it over first."""
        self.allowed += count
        self._write(str(self.allowed))

        async def held_after() -> int | None:
            return self.held_after()

        await poll_until(
            held_after, lambda taken: taken == self.allowed, f"the engine gated by {self.path} took its steps"
        )

    def open(self) -> None:
        """No gate any more: the engine steps freely."""
        self._write("open")

    def _write(self, text: str) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
