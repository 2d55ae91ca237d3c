"""What one render of a chat template may spend, and the meter that holds it to that.

A chat template is code (an adapter's comes from its uploader), and Jinja's sandbox bounds what
it may touch, not how long it runs: two nested ``range(100000)`` loops are a valid template. A
render is held to a budget in *operations*, counted the same on every machine, so a template is
refused or served alike wherever it runs:

- each loop iteration, filter, test and attribute or item lookup is one operation, and each
  call of a function, method or macro :data:`CALL_OPERATIONS` (the sandbox's checks and a
  macro's frame cost about that many loop iterations);
- a value a call, an operator or an output builds counts its size on top: one operation per
  item of a list, tuple, dict, set or range, and per KiB of a string;
- a ``*`` or ``**`` whose result would be larger than the output budget (or a number of more
  than :data:`MAX_INT_BITS` bits) is refused before it is computed.

Its rendered text is bounded by :attr:`TemplateBudget.chat_template_max_output_bytes`. The
process that renders for the gateway also holds each render to
:attr:`~TemplateBudget.chat_template_cpu_s` of CPU time and itself to
:attr:`~TemplateBudget.chat_template_memory_mib` of memory
(:mod:`services.model_files.template_worker`): those bound whatever the count does not see (a
filter's own work on a large value, say).

The fields are the gateway's settings of the same names (``settings_of`` in its config), so
this module imports nothing of the runtime: the render process starts with Jinja alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

MAX_INT_BITS = 2**16
"""Largest number a template may compute, in bits: ``9 ** 9 ** 9`` takes minutes to multiply
out, and no prompt needs a number of more than a few digits."""

CALL_OPERATIONS = 10
"""What one call of a function, method or macro counts."""

_SIZED = frozenset({list, tuple, dict, set, frozenset, range})
"""Containers whose items count (exact types: a template's values are JSON's and Jinja's)."""


@dataclass(frozen=True)
class TemplateBudget:
    """What one chat template render may spend (the gateway's ``--chat-template-*`` settings)."""

    chat_template_max_operations: int = 100_000
    """Operations one chat template render may take (loop iterations, calls, lookups, and the
    size of the values it builds: docs/security.md, "Chat templates"); over it, the request is
    refused naming the template. Real templates take a few hundred to a few thousand."""
    chat_template_max_output_bytes: int = 2 * 2**20
    """Longest text one chat template render may produce, in UTF-8 bytes (and largest value it
    may build); keep it above --max-prompt-bytes, which bounds the messages it lays out."""
    chat_template_cpu_s: float = 1.0
    """CPU seconds one chat template render may take in its render process, which is replaced
    when a render goes over: the bound on what the operation count does not see."""
    chat_template_memory_mib: int = 512
    """Memory each chat template render process may map beyond what it holds when it starts,
    in MiB; a render that needs more is refused."""


class BudgetExhausted(BaseException):
    """A render went over its budget. A ``BaseException``, so that no ``except Exception`` in
    a filter or in Jinja's runtime can swallow it and let the template go on."""

    def __init__(self, message: str, setting: str | None):
        super().__init__(message)
        self.message = message
        """What went over, e.g. ``more than 100000 operations``."""
        self.setting = setting
        """The budget's setting that was exceeded (``chat_template_max_operations``...); None:
        a fixed limit (:data:`MAX_INT_BITS`)."""


class Meter:
    """The operations and output one render has left."""

    def __init__(self, budget: TemplateBudget):
        self.budget = budget
        self.spent = 0
        """Operations taken so far."""
        self.output_bytes = 0
        """Bytes of rendered text so far."""

    def spend(self, operations: int) -> None:
        self.spent += operations
        if self.spent > self.budget.chat_template_max_operations:
            raise BudgetExhausted(
                f"more than {self.budget.chat_template_max_operations} operations",
                "chat_template_max_operations",
            )

    def spend_on(self, value: Any) -> Any:
        """One operation, plus ``value``'s size; ``value`` back."""
        self.spend(1 + size_of(value))
        return value

    def check_length(self, length: int, what: str) -> None:
        """Refuses a string or list of ``length`` before it is built, if over the output budget."""
        if length > self.budget.chat_template_max_output_bytes:
            raise BudgetExhausted(
                f"{what} of {length} items, more than {self.budget.chat_template_max_output_bytes}",
                "chat_template_max_output_bytes",
            )

    def produce(self, chunk: str) -> None:
        """Counts ``chunk`` of the rendered text against the output budget."""
        self.output_bytes += len(chunk.encode("utf-8", "surrogatepass"))
        if self.output_bytes > self.budget.chat_template_max_output_bytes:
            raise BudgetExhausted(
                f"more than {self.budget.chat_template_max_output_bytes} bytes of output",
                "chat_template_max_output_bytes",
            )


def size_of(value: Any) -> int:
    """Operations ``value``'s size counts: its items, or its KiB for a string."""
    if isinstance(value, str):  # Markup too
        return len(value) >> 10
    return len(value) if type(value) in _SIZED else 0


_meter: contextvars.ContextVar[Meter] = contextvars.ContextVar("chat_template_meter")


@contextlib.contextmanager
def metered(budget: TemplateBudget) -> Iterator[Meter]:
    """Every metered hook run inside charges a fresh meter of ``budget``."""
    meter = Meter(budget)
    token = _meter.set(meter)
    try:
        yield meter
    finally:
        _meter.reset(token)


def meter() -> Meter:
    """The render's meter; a template runs only under :func:`metered`."""
    try:
        return _meter.get()
    except LookupError:
        raise RuntimeError("a chat template is rendered only under a budget (metered)") from None


class CountedIterator:
    """An iterable whose every item is one operation of the render's meter."""

    def __init__(self, items: Iterable[Any]):
        self._items = iter(items)
        self._meter = meter()

    def __iter__(self) -> CountedIterator:
        return self

    def __next__(self) -> Any:
        item = next(self._items)
        self._meter.spend(1)
        return item


def checked_product(left: Any, right: Any) -> Any:
    """``left * right``, refused before it is computed when the result would be over budget."""
    for sequence, times in ((left, right), (right, left)):
        if isinstance(sequence, str | list | tuple) and isinstance(times, int):
            meter().check_length(len(sequence) * max(times, 0), "a repeated value")
    if isinstance(left, int) and isinstance(right, int):
        _check_bits(left.bit_length() + right.bit_length())
    return left * right


def checked_power(base: Any, exponent: Any) -> Any:
    """``base ** exponent``, refused before it is computed when the number would be too large."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        _check_bits((abs(base).bit_length() - 1) * exponent)
    return base**exponent


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise BudgetExhausted(f"a number of about {bits} bits (at most {MAX_INT_BITS})", None)
