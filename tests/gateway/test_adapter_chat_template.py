"""The gateway core renders a chat to an adapter with the adapter's own chat template (its
``tool_use`` one when tools are offered), and the base model's otherwise; a template that
refuses the messages is an INVALID_ARGUMENT naming them and the template."""

from __future__ import annotations

import pytest

from mesh_api.v1 import types_pb2
from services.gateway.adapter_reference import chat_template
from services.gateway.core import GatewayCore
from services.gateway.parts import GatewayParts
from services.gateway.tool_calls import ChatMessage, ToolCall, parse_tool_request
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.errors import InvalidArgument
from tests.gateway.in_memory_store import InMemoryStore, gateway_parts

ADAPTER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} (tuned)\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_USE_TEMPLATE = (
    "<|im_start|>system\n{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]{% endfor %}"
    "<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\\n' }}"
)
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
    "{{ m.content }}{% endfor %}"
)
ADAPTERS = {
    "tuned": types_pb2.AdapterInfo(
        id="id-tuned",
        owner="alice",
        name="tuned",
        chat_template=ADAPTER_TEMPLATE,
        tool_use_chat_template=TOOL_USE_TEMPLATE,
    ),
    "plain": types_pb2.AdapterInfo(id="id-plain", owner="alice", name="plain"),
    "strict": types_pb2.AdapterInfo(
        id="id-strict", owner="alice", name="strict", chat_template=STRICT_TEMPLATE
    ),
}
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def parts() -> GatewayParts:
    return gateway_parts("key-alice=alice", InMemoryStore(list(ADAPTERS.values())), load_tokenizer())


@pytest.fixture(scope="module")
def core(parts) -> GatewayCore:
    return parts.core


async def template_of(parts: GatewayParts, adapter: str, with_tools: bool = False) -> str | None:
    """The template a chat with alice's ``adapter`` is prompted with, resolved as a request does."""
    return chat_template(await parts.catalog.resolve("alice", adapter), with_tools)


async def prompt(parts: GatewayParts, adapter: str, messages, **kwargs) -> list[int]:
    """The prompt of alice's chat with her ``adapter`` ("": the base model)."""
    resolved = await parts.catalog.resolve("alice", adapter)
    return await parts.core.chat_prompt("alice", messages, adapter=resolved, **kwargs)


def text(core: GatewayCore, ids: list[int]) -> str:
    return core.tokenizer.decode(ids)


async def test_an_adapter_with_its_own_template_is_prompted_with_it(parts, core):
    template = await template_of(parts, "tuned")
    assert template == ADAPTER_TEMPLATE
    rendered = text(core, await prompt(parts, "tuned", [("user", "Hi")]))
    assert rendered == "<|im_start|>user (tuned)\nHi<|im_end|>\n<|im_start|>assistant\n"


async def test_an_adapter_without_one_and_the_base_model_use_the_base_template(parts, core):
    assert await template_of(parts, "plain") is None
    assert await template_of(parts, "") is None
    for adapter in ("plain", ""):
        rendered = text(core, await prompt(parts, adapter, [("user", "Hi")]))
        assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


async def test_a_request_with_tools_uses_the_adapter_s_tool_use_template(parts, core):
    template = await template_of(parts, "tuned", with_tools=True)
    assert template == TOOL_USE_TEMPLATE
    history = [
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),)),
        ChatMessage("tool", "3 C", tool_call_id="call_1"),
    ]
    ids = await prompt(parts, "tuned", history, tools=parse_tool_request([WEATHER]))
    assert text(core, ids) == (
        "<|im_start|>system\nget_weather;<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n[get_weather(Oslo)]<|im_end|>\n<|im_start|>tool\n3 C<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


async def test_the_base_template_learns_the_tools_from_a_system_message(core):
    ids = await core.chat_prompt(
        "alice", [("user", "Weather?")], tools=parse_tool_request([WEATHER], "required")
    )
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text(core, ids)


async def test_a_template_that_refuses_the_messages_is_an_invalid_argument(parts):
    with pytest.raises(
        InvalidArgument,
        match="messages: the chat template of adapter 'alice/strict' refused them: .*Only user and assistant",
    ):
        await prompt(parts, "strict", [("system", "Be brief."), ("user", "Hi")])


async def test_tool_results_are_a_role_and_unknown_roles_are_refused(core):
    rendered = text(core, await core.chat_prompt("alice", [("user", "?"), ("tool", "42")]))
    assert "<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>" in rendered
    with pytest.raises(
        InvalidArgument, match="messages\\[1\\].role must be one of system, user, assistant, tool"
    ):
        await core.chat_prompt("alice", [("user", "?"), ("robot", "beep")])
