"""Detects a service's event loop held up while it is fuzzed, from outside its process.

Every service answers ``grpc.health.v1.Health/Check`` from the servicer on its asyncio loop (the
shared bootstrap, services.runtime.rpc.server), so a health check answered late means the loop did
not get to it: a callback ran that long without yielding (a parse, a render, a file read on the
loop), or the process stopped. :class:`LagProbe` checks each service every
:attr:`LagProbeConfig.interval_s` from a thread of its own and counts the checks answered later
than :attr:`LagProbeConfig.blocked_s` (or not at all) as blocked stretches.

The threshold is a detector, not a verdict on speed: a loop that yields within tens of
milliseconds between callbacks answers in a few milliseconds even on a loaded machine, so a
check past a second means work was done on the loop that belongs in a thread or a process. On a
2-core machine that other work shares, a stretch can come from the scheduler of the machine
itself, which shows as stretches in several services at once (:func:`stretch_lines` puts
those on one line); :attr:`LagCounts.worst_s` gives the size of what was seen.

To tell those apart, the probe also checks a control (:class:`IdleControl`): a health server in a
process of its own that does nothing else. A stretch that overlaps one of the control's is the
machine's (or the prober's own process stalling, which delays every check it times), not the
service's loop: :func:`split_by_control` keeps the two apart.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True)
class LagProbeConfig:
    """How often and how strictly the services' loops are probed."""

    interval_s: float = 0.25
    """Time between two checks of one service."""
    blocked_s: float = 1.0
    """A check answered later than this (or not within :attr:`give_up_s`) counts as a blocked loop."""
    give_up_s: float = 10.0
    """How long one check waits for its answer."""


@dataclass
class LagCounts:
    """What the probe saw of one service."""

    checks: int = 0
    blocked: int = 0
    worst_s: float = 0.0


@dataclass(frozen=True)
class Stretch:
    """One health check answered late or not at all."""

    service: str
    began: float
    """When the check was sent (``time.monotonic``)."""
    took_s: float
    answered: bool
    doing: str
    """What the caller was doing then."""

    def overlaps(self, other: Stretch) -> bool:
        return self.began < other.began + other.took_s and other.began < self.began + self.took_s


def stretch_lines(stretches: list[Stretch]) -> list[str]:
    """A line per set of stretches that overlap in time: stretches in several services at once
    point at the machine (or at something they all wait on), one service alone at its loop."""
    groups: list[list[Stretch]] = []
    for stretch in sorted(stretches, key=lambda s: s.began):
        if groups and any(stretch.overlaps(other) for other in groups[-1]):
            groups[-1].append(stretch)
        else:
            groups.append([stretch])
    lines = []
    for group in groups:
        services = ", ".join(
            f"{s.service} {s.took_s:.2f} s" + ("" if s.answered else " (no answer)") for s in group
        )
        at_once = f"{len({s.service for s in group})} services at once: " if len(group) > 1 else ""
        lines.append(f"{at_once}{services}, during {group[0].doing}")
    return lines


CONTROL = "idle control"
"""The name of :class:`IdleControl` among a probe's targets."""


def split_by_control(stretches: list[Stretch]) -> tuple[list[Stretch], list[Stretch]]:
    """``stretches`` as (the services' own, the machine's): a service's stretch that overlaps one
    of the control's is the machine's; the control's own stretches are the machine's too."""
    control = [s for s in stretches if s.service == CONTROL]
    own = [s for s in stretches if s.service != CONTROL and not any(s.overlaps(c) for c in control)]
    return own, [s for s in stretches if s not in own]


class IdleControl:
    """An idle health server (:mod:`bench.fuzz.idle_health_server`) in a process of its own, and
    a channel to it; a context manager."""

    def __enter__(self) -> Self:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.fuzz.idle_health_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        port = int(self._process.stdout.readline())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        self._process.stdin.close()
        self._process.wait()
        self._process.stdout.close()


@dataclass
class LagProbe:
    """Health checks of every channel in ``targets`` (name -> channel), on a thread, until :meth:`stop`."""

    targets: dict[str, grpc.Channel]
    config: LagProbeConfig = LagProbeConfig()
    doing: Callable[[], str] = lambda: ""
    """What the caller was doing (named in each blocked stretch's line)."""
    counts: dict[str, LagCounts] = field(default_factory=dict)
    stretches: list[Stretch] = field(default_factory=list)
    """Every blocked stretch, in the order seen."""

    def __post_init__(self) -> None:
        self.counts = {name: LagCounts() for name in self.targets}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._probe, args=(name, channel), name=f"lag-{name}", daemon=True)
            for name, channel in self.targets.items()
        ]

    def start(self) -> LagProbe:
        for thread in self._threads:
            thread.start()
        return self

    def _probe(self, name: str, channel: grpc.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        counts = self.counts[name]
        while not self._stop.wait(self.config.interval_s):
            began = time.monotonic()
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=self.config.give_up_s)
                answered = True
            except grpc.RpcError:
                if self._stop.is_set():
                    return
                answered = False
            took = time.monotonic() - began
            counts.checks += 1
            counts.worst_s = max(counts.worst_s, took)
            if not answered or took > self.config.blocked_s:
                counts.blocked += 1
                self.stretches.append(Stretch(name, began, took, answered, self.doing()))

    def stop(self) -> dict[str, LagCounts]:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.config.give_up_s + 1)
        return self.counts
