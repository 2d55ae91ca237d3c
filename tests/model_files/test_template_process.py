"""A render process renders what the template renders here and refuses what it refuses, at the
lowest CPU priority; on top of the operation count, the kernel holds it to the budget's CPU time
and memory: a render past them is refused naming the setting, and a process the kernel killed is
replaced."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support.polling import poll_until

from services.model_files.chat_template import ChatTemplateError, TemplateOverBudget, render_chat_template
from services.model_files.template_budget import TemplateBudget
from services.model_files.template_process import TemplateProcess

HI = {"messages": [{"role": "user", "content": "Hi é 🎉"}], "add_generation_prompt": True}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
MINUTES_OF_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
UNCOUNTED = TemplateBudget(chat_template_max_operations=10**12, chat_template_max_output_bytes=2**31)
"""Operations and output that never run out: what stops a render is the kernel's limits."""


@pytest.fixture
def process():
    started = TemplateProcess(TemplateBudget())
    yield started
    started.close()


def over_budget(process: TemplateProcess, template: str) -> TemplateOverBudget:
    with pytest.raises(TemplateOverBudget) as refused:
        process.render(template, {})
    return refused.value


def test_a_render_there_is_the_render_here(process):
    assert process.render(TEMPLATE, HI) == render_chat_template(TEMPLATE, TemplateBudget(), **HI)
    assert process.render(TEMPLATE, HI) == "<user>Hi é 🎉<a>"
    with pytest.raises(ChatTemplateError, match="TemplateError: roles must alternate"):
        process.render("{{ raise_exception('roles must alternate') }}", {})
    over = over_budget(process, MINUTES_OF_LOOPS)
    assert (over.setting, over.message) == ("chat_template_max_operations", "more than 100000 operations")
    assert process.render(TEMPLATE, HI) == "<user>Hi é 🎉<a>"  # the same process serves on


def test_the_process_renders_at_the_lowest_cpu_priority(process):
    """Niceness 19 and SCHED_IDLE, in a session of its own: under the kernel's autogroups a
    niceness ranks a process only within its session, so in the gateway's session the renders
    took half the CPU from a worker in another session."""
    assert process.render(TEMPLATE, HI)
    with open(f"/proc/{process.pid}/stat") as stat:
        niceness = int(stat.read().split(")")[-1].split()[16])
    assert niceness == 19
    assert os.getsid(process.pid) == process.pid != os.getsid(0)
    assert os.sched_getscheduler(process.pid) == os.SCHED_IDLE
    autogroup = Path(f"/proc/{process.pid}/autogroup")
    if autogroup.exists():
        assert autogroup.read_text().split()[-1] == "19"


def test_a_render_past_its_cpu_time_is_refused_and_the_process_serves_on():
    process = TemplateProcess(TemplateBudget(**{**UNCOUNTED.__dict__, "chat_template_cpu_s": 0.05}))
    try:
        over = over_budget(process, MINUTES_OF_LOOPS)
        assert (over.setting, over.message) == ("chat_template_cpu_s", "more than 0.05 CPU seconds")
        pid = process.pid
        assert process.render(TEMPLATE, HI) == "<user>Hi é 🎉<a>" and process.pid == pid
    finally:
        process.close()


def test_a_render_past_its_memory_is_refused():
    process = TemplateProcess(TemplateBudget(**{**UNCOUNTED.__dict__, "chat_template_memory_mib": 64}))
    try:
        over = over_budget(process, "{{ ('x'|center(400000000))|length }}")
        assert over.setting == "chat_template_memory_mib"
        assert process.render(TEMPLATE, HI) == "<user>Hi é 🎉<a>"
    finally:
        process.close()


async def test_a_process_the_kernel_killed_for_its_cpu_time_is_refused_and_replaced(process):
    # What the kernel does to a render stuck in one long C call past its CPU limit: SIGXCPU.
    assert process.render(TEMPLATE, HI)
    killed = process.pid
    os.kill(killed, signal.SIGXCPU)

    async def gone() -> bool:
        return _gone(killed)

    await poll_until(gone, bool, "the render process is gone", interval_s=0.01)
    over = over_budget(process, TEMPLATE)
    assert (over.setting, over.message) == ("chat_template_cpu_s", "more than 1.0 CPU seconds")
    assert process.render(TEMPLATE, HI) == "<user>Hi é 🎉<a>"
    assert process.pid != killed


def _gone(pid: int) -> bool:
    """The process exited (a zombie until its parent reaps it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
