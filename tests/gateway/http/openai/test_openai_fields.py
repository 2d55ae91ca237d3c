"""docs/openai-fields.md against the code and the installed ``openai`` package: every field of
OpenAI's chat completions and completions requests is declared by the gateway (so it is honoured
or refused by name, never dropped as unknown) and in the doc's table, every declared field is in
the table, and every field the table marks refused is refused with a 400 naming it. A field no
one knows is ignored, and logged once per name."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from services.gateway.http.errors import OpenAIError
from services.gateway.http.openai.requests import ChatCompletionBody, CompletionBody

DOC = Path(__file__).parents[4] / "docs" / "openai-fields.md"
SECTIONS = {
    ChatCompletionBody: (
        "## `POST /v1/chat/completions`",
        chat_create_params.CompletionCreateParamsStreaming,
    ),
    CompletionBody: ("## `POST /v1/completions`", completion_create_params.CompletionCreateParamsStreaming),
}
#: A value asking for what each refused field asks for, by route.
REFUSALS = {
    "store": True, "service_tier": "priority", "reasoning_effort": "low", "verbosity": "high",
    "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "mp3"},
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "moderation": {},
    "functions": [{"name": "f"}], "function_call": {"name": "f"},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "x",
    "structured_outputs": {"json": {}}, "echo": True, "suffix": "end", "best_of": 2,
}  # fmt: skip
REQUIRED = {
    ChatCompletionBody: {"messages": [{"role": "user", "content": "Hi"}]},
    CompletionBody: {"prompt": "Hi"},
}


def documented(heading: str) -> dict[str, str]:
    """field -> its status (``supported``, ``accepted``, ``refused``) in the tables under ``heading``."""
    lines = DOC.read_text().splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    table = {}
    for line in lines[start:end]:
        if not line.startswith("| `"):
            continue
        names, status = line.split(" | ")[:2]
        for name in re.findall(r"`(\w+)`", names):
            table[name] = re.match(r"\*\*(\w+)\*\*", status).group(1)
    return table


def openai_fields(params) -> set[str]:
    return set(params.__required_keys__ | params.__optional_keys__)


@pytest.mark.parametrize("body", SECTIONS, ids=lambda b: b.ROUTE)
def test_every_openai_field_is_declared_and_documented_and_every_declared_one_too(body):
    heading, params = SECTIONS[body]
    table = documented(heading)
    assert openai_fields(params) - set(body.model_fields) == set(), "OpenAI fields the gateway would drop"
    assert set(table) == set(body.model_fields)
    assert set(table.values()) <= {"supported", "accepted", "refused"}


@pytest.mark.parametrize("body", SECTIONS, ids=lambda b: b.ROUTE)
def test_every_field_documented_refused_is_refused_by_name(body):
    refused = {name for name, status in documented(SECTIONS[body][0]).items() if status == "refused"}
    assert refused <= set(REFUSALS)
    for name in sorted(refused):
        parsed = body.model_validate({"model": "m", **REQUIRED[body], name: REFUSALS[name]})
        with pytest.raises(OpenAIError) as caught:
            parsed.check()
        assert (caught.value.status, caught.value.param) == (400, name)
        assert caught.value.message.startswith(f"{name} is not supported")


async def test_an_unknown_field_is_ignored_and_logged_once_per_name(scripted_gateway, caplog):
    scripted_gateway.worker.script = scripted_gateway.core.encode(" Ahoy")
    unknown = f"field_{uuid.uuid4().hex}"  # not logged before, whatever ran first in this process
    bodies = {
        "/v1/completions": {"model": "pirate", "prompt": "Hi", "max_tokens": 2, unknown: {"any": "value"}},
        "/v1/chat/completions": {
            "model": "pirate",
            "messages": [{"role": "user", "content": "Hi"}],
            unknown: 1,
        },
    }
    with caplog.at_level(logging.INFO, logger="loramesh.gateway.openai"):
        for path, body in [*bodies.items(), *bodies.items()]:
            reply = await scripted_gateway.http.post(path, json=body)
            assert reply.status_code == 200, reply.text
    logged = [r.getMessage() for r in caplog.records if unknown in r.getMessage()]
    assert logged == [
        f"ignoring request field {unknown!r} on /v1/completions: not a field loramesh knows (logged once)"
    ]
