"""The sampling keywords of ``generate``, ``stream``, ``chat`` and ``chat_stream``, declared once:
they are the fields of :class:`~loramesh.types.Sampling`.

A method written with one ``sampling: Sampling`` parameter is called, once decorated with
:func:`sampling_keywords`, with those fields as keyword arguments in its place
(``max_tokens=16, temperature=0.7``); it receives them gathered into one :class:`Sampling`. Its
signature, as ``inspect.signature`` and ``help()`` show it, lists them, so a keyword added to
:class:`Sampling` is a keyword of every such method of both clients.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

from loramesh.types import Sampling

_Result = TypeVar("_Result")

_SAMPLING_PARAMETER = "sampling"
_FIELDS = tuple(f.name for f in fields(Sampling))


def sampling_keywords(method: Callable[..., _Result]) -> Callable[..., _Result]:
    """``method`` with its ``sampling`` parameter spread into :class:`Sampling`'s fields, each a
    keyword-only argument defaulting to None (the server's default)."""
    declared = inspect.signature(method)
    spread_fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=f.type)
        for f in fields(Sampling)
    ]
    parameters: list[inspect.Parameter] = []
    for parameter in declared.parameters.values():
        parameters.extend(spread_fields if parameter.name == _SAMPLING_PARAMETER else [parameter])
    keywords = declared.replace(parameters=parameters)

    def gathered(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        # Binding raises the TypeError a misspelt or missing argument always raised.
        arguments = keywords.bind(*args, **kwargs).arguments
        sampling = Sampling(**{name: arguments.pop(name) for name in _FIELDS if name in arguments})
        return {**arguments, _SAMPLING_PARAMETER: sampling}

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
