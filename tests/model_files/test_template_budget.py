"""A chat template render is held to a budget counted in operations and output bytes, the same
on every machine: what loops for minutes, builds gigabytes or recurses without end is refused,
naming the setting it went over, while real templates render within a small part of it."""

from __future__ import annotations

import pytest

from services.model_files.chat_template import ChatTemplateError, TemplateOverBudget, render_chat_template
from services.model_files.template_budget import TemplateBudget
from services.model_files.tokenizer_loading import load_tokenizer

BUDGET = TemplateBudget()
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"


def refusal(template: str, budget: TemplateBudget = BUDGET, **variables) -> TemplateOverBudget:
    with pytest.raises(TemplateOverBudget) as refused:
        render_chat_template(template, budget, **variables)
    return refused.value


@pytest.mark.parametrize(
    ("template", "setting", "words"),
    [
        (NESTED_LOOPS, "chat_template_max_operations", "more than 100000 operations"),
        ("{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}",
         "chat_template_max_operations", "more than 100000 operations"),
        ("{{ 'x' * 10**9 }}", "chat_template_max_output_bytes", "a repeated value of 1000000000 items"),
        ("{{ ([0] * 10**9)|length }}", "chat_template_max_output_bytes", "a repeated value"),
        ("{{ 9 ** (9 ** 9) }}", None, "a number of about"),
        ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
         None, "a number of about"),
        # ~ and + double a string each time: its size counts as it grows
        ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
         "chat_template_max_operations", "operations"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
         "chat_template_max_operations", "operations"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", None, "nested deeper"),
        ("{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}", None, "nested deeper"),
        ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
         "chat_template_max_operations", "operations"),
        ("{% for x in [1] recursive %}{{ loop(range(99999)) }}{% endfor %}", "chat_template_max_operations",
         "operations"),
        # a filter's work on a large value counts its size; a lazy filter's items count as taken
        ("{% for i in range(1000) %}{{ range(1000)|map('string')|join }}{% endfor %}",
         "chat_template_max_operations", "operations"),
        ("{% for i in range(1000) %}{{ ('x' * 2000000)|length }}{% endfor %}",
         "chat_template_max_operations", "operations"),
        # text written again and again counts: 4 KiB a turn
        ("{% for i in range(99999) %}" + "y" * 4096 + "{% endfor %}", "chat_template_max_operations",
         "operations"),
    ],
)  # fmt: skip
def test_a_template_past_its_budget_is_refused_naming_the_setting(template, setting, words):
    over = refusal(template)
    assert over.setting == setting
    assert words in over.message


def test_output_past_the_budget_is_refused():
    small = TemplateBudget(chat_template_max_output_bytes=1000)
    over = refusal("{% for m in messages %}{{ m }}{% endfor %}", small, messages=["é" * 300] * 2)
    assert (over.setting, over.message) == (
        "chat_template_max_output_bytes",
        "more than 1000 bytes of output",
    )
    assert render_chat_template("{{ messages|join }}", small, messages=["é" * 250] * 2) == "é" * 500


def test_the_same_template_is_refused_at_the_same_count_every_time():
    # each turn: 1 iteration, range() 10 + its 400 items, 400 inner iterations
    loops = "{% for i in range(messages|length) %}{% for j in range(400) %}{% endfor %}{% endfor %}"
    assert render_chat_template(loops, BUDGET, messages=[0] * 100) == ""
    over = refusal(loops, messages=[0] * 150)
    assert over.message == "more than 100000 operations"


def test_lipsum_is_no_helper_of_chat_templates():
    with pytest.raises(ChatTemplateError, match="'lipsum' is undefined"):
        render_chat_template("{{ lipsum(10**7) }}", BUDGET)


def test_a_real_template_renders_within_a_small_part_of_the_budget():
    tokenizer = load_tokenizer().tokenizer
    chat = [{"role": ("user", "assistant")[i % 2], "content": "Hello there! " * 20} for i in range(50)]
    tight = TemplateBudget(chat_template_max_operations=1000)
    rendered = render_chat_template(tokenizer.chat_template, tight, **tokenizer.template_variables(chat))
    assert rendered == tokenizer.apply_chat_template(chat)  # the default budget's render, the same
    assert rendered.count("<|im_start|>") == 52  # system, 50 messages, the reply's start


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ loop.index }}{{ loop.last }}{{ loop.length }}{% endfor %}", "1False22True2"),
        (("{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}"
          "{% endif %}{% endfor %}"), "123"),
        ("{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join('|') }}", "hi"),
        ("{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}", "a=1"),
        ("{% generation %}hi{% endgeneration %}{% filter upper %}abc{% endfilter %}", "hiABC"),
        ("{% set x %}a{{ 1 }}{% endset %}{{ x ~ '!' }}", "a1!"),
        ("{% macro m() %}[{{ caller() }}]{% endmacro %}{% call m() %}in{% endcall %}", "[in]"),
        ("{{ messages|tojson }}", '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'),
        ("{{ 2 ** 10 }} {{ 'ab' * 2 }} {{ '%s!' % 'x' }}", "1024 abab x!"),
    ],
)  # fmt: skip
def test_metering_changes_nothing_a_template_renders(template, expected):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert render_chat_template(template, BUDGET, messages=chat) == expected
