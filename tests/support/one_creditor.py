"""A debtor engine's side of a borrowing test: a gManager that always suggests one creditor, and
stepping the debtor until a condition holds."""

from __future__ import annotations

from collections.abc import Callable

from services.gpu_worker.distkv.borrower import Candidate
from services.gpu_worker.engine.engine import Engine


class OneCreditor:
    """A gManager that always suggests the creditor ``creditor`` at ``address``."""

    def __init__(self, creditor: str, address: str, lendable_blocks: int = 16):
        self.creditor = creditor
        self.address = address
        self.lendable_blocks = lendable_blocks

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        return [Candidate(self.creditor, self.address, self.lendable_blocks)]

    def report_refusal(self, debtor: str, creditor: str) -> None:
        raise AssertionError(f"{creditor} refused {debtor}")


def step_until(debtor: Engine, done: Callable[[], bool]) -> None:
    """Step ``debtor`` until ``done()`` or it has no work left."""
    while debtor.has_work() and not done():
        debtor.step()
