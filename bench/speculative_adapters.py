"""The adapters the speculative-decoding benches serve: the demo adapters, and ``support``, a
bench-only LoRA that summarises a support ticket by quoting the customer's own words.

The repetitive workload's ticket summary needs an adapter that quotes what it is shown (an
adapter "summarising a ticket it quotes"); none of the demo adapters does (``pirate`` answers in
its style and ends its turn). ``support`` is trained here, like the demo adapters (peft on CPU,
``demo_adapters.training``), on synthetic tickets built from fixed lists, each answer quoting its
ticket's sentences; the bench's own ticket (``speculative_workloads.TICKET``) is not among them.
It is trained once, in a process of its own, and cached beside the demo adapters under a key of
everything its weights depend on.
"""

from __future__ import annotations

import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from bench.speculative_workloads import TICKET_INSTRUCTION
from demo_adapters import training
from demo_adapters.cache import (
    base_model_identity,
    build_once,
    cache_root,
    ensure_adapters,
    source_and_parts_key,
)
from demo_adapters.data import Example
from demo_adapters.training import TrainingConfig

DEMO_ADAPTERS = ("sql", "pirate", "french")
"""The demo adapters the benches serve."""
SUPPORT = "support"
"""The bench-only adapter's name."""
SUPPORT_CONFIG = TrainingConfig(steps=24)
"""How ``support`` is trained (its loss is under 0.01 from about step 15)."""

NAMES = ("Priya Raman", "Tom Becker", "Lena Vogel", "Marco Ruiz", "Aiko Tanaka", "Sam Okafor",
         "Jonas Berg", "Clara Moreau", "Ravi Patel", "Ingrid Holm", "Diego Santos", "Mia Chen")  # fmt: skip
PROBLEMS = (
    "Since yesterday the login page shows a blank screen after I enter my password.",
    "The mobile app crashes every time I open the settings tab.",
    "Our invoices for April show the wrong VAT rate of 19 percent instead of 7 percent.",
    "The search on the products page returns no results for any word with an umlaut.",
    "After the last update the dashboard takes more than a minute to load.",
    "I was charged twice for the same order on the 3rd of June.",
    "Password reset emails never arrive, not even in the spam folder.",
    "The CSV import stops at row 1000 and drops the rest of the file.",
    "Two of our users cannot upload files larger than 10 MB any more.",
    "The calendar sync with Outlook has stopped working for the whole team.",
    "Since the migration the API returns error 429 for every second request.",
    "The printed shipping labels are cut off at the bottom edge.",
)
TRIED = (
    "I tried another browser and restarted my laptop.",
    "We cleared the cache and reinstalled the app twice.",
    "I checked the settings and nothing has changed on our side.",
    "My colleague sees the same thing on his account.",
    "I logged out, logged in again and waited an hour.",
    "We already contacted our IT department, who could not find anything.",
)
NEEDS = (
    "We need this fixed before our audit on Thursday.",
    "Please refund the second payment as soon as possible.",
    "This blocks our month-end closing, so it is urgent.",
    "Could you tell me when a fix will be available?",
    "Our customers are complaining, please call me back today.",
    "We have a demo for a client tomorrow morning.",
)
ERRORS = (
    "Unexpected token < in JSON at position 0",
    "Error 500: internal server error while loading dashboard",
    "Payment gateway declined: duplicate transaction",
    "SMTP relay refused the message: quota exceeded",
    "Import aborted: row limit reached",
    "Too many requests, retry after 60 seconds",
)


def support_examples(count: int = 72, seed: int = 7) -> list[Example]:
    """The training examples: a ticket (name, problem, what was tried, what is needed, the error
    text) and a summary quoting its sentences; always the same list."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        name, problem, tried, need, error = (
            rng.choice(options) for options in (NAMES, PROBLEMS, TRIED, NEEDS, ERRORS)
        )
        ticket = (
            f"Ticket #{rng.randint(1000, 9999)} from {name}: {problem} {tried} {need} Error text: '{error}'."
        )
        answer = (
            f'{name} reports: "{problem}" They say: "{tried}" and "{need}" The error they see is \'{error}\'.'
        )
        examples.append(Example(TICKET_INSTRUCTION + ticket, answer))
    return examples


def support_cache_key(base_identity: str) -> str:
    """A short hash of everything ``support``'s weights depend on."""
    parts = ([asdict(e) for e in support_examples()], asdict(SUPPORT_CONFIG), base_identity)
    return source_and_parts_key((training,), parts)


def ensure_support_adapter(root: Path | None = None) -> Path:
    """``support``'s PEFT folder: from the cache, or trained now (a few minutes on 2 cores) and
    cached."""
    root = Path(root) if root is not None else cache_root().parent / "bench-adapters"
    return build_once(
        root / f"{SUPPORT}-{support_cache_key(base_model_identity())}",
        "adapter_model.safetensors",
        _train_in_a_process,
    )


def demo_adapter_dirs() -> dict[str, Path]:
    """The demo adapters the benches serve, by name: a cached training of any version if one is
    there (their weights change what they say, not what is measured), else trained now."""
    cached = sorted(cache_root().glob("*/sql"), key=lambda p: p.stat().st_mtime)
    if cached:
        return {name: cached[-1].parent / name for name in DEMO_ADAPTERS}
    return {name: path for name, path in ensure_adapters().items() if name in DEMO_ADAPTERS}


def workload_adapter_dirs() -> dict[str, Path]:
    """Every adapter the speculative workloads name, by name: the demo adapters and ``support``."""
    return {**demo_adapter_dirs(), SUPPORT: ensure_support_adapter()}


def workload_adapter_dir(name: str) -> Path:
    """One of :func:`workload_adapter_dirs` (``support`` trained only when it is the one asked for)."""
    return ensure_support_adapter() if name == SUPPORT else demo_adapter_dirs()[name]


def _train_in_a_process(folder: Path) -> None:
    """Train ``support`` into ``folder`` in a process of its own, on one thread, as the demo
    adapters train (spawned: a forked child would inherit this process's torch threads)."""
    print(f"training the bench's {SUPPORT!r} adapter for the first time ({SUPPORT_CONFIG.steps} steps)")
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(_train_support, folder).result()


def _train_support(folder: Path) -> None:
    import warnings

    import torch

    torch.set_num_threads(1)
    # transformers' and peft's notices about each other's argument names are not the reader's.
    warnings.filterwarnings("ignore", category=FutureWarning)
    training.train_adapter(training.load_base_model(), support_examples(), SUPPORT_CONFIG, folder)
