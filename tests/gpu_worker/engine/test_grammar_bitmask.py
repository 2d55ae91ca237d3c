"""Grammar masks applied on the logits' device from llguidance's packed words, against the host
path they replace (unpack every row's words into a vocabulary-wide bool mask, then fill): the same
logits, bit for bit, for real grammars (a JSON Schema and a regex) on the real tokenizer, with
constrained and unconstrained rows mixed; the torch ops and the Triton kernel (in the CPU
interpreter: ``TRITON_INTERPRET`` is set before anything imports it).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json

import llguidance
import pytest
import torch

from services.gpu_worker.engine.grammar_bitmask import mask_logits_
from services.gpu_worker.engine.structured_output import (
    GrammarCompiler,
    GrammarKey,
    MaskPlanner,
    RequestGrammar,
    unpack_bitmask,
)
from services.model_files.tokenizer_loading import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
DOCUMENT = '{"name": "Ann", "n": 42}'
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{3}"
MATCH = "Zorba-123"


def _host_path(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """What a step did before: a bool mask per constrained row, unpacked on the host."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    masked = logits.clone()
    masked[rows] = masked[rows].masked_fill(~allowed, float("-inf"))
    return masked


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer().tokenizer


@pytest.fixture(scope="module")
def walks(tokenizer):
    """Two real grammars and, for each, a document they accept as tokens."""
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    json_grammar = compiler.matcher(GrammarKey("json_schema", json.dumps(SCHEMA)))
    regex = llguidance.LLMatcher(compiler.lltokenizer, llguidance.LLMatcher.grammar_from_regex(REGEX))
    return [(json_grammar, tokenizer.encode(DOCUMENT)), (RequestGrammar(regex), tokenizer.encode(MATCH))]


def test_step_masks_equal_the_host_path_along_real_grammars(tokenizer, walks):
    """Rows 1 and 3 constrained (a JSON Schema, a regex), rows 0 and 2 not, step after step of
    both documents; then a step where every row is constrained."""
    planner = MaskPlanner(tokenizer.vocab_size)
    generator = torch.Generator().manual_seed(0)
    (json_grammar, json_ids), (regex_grammar, regex_ids) = walks
    try:
        for step in range(max(len(json_ids), len(regex_ids))):
            grammars = [
                None,
                json_grammar if step < len(json_ids) else None,
                None,
                regex_grammar if step < len(regex_ids) else None,
            ]
            masks = planner.start(grammars)
            logits = torch.randn(4, tokenizer.vocab_size, generator=generator)
            masked = masks.apply(logits)
            expected = _host_path(logits, planner._host[: len(masks.rows)], masks.rows)
            assert torch.equal(masked, expected)
            assert not torch.equal(masked, logits) and torch.equal(masked[[0, 2]], logits[[0, 2]])
            for grammar, ids in walks:
                if step < len(ids):
                    assert grammar.accept(ids[step])
        masks = planner.start([json_grammar, regex_grammar])  # both at the end: EOS only
        logits = torch.randn(2, tokenizer.vocab_size, generator=generator)
        masked = masks.apply(logits)
        assert torch.equal(masked, _host_path(logits, planner._host[:2], [0, 1]))
        assert set(masked.isfinite().nonzero()[:, 1].tolist()) <= set(tokenizer.eos_token_ids)
    finally:
        planner.close()


def test_triton_kernel_matches_torch_on_a_real_mask(tokenizer, walks):
    json_grammar = walks[0][0]
    planner = MaskPlanner(tokenizer.vocab_size)
    try:
        masks = planner.start([json_grammar])
        masks.wait()
        bitmask = planner._host[:1].clone()
    finally:
        planner.close()
    bitmask = bitmask.repeat(2, 1)
    bitmask[1, 5:9] = 0x5A5A5A5A  # a few words of mixed bits
    logits = torch.randn(3, tokenizer.vocab_size)
    rows = torch.tensor([2, 0])
    expected = _host_path(logits, bitmask, [2, 0])
    for backend in ("torch", "triton"):
        got = logits.clone()
        mask_logits_(got, bitmask, rows, backend=backend)
        assert torch.equal(got, expected), backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tokens_past_the_words_are_refused(backend):
    """A vocabulary that is not a multiple of 32, and logits wider than the bitmask covers."""
    bitmask = torch.tensor([[0b101, -(2**31)], [-1, -1]], dtype=torch.int32)  # row 0: tokens 0, 2, 63
    logits = torch.zeros(2, 70)
    mask_logits_(logits, bitmask, backend=backend)
    assert logits[0].isfinite().nonzero().flatten().tolist() == [0, 2, 63]
    assert logits[1].isfinite().nonzero().flatten().tolist() == list(range(64))
