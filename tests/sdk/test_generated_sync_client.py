"""The synchronous client is generated from the asyncio one (tools/generate_sync_client.py): the
committed file is what generating gives now, nothing asyncio is left in it, the two clients offer
the same methods, and the sampling keywords of both are the fields of ``Sampling``."""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from loramesh import AsyncClient, Client, Sampling
from loramesh.async_client import AsyncAdapters
from loramesh.client import Adapters
from tools.generate_sync_client import ASYNC_SOURCE, SYNC_TARGET, sync_source

SAMPLING_KEYWORDS = [
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
]
"""The keywords the clients took before they were declared once (the API they keep)."""

GENERATING = ("generate", "stream", "chat", "chat_stream")
ASYNC_NODES = (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith)


def test_the_committed_sync_client_is_what_generating_gives():
    assert SYNC_TARGET.read_text() == sync_source(ASYNC_SOURCE.read_text()), (
        "loramesh/client.py is stale: run `make sdk-sync` (python tools/generate_sync_client.py)"
    )


def test_nothing_asyncio_is_left_in_the_sync_client():
    source = sync_source(ASYNC_SOURCE.read_text())
    tree = ast.parse(source)
    assert not [type(n).__name__ for n in ast.walk(tree) if isinstance(n, ASYNC_NODES)]
    assert not any(isinstance(n, ast.comprehension) and n.is_async for n in ast.walk(tree))
    # Docstrings and comments too: a sentence only true of the asyncio client.
    body = source.split("\n", 2)[2]  # past the header, which names the source file
    assert not re.findall(r"\b(async|await|asyncio|aio|aclosing|Async\w+|event loop)\b", body)


def test_the_generator_refuses_a_source_it_no_longer_fits():
    source = ASYNC_SOURCE.read_text().replace("import asyncio\n", "")
    with pytest.raises(ValueError, match="import asyncio"):
        sync_source(source)


@pytest.mark.parametrize(("asynchronous", "synchronous"), [(AsyncClient, Client), (AsyncAdapters, Adapters)])
def test_both_clients_offer_the_same_methods_with_the_same_parameters(asynchronous, synchronous):
    def methods(cls: type) -> dict[str, list[tuple[str, object, object]]]:
        return {
            name: [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()]
            for name, member in vars(cls).items()
            if callable(member) and not name.startswith("_")
        }

    assert methods(asynchronous) == methods(synchronous)


@pytest.mark.parametrize("cls", [Client, AsyncClient])
@pytest.mark.parametrize("method", GENERATING)
def test_the_sampling_keywords_are_the_fields_of_sampling(cls, method):
    assert [f.name for f in fields(Sampling)] == SAMPLING_KEYWORDS
    parameters = inspect.signature(getattr(cls, method)).parameters.values()
    first = "messages" if method.startswith("chat") else "prompt"
    assert [p.name for p in parameters] == [
        "self",
        first,
        "adapter",
        *SAMPLING_KEYWORDS,
        "deadline_ms",
        "cache_salt",
        "timeout",
    ]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is None for p in list(parameters)[2:])


def test_the_async_calls_stay_coroutine_functions_and_the_streams_do_not():
    assert [inspect.iscoroutinefunction(getattr(AsyncClient, m)) for m in GENERATING] == [
        True,
        False,
        True,
        False,
    ]


def test_a_misspelt_keyword_is_refused_before_anything_is_sent(tmp_path: Path):
    with Client("127.0.0.1:1", "sk-test", mesh_file=tmp_path / "none.json", retries=0) as client:
        with pytest.raises(TypeError, match="temprature"):
            client.generate("Hi", temprature=0.5)
        with pytest.raises(TypeError, match="prompt"):
            client.generate(max_tokens=3)
