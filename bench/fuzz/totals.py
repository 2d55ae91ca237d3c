"""What a fuzz campaign tried and saw: per entry point and identity, each outcome's count, and
the first inputs that failed."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

FAILURES_KEPT = 5
"""Failing inputs kept per entry point and identity (the rest are only counted)."""


@dataclass
class Totals:
    outcomes: dict[tuple[str, str], Counter] = field(default_factory=lambda: defaultdict(Counter))
    """(entry point, identity) -> outcome (an HTTP status or a gRPC code's name) -> count."""
    failures: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    """(entry point, identity) -> a line per failing input: the outcome, its message, the input."""
    failed: Counter = field(default_factory=Counter)
    """(entry point, identity) -> inputs that failed (a 5xx, INTERNAL, UNKNOWN or DATA_LOSS)."""

    last: str = ""
    """The entry point and identity of the input counted last."""
    notes: list[str] = field(default_factory=list)
    """What the hostile adapters got, one line each (which input, which answer)."""

    def add(self, entry: str, identity: str, outcome: str | int, failure: str | None = None) -> None:
        """Count one input's ``outcome``; ``failure``: what to say about it when it is a failure."""
        self.outcomes[entry, identity][str(outcome)] += 1
        self.last = f"{entry} [{identity}]"
        if failure is not None:
            self.failed[entry, identity] += 1
            kept = self.failures[entry, identity]
            if len(kept) < FAILURES_KEPT:
                kept.append(failure[:600])

    @property
    def cases(self) -> int:
        return sum(sum(c.values()) for c in self.outcomes.values())

    def table(self, group: Callable[[str], str] = lambda entry: entry) -> list[str]:
        """Markdown rows: entry point (or its ``group``), identity, entry points, cases, failures,
        the three commonest outcomes."""
        grouped: dict[tuple[str, str], Counter] = defaultdict(Counter)
        entries: dict[tuple[str, str], set] = defaultdict(set)
        failed: Counter = Counter()
        for (entry, identity), counts in self.outcomes.items():
            grouped[group(entry), identity].update(counts)
            entries[group(entry), identity].add(entry)
            failed[group(entry), identity] += self.failed[entry, identity]
        lines = ["| entry point | identity | entry points | cases | 5xx / INTERNAL / UNKNOWN | commonest outcomes |",
                 "|---|---|---:|---:|---:|---|"]  # fmt: skip
        for (name, identity), counts in sorted(grouped.items()):
            common = ", ".join(f"{outcome} {n}" for outcome, n in counts.most_common(3))
            lines.append(
                f"| {name} | {identity} | {len(entries[name, identity])} | {sum(counts.values())} "
                f"| {failed[name, identity]} | {common} |"
            )
        return lines

    def failure_lines(self) -> list[str]:
        return [
            f"{entry} [{identity}]: {line}"
            for (entry, identity), kept in sorted(self.failures.items())
            for line in kept
        ]
