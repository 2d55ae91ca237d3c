"""Rendering a chat template as transformers does: ``tools``, ``documents`` and extra variables
reach it, another template (an adapter's) can replace the model's, and a template's own failure
is a ChatTemplateError, whether it raises on purpose or breaks the sandbox's rules."""

from __future__ import annotations

import jinja2
import pytest

from services.model_files.chat_template import (
    ChatTemplateError,
    chat_template_variables,
    compile_chat_template,
)
from services.model_files.tokenizer_loading import load_tokenizer

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer().tokenizer


def test_tools_documents_and_extra_variables_reach_a_replacement_template(smollm2):
    template = (
        "{{ bos_token }}{% for t in tools %}{{ t.function.name }} {% endfor %}"
        "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ today }}|{{ messages[0].content }}"
    )
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    rendered = smollm2.apply_chat_template(
        HI, tools=tools, documents=[{"title": "doc"}], chat_template=template, today="Monday"
    )
    assert rendered == "<|im_start|>f g [doc]Monday|Hi"
    assert smollm2.apply_chat_template(HI).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_tools_sees_none(smollm2):
    assert smollm2.apply_chat_template(HI, chat_template="{{ tools is none }}") == "True"


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),
        ("{{ messages[0].content + none }}", "TypeError"),
        ("{% for m in messages %}", "TemplateSyntaxError"),
    ],
)
def test_a_template_s_own_failure_is_a_chat_template_error(smollm2, template, needle):
    with pytest.raises(ChatTemplateError, match=needle):
        smollm2.apply_chat_template(HI, chat_template=template)


def test_the_variables_a_template_reads_tell_whether_it_knows_tools(smollm2):
    assert "tools" not in chat_template_variables(smollm2.chat_template)
    assert {"messages", "add_generation_prompt"} <= chat_template_variables(smollm2.chat_template)
    assert "tools" in chat_template_variables("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert "tools" not in chat_template_variables("{% set tools = [] %}{{ tools }}")


def test_a_template_that_is_not_jinja_does_not_compile():
    with pytest.raises(jinja2.TemplateSyntaxError):
        compile_chat_template("{% if %}")
    assert compile_chat_template("{{ x }}") is compile_chat_template("{{ x }}")  # compiled once
