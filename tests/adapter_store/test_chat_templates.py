"""An adapter's own chat template: read from the tokenizer files uploaded with it, kept with the
adapter, given back by GetAdapter (not in listings), refused by name when it is too large or
does not compile, and added to a catalog written before templates existed."""

from __future__ import annotations

import json

import grpc
import pytest
from support.cli import COMMAND_TIMEOUT_S  # a hang guard, not a timing claim

from mesh_api.adapter_transfer import read_adapter_dir, ref_by_name, upload_requests
from mesh_api.v1 import adapter_store_pb2 as pb
from services.adapter_store.chat_templates import (
    MAX_CHAT_TEMPLATE_BYTES,
    AdapterChatTemplates,
    read_chat_templates,
)
from services.runtime.errors import InvalidArgument

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_USE = "{% for t in tools %}{{ t | tojson }}{% endfor %}" + CHATML


def config(chat_template) -> bytes:
    return json.dumps({"eos_token": "<|im_end|>", "chat_template": chat_template}).encode()


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, AdapterChatTemplates()),
        ({"tokenizer_config.json": b'{"eos_token": "<|im_end|>"}'}, AdapterChatTemplates()),
        ({"tokenizer_config.json": config(CHATML)}, AdapterChatTemplates(CHATML)),
        (
            {
                "tokenizer_config.json": config(
                    [
                        {"name": "rag", "template": "{{ documents }}"},
                        {"name": "default", "template": CHATML},
                        {"name": "tool_use", "template": TOOL_USE},
                    ]
                )
            },
            AdapterChatTemplates(CHATML, TOOL_USE),
        ),
        (  # no "default": the first one
            {"tokenizer_config.json": config([{"name": "chat", "template": CHATML}])},
            AdapterChatTemplates(CHATML),
        ),
        (  # chat_template.jinja (transformers >= 4.43) wins over the config's default
            {"tokenizer_config.json": config(TOOL_USE), "chat_template.jinja": CHATML.encode()},
            AdapterChatTemplates(CHATML),
        ),
        ({"chat_template.jinja": TOOL_USE.encode()}, AdapterChatTemplates(TOOL_USE)),
    ],
)
def test_the_template_is_read_as_transformers_picks_it(files, expected):
    assert read_chat_templates(files) == expected


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        ({"tokenizer_config.json": b"{nope"}, "tokenizer_config.json is not valid JSON"),
        ({"tokenizer_config.json": b"[1]"}, "tokenizer_config.json must be a JSON object"),
        ({"tokenizer_config.json": b"\xff"}, "tokenizer_config.json is not valid UTF-8"),
        (
            {"tokenizer_config.json": config("{% for m in messages %}")},
            "tokenizer_config.json.chat_template does",
        ),
        ({"tokenizer_config.json": config("{{ x }")}, "compile as a Jinja template (line 1)"),
        ({"tokenizer_config.json": config(" ")}, "tokenizer_config.json.chat_template is empty"),
        ({"tokenizer_config.json": config(7)}, "tokenizer_config.json.chat_template must be a template"),
        ({"tokenizer_config.json": config([])}, "tokenizer_config.json.chat_template must be a template"),
        (
            {"tokenizer_config.json": config([{"template": CHATML}])},
            "tokenizer_config.json.chat_template[0] must",
        ),
        (
            {
                "tokenizer_config.json": config(
                    [{"name": "default", "template": CHATML}, {"name": "x", "template": 1}]
                )
            },
            "tokenizer_config.json.chat_template[1].template must be a string",
        ),
        (
            {"tokenizer_config.json": config([{"name": "default", "template": "{% if %}"}])},
            "tokenizer_config.json.chat_template[0].template does not compile",
        ),
        (
            {"tokenizer_config.json": config("x" * (MAX_CHAT_TEMPLATE_BYTES + 1))},
            f"tokenizer_config.json.chat_template is {MAX_CHAT_TEMPLATE_BYTES + 1} bytes",
        ),
        ({"chat_template.jinja": b"{% endfor %}"}, "chat_template.jinja does not compile"),
    ],
)
def test_a_bad_template_is_refused_naming_where_it_is(files, needle):
    with pytest.raises(InvalidArgument) as refused:
        read_chat_templates(files)
    assert needle in str(refused.value)


def test_a_template_that_uses_what_the_sandbox_forbids_still_compiles_and_is_kept():
    # The sandbox refuses unsafe attribute access when rendering, not when compiling.
    template = "{{ messages.__class__ }}"
    assert read_chat_templates({"chat_template.jinja": template.encode()}) == AdapterChatTemplates(template)


def register(stub, files, name="a1", owner="alice"):
    return stub.RegisterAdapter(upload_requests(files, name, owner), timeout=COMMAND_TIMEOUT_S).adapter


def test_the_store_keeps_the_template_and_gives_it_back_where_it_is_needed(store_stub, sample_files):
    tokenizer_config = config(
        [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOL_USE}]
    )
    registered = register(store_stub, {**sample_files, "tokenizer_config.json": tokenizer_config})
    assert (registered.chat_template, registered.tool_use_chat_template) == (CHATML, TOOL_USE)
    got = store_stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_name("alice", "a1")))
    assert got == registered
    # Listings and fetches do not carry it: pages of many adapters stay small.
    (listed,) = store_stub.ListAdapters(pb.ListAdaptersRequest(owner="alice")).adapters
    assert listed.id == registered.id and listed.chat_template == listed.tool_use_chat_template == ""
    header = next(
        iter(store_stub.FetchAdapter(pb.FetchAdapterRequest(ref=ref_by_name("alice", "a1"))))
    ).header
    assert header.adapter.id == registered.id and header.adapter.chat_template == ""
    plain = register(store_stub, sample_files, name="plain")
    assert plain.chat_template == plain.tool_use_chat_template == ""


def test_an_adapter_directory_uploads_its_template(store_stub, sample_files, tmp_path):
    for name, data in sample_files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    (tmp_path / "README.md").write_text("not needed to serve")
    assert register(store_stub, read_adapter_dir(tmp_path)).chat_template == CHATML


def test_a_template_that_does_not_compile_is_refused_and_leaves_no_trace(
    store_stub, store_server, sample_files, traces
):
    with pytest.raises(grpc.RpcError) as refused:
        register(store_stub, {**sample_files, "tokenizer_config.json": config("{% if x %}")})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "tokenizer_config.json.chat_template does not compile as a Jinja template" in refused.value.details()
    )
    assert traces(store_server) == {"blobs": 0, "temp": 0, "rows": 0}
