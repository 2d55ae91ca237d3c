"""Where the gateway renders chat templates: in a few processes of their own, off its event loop.

A chat template is code, an adapter's written by whoever uploaded the adapter. Each render runs
in one of ``processes`` render processes (:class:`~services.model_files.template_process.TemplateProcess`),
held to the gateway's :class:`~services.model_files.template_budget.TemplateBudget`: a template
that loops for minutes costs its own request a refusal and its render process at most the
budget's CPU time, while the event loop goes on serving everyone else. The processes are lent
to tenants in turn (:class:`~services.gateway.fair_share.FairShare`), one tenant at most all
but one of them at once, so a tenant that sends many heavy renders waits behind itself.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.gateway.fair_share import FairShare
from services.model_files.template_budget import TemplateBudget
from services.model_files.template_process import TemplateProcess


class TemplateRenderer:
    """Chat template renders in ``processes`` render processes (started when first needed)."""

    def __init__(self, budget: TemplateBudget, processes: int):
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.budget = budget
        self._processes = [TemplateProcess(budget) for _ in range(processes)]
        self._share = FairShare(self._processes, per_tenant=max(1, processes - 1))
        # One thread per process: each waits on its process's answer, never on the event loop.
        self._threads = ThreadPoolExecutor(processes, thread_name_prefix="chat-template")

    async def render(self, tenant: str, source: str, variables: dict[str, Any]) -> str:
        """``source`` rendered with ``variables`` (JSON values) for ``tenant``; raises what
        :meth:`TemplateProcess.render` raises. A render whose caller goes away runs to its end
        (within the budget) before its process serves another."""
        process = await self._share.acquire(tenant)
        try:
            done = self._threads.submit(process.render, source, variables)
        except BaseException:
            self._share.release(tenant, process)
            raise
        done.add_done_callback(lambda _: self._share.release(tenant, process))
        return await asyncio.wrap_future(done)

    @property
    def rendering(self) -> int:
        """Renders running now (each holds a render process)."""
        return self._share.lent

    @property
    def waiting(self) -> int:
        """Renders waiting for a render process now."""
        return self._share.waiting

    def close(self) -> None:
        """Ends the render processes; renders in progress fail."""
        for process in self._processes:
            process.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
