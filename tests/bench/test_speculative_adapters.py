"""The speculative benches' ``support`` adapter: trained to quote the tickets it summarises, never
on the bench's own ticket, and reused from its cache (no training here)."""

from __future__ import annotations

import re

from bench import speculative_adapters
from bench.speculative_adapters import (
    SUPPORT,
    ensure_support_adapter,
    support_cache_key,
    support_examples,
)
from bench.speculative_workloads import TICKET, TICKET_INSTRUCTION, repetitive
from demo_adapters.cache import base_model_identity
from services.model_files.cache_dir import CACHE_ENV

QUOTED = re.compile(r"\"([^\"]+)\"|'([^']+)'")


def test_every_answer_quotes_sentences_of_its_own_ticket():
    examples = support_examples()
    assert len({e.question for e in examples}) > 40, "varied tickets"
    for example in examples:
        assert example.question.startswith(TICKET_INSTRUCTION)
        quotes = [a or b for a, b in QUOTED.findall(example.answer)]
        assert len(quotes) == 4, example.answer
        for quote in quotes:
            assert quote in example.question, (quote, example.question)


def test_the_bench_ticket_is_held_out_of_training():
    sentences = [s for s in re.split(r"(?<=\.) ", TICKET.split(": ", 1)[1]) if len(s) > 20]
    for example in support_examples():
        assert TICKET not in example.question
        assert not any(sentence in example.question for sentence in sentences)


def test_the_ticket_summary_is_sent_to_the_support_adapter_as_it_was_trained():
    item = next(i for i in repetitive(64) if i.name == "ticket-summary")
    assert item.adapter == SUPPORT
    assert item.messages == ({"role": "user", "content": TICKET_INSTRUCTION + TICKET},)


def test_a_cached_adapter_is_reused_and_its_key_follows_the_base_model(tmp_path):
    key = support_cache_key(base_model_identity())
    assert key == support_cache_key(base_model_identity())
    assert key != support_cache_key("another-model.gguf:123")
    folder = tmp_path / f"{SUPPORT}-{key}"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"cached")
    assert ensure_support_adapter(tmp_path) == folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name], "nothing trained or staged"


def test_asking_for_a_demo_adapter_trains_no_support_adapter(tmp_path, monkeypatch):
    cached = tmp_path / "demo-adapters" / "0123456789abcdef"
    for name in speculative_adapters.DEMO_ADAPTERS:
        (cached / name).mkdir(parents=True)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def no_training(root=None):
        raise AssertionError("the support adapter was asked for")

    monkeypatch.setattr(speculative_adapters, "ensure_support_adapter", no_training)
    assert speculative_adapters.workload_adapter_dir("sql") == cached / "sql"
