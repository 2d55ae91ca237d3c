"""Prompts of chats with tools: through SmolLM2's real template (which knows no tools: a system
message teaches the call format, history calls and results are written as text), and through a
template that knows tools (which gets them as transformers gives them)."""

from __future__ import annotations

import json

import pytest

from services.gateway.tool_calls import ChatMessage, ToolCall, parse_reply, parse_tool_request, template_input
from services.model_files.tokenizer_loading import load_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
HISTORY = [
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", (CALL,)),
    ChatMessage("tool", "18 C", tool_call_id="call_1"),
]


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer().tokenizer


def render(tokenizer, messages, request, template=None) -> str:
    template = template or tokenizer.chat_template
    rendered = template_input(messages, request, template)
    return tokenizer.apply_chat_template(rendered.messages, tools=rendered.tools, chat_template=template)


def system_turn(prompt: str) -> str:
    assert prompt.startswith("<|im_start|>system\n")
    return prompt[len("<|im_start|>system\n") : prompt.index("<|im_end|>")]


def test_smollm2_gets_a_system_message_listing_the_tools_and_the_tagged_call_format(smollm2):
    prompt = render(smollm2, [ChatMessage("user", "Weather in Paris?")], parse_tool_request([WEATHER, CLOCK]))
    system = system_turn(prompt)
    assert "SmolLM" not in prompt  # the template's default system message gave way to ours
    assert f"<tools>\n{json.dumps(WEATHER)}\n{json.dumps(CLOCK)}\n</tools>" in system
    assert '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>' in system
    assert "You may call several functions" in system
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_the_tools_join_the_chat_s_own_system_message(smollm2):
    request = parse_tool_request([WEATHER], "auto", False)
    prompt = render(smollm2, [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")], request)
    assert prompt.count("<|im_start|>system") == 1
    assert system_turn(prompt).startswith("Be brief.\n\nYou can call functions.")
    assert "Call at most one function." in system_turn(prompt)


@pytest.mark.parametrize(
    ("tool_choice", "instruction"),
    [
        ("required", 'Call one of them now: reply with only this JSON object: {"name": <function name>'),
        (
            {"type": "function", "function": {"name": "get_time"}},
            'Call get_time now: reply with only this JSON object: {"name": "get_time", "arguments": ',
        ),
    ],
)
def test_a_constrained_choice_asks_for_the_bare_json_call(smollm2, tool_choice, instruction):
    prompt = render(smollm2, [ChatMessage("user", "Hi")], parse_tool_request([WEATHER, CLOCK], tool_choice))
    assert instruction in system_turn(prompt)
    assert "<tool_call>" not in prompt


def test_history_calls_and_results_render_as_text_for_a_template_without_tools(smollm2):
    prompt = render(smollm2, HISTORY, None)  # tool_choice "none": no tools offered, history kept
    assert system_turn(prompt) == "Be brief."
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in prompt


def test_a_history_call_is_written_as_the_reply_parser_reads_it_back(smollm2):
    with_text = ChatMessage("assistant", "Let me look.", (CALL, ToolCall("call_2", "get_time", "{}")))
    written = template_input([with_text], None, smollm2.chat_template).messages[0]["content"]
    reply = parse_reply(written, parse_tool_request([WEATHER, CLOCK]))
    assert reply.content == "Let me look."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("get_weather", CALL.arguments),
        ("get_time", "{}"),
    ]


# A template that knows tools, shaped as Qwen2.5's: tools in its system turn, calls as tagged JSON
# with the arguments written by tojson, results in a user turn.
TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not tools %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response name="{{ message.name }}" id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_knows_tools_gets_them_and_the_history_as_transformers_gives_them(smollm2):
    transformers = pytest.importorskip("transformers")
    request = parse_tool_request([WEATHER, CLOCK], "required")
    ours = render(smollm2, HISTORY, request, TOOLS_TEMPLATE)

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=smollm2.backend, **smollm2.special_tokens)
    openai_history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
    ]
    theirs = hf.apply_chat_template(
        openai_history,
        tools=[WEATHER, CLOCK],
        chat_template=TOOLS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    assert json.dumps(WEATHER) in ours and json.dumps(CLOCK) in ours
    assert '<tool_response name="get_weather" id="call_1">\n18 C\n</tool_response>' in ours
    assert "You can call functions" not in ours  # the template lays the tools out, not us


def test_arguments_that_are_not_a_json_object_reach_a_tools_template_as_written(smollm2):
    broken = ChatMessage("assistant", "", (ToolCall("c", "get_weather", "{not json"),))
    rendered = template_input([broken], None, TOOLS_TEMPLATE)
    assert rendered.messages[0]["tool_calls"][0]["function"]["arguments"] == "{not json"
    assert rendered.tools is None
