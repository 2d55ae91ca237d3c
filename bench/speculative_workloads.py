"""The two workloads of the served speculative-decoding bench (``bench.speculative_served_bench``).

- **repetitive**: output that re-emits what the request was shown or said before, where prompt
  lookup pays: the ``sql`` demo adapter rewriting a query it is given, the bench's ``support``
  adapter summarising a support ticket it quotes (``bench.speculative_adapters``), and the base
  model in a multi-turn chat asked to repeat an earlier answer;
- **non-repetitive**: the quick profile's trace (``bench.serving.profiles``): its requests'
  prompts are random token ids (``RunContext.prompt``), so nothing in them is worth drafting
  from; the requests keep their trace lengths and go to the demo adapters and the base model in
  turn (the trace's adapter index modulo four), a mixed-adapter batch at 8 concurrent.

Each item is one OpenAI request body without ``model``-independent extras; the bench adds
``stream``, ``temperature`` 0, ``ignore_eos`` and ``return_token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.serving.profiles import QUICK
from bench.systems.base import AdapterSet, RunContext
from bench.workload import generate

BASE_MODEL = ""
"""``adapter`` of an item on the base model (the bench names the served model itself)."""

QUERY = (
    "select o.id, o.created_at, c.name, c.email, sum(i.price * i.quantity) as total "
    "from orders o join customers c on c.id = o.customer_id join order_items i on i.order_id = o.id "
    "where o.created_at >= '2024-01-01' and c.country = 'DE' group by o.id, o.created_at, c.name, c.email "
    "order by total desc limit 20"
)
TICKET = (
    "Ticket #4821 from Dana Whitfield: Since the update on Monday the export button on the "
    "billing page returns an error 502 after about thirty seconds. I tried Chrome and Firefox, "
    "cleared the cache and logged out and in again. The export of the March invoices is needed "
    "by our accountant before Friday. Error text: 'Bad gateway: upstream timed out while "
    "generating invoices_2024_03.csv'."
)
TICKET_INSTRUCTION = "Summarise this support ticket, quoting the customer's own words:\n\n"
"""The ticket summary's request before the ticket (the ``support`` adapter is trained on it)."""
EARLIER_ANSWER = (
    "To reset your password, open Settings, choose Security, click 'Reset password', enter "
    "the code we email you, then type your new password twice and press Save."
)


@dataclass(frozen=True)
class WorkloadItem:
    """One request of a workload."""

    name: str
    """Label in the results."""
    adapter: str
    """Demo adapter name, or ``BASE_MODEL``."""
    max_tokens: int
    """Tokens generated (end of sequence ignored)."""
    messages: tuple[dict, ...] = ()
    """Chat messages (``/v1/chat/completions``); empty when ``prompt_ids`` is used."""
    prompt_ids: tuple[int, ...] = ()
    """Prompt token ids (``/v1/completions``)."""


def repetitive(max_tokens: int) -> list[WorkloadItem]:
    """The SQL rewrite, the ticket summary and the repeating chat, ``max_tokens`` each."""
    return [
        WorkloadItem(
            "sql-rewrite",
            "sql",
            max_tokens,
            messages=(
                {
                    "role": "user",
                    "content": f"Rewrite this SQL query with upper-case keywords, changing nothing else:\n\n{QUERY}",
                },
            ),
        ),
        WorkloadItem(
            "ticket-summary",
            "support",
            max_tokens,
            messages=({"role": "user", "content": TICKET_INSTRUCTION + TICKET},),
        ),
        WorkloadItem(
            "chat-repeat",
            BASE_MODEL,
            max_tokens,
            messages=(
                {"role": "user", "content": "How do I reset my password?"},
                {"role": "assistant", "content": EARLIER_ANSWER},
                {"role": "user", "content": "I did not get that. Say it again, word for word, please."},
                {"role": "assistant", "content": EARLIER_ANSWER},
                {"role": "user", "content": "Once more, exactly as before, and then once again."},
            ),
        ),
    ]


ADAPTER_CYCLE = ("sql", "pirate", "french", BASE_MODEL)
"""Which model a trace request goes to: its adapter index modulo four."""


def non_repetitive(count: int, seed: int = QUICK.workload.seed) -> list[WorkloadItem]:
    """The first ``count`` requests of the quick profile's trace, prompts of random token ids
    drawn as ``RunContext.prompt`` draws them, at their trace lengths."""
    trace = generate(QUICK.workload)[:count]
    context = RunContext(trace, AdapterSet(Path(), ()), window_s=QUICK.workload.duration_s, seed=seed)
    return [
        WorkloadItem(
            request.request_id,
            ADAPTER_CYCLE[request.adapter % len(ADAPTER_CYCLE)],
            request.output_len,
            prompt_ids=context.prompt(request),
        )
        for request in trace
    ]
