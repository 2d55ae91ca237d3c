"""An adapter's own chat template, read from the tokenizer files uploaded with it.

A fine-tune may be trained on another prompt format than the base model's (a tool-use format,
say), and ships it the way transformers saves a tokenizer: ``chat_template.jinja`` beside
``tokenizer_config.json`` (transformers >= 4.43), or inlined as the config's ``chat_template``:
one string, or a list of named templates. As transformers picks, the chat template is the one
named ``default`` (here: else the list's first), and a request that offers tools uses the one
named ``tool_use`` when there is one. ``chat_template.jinja`` wins over the config's default.

Uploading these files is also how a tenant overrides the base model's template for an adapter.
A template is refused (``INVALID_ARGUMENT`` naming where it came from) when it is over
:data:`MAX_CHAT_TEMPLATE_BYTES` or does not compile in the sandbox the gateway renders it in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2

from services.model_files.chat_template import compile_chat_template
from services.runtime.errors import InvalidArgument

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = (TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE)
"""The uploaded files a chat template is read from (both optional)."""

MAX_CHAT_TEMPLATE_BYTES = 64 * 2**10
"""Largest template kept, in UTF-8 bytes: real ones, tool-use formats included, are a few KiB,
and every chat request to the adapter renders it."""


@dataclass(frozen=True)
class AdapterChatTemplates:
    """The templates an adapter is served with; "" where the base model's applies."""

    chat_template: str = ""
    """The template of its chat requests."""
    tool_use_chat_template: str = ""
    """The template of its chat requests that offer tools, when it differs ("" otherwise)."""


def read_chat_templates(files: Mapping[str, bytes]) -> AdapterChatTemplates:
    """The templates in the uploaded ``files`` (by file name; the tokenizer files may be
    absent); ``InvalidArgument`` naming the file and field at fault."""
    default, tool_use = "", ""
    if TOKENIZER_CONFIG_FILE in files:
        default, tool_use = _config_templates(_json_object(files[TOKENIZER_CONFIG_FILE]))
    if CHAT_TEMPLATE_FILE in files:
        default = _checked(_utf8(files[CHAT_TEMPLATE_FILE], CHAT_TEMPLATE_FILE), CHAT_TEMPLATE_FILE)
    return AdapterChatTemplates(default, tool_use if tool_use != default else "")


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        config = json.loads(_utf8(data, TOKENIZER_CONFIG_FILE))
    except (json.JSONDecodeError, RecursionError) as error:
        raise InvalidArgument(f"{TOKENIZER_CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{TOKENIZER_CONFIG_FILE} must be a JSON object, got {type(config).__name__}")
    return config


def _config_templates(config: dict[str, Any]) -> tuple[str, str]:
    """``(default, tool_use)`` of the config's ``chat_template`` ("" for none)."""
    field = f"{TOKENIZER_CONFIG_FILE}.chat_template"
    templates = config.get("chat_template")
    if templates is None:
        return "", ""
    if isinstance(templates, str):
        return _checked(templates, field), ""
    if not isinstance(templates, list) or not templates:
        raise InvalidArgument(
            f"{field} must be a template (a string) or a list of named templates, got {templates!r:.80}"
        )
    named: dict[str, str] = {}
    for i, entry in enumerate(templates):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
            raise InvalidArgument(f"{field}[{i}] must be an object with a name and a template")
        if not isinstance(entry.get("template"), str):
            raise InvalidArgument(f"{field}[{i}].template must be a string")
        named.setdefault(entry["name"], _checked(entry["template"], f"{field}[{i}].template"))
    return named.get("default", next(iter(named.values()))), named.get("tool_use", "")


def _utf8(data: bytes, field: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument(f"{field} is not valid UTF-8: {error}") from None


def _checked(template: str, field: str) -> str:
    size = len(template.encode())
    if size > MAX_CHAT_TEMPLATE_BYTES:
        raise InvalidArgument(
            f"{field} is {size} bytes; a chat template may have at most {MAX_CHAT_TEMPLATE_BYTES}"
        )
    if not template.strip():
        raise InvalidArgument(f"{field} is empty")
    try:
        compile_chat_template(template)
    except jinja2.TemplateError as error:
        where = f" (line {error.lineno})" if isinstance(error, jinja2.TemplateSyntaxError) else ""
        raise InvalidArgument(
            f"{field} does not compile as a Jinja template{where}: {error.message}"
        ) from None
    return template
