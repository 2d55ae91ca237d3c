"""The gateway renders chat templates in render processes lent to tenants in turn: a tenant whose
template loops for minutes holds one process and waits behind itself, while another tenant's
renders are answered meanwhile; what a render raises reaches its caller."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from support.polling import poll_until

from services.gateway.template_renderer import TemplateRenderer
from services.model_files.chat_template import ChatTemplateError, TemplateOverBudget
from services.model_files.template_budget import TemplateBudget

MINUTES_OF_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HELLO = ("{{ messages[0].content }}!", {"messages": [{"role": "user", "content": "hello"}]})


async def test_a_looping_render_holds_one_process_while_another_tenant_s_renders_are_answered():
    # Nothing stops bob's renders within this test but closing the renderer: no operation count
    # and ten minutes of CPU.
    endless = TemplateBudget(chat_template_max_operations=10**12, chat_template_cpu_s=600)
    renderer = TemplateRenderer(endless, processes=2)
    try:
        bob = [asyncio.ensure_future(renderer.render("bob", MINUTES_OF_LOOPS, {})) for _ in range(2)]

        async def state() -> tuple[int, int]:
            return renderer.rendering, renderer.waiting

        await poll_until(state, lambda s: s == (1, 1), "bob's first render running, his second waiting")
        for _ in range(5):
            assert await renderer.render("alice", *HELLO) == "hello!"
        assert not any(render.done() for render in bob) and await state() == (1, 1)
    finally:
        renderer.close()
    with pytest.raises(ChatTemplateError, match="the render process ended"):
        await bob[0]
    bob[1].cancel()


async def test_what_a_render_raises_reaches_its_caller_and_the_process_serves_on():
    renderer = TemplateRenderer(TemplateBudget(), processes=1)
    try:
        with pytest.raises(TemplateOverBudget, match="more than 100000 operations"):
            await renderer.render("bob", MINUTES_OF_LOOPS, {})
        with pytest.raises(ChatTemplateError, match="roles must alternate"):
            await renderer.render("bob", "{{ raise_exception('roles must alternate') }}", {})
        assert await renderer.render("alice", *HELLO) == "hello!"
        assert (renderer.rendering, renderer.waiting) == (0, 0)
    finally:
        renderer.close()


async def test_a_caller_that_goes_away_leaves_the_process_to_finish_its_render_first():
    renderer = TemplateRenderer(dataclasses.replace(TemplateBudget(), chat_template_max_operations=10**6), 1)
    try:
        gone = asyncio.ensure_future(renderer.render("bob", MINUTES_OF_LOOPS, {}))

        async def rendering() -> int:
            return renderer.rendering

        await poll_until(rendering, lambda n: n == 1, "bob's render running")
        gone.cancel()
        assert await renderer.render("alice", *HELLO) == "hello!"  # after bob's ran out of budget
    finally:
        renderer.close()
