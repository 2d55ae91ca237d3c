"""Keep a local mesh's processes running, as a kubelet keeps a pod's containers: a process seen
dead is started again on the same ports, instance id and data directory (so it registers again
in etcd under the same member key), after the backoff of its :class:`RestartTracker`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loramesh_cli.restart_policy import RestartPolicy, RestartTracker
from services.runtime.etcd.etcd_server import EtcdServer, EtcdStartError
from services.runtime.process.process import ServiceProcess

log = logging.getLogger("loramesh.supervisor")

CHECK_INTERVAL_S = 0.2
"""How often the supervisor looks for dead processes."""


class Supervised(Protocol):
    """One process the supervisor can launch, watch and stop."""

    name: str

    def launch(self) -> None:
        """Start the process (may block until it is up; the supervisor runs it off the loop)."""

    def exit_code(self) -> int | None:
        """The exit status once the process has died; None while it runs."""

    def pid(self) -> int:
        """Its process id (0 when none runs)."""

    def stop(self) -> None:
        """Stop it gracefully (blocking), killing it if it does not go."""


@dataclass
class ServiceUnit:
    """A ``python -m services.<name>`` process; its ports, flags and environment never change,
    so a restart comes back at the same address."""

    name: str
    process: ServiceProcess

    def launch(self) -> None:
        self.process.start()

    def exit_code(self) -> int | None:
        return self.process.proc.poll() if self.process.proc is not None else None

    def pid(self) -> int:
        return self.process.pid or 0

    def stop(self) -> None:
        self.process.terminate()


@dataclass
class EtcdUnit:
    """The mesh's etcd, restarted on the same ports and data directory (its keys and leases
    survive a crash)."""

    name: str
    server: EtcdServer

    def launch(self) -> None:
        self.server.start()

    def exit_code(self) -> int | None:
        return self.server.exit_code

    def pid(self) -> int:
        return self.server.pid or 0

    def stop(self) -> None:
        self.server.stop()


@dataclass
class Supervisor:
    """Restarts the ``units`` that die; ``on_change`` is called after every exit or restart
    (``loramesh up`` rewrites mesh.json there)."""

    units: list[Supervised]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    on_change: Callable[[], None] = lambda: None
    clock: Callable[[], float] = time.monotonic
    trackers: dict[str, RestartTracker] = field(init=False)
    last_exit_unix: dict[str, float] = field(init=False, default_factory=dict)
    """Wall-clock time of each unit's last exit, for ``loramesh status``."""

    def __post_init__(self) -> None:
        self.trackers = {unit.name: RestartTracker(self.policy) for unit in self.units}

    def launched(self, unit: Supervised) -> None:
        """Record a launch made outside :meth:`check` (the mesh's first start)."""
        self.trackers[unit.name].started(self.clock())

    async def check(self) -> None:
        """One pass: note the units that died, relaunch those whose backoff has passed."""
        for unit in self.units:
            tracker = self.trackers[unit.name]
            if tracker.started_at is not None:
                code = unit.exit_code()
                if code is not None:
                    self._exited(unit, code)
            elif tracker.due(self.clock()):
                try:
                    await asyncio.to_thread(unit.launch)
                except (EtcdStartError, OSError) as error:
                    log.error("could not restart %s: %s", unit.name, error)
                    tracker.started(self.clock())
                    self._exited(unit, unit.exit_code() or 1)
                    continue
                tracker.started(self.clock())
                log.warning("restarted %s (pid %d, restart %d)", unit.name, unit.pid(), tracker.restarts)
                self.on_change()

    def _exited(self, unit: Supervised, code: int) -> None:
        restart_at = self.trackers[unit.name].exited(self.clock(), code)
        self.last_exit_unix[unit.name] = time.time()
        log.warning(
            "%s exited (%s); restarting in %.1f s", unit.name, describe_exit(code), restart_at - self.clock()
        )
        self.on_change()

    async def run(self, stop: asyncio.Event) -> None:
        """Check every :data:`CHECK_INTERVAL_S` until ``stop`` is set."""
        while not stop.is_set():
            await self.check()
            try:
                await asyncio.wait_for(stop.wait(), CHECK_INTERVAL_S)
            except TimeoutError:
                pass


def describe_exit(code: int | None) -> str:
    """``"killed by signal 9"``, ``"exit code 1"``, or ``""`` when it never exited."""
    if code is None:
        return ""
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
