"""Grammars and step masks, on the real model's tokenizer: a masked greedy walk writes a document
that parses and validates, whatever the logits prefer; bad schemas are refused by field."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
import torch

from services.gpu_worker.engine.structured_output import (
    GrammarCompiler,
    GrammarKey,
    MaskPlanner,
    unpack_bitmask,
)
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.errors import InvalidArgument

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "mood", "tags", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer().tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)


def masked_walk(compiler, tokenizer, key, logits_of, max_steps=200):
    """Greedy decoding of one request under its grammar, with ``logits_of(step)`` standing in
    for the model; returns the text and whether it ended with EOS."""
    grammar, planner, ids = compiler.matcher(key), MaskPlanner(tokenizer.vocab_size), []
    try:
        for step in range(max_steps):
            masks = planner.start([None, grammar])  # row 0: an unconstrained request beside it
            logits = masks.apply(torch.stack([logits_of(step), logits_of(step)]))
            assert torch.equal(logits[0], logits_of(step))  # the other row is untouched
            token = int(logits[1].argmax())
            if token in tokenizer.eos_token_ids:
                return tokenizer.decode(ids), True
            assert grammar.accept(token)
            ids.append(token)
    finally:
        planner.close()
    return tokenizer.decode(ids), False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_masked_walk_writes_json_that_validates_and_then_stops(compiler, tokenizer, seed):
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(400, tokenizer.vocab_size, generator=generator)
    text, stopped = masked_walk(
        compiler, tokenizer, GrammarKey("json_schema", json.dumps(SCHEMA)), noise.__getitem__
    )
    assert stopped, text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_gives_an_object(compiler, tokenizer):
    # Logits that prefer a closing brace as soon as it is allowed: "{}" is a valid object.
    brace = tokenizer.encode("}")[0]

    def logits(step):
        row = torch.zeros(tokenizer.vocab_size)
        row[brace] = 5.0
        return row

    text, stopped = masked_walk(compiler, tokenizer, GrammarKey("json_object"), logits)
    assert stopped and isinstance(json.loads(text), dict)


def test_a_request_resumed_with_its_tokens_continues_where_it_was(compiler, tokenizer):
    key = GrammarKey("json_schema", json.dumps(SCHEMA))
    done = tokenizer.encode('{"name": "Ann", "mood": "')
    grammar = compiler.matcher(key, generated=done)
    assert grammar.accept(tokenizer.encode("happy")[0])
    with pytest.raises(InvalidArgument, match="structured_output"):
        compiler.matcher(key, generated=tokenizer.encode('{"nome": 1'))


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (GrammarKey("json_schema", "{not json"), "structured_output.json_schema is not valid JSON"),
        (GrammarKey("json_schema", "[1, 2]"), "must be a JSON object"),
        (GrammarKey("json_schema", '{"type": "no-such-type"}'), "structured_output.json_schema"),
        (GrammarKey("yaml"), "unknown kind"),
    ],
)
def test_bad_schemas_are_refused_naming_the_field(compiler, key, message):
    with pytest.raises(InvalidArgument, match=message):
        compiler.grammar(key)


def test_unpack_bitmask_maps_bit_j_of_word_w_to_token_32w_plus_j():
    bitmask = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    allowed = unpack_bitmask(bitmask, 70)
    assert allowed.shape == (1, 70) and allowed[0].nonzero().flatten().tolist() == [0, 2, 63]


def test_the_engine_does_not_import_triton():
    """Triton imported before a test sets TRITON_INTERPRET cannot interpret kernels: the engine
    (and its grammar masks) must leave it to the kernels' first use."""
    code = "import sys, services.gpu_worker.engine.engine; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
