"""``python -m demo_adapters [--preview]``: train the demo adapters (or find them cached), print
their folders, and with ``--preview`` the greedy answers of the base model and of each adapter to
the demo's questions, computed in transformers + peft."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from demo_adapters.cache import ensure_adapters
from demo_adapters.data import DEMO_QUESTIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo_adapters", description=__doc__)
    parser.add_argument(
        "--cache-dir", type=Path, help="cache root (default: ~/.cache/loramesh/demo-adapters)"
    )
    parser.add_argument("--preview", action="store_true", help="print greedy answers to the demo questions")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per previewed answer")
    args = parser.parse_args(argv)
    adapters = ensure_adapters(root=args.cache_dir)
    for name, directory in adapters.items():
        print(f"{name:>8}  {directory}")
    if args.preview:
        from demo_adapters.preview import preview
        from demo_adapters.training import load_base_model

        answers = preview(load_base_model(), adapters, list(DEMO_QUESTIONS), args.max_tokens)
        for question, by_model in answers.items():
            print(f"\n{question}")
            for name, answer in by_model.items():
                print(f"  {name:>8} → {answer!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
