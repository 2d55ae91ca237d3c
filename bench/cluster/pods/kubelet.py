"""Each container's life as the kubelet leads it: started, probed, restarted.

restartPolicy Always (the only one a Deployment or StatefulSet allows): a container that exits
is started again, at once the first time, then after a back-off that doubles from
``backoff_s`` (the kubelet's 10 s) up to 300 s; one that ran 10 minutes starts afresh. The
startup probe runs first, every periodSeconds after initialDelaySeconds, and failureThreshold
failures in a row kill the container; once it passes, the liveness probe (failureThreshold in a
row: the container is killed and restarted) and the readiness probe (ready after
successThreshold, not ready after failureThreshold) run. A kill is SIGTERM, then SIGKILL after
terminationGracePeriodSeconds, to the container's whole process group.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from bench.cluster.pods.container import ContainerLaunch, signal_group
from bench.cluster.pods.probes import ProbeTarget, run_probe

MAX_BACKOFF_S = 300.0
BACKOFF_RESET_S = 600.0
EXIT_POLL_S = 0.1
"""How often a container's process is checked for exit (the kubelet's PLEG relists each second)."""


@dataclass
class ContainerState:
    """What ``kubectl get pod`` would show of one container."""

    name: str
    restarts: int = 0
    running: bool = False
    started: bool = False
    """Its startup probe has passed (or it has none)."""
    ready: bool = False
    pid: int = 0
    last_exit: str = ""
    events: list[str] = field(default_factory=list)


class Container:
    """One container, supervised."""

    def __init__(
        self,
        launch: ContainerLaunch,
        spec: Mapping,
        log: Path,
        executor: Executor,
        target: Callable[[int], ProbeTarget],
        grace_s: float,
        backoff_s: float,
        on_event: Callable[[str], None],
    ):
        self.launch, self.spec, self.log = launch, spec, log
        self.state = ContainerState(launch.name)
        self._executor, self._target, self._grace_s, self._backoff_s = executor, target, grace_s, backoff_s
        self._on_event = on_event
        self._proc: subprocess.Popen | None = None
        self._stopping = False
        self._released = asyncio.Event()
        self._released.set()

    def event(self, message: str) -> None:
        self.state.events.append(message)
        self._on_event(f"{self.launch.name}: {message}")

    async def _probe_loop(self, key: str, started_at: float) -> str:
        """Run probe ``key`` until it decides something; what (for startup/liveness: "kill")."""
        probe = self.spec[key]
        period = float(probe.get("periodSeconds", 10))
        failures_needed = int(probe.get("failureThreshold", 3))
        successes_needed = int(probe.get("successThreshold", 1))
        delay = float(probe.get("initialDelaySeconds", 0)) - (time.monotonic() - started_at)
        if delay > 0:
            await asyncio.sleep(delay)
        loop = asyncio.get_running_loop()
        failures = successes = 0
        while True:
            assert self._proc is not None
            ok, detail = await loop.run_in_executor(
                self._executor, run_probe, probe, self._target(self._proc.pid)
            )
            failures, successes = (0, successes + 1) if ok else (failures + 1, 0)
            if key == "startupProbe":
                if ok:
                    return "started"
                if failures >= failures_needed:
                    self.event(f"startup probe failed {failures} times ({detail}): killing it")
                    return "kill"
            elif key == "livenessProbe" and failures >= failures_needed:
                self.event(f"liveness probe failed {failures} times ({detail}): killing it")
                return "kill"
            elif key == "readinessProbe":
                if ok and successes >= successes_needed and not self.state.ready:
                    self.state.ready = True
                    self.event("ready")
                elif not ok and failures >= failures_needed and self.state.ready:
                    self.state.ready = False
                    self.event(f"not ready ({detail})")
            await asyncio.sleep(period)

    async def _probes(self, started_at: float) -> str:
        if "startupProbe" in self.spec and await self._probe_loop("startupProbe", started_at) == "kill":
            return "kill"
        self.state.started = True
        if "readinessProbe" not in self.spec:
            self.state.ready = True
        loops = [asyncio.create_task(self._probe_loop(k, started_at)) for k in ("livenessProbe", "readinessProbe")
                 if k in self.spec]  # fmt: skip
        if not loops:
            await asyncio.Event().wait()
        try:
            done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            for task in loops:
                task.cancel()

    async def _exited(self) -> int:
        assert self._proc is not None
        while (code := self._proc.poll()) is None:
            await asyncio.sleep(EXIT_POLL_S)
        return code

    async def _kill(self) -> None:
        """SIGTERM, then SIGKILL after the grace period (the process group, both times)."""
        assert self._proc is not None
        signal_group(self._proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(self._exited(), self._grace_s)
        except TimeoutError:
            pass
        signal_group(self._proc, signal.SIGKILL)
        await self._exited()

    async def supervise(self) -> None:
        """Start it and keep it running until :meth:`stop`."""
        crashes = 0
        while not self._stopping:
            await self._released.wait()
            if self._stopping:
                return
            started_at = time.monotonic()
            self._proc = self.launch.start(self.log)
            self.state.running, self.state.pid = True, self._proc.pid
            self.state.started = self.state.ready = False
            probes = asyncio.create_task(self._probes(started_at))
            exited = asyncio.create_task(self._exited())
            done, _ = await asyncio.wait({probes, exited}, return_when=asyncio.FIRST_COMPLETED)
            if exited not in done:
                probes_said = probes.result()
                if probes_said == "kill":
                    await self._kill()
            probes.cancel()
            code = await exited
            self.state.running = self.state.started = self.state.ready = False
            if self._stopping:
                return
            self.state.last_exit = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
            ran_s = time.monotonic() - started_at
            crashes = 1 if ran_s > BACKOFF_RESET_S else crashes + 1
            self.state.restarts += 1
            wait_s = 0.0 if crashes == 1 else min(self._backoff_s * 2 ** (crashes - 2), MAX_BACKOFF_S)
            self.event(
                f"{self.state.last_exit} after {ran_s:.1f} s; restart {self.state.restarts} in {wait_s:.0f} s"
            )
            await asyncio.sleep(wait_s)

    async def stop(self) -> None:
        """Stop it for good (SIGTERM, grace, SIGKILL)."""
        self._stopping = True
        self._released.set()
        if self._proc is not None and self._proc.poll() is None:
            await self._kill()

    def hold(self) -> None:
        """Start it no more once it exits (its node is down); on the kubelet's loop."""
        self._released.clear()

    def release(self) -> None:
        """Its node is back: start it again if it is down; on the kubelet's loop."""
        self._released.set()

    def kill_group(self) -> None:
        """SIGKILL to its process group, from any thread, leaving the restart to :meth:`supervise`."""
        if self._proc is not None:
            signal_group(self._proc, signal.SIGKILL)

    def kill_now(self) -> None:
        """SIGKILL to its process group, from any thread (teardown)."""
        self._stopping = True
        if self._proc is not None:
            signal_group(self._proc, signal.SIGKILL)
            self._proc.wait()
