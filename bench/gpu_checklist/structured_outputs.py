"""Part 5 (a), structured outputs, bf16: constrained decoding's cost per decode step (every
request of a batch under one of ``bench/structured_output_bench.py``'s JSON Schemas against an
unconstrained twin batch generating as many tokens), the host's share of it replayed alone, and
every constrained output checked against its schema."""

from __future__ import annotations

import gc
import json
import time

import torch

from bench.gpu_checklist.base_model import tokenizer_json
from bench.gpu_checklist.context import Ctx
from bench.gpu_checklist.helpers import engine_model, fmt_ms, kv_mib, median, timed_steps
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams


def schema_errors(value, schema: dict, where: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (the subset of JSON Schema the bench's schemas use:
    type, properties, required, additionalProperties, enum, maxLength, minimum, maximum, items,
    maxItems); empty when it is an instance."""
    if "enum" in schema:
        if not any(type(value) is type(e) and value == e for e in schema["enum"]):
            return [f"{where}: {value!r} not in {schema['enum']}"]
        return []
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        if type(value) is not int:
            return [f"{where}: not an integer"]
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            return [f"{where}: {value} out of range"]
        return []
    if kind in types and type(value) is not types[kind]:
        return [f"{where}: not a {kind}"]
    errors = []
    if kind == "string" and len(value) > schema.get("maxLength", len(value)):
        errors.append(f"{where}: longer than {schema['maxLength']}")
    if kind == "array":
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{where}: more than {schema['maxItems']} items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{where}[{i}]")
    if kind == "object":
        properties = schema.get("properties", {})
        errors += [f"{where}: missing {k}" for k in schema.get("required", ()) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{where}: unexpected {k}" for k in value if k not in properties]
        for k, v in value.items():
            if k in properties:
                errors += schema_errors(v, properties[k], f"{where}.{k}")
    return errors


def _kinds(batch: int) -> list[str]:
    """The schema of each request of a batch, round-robin."""
    from bench.structured_output_bench import SCHEMAS

    return [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(batch)]


def _constrained_requests(prompts: dict, batch: int, tag: str) -> list[GenerationRequest]:
    from bench.structured_output_bench import MAX_TOKENS, SCHEMAS
    from services.runtime.sampling.sampling_params import StructuredOutput

    return [
        GenerationRequest(
            f"{tag}{i}", prompts[kind],
            SamplingParams(max_tokens=MAX_TOKENS, structured_output=StructuredOutput("json_schema", json.dumps(SCHEMAS[kind]))),
        )
        for i, kind in enumerate(_kinds(batch))
    ]  # fmt: skip


def _rounds(ctx: Ctx, engines: dict, prompts: dict, batch: int, rounds: int):
    """Each round: the constrained batch, and the free twin batch generating as many tokens per
    request, alternating which runs first: ({engine: [its steps per round]}, the constrained
    requests' lengths, the last constrained run's outputs)."""
    kinds = _kinds(batch)
    runs: dict[str, list[list[tuple[int, float]]]] = {"constrained": [], "free": []}
    lengths: list[int] | None = None
    outputs = None
    order = ["constrained", "free"]
    for r in range(rounds):
        for name in order:
            if name == "constrained":
                requests = _constrained_requests(prompts, batch, f"c{batch}-{r}-")
                out, steps = timed_steps(ctx, engines[name], requests)
                got = [len(o["tokens"]) for o in out.values()]
                if lengths is not None and got != lengths:
                    ctx.log(f"part 5 structured: batch {batch} round {r}: lengths changed {lengths} -> {got}")
                lengths, outputs = got, out
            else:
                free = [
                    GenerationRequest(f"f{batch}-{r}-{i}", prompts[kinds[i]], SamplingParams(max_tokens=n, ignore_eos=True))
                    for i, n in enumerate(lengths)
                ]  # fmt: skip
                _, steps = timed_steps(ctx, engines[name], free)
            runs[name].append(steps)
        order.reverse()
    return runs, lengths, outputs


def _paired(runs: dict, batch: int):
    """Step i of both runs has the same requests (same lengths): their decode steps paired, (all
    differences, the full batch's constrained and free step times, each engine's best decode s)."""
    diffs, full_c, full_f = [], [], []
    for c_steps, f_steps in zip(runs["constrained"], runs["free"]):
        for (nc, c_ms), (nf, f_ms) in zip(c_steps[1:], f_steps[1:]):  # decode steps
            if nc != nf:
                continue
            diffs.append(c_ms - f_ms)
            if nc == batch:
                full_c.append(c_ms)
                full_f.append(f_ms)
    decode_s = {name: min(sum(ms for _, ms in s[1:]) for s in runs[name]) / 1e3 for name in runs}
    return diffs, full_c, full_f, decode_s


def _documents(tok, outputs: dict, kinds: list[str]) -> list[dict]:
    """Each constrained output decoded, parsed and checked against its schema."""
    from bench.structured_output_bench import SCHEMAS

    docs = []
    for i, o in enumerate(outputs.values()):
        text = tok.decode_str([t for t in o["tokens"] if not tok.is_special_token(t)])
        try:
            errs = schema_errors(json.loads(text), SCHEMAS[kinds[i]])
            parsed = True
        except ValueError as exc:
            errs, parsed = [f"not JSON: {exc}"], False
        docs.append({"schema": kinds[i], "tokens": len(o["tokens"]), "finish": o["finish"], "error": o["error"],
                     "parsed": parsed, "schema_errors": errs, "text": text[:300]})  # fmt: skip
    return docs


def _host_mask_ms(ctx: Ctx, compiler, outputs: dict, kinds: list[str], dtype) -> tuple[list, list]:
    """Host side of the same steps, replayed alone: the masks' computation (llguidance, on the
    helper thread during the forward pass) and their application to device logits, ms per
    full-batch step."""
    from bench.structured_output_bench import SCHEMAS
    from services.gpu_worker.engine.structured_output import GrammarKey, MaskPlanner

    batch, vocab = len(kinds), ctx.model()["config"].vocab_size
    planner = MaskPlanner(vocab)
    try:
        matchers = [
            compiler.matcher(GrammarKey("json_schema", json.dumps(SCHEMAS[kinds[i]]))) for i in range(batch)
        ]
        toks = [o["tokens"] for o in outputs.values()]
        logits = torch.randn(batch, vocab, device=ctx.device, dtype=dtype)
        compute_ms, apply_ms = [], []
        for step in range(max(map(len, toks))):
            alive = [i for i in range(batch) if len(toks[i]) > step]
            ctx.sync()
            t = time.perf_counter()
            masks = planner.start([matchers[i] for i in alive])
            masks.wait()
            t1 = time.perf_counter()
            masks.apply(logits[: len(alive)])
            ctx.sync()
            t2 = time.perf_counter()
            if len(alive) == batch:
                compute_ms.append(1e3 * (t1 - t))
                apply_ms.append(1e3 * (t2 - t1))
            for i in alive:
                if not matchers[i].accept(toks[i][step]):
                    break
    finally:
        planner.close()
    return compute_ms, apply_ms


def _batch_row(ctx: Ctx, engines: dict, compiler, tok, prompts: dict, batch: int, rounds: int, dtype) -> dict:
    kinds = _kinds(batch)
    runs, lengths, outputs = _rounds(ctx, engines, prompts, batch, rounds)
    diffs, full_c, full_f, decode_s = _paired(runs, batch)
    docs = _documents(tok, outputs, kinds)
    compute_ms, apply_ms = _host_mask_ms(ctx, compiler, outputs, kinds, dtype)
    return {
        "batch": batch, "rounds": rounds, "tokens_per_request": lengths,
        "tokens_per_request_mean": sum(lengths) / batch,
        "decode_step_ms_full_batch": {"constrained": median(full_c), "free": median(full_f), "steps": len(full_c)},
        "mask_cost_ms_per_step": median(diffs),
        "mask_cost_ms_per_step_full_batch": median(c - f for c, f in zip(full_c, full_f)),
        "decode_s": decode_s, "decode_time_ratio_constrained_over_free": decode_s["constrained"] / decode_s["free"],
        "host_mask_compute_ms_full_batch": median(compute_ms),
        "host_mask_apply_ms_full_batch": median(apply_ms),
        "parsed": sum(d["parsed"] for d in docs), "schema_valid": sum(d["parsed"] and not d["schema_errors"] for d in docs),
        "finished_by_length": sum(d["finish"] == "length" for d in docs),
        "documents": docs,
    }  # fmt: skip


def part5_structured(ctx: Ctx) -> dict:
    """Constrained decoding's cost per decode step: every request of a batch under a JSON Schema
    against an unconstrained twin batch of the same prompts generating as many tokens (so both
    engines run the same forward passes), bf16; and the constrained outputs checked against
    their schemas."""
    from bench.structured_output_bench import MAX_TOKENS, PROMPTS, SCHEMAS
    from services.gpu_worker.engine.structured_output import GrammarCompiler, GrammarKey

    dtype = torch.bfloat16
    config = ctx.model()["config"]
    compiler = GrammarCompiler(tokenizer_json(ctx), config.vocab_size, config.eos_token_ids)
    tok = compiler.lltokenizer  # llguidance's own reading of the JSON (no `tokenizers` version skew)
    batches = (4,) if ctx.quick else (8, 32)
    rounds = 1 if ctx.quick else 2
    prompts = {kind: tuple(tok.tokenize_str(text)) for kind, text in PROMPTS.items()}
    model = engine_model(ctx, dtype)
    kv = kv_mib(ctx, max(batches), max(map(len, prompts.values())) + MAX_TOKENS, dtype)
    engines = {
        name: local_engine(
            model,
            EngineConfig(pool_mib=kv + 32, max_running=max(batches), max_prefill_tokens=4096, prefix_cache=False),
            eos_token_ids=config.eos_token_ids,
            grammars=compiler if name == "constrained" else None,
        )
        for name in ("constrained", "free")
    }  # fmt: skip
    t = time.perf_counter()
    for schema in SCHEMAS.values():
        compiler.grammar(GrammarKey("json_schema", json.dumps(schema)))
    compile_s = time.perf_counter() - t
    # Warm-up: grammars' matchers, kernels, allocator.
    timed_steps(ctx, engines["constrained"], _constrained_requests(prompts, 2, "wc"))
    timed_steps(ctx, engines["free"], [GenerationRequest(f"wf{i}", prompts["person"], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(2)])  # fmt: skip
    rows = []
    for batch in batches:
        r = _batch_row(ctx, engines, compiler, tok, prompts, batch, rounds, dtype)
        rows.append(r)
        ctx.log(
            f"part 5 structured: batch {batch}: step {fmt_ms(r['decode_step_ms_full_batch']['constrained'])} vs "
            f"{fmt_ms(r['decode_step_ms_full_batch']['free'])} ms, mask cost {fmt_ms(r['mask_cost_ms_per_step'])} ms/step, "
            f"valid {r['schema_valid']}/{batch}"
        )
        gc.collect()
    for engine in engines.values():
        if engine.masks is not None:
            engine.masks.close()
    return {
        "dtype": "bfloat16", "schemas": list(SCHEMAS), "max_tokens": MAX_TOKENS, "grammar_compile_s": compile_s,
        "tokenizer": "the model's" if ctx.model().get("tokenizer_json") else "SmolLM2's (--tokenizer)",
        "rows": rows, "pass": all(r["schema_valid"] == r["batch"] for r in rows),
    }  # fmt: skip
