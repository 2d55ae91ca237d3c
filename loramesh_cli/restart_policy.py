"""When to restart a supervised process that died: exponential backoff, capped, forgiven after a
healthy run. Pure bookkeeping over times handed in by the caller (no clock, no processes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """How ``loramesh up``'s supervisor spaces the restarts of one process."""

    initial_backoff_s: float = 0.5
    """Wait before the first restart after a crash."""
    multiplier: float = 2.0
    """Each further crash in a row multiplies the wait by this."""
    max_backoff_s: float = 30.0
    """The wait never grows beyond this."""
    healthy_after_s: float = 60.0
    """A process that ran this long before dying counts as healthy: its next wait starts over at
    ``initial_backoff_s``."""

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"need 0 <= initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s} and "
                f"{self.max_backoff_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if self.healthy_after_s <= 0:
            raise ValueError(f"healthy_after_s must be > 0, got {self.healthy_after_s}")


@dataclass
class RestartTracker:
    """One process's life under a :class:`RestartPolicy`: call :meth:`started` when it is
    launched and :meth:`exited` when it is seen dead; :meth:`due` says when to launch it again."""

    policy: RestartPolicy
    restarts: int = 0
    """Launches after the first one."""
    crashes_in_a_row: int = 0
    """Exits since the last healthy run (drives the backoff)."""
    started_at: float | None = None
    """When the current run began; None while it is down."""
    restart_at: float | None = None
    """When to launch it again; None while it runs."""
    last_exit_code: int | None = None
    """Exit status of the last run (negative: killed by that signal); None if it never ended."""
    last_exit_at: float | None = None
    """When the last run ended."""

    def started(self, now: float) -> None:
        """The process was launched at ``now``."""
        if self.last_exit_at is not None:
            self.restarts += 1
        self.started_at = now
        self.restart_at = None

    def exited(self, now: float, exit_code: int) -> float:
        """The process was seen dead at ``now`` with ``exit_code``; returns when to restart it."""
        ran_s = now - self.started_at if self.started_at is not None else 0.0
        if ran_s >= self.policy.healthy_after_s:
            self.crashes_in_a_row = 0
        wait_s = min(
            self.policy.initial_backoff_s * self.policy.multiplier**self.crashes_in_a_row,
            self.policy.max_backoff_s,
        )
        self.crashes_in_a_row += 1
        self.started_at = None
        self.last_exit_code = exit_code
        self.last_exit_at = now
        self.restart_at = now + wait_s
        return self.restart_at

    def due(self, now: float) -> bool:
        """The process is down and its backoff has passed."""
        return self.restart_at is not None and now >= self.restart_at
