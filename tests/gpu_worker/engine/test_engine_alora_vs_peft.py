"""Activated LoRA (aLoRA) in the engine equals PEFT's aLoRA ``generate``, on the real model.

SmolLM2-135M in fp32. Two aLoRA adapters (different invocation sequences, ranks and targets) and
a standard one, written in PEFT's format and loaded by PEFT itself for the reference. An aLoRA
request runs alone, then in one batch with a standard adapter's request, a base request, the
other aLoRA's request (arriving while the rest decode) and an aLoRA request whose prompt lacks
its invocation (PEFT runs that one as the base model throughout). Greedy tokens must be PEFT's
and every step's logits within 1e-3 of PEFT's (as ``test_engine_vs_hf_peft.py``). The reference
is PEFT's own ``generate``: it finds the invocation in the prompt and keeps it while decoding.
"""

from __future__ import annotations

import pytest
import torch
from support.alora_adapters import write_adapters

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS

pytestmark = pytest.mark.model

NEW_TOKENS = 10
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, name your sources, and never make "
    "up facts. If a question is ambiguous, say which reading you answer."
)
ANSWER = " The Eiffel Tower is in Paris and was finished in 1889 for the World's Fair."
ADAPTERS = {
    "check": (SampleAdapterSpec(rank=8, scale=0.05, seed=41), " Is this correct?"),
    "grade": (SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.03, seed=42), " Grade:"),
    "sql": (SampleAdapterSpec(rank=8, target_modules=LORA_TARGETS, scale=0.05, seed=43), None),
}
"""Name -> (weights, invocation text; None: a standard LoRA). Scaled to move the logits by
units, not tens: four times stronger, fp32's rounding alone (PEFT's as the engine's) moved them
by 3e-3 from a float64 run's."""


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def written(loaded, base_spec, tmp_path_factory):
    """Each aLoRA's invocation tokens, and each adapter's directory."""
    return write_adapters(tmp_path_factory.mktemp("alora-adapters"), base_spec, loaded.tokenizer, ADAPTERS)


@pytest.fixture(scope="module")
def invocations(written) -> dict[str, list[int]]:
    return written[0]


@pytest.fixture(scope="module")
def adapter_dirs(written):
    return written[1]


@pytest.fixture(scope="module")
def prompts(loaded, invocations) -> dict[str, list[int]]:
    encode = loaded.tokenizer.encode
    system, answer, check, grade = encode(SYSTEM), encode(ANSWER), invocations["check"], invocations["grade"]
    return {
        # The invocation twice: the adapter applies from the last occurrence on.
        "check": system + check + answer + check + encode(" Reply yes or no."),
        "grade": system + answer + grade,
        "plain": system + answer,
    }


@pytest.fixture(scope="module")
def peft(loaded, adapter_dirs):
    """PEFT's model holding every adapter."""
    from peft import PeftModel
    from support.hf_llama import hf_llama

    names = list(ADAPTERS)
    model = PeftModel.from_pretrained(hf_llama(loaded), str(adapter_dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    return model.eval()


@pytest.fixture(scope="module")
def references(peft, loaded) -> dict:
    """PEFT's greedy tokens and per-step logits by (adapter, prompt), computed once each; the
    base model's (adapter None) from transformers alone."""
    from support.hf_llama import hf_llama
    from transformers import GenerationConfig

    base = hf_llama(loaded)
    # The engine runs with ignore_eos: neither model may stop at (nor be kept off) its EOS.
    for model in (base, peft.get_base_model()):
        model.generation_config.eos_token_id = None

    done: dict = {}

    def reference(adapter: str | None, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        key = (adapter, tuple(prompt))
        if key not in done:
            config = GenerationConfig(
                max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
            model = base if adapter is None else peft
            if adapter is not None:
                peft.set_adapter(adapter)
            with torch.no_grad():
                out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
            done[key] = (out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits])
        return done[key]

    return reference


def run(loaded, adapter_dirs, submissions: list[tuple[int, str, str | None, list[int]]]):
    """Greedy tokens and logits of each request, ``(step it arrives before, id, adapter,
    prompt)``, in one engine."""
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    logits: dict[str, list[torch.Tensor]] = {}
    engine: Engine = local_engine(
        model,
        EngineConfig(pool_mib=64),
        on_logits=lambda rid, row: logits.setdefault(rid, []).append(row.clone()),
    )
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    tokens: dict[str, list[int]] = {}
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    steps = 0
    while True:
        for arrives, rid, adapter, prompt in submissions:
            if arrives == steps:
                engine.submit(
                    GenerationRequest(rid, tuple(prompt), sampling, adapter),
                    lambda e: (
                        e.token_id is not None and tokens.setdefault(e.request_id, []).append(e.token_id)
                    ),
                )
        if not engine.has_work() and steps > max(s[0] for s in submissions):
            break
        engine.step()
        steps += 1
    return tokens, logits


def assert_matches(tokens, logits, reference, rid: str) -> None:
    ref_tokens, ref_logits = reference
    assert tokens[rid] == ref_tokens, f"{rid}: engine {tokens[rid]}, PEFT {ref_tokens}"
    assert len(logits[rid]) == NEW_TOKENS
    for step, (ours, theirs) in enumerate(zip(logits[rid], ref_logits)):
        diff = (ours - theirs).abs().max().item()
        assert diff <= 1e-3, f"{rid} step {step}: logits differ from PEFT's by {diff:.2e}"


def test_alora_alone_matches_peft(loaded, adapter_dirs, prompts, references):
    tokens, logits = run(loaded, adapter_dirs, [(0, "alone", "check", prompts["check"])])
    assert_matches(tokens, logits, references("check", prompts["check"]), "alone")
    # The adapter did act: the base model answers otherwise.
    _, base_logits = references(None, prompts["check"])
    assert max((a - b).abs().max().item() for a, b in zip(logits["alone"], base_logits)) > 0.1


def test_alora_in_a_mixed_batch_matches_peft(loaded, adapter_dirs, prompts, references):
    requests = [
        (0, "check", "check", prompts["check"]),
        (0, "sql", "sql", prompts["plain"]),
        (0, "base", None, prompts["check"]),
        (0, "no-invocation", "check", prompts["plain"]),
        (2, "grade", "grade", prompts["grade"]),  # prefills while the others decode
    ]
    tokens, logits = run(loaded, adapter_dirs, requests)
    for _, rid, adapter, prompt in requests:
        # A prompt without the invocation runs as the base model, as in PEFT.
        expected = None if rid == "no-invocation" else adapter
        assert_matches(tokens, logits, references(expected, prompt), rid)
    assert references("check", prompts["plain"])[0] == references(None, prompts["plain"])[0]
