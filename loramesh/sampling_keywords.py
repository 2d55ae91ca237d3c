"""The keywords of ``generate``, ``stream``, ``chat`` and ``chat_stream`` after the prompt,
declared once: ``adapter``, the fields of :class:`~loramesh.types.Sampling`, ``deadline_ms``,
``cache_salt`` and ``timeout`` (:class:`CallKeywords`).

A method written with one ``call: CallKeywords`` parameter is called, once decorated with
:func:`call_keywords`, with those keywords in its place (``adapter="french", max_tokens=16,
temperature=0.7, timeout=5``); it receives them gathered into one :class:`CallKeywords`, its
sampling fields into one :class:`Sampling`. Its signature, as ``inspect.signature`` and
``help()`` show it, lists them, so a keyword added to :class:`Sampling` is a keyword of every
such method of both clients.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from loramesh.types import Sampling

_Result = TypeVar("_Result")

_CALL_PARAMETER = "call"
_SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling))


@dataclass(frozen=True)
class CallKeywords:
    """What a generating call takes besides its prompt or messages; each None: the default."""

    adapter: str | None = None
    """``"name"`` (the caller's adapter), ``"owner/name"`` (another tenant's public one), or None
    for the base model."""
    sampling: Sampling = field(default_factory=Sampling)
    """How tokens are picked: one keyword per field, each None for the server's default."""
    deadline_ms: float | None = None
    """Time-to-first-token objective the gateway schedules for; None for its default."""
    cache_salt: str | None = None
    """Share the prompt's cached KV only with requests passing the same salt; None: only within
    the caller's tenant."""
    timeout: float | None = None
    """Seconds for the whole call; None for the client's default."""


def _keyword(name: str, annotation: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def _spread_keywords() -> list[inspect.Parameter]:
    """:class:`CallKeywords`' fields as keyword-only parameters, ``sampling`` spread into
    :class:`Sampling`'s fields."""
    spread: list[inspect.Parameter] = []
    for call_field in fields(CallKeywords):
        if call_field.name == "sampling":
            spread.extend(_keyword(f.name, f.type) for f in fields(Sampling))
        else:
            spread.append(_keyword(call_field.name, call_field.type))
    return spread


def call_keywords(method: Callable[..., _Result]) -> Callable[..., _Result]:
    """``method`` with its ``call`` parameter spread into :class:`CallKeywords`' keywords (its
    ``sampling`` into :class:`Sampling`'s fields), each keyword-only and defaulting to None."""
    declared = inspect.signature(method)
    parameters: list[inspect.Parameter] = []
    for parameter in declared.parameters.values():
        parameters.extend(_spread_keywords() if parameter.name == _CALL_PARAMETER else [parameter])
    keywords = declared.replace(parameters=parameters)

    def gathered(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        # Binding raises the TypeError a misspelt or missing argument always raised.
        arguments = keywords.bind(*args, **kwargs).arguments
        sampling = Sampling(**{n: arguments.pop(n) for n in _SAMPLING_FIELDS if n in arguments})
        call = CallKeywords(
            sampling=sampling,
            **{f.name: arguments.pop(f.name) for f in fields(CallKeywords) if f.name in arguments},
        )
        return {**arguments, _CALL_PARAMETER: call}

    # A coroutine method stays one, so that inspect.iscoroutinefunction still says so.
    if inspect.iscoroutinefunction(method):

        async def spread(*args: Any, **kwargs: Any) -> Any:
            return await method(**gathered(args, kwargs))
    else:

        def spread(*args: Any, **kwargs: Any) -> Any:
            return method(**gathered(args, kwargs))

    functools.update_wrapper(spread, method)
    spread.__signature__ = keywords  # type: ignore[attr-defined]
    # typing.get_type_hints then agrees with the signature.
    spread.__annotations__ = {p.name: p.annotation for p in parameters} | {
        "return": declared.return_annotation
    }
    return spread
