"""Every model output printed in README.md and docs/ says the dtype it was made with: greedy text
depends on it (`loramesh up --dtype auto` computes in bfloat16 on CPUs with native bf16), so an
output a reader cannot reproduce without knowing the dtype is a wrong doc."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: What generated text looks like in a printed output: the demo's `model → reply` lines, an SSE
#: chunk's delta, a completion's text.
GENERATED_TEXT = re.compile(r"^\s*\S+ → \S|\"delta\":\{\"content\":\"\S|\"text\":\s*\"\S", re.MULTILINE)
DTYPE = re.compile(r"float32|bfloat16|float16|fp32|bf16")
FENCE = re.compile(r"^(`{3,})[^\n]*\n(.*?)^\1\s*$", re.MULTILINE | re.DOTALL)
LINES_BEFORE = 6
"""How far above a printed output its dtype may be said: the sentence that introduces it."""


def printed_outputs(text: str) -> list[tuple[int, str, str]]:
    """(line number, the lines that introduce it, block) of every fenced block with generated text."""
    found = []
    for match in FENCE.finditer(text):
        if GENERATED_TEXT.search(match.group(2)):
            line = text.count("\n", 0, match.start())
            intro = "\n".join(text.splitlines()[max(0, line - LINES_BEFORE) : line])
            found.append((line + 1, intro, match.group(2)))
    return found


def test_every_printed_output_names_its_dtype():
    undated = [
        f"{doc.relative_to(ROOT)}:{line}"
        for doc in DOCS
        for line, intro, block in printed_outputs(doc.read_text())
        if not DTYPE.search(intro) and not DTYPE.search(block.split("\n", 1)[0])
    ]
    assert not undated, f"printed outputs that do not say their dtype: {undated}"


def test_the_check_finds_the_printed_outputs_it_must_check():
    readme = printed_outputs((ROOT / "README.md").read_text())
    assert any("pirate →" in block for _, _, block in readme)
    undated = "Some text.\n\n```\n(base) → The capital of France is Paris.\n```\n"
    assert printed_outputs(undated) and not DTYPE.search(printed_outputs(undated)[0][1])


def test_the_readme_prints_the_demo_as_it_runs_in_float32():
    from loramesh_cli.demo import UP_ARGS

    assert "--dtype" in UP_ARGS and UP_ARGS[UP_ARGS.index("--dtype") + 1] == "float32"
    assert f"$ loramesh {' '.join(UP_ARGS)}\n" in (ROOT / "README.md").read_text()
